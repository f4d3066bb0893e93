"""Read and commit an application's durable state: S3 segments and DynamoDB slice heads.

A Spark task commits all the slices it changed in a batch with one S3 PUT and one
DynamoDB transaction per 100 slices; slices without changes cost nothing. Each head
update is conditional on the head the task started from, so a stale attempt cannot
commit over a newer one, and its segment is never referenced.
"""

from __future__ import annotations

from dataclasses import dataclass

from botocore.exceptions import ClientError

from changelog import aws
from changelog.errors import CommitConflictError
from changelog.layout import (
    HEAD_SK,
    AppLocation,
    Head,
    LogEntry,
    encode_log,
    head_from_item,
    new_uid,
    next_log,
    segment_key,
    slice_pk,
)
from changelog.segment import decode_section, encode_segment
from state.store import Change

_SLICES_PER_TRANSACTION = 100  # DynamoDB's limit of items per transaction


@dataclass(frozen=True)
class SliceCommit:
    """What one slice commits in a batch: its new version, based on `expected`.

    With `base`, `changes` is the slice's whole state at `version` rather than a delta.
    """

    slice: int
    version: int
    expected: Head | None
    changes: list[Change]
    base: bool = False


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

    def read_changes(self, slice_id: int, entry: LogEntry) -> list[Change]:
        """Fetch and verify one slice's section of a segment by byte range."""
        key = entry.key(self.loc)
        end = entry.offset + entry.length - 1
        where = f"s3://{self.loc.bucket}/{key} (slice {slice_id} v{entry.version})"
        try:
            raw = self._s3.get_object(
                Bucket=self.loc.bucket, Key=key, Range=f"bytes={entry.offset}-{end}"
            )["Body"].read()
        except ClientError as exc:
            if exc.response["Error"]["Code"] in {"NoSuchKey", "404"}:
                raise CommitConflictError(
                    f"{where} is referenced by the slice's head but missing from the "
                    "bucket: it was deleted outside shardless, and the slice cannot be "
                    "restored past it until the object is recovered (S3 versioning)"
                ) from exc
            raise
        return decode_section(raw, slice_id=slice_id, version=entry.version, where=where)

    def commit(self, query: str, batch: int, group: int, commits: list[SliceCommit]) -> int:
        """Persist the changes of several slices; return the bytes written to S3.

        The segment is written first; the DynamoDB transaction then makes it part of the
        slices' committed history. If the transaction loses, the segment stays unreferenced.
        """
        if not commits:
            return 0
        uid = new_uid()
        info = {"app": self.loc.app, "query": query, "batch": batch, "group": group}
        body, refs = encode_segment(info, [(c.slice, c.version, c.changes) for c in commits])
        self._s3.put_object(
            Bucket=self.loc.bucket, Key=segment_key(self.loc, batch, group, uid), Body=body
        )
        updates = []
        for c, ref in zip(commits, refs, strict=True):
            entry = LogEntry(
                c.version, batch, group, uid, ref.offset, ref.length, ref.records, c.base
            )
            old = c.expected.log if c.expected else ()
            updates.append({"Update": self._head_update(c, query, batch, next_log(old, entry))})
        for i in range(0, len(updates), _SLICES_PER_TRANSACTION):
            chunk = updates[i : i + _SLICES_PER_TRANSACTION]
            try:
                self._ddb.transact_write_items(TransactItems=chunk)
            except ClientError as exc:
                if exc.response["Error"]["Code"] == "TransactionCanceledException":
                    lost = [c.slice for c in commits[i : i + _SLICES_PER_TRANSACTION]]
                    raise CommitConflictError(
                        f"batch {batch}: commit of slices {lost} lost to another writer (a "
                        "retried, speculative or newer attempt); this attempt's output is "
                        "discarded"
                    ) from exc
                raise
        return len(body)

    def _head_update(
        self, c: SliceCommit, query: str, batch: int, log: tuple[LogEntry, ...]
    ) -> dict:
        update = {
            "TableName": self.loc.table,
            "Key": {"pk": {"S": slice_pk(c.slice)}, "sk": {"S": HEAD_SK}},
            "UpdateExpression": "SET #v = :v, #q = :q, #b = :b, #l = :l",
            "ExpressionAttributeNames": {
                "#v": "version",
                "#q": "query",
                "#b": "batch",
                "#l": "log",
            },
            "ExpressionAttributeValues": {
                ":v": {"N": str(c.version)},
                ":q": {"S": query},
                ":b": {"N": str(batch)},
                ":l": {"B": encode_log(log)},
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
