"""Names and records of an application's durable state.

DynamoDB (one table per application, keys `pk`/`sk`):

    pk="app"          sk="meta"   slices, format, created_at
    pk="slice#00017"  sk="head"   version, query, batch, at, log, snaps, epoch, owner, claimed,
                                  tp, te (when its next timers are due, if any),
                                  ch, from (the group chain its later versions are in)
    pk="chain#<id>"   sk=...      a group's chain (`shardless.changelog.chain`)

A slice's head is what is committed: restore stops at its version. `snaps` lists the
retained snapshots (newest last), `log` where every version after the oldest of them
lives in S3 (compactly encoded: see `encode_log`). Restore is the newest snapshot at or
below the target plus the log entries after it, up to the head's version: an explicit
start and end. `epoch` and `owner` say who owns the slice: ownership changes raise the
epoch. Every write of a head is conditional on the exact `log` and `epoch` the writer
started from, which change with every commit, claim and roll-back: a compare-and-swap.

S3 (immutable, uniquely named objects under the application's prefix):

    changelog/<batch>/g<group>-<uid>.seg          one per Spark task and batch
    snapshots/slice-<n>/v<version>-<uid>.manifest one per snapshot
    sst/slice-<n>/<uid>-<file>.sst                 one per RocksDB SST file, shared by
                                                   every later snapshot that still has it
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import msgpack

from shardless.changelog.errors import ConfigurationError

APP_PK = "app"
META_SK = "meta"
HEAD_SK = "head"
FORMAT = 1


APP_NAME_RULE = (
    "use 1 to 53 lower-case letters, digits and '-', starting and ending with a letter or "
    "digit (it names the bucket shardless-<app>, the table and a local directory)"
)
_APP_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,51}[a-z0-9])?")
_RESERVED_BUCKET_SUFFIXES = ("-s3alias", "--ol-s3", "--x-s3")


def check_app_name(app: str) -> str:
    """`app` if it makes a valid S3 bucket `shardless-<app>` and a plain directory name,
    else ConfigurationError naming it and the rule."""
    if not isinstance(app, str) or not _APP_NAME.fullmatch(app):
        raise ConfigurationError(f"application name {app!r}: {APP_NAME_RULE}")
    if app.endswith(_RESERVED_BUCKET_SUFFIXES):
        raise ConfigurationError(
            f"application name {app!r}: {APP_NAME_RULE}; S3 reserves bucket names ending "
            f"in {', '.join(_RESERVED_BUCKET_SUFFIXES)}"
        )
    return app


@dataclass(frozen=True)
class AppLocation:
    """Where an application's durable state lives."""

    app: str
    bucket: str
    prefix: str
    table: str

    @classmethod
    def default(cls, app: str) -> AppLocation:
        """The application's own bucket, prefix and table; ConfigurationError for a name
        that `check_app_name` refuses."""
        check_app_name(app)
        return cls(app=app, bucket=f"shardless-{app}", prefix=app, table=f"shardless-{app}")

    @classmethod
    def of(
        cls,
        app: str,
        bucket: str | None = None,
        prefix: str | None = None,
        table: str | None = None,
    ) -> AppLocation:
        """The application's location with any of its defaults replaced: the one rule for
        jobs, tools and the state data source (None or an empty bucket or table: the
        default; an empty prefix is a prefix, none)."""
        base = cls.default(app)
        return cls(
            app=app,
            bucket=bucket or base.bucket,
            prefix=base.prefix if prefix is None else prefix,
            table=table or base.table,
        )

    def key(self, rest: str) -> str:
        """An object key under the application's prefix."""
        base = self.prefix.strip("/")
        return f"{base}/{rest}" if base else rest

    @property
    def root(self) -> str:
        """The prefix every object of the application starts with ("" for none)."""
        base = self.prefix.strip("/")
        return f"{base}/" if base else ""


def slice_pk(slice_id: int) -> str:
    return f"slice#{slice_id:05d}"


def slice_of_pk(pk: str) -> int:
    """The slice of a head item's partition key (the inverse of `slice_pk`)."""
    return int(pk.split("#")[1])


_uid_lock = threading.Lock()
_uid_state: list[Any] = [0, b"", 0]  # pid, 8 random bytes, counter


def new_uid() -> str:
    """A unique name (32 hex digits): 8 random bytes drawn once per process (again after a
    fork), then an 8-byte counter. Consecutive uids of a process share their first half,
    which is what keeps a slice's log of them small (`encode_log`)."""
    with _uid_lock:
        pid = os.getpid()
        if _uid_state[0] != pid:
            _uid_state[:] = [pid, os.urandom(8), int.from_bytes(os.urandom(4), "big")]
        _uid_state[2] += 1
        return (_uid_state[1] + _uid_state[2].to_bytes(8, "big")).hex()


def segment_key(loc: AppLocation, batch: int, group: int, uid: str) -> str:
    return loc.key(f"changelog/{batch:012d}/g{group:05d}-{uid}.seg")


def manifest_key(loc: AppLocation, slice_id: int, version: int, uid: str) -> str:
    return loc.key(f"snapshots/slice-{slice_id:05d}/v{version:012d}-{uid}.manifest")


def sst_key(loc: AppLocation, slice_id: int, uid: str, name: str) -> str:
    return loc.key(f"sst/slice-{slice_id:05d}/{uid}-{name}")


def pack_key(loc: AppLocation, uid: str) -> str:
    """A snapshot pack: the snapshots a group took in one batch, in one object (`pack`)."""
    return loc.key(f"packs/{uid}.pack")


def pack_prefix(loc: AppLocation) -> str:
    return loc.key("packs/")


@dataclass(frozen=True)
class LogEntry:
    """One committed version of one slice: where its changes (from `version - 1`) live."""

    version: int
    batch: int
    group: int
    uid: str
    offset: int
    length: int
    records: int
    query: str = ""  # the first 8 characters of the committing query's id

    def key(self, loc: AppLocation) -> str:
        return segment_key(loc, self.batch, self.group, self.uid)


@dataclass(frozen=True)
class SnapRef:
    """A snapshot of one slice at `version`: its manifest (the object `key`, or the bytes
    `at` to `at + length` of it when the manifest is in a pack), and the bytes it
    references."""

    version: int
    key: str
    bytes: int
    files: int
    batch: int = -1  # the batch that committed `version` (-1: not known)
    query: str = ""  # and its query (first 8 characters)
    at: int = -1  # the manifest's offset in a pack (-1: the whole object)
    length: int = 0

    @property
    def byte_range(self) -> str | None:
        """The HTTP range of the manifest in its object (None: the whole object)."""
        return None if self.at < 0 else f"bytes={self.at}-{self.at + self.length - 1}"


@dataclass(frozen=True)
class Head:
    """A slice's committed version, the query batch that produced it, its restore history
    and its owner."""

    slice: int
    version: int
    query: str
    batch: int
    log: tuple[LogEntry, ...] = ()
    snaps: tuple[SnapRef, ...] = ()
    epoch: int = 0
    owner: str = ""
    at_ms: int = 0
    claimed_ms: int = 0
    # When the slice's next processing-time / event-time timer is due (None: none pending;
    # TIMERS_UNKNOWN: maybe, after a roll-back or an install): the durable index a new
    # checkpoint wakes slices by, since Spark's group state stays with the old one.
    next_timer: int | None = None
    next_event_timer: int | None = None
    # The group chain that commits the slice's versions after `version`: its links at or
    # after position `chain_from` that name the slice ("": none, every version is in
    # `log`). See `shardless.changelog.chain`.
    chain: str = ""
    chain_from: int = 0
    # The `log` attribute exactly as stored (None: the item has none), which the next write
    # of the head is conditional on. Not part of the head's value.
    log_bytes: bytes | None = field(default=None, compare=False, repr=False)

    @property
    def committed(self) -> bool:
        """False for a head that was claimed but never committed."""
        return self.version > 0 or bool(self.log)

    @property
    def timers_pending(self) -> bool:
        """Whether the slice may hold timers to fire (so a new checkpoint must wake it)."""
        return self.next_timer is not None or self.next_event_timer is not None


TIMERS_UNKNOWN = 0  # a `next_timer` that makes a new checkpoint look at the slice's store


LOG_COMPACT = b"\xc1"  # a byte msgpack never uses: what follows is the compact form
_HEX = frozenset("0123456789abcdef")


def uid_bytes(uid: str) -> bytes | None:
    """A uid of 32 hex digits as its 16 bytes; None for any other name."""
    return bytes.fromhex(uid) if len(uid) == 32 and _HEX.issuperset(uid) else None


def encode_log(log: tuple[LogEntry, ...] | list[LogEntry]) -> bytes:
    """A log in column form: consecutive versions as their first, batches as differences,
    runs of one query as [tag, count], and each uid as 16 bytes, or, when it shares its
    first 8 bytes with the entry before (one process's uids), as the difference of the
    last 8. About 15 bytes an entry instead of 65 as one msgpack row each."""
    versions = [e.version for e in log]
    first = versions[0] if versions else 0
    consecutive = versions == list(range(first, first + len(versions)))
    batches, uids, queries = [], [], []
    last_batch, last_uid = 0, None
    for e in log:
        batches.append(e.batch - last_batch)
        last_batch = e.batch
        raw = uid_bytes(e.uid)
        if raw is None:
            uids.append(e.uid)
        elif last_uid is not None and raw[:8] == last_uid[:8]:
            step = int.from_bytes(raw[8:], "big") - int.from_bytes(last_uid[8:], "big")
            uids.append(step if -(1 << 63) <= step < (1 << 63) else raw)
        else:
            uids.append(raw)
        last_uid = raw
        if queries and queries[-1][0] == e.query:
            queries[-1][1] += 1
        else:
            queries.append([e.query, 1])
    columns = [
        first if consecutive else versions,
        batches,
        [e.group for e in log],
        uids,
        [e.offset for e in log],
        [e.length for e in log],
        [e.records for e in log],
        queries,
    ]
    return LOG_COMPACT + msgpack.packb(columns, use_bin_type=True)


def decode_log(raw: bytes) -> tuple[LogEntry, ...]:
    """Either form: the compact one, or a msgpack list of rows (written before it)."""
    if not raw.startswith(LOG_COMPACT):
        return tuple(LogEntry(*row[:8]) for row in msgpack.unpackb(raw))
    versions, batches, groups, uids, offsets, lengths, records, queries = msgpack.unpackb(
        raw[1:], raw=False
    )
    n = len(batches)
    if isinstance(versions, int):
        versions = range(versions, versions + n)
    tags = [tag for tag, count in queries for _ in range(count)]
    out = []
    batch, last = 0, b""
    for i in range(n):
        batch += batches[i]
        uid = uids[i]
        if isinstance(uid, int):
            counter = (int.from_bytes(last[8:], "big") + uid) % (1 << 64)
            uid = last[:8] + counter.to_bytes(8, "big")
        if isinstance(uid, bytes):
            last = uid
            uid = uid.hex()
        else:
            last = b""
        row = (versions[i], batch, groups[i], uid, offsets[i], lengths[i], records[i], tags[i])
        out.append(LogEntry(*row))
    return tuple(out)


def encode_snaps(snaps: tuple[SnapRef, ...] | list[SnapRef]) -> bytes:
    """A head's snapshot list: rows of six, or eight for a manifest in a pack."""
    return msgpack.packb(
        [
            [s.version, s.key, s.bytes, s.files, s.batch, s.query]
            + ([s.at, s.length] if s.at >= 0 else [])
            for s in snaps
        ]
    )


def decode_snaps(raw: bytes) -> tuple[SnapRef, ...]:
    return tuple(SnapRef(*row[:8]) for row in msgpack.unpackb(raw))


def query_tag(query: str) -> str:
    """The short form of a query id kept in log entries and snapshots."""
    return query[:8]


def _int(item: dict, name: str, default: int = 0) -> int:
    return int(item[name]["N"]) if name in item else default


def head_from_item(item: dict) -> Head:
    log_bytes = bytes(item["log"]["B"]) if "log" in item else None
    return Head(
        slice=slice_of_pk(item["pk"]["S"]),
        version=_int(item, "version"),
        query=item["query"]["S"] if "query" in item else "",
        batch=_int(item, "batch", -1),
        log=decode_log(log_bytes) if log_bytes is not None else (),
        snaps=decode_snaps(item["snaps"]["B"]) if "snaps" in item else (),
        epoch=_int(item, "epoch"),
        owner=item["owner"]["S"] if "owner" in item else "",
        at_ms=_int(item, "at"),
        claimed_ms=_int(item, "claimed"),
        next_timer=int(item["tp"]["N"]) if "tp" in item else None,
        next_event_timer=int(item["te"]["N"]) if "te" in item else None,
        chain=item["ch"]["S"] if "ch" in item else "",
        chain_from=_int(item, "from"),
        log_bytes=log_bytes,
    )


@dataclass(frozen=True)
class Claim:
    """Who holds a slice's head, on which chain, and its log as stored (not decoded). Every
    write of a head item changes it: a commit appends to the log, a claim or a takeover
    raises the epoch. So a head item whose claim is the one read before was not written
    since, and a read of claims is a read of heads without decoding their history."""

    epoch: int
    owner: str
    claimed_ms: int
    chain: str
    chain_from: int
    log_bytes: bytes | None


# a BatchGetItem's projection of a head item onto its claim
CLAIM_READ = {
    "ProjectionExpression": "pk, epoch, #o, claimed, ch, #f, #l",
    "ExpressionAttributeNames": {"#o": "owner", "#f": "from", "#l": "log"},
}


def claim_from_item(item: dict) -> Claim:
    return Claim(
        epoch=_int(item, "epoch"),
        owner=item["owner"]["S"] if "owner" in item else "",
        claimed_ms=_int(item, "claimed"),
        chain=item["ch"]["S"] if "ch" in item else "",
        chain_from=_int(item, "from"),
        log_bytes=bytes(item["log"]["B"]) if "log" in item else None,
    )


def claim_of(head: Head) -> Claim:
    """The claim of `head`'s item as it was read or written (the log as stored)."""
    return Claim(
        head.epoch, head.owner, head.claimed_ms, head.chain, head.chain_from, head.log_bytes
    )


def head_item(head: Head) -> dict[str, dict[str, Any]]:
    """The whole DynamoDB item of `head` (its log as `head.log_bytes`), for a PutItem."""
    item: dict[str, dict[str, Any]] = {
        "pk": {"S": slice_pk(head.slice)},
        "sk": {"S": HEAD_SK},
        "version": {"N": str(head.version)},
        "query": {"S": head.query},
        "batch": {"N": str(head.batch)},
        "snaps": {"B": encode_snaps(head.snaps)},
    }
    if head.log_bytes is not None:
        item["log"] = {"B": head.log_bytes}
    for name, value in (("epoch", head.epoch), ("at", head.at_ms), ("claimed", head.claimed_ms)):
        if value:
            item[name] = {"N": str(value)}
    if head.owner:
        item["owner"] = {"S": head.owner}
    for name, due in (("tp", head.next_timer), ("te", head.next_event_timer)):
        if due is not None:
            item[name] = {"N": str(due)}
    if head.chain:
        item["ch"] = {"S": head.chain}
        item["from"] = {"N": str(head.chain_from)}
    return item


def head_condition(head: Head | None) -> dict[str, Any]:
    """The condition that the stored head is still exactly `head` (None: no head yet).

    Every commit appends a log entry with a new uid, and every claim or roll-back raises
    the epoch, so the pair (log, epoch) never repeats: equal means nobody wrote since."""
    if head is None:
        return {"ConditionExpression": "attribute_not_exists(pk)"}
    names = {"#l": "log", "#e": "epoch"}
    values: dict[str, dict[str, Any]] = {}
    if head.log_bytes is None:
        clauses = ["attribute_exists(pk)", "attribute_not_exists(#l)"]
    else:
        clauses = ["#l = :l"]
        values[":l"] = {"B": head.log_bytes}
    if head.epoch:
        clauses.append("#e = :e")
        values[":e"] = {"N": str(head.epoch)}
    else:
        clauses.append("attribute_not_exists(#e)")
    out: dict[str, Any] = {
        "ConditionExpression": " AND ".join(clauses),
        "ExpressionAttributeNames": names,
    }
    if values:
        out["ExpressionAttributeValues"] = values
    return out
