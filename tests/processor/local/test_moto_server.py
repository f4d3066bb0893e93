"""shardless.processor.local.moto_server's DynamoDB: a failed transaction leaves exactly what was
there before, conditions are judged with their own values, and a transaction copies only the
items it names. Against the session's moto server over HTTP, which runs that entry point."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from shardless.changelog.resources import TABLE_SCHEMA
from shardless.processor.local import emulators as local_aws


@pytest.fixture
def table(aws: local_aws.LocalAws) -> tuple[Any, str]:
    ddb = boto3.client("dynamodb")
    name = f"moto-{uuid.uuid4().hex[:8]}"
    ddb.create_table(TableName=name, **TABLE_SCHEMA)
    return ddb, name


def _item(pk: str, v: int, sk: str = "head") -> dict[str, Any]:
    return {"pk": {"S": pk}, "sk": {"S": sk}, "v": {"N": str(v)}, "blob": {"B": bytes([v]) * 40}}


def _key(pk: str, sk: str = "head") -> dict[str, Any]:
    return {"pk": {"S": pk}, "sk": {"S": sk}}


def _all(ddb: Any, name: str) -> dict[tuple[str, str], dict[str, Any]]:
    items = ddb.scan(TableName=name, ConsistentRead=True)["Items"]
    return {(i["pk"]["S"], i["sk"]["S"]): i for i in items}


def _if_v(v: int) -> dict[str, Any]:
    return {
        "ConditionExpression": "#v = :v",
        "ExpressionAttributeNames": {"#v": "v"},
        "ExpressionAttributeValues": {":v": {"N": str(v)}},
    }


def _reasons(exc: ClientError) -> list[str]:
    return [r.get("Code", "None") for r in exc.response["CancellationReasons"]]


def test_a_cancelled_transaction_leaves_every_item_as_it_was(table: tuple[Any, str]) -> None:
    ddb, name = table
    for pk, v in (("put", 1), ("update", 2), ("delete", 3), ("bystander", 4)):
        ddb.put_item(TableName=name, Item=_item(pk, v))
    ddb.put_item(TableName=name, Item=_item("put", 9, sk="other"))  # same hash key, other range
    before = _all(ddb, name)

    with pytest.raises(ClientError) as caught:
        ddb.transact_write_items(
            TransactItems=[
                {"Put": {"TableName": name, "Item": _item("put", 11), **_if_v(1)}},
                {"Put": {"TableName": name, "Item": _item("new", 12)}},
                {"Put": {"TableName": name, "Item": _item("new-hash", 15, sk="x")}},
                {
                    "Update": {
                        "TableName": name,
                        "Key": _key("update"),
                        "UpdateExpression": "SET #v = :n, #w = :n",
                        "ExpressionAttributeNames": {"#v": "v", "#w": "w"},
                        "ExpressionAttributeValues": {":n": {"N": "13"}},
                    }
                },
                {"Delete": {"TableName": name, "Key": _key("delete")}},
                {"Put": {"TableName": name, "Item": _item("bystander", 14), **_if_v(99)}},
            ]
        )
    assert caught.value.response["Error"]["Code"] == "TransactionCanceledException"
    assert _reasons(caught.value) == ["None"] * 5 + ["ConditionalCheckFailed"]
    assert _all(ddb, name) == before


def test_a_transaction_refused_half_way_is_undone(table: tuple[Any, str]) -> None:
    """moto applies items in order and refuses a second write of one item when it reaches
    it: the items written before that are put back."""
    ddb, name = table
    ddb.put_item(TableName=name, Item=_item("a", 1))
    before = _all(ddb, name)
    with pytest.raises(ClientError):
        ddb.transact_write_items(
            TransactItems=[
                {"Put": {"TableName": name, "Item": _item("a", 2)}},
                {"Put": {"TableName": name, "Item": _item("b", 3)}},
                {"Delete": {"TableName": name, "Key": _key("a")}},
            ]
        )
    assert _all(ddb, name) == before


def test_one_expression_is_judged_with_each_items_own_values(table: tuple[Any, str]) -> None:
    ddb, name = table
    for pk in ("x", "y"):
        ddb.put_item(TableName=name, Item=_item(pk, 5))

    def both(vx: int, vy: int, to: int) -> None:
        ddb.transact_write_items(
            TransactItems=[
                {"Put": {"TableName": name, "Item": _item("x", to), **_if_v(vx)}},
                {"Put": {"TableName": name, "Item": _item("y", to), **_if_v(vy)}},
            ]
        )

    with pytest.raises(ClientError) as caught:
        both(5, 6, 7)
    assert _reasons(caught.value) == ["None", "ConditionalCheckFailed"]
    with pytest.raises(ClientError) as caught:
        both(6, 5, 7)
    assert _reasons(caught.value) == ["ConditionalCheckFailed", "None"]
    both(5, 5, 7)
    both(7, 7, 8)  # the same expression string again, with values it has not seen
    assert {k: int(i["v"]["N"]) for k, i in _all(ddb, name).items()} == {
        ("x", "head"): 8,
        ("y", "head"): 8,
    }


def test_a_transaction_copies_the_items_it_names_not_the_table(
    in_process_moto: Callable[[str], list[str]],
) -> None:
    """In-process: a transaction over a table of 2,000 items deep-copies no table, and a
    cancelled one still leaves its items as they were."""
    printed = in_process_moto(
        """
        import copy
        import moto.dynamodb.models as m
        tables = []
        real = copy.deepcopy
        def counting(obj, memo=None):
            if isinstance(obj, m.Table):
                tables.append(obj.name)
            return real(obj, memo)
        copy.deepcopy = counting
        def put(i, v):
            return {"Put": {"TableName": "t", "Item": {"pk": {"S": str(i)}, "v": {"N": v}}}}
        with mock_aws():
            ddb = boto3.client("dynamodb")
            hash_table(ddb)
            for i in range(2000):
                ddb.put_item(**put(i, "0")["Put"])
            ddb.transact_write_items(TransactItems=[put(i, "1") for i in range(50)])
            refused = {"ConditionCheck": {"TableName": "t", "Key": {"pk": {"S": "60"}},
                                          "ConditionExpression": "attribute_not_exists(pk)"}}
            try:
                ddb.transact_write_items(TransactItems=[put(i, "2") for i in range(10)] + [refused])
            except ddb.exceptions.TransactionCanceledException:
                print("cancelled")
            got = ddb.get_item(TableName="t", Key={"pk": {"S": "3"}})["Item"]["v"]["N"]
        print(len(tables), got)
        """
    )
    assert printed == ["cancelled", "0", "1"]


def test_a_transaction_parses_each_items_condition_once_and_still_validates_it(
    in_process_moto: Callable[[str], list[str]],
) -> None:
    """In-process: 20 items with their own values cost 20 parses (moto as released: 60,
    for the request's validation, the transaction and the put), and the request's
    validation still refuses an expression attribute name the expression does not use."""
    printed = in_process_moto(
        """
        import moto.dynamodb.comparisons as c
        parses = []
        real = c.ConditionExpressionParser.parse
        def counting(self):
            parses.append(self.condition_expression)
            return real(self)
        c.ConditionExpressionParser.parse = counting
        def put(i, v, old):
            return {"Put": {"TableName": "t", "Item": {"pk": {"S": str(i)}, "v": {"N": v}},
                            "ConditionExpression": "#v = :v",
                            "ExpressionAttributeNames": {"#v": "v"},
                            "ExpressionAttributeValues": {":v": {"N": old}}}}
        with mock_aws():
            ddb = boto3.client("dynamodb")
            hash_table(ddb)
            for i in range(20):
                ddb.put_item(TableName="t", Item={"pk": {"S": str(i)}, "v": {"N": str(i)}})
            parses.clear()
            ddb.transact_write_items(TransactItems=[put(i, "100", str(i)) for i in range(20)])
            print(len(parses))
            unused = put(0, "101", "100")
            unused["Put"]["ExpressionAttributeNames"]["#w"] = "w"
            try:
                ddb.transact_write_items(TransactItems=[unused])
            except ddb.exceptions.ClientError as exc:
                print(exc.response["Error"]["Code"], "#w" in exc.response["Error"]["Message"])
            parses.clear()
            ddb.put_item(**put(1, "102", "100")["Put"])  # outside a transaction: as moto does
            item = ddb.get_item(TableName="t", Key={"pk": {"S": "1"}})["Item"]
            print(len(parses) >= 1, item["v"]["N"])
        """
    )
    assert printed == ["20", "ValidationException", "True", "True", "102"]
