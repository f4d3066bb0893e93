"""Garbage collection of an application's S3 objects.

What is referenced: every log entry's segment, every retained snapshot's manifest and the
SST objects it names (heads keep the newest K snapshots and the log after the oldest of
them; commits trim them). Everything else under `changelog/`, `snapshots/` and `sst/` is
garbage once it has been unreferenced for a grace period:

- an object is deleted only if an earlier collection already found it unreferenced at
  least `grace_s` ago (recorded in `<prefix>/gc/pending.msgpack`) and it was last
  written at least `grace_s` ago. A restore that read a head before the object was
  dropped from it has `grace_s` to finish; an upload whose commit is still in flight
  (or lost, like a zombie's) is never touched while young.
- If any retained manifest cannot be read, nothing is deleted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgpack
from botocore.exceptions import ClientError

from changelog import aws
from changelog.durable import DurableState
from changelog.errors import ChangelogError
from changelog.layout import AppLocation
from changelog.snapshot import is_missing, read_manifest

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 3600
_KINDS = ("changelog/", "snapshots/", "sst/")


@dataclass
class GcReport:
    referenced: int = 0
    objects: int = 0
    unreferenced: int = 0
    deleted: list[str] = field(default_factory=list)
    deleted_bytes: int = 0
    waiting: int = 0  # unreferenced but inside the grace period
    dry_run: bool = True

    def to_dict(self) -> dict[str, object]:
        return {**self.__dict__, "deleted": len(self.deleted)}


def pending_key(loc: AppLocation) -> str:
    return loc.key("gc/pending.msgpack")


def referenced(loc: AppLocation, slices: int) -> set[str]:
    """Every object key the committed heads of the application can still need."""
    durable = DurableState(loc)
    keys: set[str] = set()
    for head in durable.heads(list(range(slices))).values():
        keys.update(e.key(loc) for e in head.log)
        for snap in head.snaps:
            keys.add(snap.key)
            m = read_manifest(loc, snap.key, slice_id=head.slice, version=snap.version)
            keys.update(f.key for f in m.files)
    return keys


def _listing(loc: AppLocation) -> dict[str, tuple[int, int]]:
    """key -> (size, last modified in ms) for every object of the kinds GC manages."""
    s3 = aws.client("s3")
    found: dict[str, tuple[int, int]] = {}
    for kind in _KINDS:
        for page in s3.get_paginator("list_objects_v2").paginate(
            Bucket=loc.bucket, Prefix=loc.root + kind
        ):
            for o in page.get("Contents", []):
                found[o["Key"]] = (o["Size"], int(o["LastModified"].timestamp() * 1000))
    return found


def _load_pending(loc: AppLocation) -> dict[str, int]:
    try:
        # The one object read back without a checksum of its own: ask S3 for its CRC.
        raw = (
            aws.client("s3")
            .get_object(Bucket=loc.bucket, Key=pending_key(loc), ChecksumMode="ENABLED")["Body"]
            .read()
        )
    except ClientError as exc:
        if is_missing(exc):
            return {}
        raise
    return {str(k): int(v) for k, v in msgpack.unpackb(raw).items()}


def collect(
    loc: AppLocation,
    slices: int,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = True,
    now_ms: int | None = None,
) -> GcReport:
    """Find (and unless `dry_run`, delete) objects no committed head needs any more."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    grace_ms = int(grace_s * 1000)
    keep = referenced(loc, slices)
    objects = _listing(loc)
    pending = _load_pending(loc)
    report = GcReport(referenced=len(keep), objects=len(objects), dry_run=dry_run)
    still: dict[str, int] = {}
    doomed: list[str] = []
    for key, (size, modified_ms) in sorted(objects.items()):
        if key in keep:
            continue
        report.unreferenced += 1
        first = pending.get(key, now)
        if first <= now - grace_ms and modified_ms <= now - grace_ms:
            doomed.append(key)
            report.deleted_bytes += size
        else:
            still[key] = first
    report.waiting = len(still)
    report.deleted = doomed
    if dry_run:
        return report
    s3 = aws.client("s3")
    for i in range(0, len(doomed), 1000):
        out = s3.delete_objects(
            Bucket=loc.bucket,
            Delete={"Objects": [{"Key": k} for k in doomed[i : i + 1000]], "Quiet": True},
        )
        if out.get("Errors"):
            first_error = out["Errors"][0]
            raise ChangelogError(
                f"s3://{loc.bucket}: {len(out['Errors'])} deletions failed, e.g. "
                f"{first_error['Key']}: {first_error.get('Message')}"
            )
    s3.put_object(Bucket=loc.bucket, Key=pending_key(loc), Body=msgpack.packb(still))
    log.info("gc %s: %s", loc.app, report.to_dict())
    return report
