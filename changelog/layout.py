"""Names and records of an application's durable state.

DynamoDB (one table per application, keys `pk`/`sk`):

    pk="app"          sk="meta"   slices, format, created_at
    pk="slice#00017"  sk="head"   version, query, batch, at, log, snaps, epoch, owner, claimed

A slice's head is what is committed: restore stops at its version. `snaps` lists the
retained snapshots (newest last), `log` where every version after the oldest of them
lives in S3. Restore is the newest snapshot at or below the target plus the log entries
after it, up to the head's version: an explicit start and end. `epoch` and `owner` say
who may commit the slice: a worker claims a slice by raising its epoch, and every
commit is conditional on the version and epoch it started from.

S3 (immutable, uniquely named objects under the application's prefix):

    changelog/<batch>/g<group>-<uid>.seg          one per Spark task and batch
    snapshots/slice-<n>/v<version>-<uid>.manifest one per snapshot
    sst/slice-<n>/<uid>-<file>.sst                 one per RocksDB SST file, shared by
                                                   every later snapshot that still has it
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import msgpack

APP_PK = "app"
META_SK = "meta"
HEAD_SK = "head"
FORMAT = 1


@dataclass(frozen=True)
class AppLocation:
    """Where an application's durable state lives."""

    app: str
    bucket: str
    prefix: str
    table: str

    @classmethod
    def default(cls, app: str) -> AppLocation:
        return cls(app=app, bucket=f"shardless-{app}", prefix=app, table=f"shardless-{app}")

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


def new_uid() -> str:
    return uuid.uuid4().hex


def segment_key(loc: AppLocation, batch: int, group: int, uid: str) -> str:
    return loc.key(f"changelog/{batch:012d}/g{group:05d}-{uid}.seg")


def manifest_key(loc: AppLocation, slice_id: int, version: int, uid: str) -> str:
    return loc.key(f"snapshots/slice-{slice_id:05d}/v{version:012d}-{uid}.manifest")


def sst_key(loc: AppLocation, slice_id: int, uid: str, name: str) -> str:
    return loc.key(f"sst/slice-{slice_id:05d}/{uid}-{name}")


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
    """A snapshot of one slice at `version`: its manifest, and the bytes it references."""

    version: int
    key: str
    bytes: int
    files: int
    batch: int = -1  # the batch that committed `version` (-1: not known)
    query: str = ""  # and its query (first 8 characters)


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

    @property
    def committed(self) -> bool:
        """False for a head that was claimed but never committed."""
        return self.version > 0 or bool(self.log)


def encode_log(log: tuple[LogEntry, ...] | list[LogEntry]) -> bytes:
    return msgpack.packb(
        [[e.version, e.batch, e.group, e.uid, e.offset, e.length, e.records, e.query] for e in log]
    )


def decode_log(raw: bytes) -> tuple[LogEntry, ...]:
    return tuple(LogEntry(*row[:8]) for row in msgpack.unpackb(raw))


def encode_snaps(snaps: tuple[SnapRef, ...] | list[SnapRef]) -> bytes:
    return msgpack.packb([[s.version, s.key, s.bytes, s.files, s.batch, s.query] for s in snaps])


def decode_snaps(raw: bytes) -> tuple[SnapRef, ...]:
    return tuple(SnapRef(*row[:6]) for row in msgpack.unpackb(raw))


def query_tag(query: str) -> str:
    """The short form of a query id kept in log entries and snapshots."""
    return query[:8]


def _int(item: dict, name: str, default: int = 0) -> int:
    return int(item[name]["N"]) if name in item else default


def head_from_item(item: dict) -> Head:
    return Head(
        slice=int(item["pk"]["S"].split("#")[1]),
        version=_int(item, "version"),
        query=item["query"]["S"] if "query" in item else "",
        batch=_int(item, "batch", -1),
        log=decode_log(item["log"]["B"]) if "log" in item else (),
        snaps=decode_snaps(item["snaps"]["B"]) if "snaps" in item else (),
        epoch=_int(item, "epoch"),
        owner=item["owner"]["S"] if "owner" in item else "",
        at_ms=_int(item, "at"),
        claimed_ms=_int(item, "claimed"),
    )


def next_history(
    log: tuple[LogEntry, ...],
    snaps: tuple[SnapRef, ...],
    entry: LogEntry,
    snapshot: SnapRef | None = None,
    keep_snapshots: int = 3,
) -> tuple[tuple[LogEntry, ...], tuple[SnapRef, ...]]:
    """The log and snapshots after committing `entry` (with `snapshot`, if one was taken).

    A commit replaces any entries and snapshots at or after its version (a re-run of a
    batch commits in its own place). The newest `keep_snapshots` snapshots below the new
    version are kept, and log entries only after the oldest of them: every version from
    that snapshot to the head stays restorable, so the head stays small and restore stays
    bounded however long the history.
    """
    kept = [s for s in snaps if s.version < entry.version]
    if snapshot is not None and snapshot.version < entry.version:
        kept = [s for s in kept if s.version != snapshot.version] + [snapshot]
        kept.sort(key=lambda s: s.version)
    kept = kept[-keep_snapshots:] if keep_snapshots > 0 else []
    floor = kept[0].version if kept else 0
    new_log = [e for e in log if floor < e.version < entry.version] + [entry]
    return tuple(new_log), tuple(kept)


@dataclass(frozen=True)
class RestorePlan:
    """How to bring a store to a version: optionally a snapshot to start from, then log
    entries to replay in order. `fresh` plans start from an empty store."""

    snapshot: SnapRef | None
    entries: tuple[LogEntry, ...]
    fresh: bool = False  # the local store is discarded first

    @property
    def bytes(self) -> int:
        return (self.snapshot.bytes if self.snapshot else 0) + sum(e.length for e in self.entries)


def _replay(log: tuple[LogEntry, ...], start: int, target: int) -> tuple[LogEntry, ...] | None:
    """The entries for versions `start+1 .. target` if the log holds all of them."""
    path = tuple(e for e in log if start < e.version <= target)
    if [e.version for e in path] == list(range(start + 1, target + 1)):
        return path
    return None


def plan_restore(head: Head, local: int | None, target: int) -> RestorePlan:
    """The cheapest way to bring a store at version `local` (None: no usable store) to
    `target`: replay the log from `local`, or a snapshot and the log after it.

    Raises ValueError when neither reaches `target` (a gap); callers turn that into an
    error naming the slice and table.
    """
    options: list[RestorePlan] = []
    if local is not None and 0 <= local <= target:
        path = _replay(head.log, local, target)
        if path is not None:
            options.append(RestorePlan(None, path, fresh=False))
    if local is None or local > 0:
        path = _replay(head.log, 0, target)
        if path is not None:
            options.append(RestorePlan(None, path, fresh=True))
    for snap in reversed(head.snaps):
        if snap.version <= target:
            path = _replay(head.log, snap.version, target)
            if path is not None:
                options.append(RestorePlan(snap, path, fresh=True))
                break
    if not options:
        raise ValueError(
            f"log holds versions {[e.version for e in head.log]} and snapshots "
            f"{[s.version for s in head.snaps]}, which cannot bring version {local} to {target}"
        )
    # A replay from the local store is preferred unless a snapshot is less to fetch.
    return min(options, key=lambda p: (p.bytes, p.fresh))


def snapshot_due(
    head: Head | None, version: int, slice_id: int, every: int, max_log_bytes: int
) -> bool:
    """Whether to snapshot a slice at `version` (the version a batch starts from).

    Every `every` versions, or sooner once the log since the newest snapshot holds
    `max_log_bytes`. A slice's first snapshot comes `slice_id % every` versions early, so
    the slices of an application that move in step do not all snapshot in one batch.
    """
    if version <= 0 or every <= 0:
        return False
    last = head.snaps[-1].version if head and head.snaps else -(slice_id % every)
    if version <= last:
        return False
    if version - last >= every:
        return True
    since = max(last, 0)
    tail = sum(e.length for e in head.log if e.version > since) if head else 0
    return tail >= max_log_bytes
