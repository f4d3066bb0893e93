"""Where a run's batches ended, kept in the application's DynamoDB table.

    pk="src#<run>"  sk="end#<n>#<stream>/<shard>"  what batch n read from one shard
    pk="src#<run>"  sk="pos#<n>"                    all shard positions after batch n

The executor that first reads a shard for batch n records its end with a conditional
put; any later attempt of the same batch (a retry, a speculative copy) finds that record
and reads exactly up to it.
"""

from __future__ import annotations

import json
from typing import Any

from botocore.exceptions import ClientError

from shardless.changelog import aws
from shardless.processor.kinesis.positions import Position, Positions


def _pk(run: str) -> str:
    return f"src#{run}"


def _end_sk(n: int, shard_key: str) -> str:
    return f"end#{n:012d}#{shard_key}"


class BatchLog:
    def __init__(self, table: str) -> None:
        self.table = table

    @property
    def _ddb(self):  # noqa: ANN202
        return aws.client("dynamodb")

    def record_end(self, run: str, n: int, shard_key: str, end: dict[str, Any]) -> dict[str, Any]:
        """Record batch n's end for a shard unless one exists; return the recorded end."""
        item = {
            "pk": {"S": _pk(run)},
            "sk": {"S": _end_sk(n, shard_key)},
            "end": {"S": json.dumps(end)},
        }
        try:
            self._ddb.put_item(
                TableName=self.table, Item=item, ConditionExpression="attribute_not_exists(pk)"
            )
            return end
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "ConditionalCheckFailedException":
                raise
        found = self.recorded_end(run, n, shard_key)
        assert found is not None, "conditional put failed but no end is recorded"
        return found

    def recorded_end(self, run: str, n: int, shard_key: str) -> dict[str, Any] | None:
        out = self._ddb.get_item(
            TableName=self.table,
            Key={"pk": {"S": _pk(run)}, "sk": {"S": _end_sk(n, shard_key)}},
            ConsistentRead=True,
        )
        item = out.get("Item")
        return None if item is None else json.loads(item["end"]["S"])

    def ends(self, run: str, n: int) -> dict[str, Position]:
        """Every end recorded for batch n, by shard key."""
        prefix = f"end#{n:012d}#"
        found: dict[str, Position] = {}
        kwargs: dict[str, Any] = {
            "TableName": self.table,
            "KeyConditionExpression": "pk = :pk AND begins_with(sk, :p)",
            "ExpressionAttributeValues": {":pk": {"S": _pk(run)}, ":p": {"S": prefix}},
            "ConsistentRead": True,
        }
        while True:
            out = self._ddb.query(**kwargs)
            for item in out["Items"]:
                found[item["sk"]["S"][len(prefix) :]] = json.loads(item["end"]["S"])
            if "LastEvaluatedKey" not in out:
                return found
            kwargs["ExclusiveStartKey"] = out["LastEvaluatedKey"]

    def save_positions(self, run: str, n: int, positions: Positions) -> None:
        self._ddb.put_item(
            TableName=self.table,
            Item={
                "pk": {"S": _pk(run)},
                "sk": {"S": f"pos#{n:012d}"},
                "positions": {"S": json.dumps(positions, sort_keys=True)},
            },
        )

    def positions(self, run: str, n: int) -> Positions | None:
        out = self._ddb.get_item(
            TableName=self.table,
            Key={"pk": {"S": _pk(run)}, "sk": {"S": f"pos#{n:012d}"}},
            ConsistentRead=True,
        )
        item = out.get("Item")
        return None if item is None else json.loads(item["positions"]["S"])
