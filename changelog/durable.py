"""Read and commit an application's durable state: S3 segments and DynamoDB commit records.

A Spark task commits all the slices it changed in a batch with one S3 PUT and one
DynamoDB transaction per 50 slices; slices without changes cost nothing. Each slice's
head update is conditional on the head the task started from, so a stale attempt cannot
commit over a newer one.
"""

from __future__ import annotations

from dataclasses import dataclass

from botocore.exceptions import ClientError

from changelog import aws
from changelog.errors import CommitConflictError, ContinuityError
from changelog.layout import (
    HEAD_SK,
    AppLocation,
    Head,
    LogEntry,
    head_from_item,
    log_entry_from_item,
    log_entry_item,
    segment_key,
    slice_pk,
    version_sk,
)
from changelog.segment import decode_section, encode_segment
from state.store import Change

_SLICES_PER_TRANSACTION = 50  # two items per slice, DynamoDB allows 100 per transaction


@dataclass(frozen=True)
class SliceCommit:
    """What one slice commits in a batch: its new version, based on `expected`."""

    slice: int
    version: int
    expected: Head | None
    changes: list[Change]


class DurableState:
    def __init__(self, loc: AppLocation) -> None:
        self.loc = loc

    @property
    def _s3(self):  # noqa: ANN202
        return aws.client("s3")

    @property
    def _ddb(self):  # noqa: ANN202
        return aws.client("dynamodb")

    def heads(self, slices: list[int]) -> dict[int, Head]:
        """Committed heads of `slices` (absent when a slice was never committed)."""
        found: dict[int, Head] = {}
        for i in range(0, len(slices), 100):
            keys = [{"pk": {"S": slice_pk(s)}, "sk": {"S": HEAD_SK}} for s in slices[i : i + 100]]
            request = {self.loc.table: {"Keys": keys, "ConsistentRead": True}}
            while request:
                out = self._ddb.batch_get_item(RequestItems=request)
                for item in out["Responses"].get(self.loc.table, []):
                    head = head_from_item(item)
                    found[head.slice] = head
                request = out.get("UnprocessedKeys") or {}
        return found

    def log(self, slice_id: int, first: int, last: int) -> list[LogEntry]:
        """Log entries of versions `first..last` inclusive; refuses a gap."""
        if first > last:
            return []
        entries: list[LogEntry] = []
        kwargs = {
            "TableName": self.loc.table,
            "KeyConditionExpression": "pk = :pk AND sk BETWEEN :lo AND :hi",
            "ExpressionAttributeValues": {
                ":pk": {"S": slice_pk(slice_id)},
                ":lo": {"S": version_sk(first)},
                ":hi": {"S": version_sk(last)},
            },
            "ConsistentRead": True,
        }
        while True:
            out = self._ddb.query(**kwargs)
            entries += [log_entry_from_item(i) for i in out["Items"]]
            if "LastEvaluatedKey" not in out:
                break
            kwargs["ExclusiveStartKey"] = out["LastEvaluatedKey"]
        got = [e.version for e in entries]
        if got != list(range(first, last + 1)):
            missing = sorted(set(range(first, last + 1)) - set(got))[:5]
            raise ContinuityError(
                f"slice {slice_id}: commit log in table {self.loc.table} lacks versions "
                f"{missing} of {first}..{last}; refusing to restore a state with a gap"
            )
        return entries

    def read_changes(self, entry: LogEntry) -> list[Change]:
        """Fetch and verify one slice's section of a segment by byte range."""
        end = entry.offset + entry.length - 1
        raw = self._s3.get_object(
            Bucket=self.loc.bucket, Key=entry.segment, Range=f"bytes={entry.offset}-{end}"
        )["Body"].read()
        where = f"s3://{self.loc.bucket}/{entry.segment} (slice {entry.slice} v{entry.version})"
        return decode_section(raw, slice_id=entry.slice, version=entry.version, where=where)

    def commit(self, query: str, batch: int, group: int, commits: list[SliceCommit]) -> int:
        """Persist the changes of several slices; return the bytes written to S3.

        The segment is written first; the DynamoDB transaction then makes it part of the
        slices' committed history. If the transaction loses, the segment stays unreferenced.
        """
        if not commits:
            return 0
        info = {"app": self.loc.app, "query": query, "batch": batch, "group": group}
        body, refs = encode_segment(info, [(c.slice, c.version, c.changes) for c in commits])
        key = segment_key(self.loc, batch, group)
        self._s3.put_object(Bucket=self.loc.bucket, Key=key, Body=body)
        for i in range(0, len(commits), _SLICES_PER_TRANSACTION):
            chunk = list(zip(commits, refs, strict=True))[i : i + _SLICES_PER_TRANSACTION]
            items = []
            for c, ref in chunk:
                entry = LogEntry(
                    c.slice, c.version, key, ref.offset, ref.length, ref.records, query, batch
                )
                items.append({"Put": {"TableName": self.loc.table, "Item": log_entry_item(entry)}})
                items.append({"Update": self._head_update(c, query, batch)})
            try:
                self._ddb.transact_write_items(TransactItems=items)
            except ClientError as exc:
                if exc.response["Error"]["Code"] == "TransactionCanceledException":
                    raise CommitConflictError(
                        f"batch {batch}: commit of slices {[c.slice for c, _ in chunk]} lost to "
                        f"another writer (a retried, speculative or newer attempt); this "
                        f"attempt's output is discarded"
                    ) from exc
                raise
        return len(body)

    def _head_update(self, c: SliceCommit, query: str, batch: int) -> dict:
        update = {
            "TableName": self.loc.table,
            "Key": {"pk": {"S": slice_pk(c.slice)}, "sk": {"S": HEAD_SK}},
            "UpdateExpression": "SET #v = :v, #q = :q, #b = :b",
            "ExpressionAttributeNames": {"#v": "version", "#q": "query", "#b": "batch"},
            "ExpressionAttributeValues": {
                ":v": {"N": str(c.version)},
                ":q": {"S": query},
                ":b": {"N": str(batch)},
            },
        }
        if c.expected is None:
            update["ConditionExpression"] = "attribute_not_exists(pk)"
        else:
            update["ConditionExpression"] = "#v = :ev AND #q = :eq AND #b = :eb"
            update["ExpressionAttributeValues"].update(
                {
                    ":ev": {"N": str(c.expected.version)},
                    ":eq": {"S": c.expected.query},
                    ":eb": {"N": str(c.expected.batch)},
                }
            )
        return update
