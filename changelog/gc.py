"""Garbage collection of an application's S3 objects, and of the group chains no head names
any more (`shardless.changelog.chain_gc`, the same grace period and pending list).

What is referenced: every log entry's segment, every retained snapshot's manifest (its own
object, or the pack it is in) and the SST objects it names (whole, or the packs they are
in); heads keep the newest K snapshots and the log after the oldest of them, and commits
trim them. A pack is kept while any retained snapshot needs any part of it. Everything
else under `changelog/`, `snapshots/`, `sst/` and `packs/` is garbage once it has been
unreferenced for a grace period:

- an object is deleted only if an earlier collection already found it unreferenced at
  least `grace_s` ago (recorded in `<prefix>/gc/pending.msgpack`) and it was last
  written at least `grace_s` ago. A restore that read a head before the object was
  dropped from it has `grace_s` to finish; an upload whose commit is still in flight
  (or lost, like a zombie's) is never touched while young.
- If any retained manifest cannot be read, nothing is deleted.
- Only this application's objects: segments, manifests and packs name the application
  that wrote them, and gc reads that name from every unreferenced one before it counts it as
  garbage. One of another application (two applications given the same bucket and
  prefix) makes gc refuse, deleting nothing: their SST files carry no name, so the
  prefix cannot be shared safely.

Safe beside a running job (with `grace_s` >= `RUNNING_GRACE_S`): gc lists the objects
first and reads the heads after, so every object it may delete existed before the heads
it judges by. A commit after that read references only (a) what the head it replaces
referenced, which is kept, recursively back to the heads gc read, and (b) what that
commit itself uploaded: its segment, and its snapshot's manifest and SST files, written
during the batch, just before the commit. Such an upload is younger than the grace
period as long as a batch takes less than it (an hour against batches of seconds to
minutes), so it is never deleted, even when an earlier collection saw it unreferenced
while its commit was in flight. An attempt that stalls longer than that between its
uploads and its commit is refused at its commit: before it reads the heads, gc raises the
application's horizon (`shardless.changelog.fence`) to `now - grace_s`, and every commit
checks in its transaction that its uploads began after the horizon.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgpack
from botocore.exceptions import ClientError

from shardless.changelog import aws, chain_gc, fence
from shardless.changelog.durable import DurableState
from shardless.changelog.errors import ChangelogError, CorruptObjectError, MissingObjectError
from shardless.changelog.layout import AppLocation
from shardless.changelog.manifest import decode_manifest, read_manifest
from shardless.changelog.objects import get_bytes, is_missing
from shardless.changelog.pack import decode_pack_header
from shardless.changelog.segment import decode_info

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 3600
# The shortest grace period with which gc may delete beside a running job: longer than any
# batch takes from its first upload to its commit.
RUNNING_GRACE_S = DEFAULT_GRACE_S
_KINDS = ("changelog/", "snapshots/", "sst/", "packs/")
_HEADER_BYTES = 4096  # a segment's header (its writer's name, query, batch, group) fits


class GcError(ChangelogError):
    """Garbage collection refused: it cannot tell what is this application's garbage."""


class BadGraceError(ChangelogError, ValueError):
    """A grace period that is negative or not a number."""


@dataclass
class GcReport:
    referenced: int = 0
    objects: int = 0
    unreferenced: int = 0
    deleted: list[str] = field(default_factory=list)
    deleted_bytes: int = 0
    waiting: int = 0  # unreferenced but inside the grace period
    chains: int = 0  # group chains in the table
    chains_deleted: list[str] = field(default_factory=list)
    chain_items_deleted: int = 0  # their links and genesis items (1 write unit each)
    chains_sealed: list[str] = field(default_factory=list)  # never named: deleted next time
    dry_run: bool = True

    def to_dict(self) -> dict[str, object]:
        return {
            **self.__dict__,
            "deleted": len(self.deleted),
            "chains_deleted": len(self.chains_deleted),
            "chains_sealed": len(self.chains_sealed),
        }


def pending_key(loc: AppLocation) -> str:
    return loc.key("gc/pending.msgpack")


def check_grace(grace_s: float) -> float:
    """`grace_s` if it is a usable grace period (a finite number of seconds >= 0)."""
    if not isinstance(grace_s, int | float) or not math.isfinite(grace_s) or grace_s < 0:
        raise BadGraceError(
            f"grace period {grace_s!r}: give a number of seconds >= 0 (default "
            f"{DEFAULT_GRACE_S}); a negative one would delete uploads whose commits are in flight"
        )
    return grace_s


def referenced(loc: AppLocation, slices: int, chains: set[str] | None = None) -> set[str]:
    """Every object key the committed heads of the application can still need (and, into
    `chains`, every group chain a head names)."""
    durable = DurableState(loc)
    keys: set[str] = set()
    for head in durable.heads(list(range(slices))).values():
        if chains is not None and head.chain:
            chains.add(head.chain)
        keys.update(e.key(loc) for e in head.log)
        for snap in head.snaps:
            keys.add(snap.key)
            m = read_manifest(loc, snap, slice_id=head.slice)
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


def _load_pending(loc: AppLocation) -> tuple[dict[str, int], bool]:
    """What earlier collections found unreferenced (key -> first seen, ms), and whether
    they checked whose each one is (lists written before that check: not)."""
    try:
        # The one object read back without a checksum of its own: ask S3 for its CRC.
        raw = (
            aws.client("s3")
            .get_object(Bucket=loc.bucket, Key=pending_key(loc), ChecksumMode="ENABLED")["Body"]
            .read()
        )
    except ClientError as exc:
        if is_missing(exc):
            return {}, True
        raise
    data = msgpack.unpackb(raw)
    if set(data) == {"app", "first"}:
        if data["app"] != loc.app:
            raise _shared(loc, str(data["app"]), pending_key(loc))
        return {str(k): int(v) for k, v in data["first"].items()}, True
    return {str(k): int(v) for k, v in data.items()}, False


def _shared(loc: AppLocation, other: str, key: str) -> GcError:
    return GcError(
        f"s3://{loc.bucket}/{loc.root}: {key} belongs to application {other!r}, not "
        f"{loc.app!r}: two applications share this bucket and prefix, and gc cannot tell "
        "their SST files apart, so it deletes nothing. Give each application its own prefix "
        f"(if {other!r} is gone for good, delete its objects yourself first)"
    )


def _writer(loc: AppLocation, key: str) -> str | None:
    """The application that wrote a segment, manifest or pack (None: it is gone already)."""
    try:
        if key.startswith(loc.root + "packs/"):
            raw = get_bytes(loc.bucket, key, f"bytes=0-{_HEADER_BYTES - 1}")
            return str(decode_pack_header(raw, where=key)["app"])
        if key.startswith(loc.root + "changelog/"):
            raw = get_bytes(loc.bucket, key, f"bytes=0-{_HEADER_BYTES - 1}")
            try:
                info = decode_info(raw, where=key)
            except CorruptObjectError:
                if len(raw) < _HEADER_BYTES:  # the whole object: it is corrupt
                    raise
                info = decode_info(get_bytes(loc.bucket, key), where=key)  # a long header
            return str(info["app"])
        return decode_manifest(get_bytes(loc.bucket, key), where=key).app
    except MissingObjectError:
        return None
    except (CorruptObjectError, KeyError, TypeError) as exc:
        raise GcError(
            f"s3://{loc.bucket}/{key} is not a readable shardless object ({exc}); gc deletes "
            "only what it can tell is this application's: remove or restore it by hand"
        ) from exc


def _check_owner(loc: AppLocation, keys: list[str]) -> None:
    """Refuse if any of these segments, manifests or packs was written by another
    application."""
    named = [k for k in keys if not k.startswith(loc.root + "sst/")]
    if not named:
        return
    with ThreadPoolExecutor(max_workers=min(16, len(named))) as pool:
        for key, app in zip(named, pool.map(lambda k: _writer(loc, k), named), strict=True):
            if app is not None and app != loc.app:
                raise _shared(loc, app, key)


def collect(
    loc: AppLocation,
    slices: int,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = True,
    now_ms: int | None = None,
) -> GcReport:
    """Find (and unless `dry_run`, delete) objects no committed head needs any more."""
    grace_ms = int(check_grace(grace_s) * 1000)
    now = int(time.time() * 1000) if now_ms is None else now_ms
    objects = _listing(loc)  # first what exists, then what the heads need: see the docstring
    listed = chain_gc.sealed_chains(loc)
    if not dry_run:  # before the heads are read: a commit after this is checked against it
        fence.raise_horizon(loc, now - grace_ms)
    named: set[str] = set()
    keep = referenced(loc, slices, named)
    pending, checked = _load_pending(loc)
    chains = chain_gc.judge(listed, named, pending, now, grace_ms)
    pending = {k: v for k, v in pending.items() if not k.startswith(chain_gc.PENDING_PREFIX)}
    unreferenced = sorted(k for k in objects if k not in keep)
    _check_owner(
        loc, unreferenced if not checked else [k for k in unreferenced if k not in pending]
    )
    report = GcReport(referenced=len(keep), objects=len(objects), dry_run=dry_run)
    report.chains, report.chains_deleted = chains.listed, chains.delete
    report.chains_sealed = chains.seal
    still: dict[str, int] = dict(chains.waiting)
    doomed: list[str] = []
    for key in unreferenced:
        size, modified_ms = objects[key]
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
    chain_gc.seal_unnamed(loc, chains.seal)
    report.chain_items_deleted = sum(chain_gc.delete_chain(loc, c) for c in chains.delete)
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
    body = msgpack.packb({"app": loc.app, "first": still})
    s3.put_object(Bucket=loc.bucket, Key=pending_key(loc), Body=body)
    log.info("gc %s: %s", loc.app, report.to_dict())
    return report
