"""Where a run's batches ended, kept in the application's DynamoDB table.

    pk="src#<run>"  sk="end#<n>#<stream>/<shard>"  what batch n read from one shard
    pk="src#<run>"  sk="pos#<n>"                    all shard positions after batch n
    pk="src#<run>"  sk="gc"                         `below`: batches before it are deleted

The executor that first reads a shard for batch n records its end with a conditional
put; any later attempt of the same batch (a retry, a speculative copy) finds that record
and reads exactly up to it.

Batches that can never be read again are deleted by `collect` (the source calls it from
`commit`, see `shardless.processor.kinesis.source`), and a whole run by `retire` once a
COMMITTED start has continued from it (`shardless.processor.driver.recorder`); the `gc`
item says how far, so that a reader that asks for a deleted batch fails naming it instead
of starting over.
"""

from __future__ import annotations

import json
import time
from typing import Any

from botocore.exceptions import ClientError

from shardless.changelog import aws
from shardless.processor.errors import SourceError
from shardless.processor.kinesis.positions import Position, Positions

# A `gc` bound past every batch number (sort keys hold 12 digits): the run is retired.
RETIRED = 10**12


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

    def knows(self, run: str) -> bool:
        """Whether this table holds any record of `run` (a batch's end or positions, or
        the mark that its records were collected)."""
        out = self._ddb.query(
            TableName=self.table,
            KeyConditionExpression="pk = :pk",
            ExpressionAttributeValues={":pk": {"S": _pk(run)}},
            ProjectionExpression="sk",
            Limit=1,
            ConsistentRead=True,
        )
        return bool(out["Items"])

    # -- garbage collection --------------------------------------------------------------

    def retire(self, run: str) -> int:
        """Delete every record of `run`, whose checkpoint can never run a batch again."""
        return self.collect(run, RETIRED)

    def collected_below(self, run: str) -> int:
        """The first batch of `run` whose records `collect` has not deleted (0: none)."""
        out = self._ddb.get_item(
            TableName=self.table,
            Key={"pk": {"S": _pk(run)}, "sk": {"S": "gc"}},
            ConsistentRead=True,
        )
        item = out.get("Item")
        return 0 if item is None else int(item["below"]["N"])

    def check_not_collected(self, run: str, n: int) -> None:
        """SourceError if batch n of `run` is one whose records `collect` deleted."""
        below = self.collected_below(run)
        if below >= RETIRED:
            raise SourceError(
                f"source run {run} was retired: this checkpoint may no longer work on "
                f"application table {self.table}'s state, which a new checkpoint continued "
                "from this run's progress (startingPosition=COMMITTED), deleting this run's "
                "batch log; start a NEW checkpoint with startingPosition=COMMITTED"
            )
        if n < below:
            raise SourceError(
                f"batch {n} of source run {run}: its records in table {self.table} were "
                f"deleted as no longer needed (the batch log keeps batches from {below} on); "
                "Spark's checkpoint asks for a batch older than the source option "
                "batchLogRetain allows: was the checkpoint's offset log rolled back by hand? "
                "Start a new checkpoint with startingPosition=COMMITTED"
            )

    def collect(self, run: str, below: int) -> int:
        """Delete the records of `run`'s batches before `below` (ends and positions); return
        how many. The `gc` item is raised first, so a reader that finds a record missing can
        tell it was collected; it never moves back."""
        if below <= 0:
            return 0
        try:
            self._ddb.update_item(
                TableName=self.table,
                Key={"pk": {"S": _pk(run)}, "sk": {"S": "gc"}},
                UpdateExpression="SET #b = :b",
                ConditionExpression="attribute_not_exists(#b) OR #b < :b",
                ExpressionAttributeNames={"#b": "below"},
                ExpressionAttributeValues={":b": {"N": str(below)}},
            )
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "ConditionalCheckFailedException":
                raise
        # `end#<n>#...` sorts after `end#<n>` and before `end#<n+1>`; positions are exact keys.
        doomed = self._keys(run, "end#", f"end#{below:012d}")
        doomed += self._keys(run, "pos#", f"pos#{below - 1:012d}")
        for lo in range(0, len(doomed), 25):
            self._delete(run, doomed[lo : lo + 25])
        return len(doomed)

    def _keys(self, run: str, lo: str, hi: str) -> list[str]:
        """Sort keys of `run` between `lo` and `hi` (both inclusive)."""
        kwargs: dict[str, Any] = {
            "TableName": self.table,
            "KeyConditionExpression": "pk = :pk AND sk BETWEEN :lo AND :hi",
            "ExpressionAttributeValues": {
                ":pk": {"S": _pk(run)},
                ":lo": {"S": lo},
                ":hi": {"S": hi},
            },
            "ProjectionExpression": "sk",
        }
        found: list[str] = []
        while True:
            out = self._ddb.query(**kwargs)
            found += [item["sk"]["S"] for item in out["Items"]]
            if "LastEvaluatedKey" not in out:
                return found
            kwargs["ExclusiveStartKey"] = out["LastEvaluatedKey"]

    def _delete(self, run: str, sort_keys: list[str]) -> None:
        """One BatchWriteItem of up to 25 deletes, what it left unprocessed sent again."""
        pending = {
            self.table: [
                {"DeleteRequest": {"Key": {"pk": {"S": _pk(run)}, "sk": {"S": sk}}}}
                for sk in sort_keys
            ]
        }
        for attempt in range(10):
            pending = self._ddb.batch_write_item(RequestItems=pending).get("UnprocessedItems")
            if not pending:
                return
            time.sleep(min(2.0, 0.05 * 2**attempt))
        raise SourceError(
            f"table {self.table}: DynamoDB left {len(pending[self.table])} deletes of source "
            f"run {run} unprocessed after 10 attempts"
        )
