"""Read and commit an application's durable state: S3 segments and DynamoDB slice heads.

A Spark task commits all the slices it changed in a batch with one S3 PUT and one
DynamoDB transaction per 100 slices; slices without changes cost nothing. Each head
update is conditional on the version and owner epoch the task started from, so a stale,
zombie or speculative attempt cannot commit over another, and its segment is never
referenced.

A worker claims a slice before using it (`claim`): the epoch goes up by one, which fences
every earlier owner. Claims cost a write only when a slice changes hands.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, replace

from botocore.exceptions import ClientError

from changelog import aws
from changelog.errors import CommitConflictError
from changelog.layout import (
    HEAD_SK,
    AppLocation,
    Head,
    LogEntry,
    SnapRef,
    encode_log,
    encode_snaps,
    head_from_item,
    new_uid,
    next_history,
    query_tag,
    segment_key,
    slice_pk,
)
from changelog.segment import decode_section, encode_segment
from changelog.snapshot import is_missing, missing
from state.store import Change

_SLICES_PER_TRANSACTION = 100  # DynamoDB's limit of items per transaction


@dataclass(frozen=True)
class SliceCommit:
    """What one slice commits in a batch: its new version, based on `expected` (the head
    the writer read or claimed), and a snapshot of the version before, if one was taken."""

    slice: int
    version: int
    expected: Head | None
    changes: list[Change]
    snapshot: SnapRef | None = None


@dataclass(frozen=True)
class CommitResult:
    """The segment a commit wrote (its uid tags the local stores) and what it cost."""

    uid: str
    bytes: int
    transactions: int


def owner_name() -> str:
    """Who this process is, as recorded in the heads of the slices it owns."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _now_ms() -> int:
    return int(time.time() * 1000)


class DurableState:
    def __init__(self, loc: AppLocation, keep_snapshots: int = 3) -> None:
        self.loc = loc
        self.keep_snapshots = keep_snapshots

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
            if is_missing(exc):
                raise missing(where) from exc
            raise
        return decode_section(raw, slice_id=slice_id, version=entry.version, where=where)

    def commit(
        self, query: str, batch: int, group: int, commits: list[SliceCommit]
    ) -> CommitResult:
        """Persist the changes of several slices; return the segment's uid and size.

        The segment is written first; the DynamoDB transaction then makes it part of the
        slices' committed history. If the transaction loses, the segment stays unreferenced.
        """
        if not commits:
            return CommitResult("", 0, 0)
        uid = new_uid()
        info = {"app": self.loc.app, "query": query, "batch": batch, "group": group}
        body, refs = encode_segment(info, [(c.slice, c.version, c.changes) for c in commits])
        self._s3.put_object(
            Bucket=self.loc.bucket, Key=segment_key(self.loc, batch, group, uid), Body=body
        )
        updates = []
        now = _now_ms()
        for c, ref in zip(commits, refs, strict=True):
            entry = LogEntry(
                c.version, batch, group, uid, ref.offset, ref.length, ref.records, query_tag(query)
            )
            old = c.expected or Head(c.slice, 0, "", -1)
            log, snaps = next_history(old.log, old.snaps, entry, c.snapshot, self.keep_snapshots)
            updates.append({"Update": self._head_update(c, query, batch, log, snaps, now)})
        for i in range(0, len(updates), _SLICES_PER_TRANSACTION):
            chunk = updates[i : i + _SLICES_PER_TRANSACTION]
            try:
                self._ddb.transact_write_items(TransactItems=chunk)
            except ClientError as exc:
                if exc.response["Error"]["Code"] == "TransactionCanceledException":
                    lost = [c.slice for c in commits[i : i + _SLICES_PER_TRANSACTION]]
                    raise CommitConflictError(
                        f"batch {batch}: commit of slices {lost} lost to another writer (a "
                        "retried, speculative, zombie or newer attempt, or a new owner); "
                        "this attempt's output is discarded"
                    ) from exc
                raise
        return CommitResult(uid, len(body), -(-len(updates) // _SLICES_PER_TRANSACTION))

    def install(self, slice_id: int, version: int, snapshot: SnapRef, query: str) -> None:
        """Start a slice's history from a snapshot (a new state generation, written by a
        tool); refused if the slice already has a committed head."""
        try:
            self._ddb.put_item(
                TableName=self.loc.table,
                Item={
                    "pk": {"S": slice_pk(slice_id)},
                    "sk": {"S": HEAD_SK},
                    "version": {"N": str(version)},
                    "query": {"S": query},
                    "batch": {"N": "-1"},
                    "log": {"B": encode_log(())},
                    "snaps": {"B": encode_snaps((snapshot,))},
                    "at": {"N": str(_now_ms())},
                },
                ConditionExpression="attribute_not_exists(pk) OR #v = :zero",
                ExpressionAttributeNames={"#v": "version"},
                ExpressionAttributeValues={":zero": {"N": "0"}},
            )
        except ClientError as exc:
            if exc.response["Error"]["Code"] == "ConditionalCheckFailedException":
                raise CommitConflictError(
                    f"slice {slice_id} of {self.loc.app!r} already has committed state; "
                    "write a new generation to an application without state"
                ) from exc
            raise

    def claim(self, heads: dict[int, Head | None], owner: str | None = None) -> dict[int, Head]:
        """Take ownership of slices: raise each one's epoch by one, conditional on the head
        read (`None`: never written). Returns the claimed heads; every commit based on an
        older epoch fails from now on. Raises CommitConflictError when another writer
        changed a head in between."""
        owner = owner or owner_name()
        now = _now_ms()
        claimed: dict[int, Head] = {}
        items = []
        for s, head in sorted(heads.items()):
            old = head or Head(s, 0, "", -1)
            new = replace(old, epoch=old.epoch + 1, owner=owner, claimed_ms=now)
            claimed[s] = new
            key = {"pk": {"S": slice_pk(s)}, "sk": {"S": HEAD_SK}}
            names = {"#e": "epoch", "#o": "owner", "#c": "claimed"}
            values = {
                ":e": {"N": str(new.epoch)},
                ":o": {"S": owner},
                ":c": {"N": str(now)},
            }
            if head is None:
                update = {
                    "UpdateExpression": "SET #e = :e, #o = :o, #c = :c, #v = :zero, #q = :nq, "
                    "#b = :nb",
                    "ConditionExpression": "attribute_not_exists(pk)",
                }
                names.update({"#v": "version", "#q": "query", "#b": "batch"})
                values.update({":zero": {"N": "0"}, ":nq": {"S": ""}, ":nb": {"N": "-1"}})
            else:
                update = {
                    "UpdateExpression": "SET #e = :e, #o = :o, #c = :c",
                    "ConditionExpression": "#v = :ev AND "
                    + ("#e = :ee" if old.epoch else "(attribute_not_exists(#e) OR #e = :ee)"),
                }
                names["#v"] = "version"
                values.update({":ev": {"N": str(old.version)}, ":ee": {"N": str(old.epoch)}})
            update.update(
                TableName=self.loc.table,
                Key=key,
                ExpressionAttributeNames=names,
                ExpressionAttributeValues=values,
            )
            items.append({"Update": update})
        slices = sorted(heads)
        for i in range(0, len(items), _SLICES_PER_TRANSACTION):
            try:
                self._ddb.transact_write_items(TransactItems=items[i : i + _SLICES_PER_TRANSACTION])
            except ClientError as exc:
                if exc.response["Error"]["Code"] == "TransactionCanceledException":
                    raise CommitConflictError(
                        f"claim of slices {slices[i : i + _SLICES_PER_TRANSACTION]} lost: "
                        "another worker committed or claimed them since their heads were read"
                    ) from exc
                raise
        return claimed

    def _head_update(
        self,
        c: SliceCommit,
        query: str,
        batch: int,
        log: tuple[LogEntry, ...],
        snaps: tuple[SnapRef, ...],
        now_ms: int,
    ) -> dict:
        update = {
            "TableName": self.loc.table,
            "Key": {"pk": {"S": slice_pk(c.slice)}, "sk": {"S": HEAD_SK}},
            "UpdateExpression": "SET #v = :v, #q = :q, #b = :b, #l = :l, #s = :s, #a = :a",
            "ExpressionAttributeNames": {
                "#v": "version",
                "#q": "query",
                "#b": "batch",
                "#l": "log",
                "#s": "snaps",
                "#a": "at",
            },
            "ExpressionAttributeValues": {
                ":v": {"N": str(c.version)},
                ":q": {"S": query},
                ":b": {"N": str(batch)},
                ":l": {"B": encode_log(log)},
                ":s": {"B": encode_snaps(snaps)},
                ":a": {"N": str(now_ms)},
            },
        }
        if c.expected is None:
            update["ConditionExpression"] = "attribute_not_exists(pk)"
        else:
            cond = "#v = :ev AND #q = :eq AND #b = :eb"
            values = update["ExpressionAttributeValues"]
            values.update(
                {
                    ":ev": {"N": str(c.expected.version)},
                    ":eq": {"S": c.expected.query},
                    ":eb": {"N": str(c.expected.batch)},
                }
            )
            update["ExpressionAttributeNames"]["#e"] = "epoch"
            if c.expected.epoch:
                cond += " AND #e = :ee"
                values[":ee"] = {"N": str(c.expected.epoch)}
            else:
                cond += " AND attribute_not_exists(#e)"
            update["ConditionExpression"] = cond
        return update
