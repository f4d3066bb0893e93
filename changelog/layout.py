"""Names and records of an application's durable state.

DynamoDB (one table per application, keys `pk`/`sk`):

    pk="app"          sk="meta"   slices, format, created_at
    pk="slice#00017"  sk="head"   version, query, batch, log

A slice's head is what is committed: restore stops at its version. Its `log` lists
where every version since the newest base lives in S3: the restore path, with an
explicit start and end. A base is a full copy of the slice's state at its version; a
commit that lets the log grow past a bound writes one, and the entries before the
previous base are then dropped, so the head stays small and restore stays bounded.

S3: `<prefix>/changelog/<batch>/g<group>-<uid>.seg`, immutable and uniquely named.
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


def slice_pk(slice_id: int) -> str:
    return f"slice#{slice_id:05d}"


def new_uid() -> str:
    return uuid.uuid4().hex


def segment_key(loc: AppLocation, batch: int, group: int, uid: str) -> str:
    base = f"{loc.prefix.strip('/')}/" if loc.prefix.strip("/") else ""
    return f"{base}changelog/{batch:012d}/g{group:05d}-{uid}.seg"


@dataclass(frozen=True)
class LogEntry:
    """One committed version of one slice: where its section lives in S3.

    `base` entries hold the slice's whole state at `version`; others hold the changes
    from `version - 1`.
    """

    version: int
    batch: int
    group: int
    uid: str
    offset: int
    length: int
    records: int
    base: bool = False

    def key(self, loc: AppLocation) -> str:
        return segment_key(loc, self.batch, self.group, self.uid)


@dataclass(frozen=True)
class Head:
    """A slice's committed version, the query batch that produced it, and its log."""

    slice: int
    version: int
    query: str
    batch: int
    log: tuple[LogEntry, ...] = ()


def encode_log(log: tuple[LogEntry, ...] | list[LogEntry]) -> bytes:
    return msgpack.packb(
        [[e.version, e.batch, e.group, e.uid, e.offset, e.length, e.records, e.base] for e in log]
    )


def decode_log(raw: bytes) -> tuple[LogEntry, ...]:
    return tuple(LogEntry(*row) for row in msgpack.unpackb(raw))


def head_from_item(item: dict) -> Head:
    return Head(
        slice=int(item["pk"]["S"].split("#")[1]),
        version=int(item["version"]["N"]),
        query=item["query"]["S"],
        batch=int(item["batch"]["N"]),
        log=decode_log(item["log"]["B"]) if "log" in item else (),
    )


def next_log(old: tuple[LogEntry, ...], entry: LogEntry) -> tuple[LogEntry, ...]:
    """The log after committing `entry`, replacing any entries at or after its version.

    Entries before the newest base at or below `entry.version - 1` are dropped: the log
    can always rebuild both the new version and the one before it (which a re-run of
    the same batch starts from).
    """
    log = [e for e in old if e.version < entry.version] + [entry]
    keep_from = 0
    for i, e in enumerate(log):
        if e.base and e.version <= entry.version - 1:
            keep_from = i
    return tuple(log[keep_from:])


def restore_path(log: tuple[LogEntry, ...], local: int, target: int) -> tuple[bool, list[LogEntry]]:
    """How to bring a store at version `local` to `target`: (start from empty?, entries).

    Raises ValueError when the log cannot reach `target` (a gap); callers turn that into
    an error naming the slice and table.
    """
    upto = [e for e in log if e.version <= target]
    bases = [i for i, e in enumerate(upto) if e.base]
    floor = upto[bases[-1]].version if bases else 0
    if floor <= local <= target:
        path, fresh = [e for e in upto if e.version > local], False
    elif bases:
        path, fresh = upto[bases[-1] :], True
    else:
        path, fresh = upto, True
    start = path[0].version if path and path[0].base else (0 if fresh else local)
    expected = list(range(start + (0 if path and path[0].base else 1), target + 1))
    if [e.version for e in path] != expected:
        raise ValueError(
            f"log holds versions {[e.version for e in log]}, which cannot bring version "
            f"{local} to {target}"
        )
    return fresh, path
