"""Names of durable things: S3 keys and DynamoDB items of an application.

DynamoDB (one table per application, keys `pk`/`sk`):

    pk="app"          sk="meta"        slices, format, created_at
    pk="slice#00017"  sk="head"        version, query, batch  (restore stops here)
    pk="slice#00017"  sk="v#000..042"  segment, offset, length, records, query, batch

S3: `<prefix>/changelog/<batch>/<group>-<uuid>.seg`, immutable and uniquely named.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

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


def version_sk(version: int) -> str:
    return f"v#{version:012d}"


def segment_key(loc: AppLocation, batch: int, group: int) -> str:
    base = f"{loc.prefix.strip('/')}/" if loc.prefix.strip("/") else ""
    return f"{base}changelog/{batch:012d}/g{group:05d}-{uuid.uuid4().hex}.seg"


@dataclass(frozen=True)
class Head:
    """A slice's committed version and the query batch that produced it."""

    slice: int
    version: int
    query: str
    batch: int


@dataclass(frozen=True)
class LogEntry:
    """One committed version of one slice: where its changes are in S3."""

    slice: int
    version: int
    segment: str
    offset: int
    length: int
    records: int
    query: str
    batch: int


def head_from_item(item: dict) -> Head:
    return Head(
        slice=int(item["pk"]["S"].split("#")[1]),
        version=int(item["version"]["N"]),
        query=item["query"]["S"],
        batch=int(item["batch"]["N"]),
    )


def log_entry_item(e: LogEntry) -> dict:
    return {
        "pk": {"S": slice_pk(e.slice)},
        "sk": {"S": version_sk(e.version)},
        "segment": {"S": e.segment},
        "offset": {"N": str(e.offset)},
        "length": {"N": str(e.length)},
        "records": {"N": str(e.records)},
        "query": {"S": e.query},
        "batch": {"N": str(e.batch)},
    }


def log_entry_from_item(item: dict) -> LogEntry:
    return LogEntry(
        slice=int(item["pk"]["S"].split("#")[1]),
        version=int(item["sk"]["S"].split("#")[1]),
        segment=item["segment"]["S"],
        offset=int(item["offset"]["N"]),
        length=int(item["length"]["N"]),
        records=int(item["records"]["N"]),
        query=item["query"]["S"],
        batch=int(item["batch"]["N"]),
    )
