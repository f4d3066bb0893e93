"""bench.billing's units follow DynamoDB's documented sizing and rounding, and its dollars
the list prices."""

from __future__ import annotations

import pytest

from bench import billing


def test_item_sizes_follow_dynamodb_rules():
    assert billing.item_bytes({"pk": {"S": "app"}}) == 2 + 3
    assert billing.item_bytes({"b": {"B": b"\x00" * 10}}) == 1 + 10
    assert billing.item_bytes({"n": {"N": "12345"}}) == 1 + 3 + 1  # 1 byte per 2 digits, + 1
    assert billing.item_bytes({"n": {"N": "-1.500"}}) == 1 + 1 + 1  # zeros trimmed
    assert billing.item_bytes({"f": {"BOOL": True}, "z": {"NULL": True}}) == 4
    assert billing.item_bytes({"l": {"L": [{"S": "ab"}, {"N": "1"}]}}) == 1 + 3 + (1 + 2) + (1 + 2)
    assert billing.item_bytes({"m": {"M": {"k": {"S": "v"}}}}) == 1 + 3 + 1 + 1 + 1
    assert billing.item_bytes({"é": {"S": "é"}}) == 4  # UTF-8 bytes
    with pytest.raises(ValueError, match="'X'"):
        billing.item_bytes({"x": {"X": 1}})


def item_of(size: int) -> dict:
    return {"k": {"B": b"x" * (size - 1)}}


@pytest.mark.parametrize(("size", "plain"), [(1, 1), (1024, 1), (1025, 2), (3000, 3)])
def test_writes_bill_per_started_kb_and_transactions_twice(size, plain):
    item = item_of(size)
    assert billing.item_bytes(item) == size
    assert billing.dynamodb_units("PutItem", {"Item": item}, {}) == (plain, 0.0)
    tx = {"TransactItems": [{"Put": {"Item": item}}, {"ConditionCheck": {"Key": {}}}]}
    assert billing.dynamodb_units("TransactWriteItems", tx, {}) == (2 * plain, 2.0)


def test_reads_bill_per_started_4kb_half_when_eventually_consistent():
    answer = {"Item": item_of(4097)}
    assert billing.dynamodb_units("GetItem", {"ConsistentRead": True}, answer) == (0, 2)
    assert billing.dynamodb_units("GetItem", {}, answer) == (0, 1.0)
    asked = {"RequestItems": {"t": {"Keys": [{}, {}, {}], "ConsistentRead": True}}}
    found = {"Responses": {"t": [item_of(100), item_of(5000)]}}
    assert billing.dynamodb_units("BatchGetItem", asked, found) == (0, 1 + 2 + 1)  # a miss: 1
    query = {"Items": [item_of(3000), item_of(3000)]}
    assert billing.dynamodb_units("Query", {}, query) == (0, 1.0)  # the sum rounds, halved
    assert billing.dynamodb_units("DescribeTable", {}, {}) == (0, 0.0)


def test_dollars_scale_with_the_trigger():
    per_batch = {"dynamodb_write_units": 1e6, "dynamodb_read_units": 0, "s3_puts": 1000}
    per_batch["s3_gets"] = 0
    month = billing.dollars_per_month(per_batch, 1.0)
    batches = billing.SECONDS_PER_MONTH
    assert month["dynamodb"] == pytest.approx(batches * 0.625)
    assert month["s3"] == pytest.approx(batches * 0.005)
    assert billing.dollars_per_month(per_batch, 10.0)["total"] == pytest.approx(month["total"] / 10)
    calls = {("s3", "PutObject:segment"): 2, ("s3", "GetObject"): 3, ("s3", "DeleteObject"): 9}
    assert billing.s3_requests(calls | {("dynamodb", "GetItem"): 1}) == (2, 3)
