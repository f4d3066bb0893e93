"""Re-slicing: rewrite an application's state from N slices to M, where M is a multiple or
a divisor of N, as a new state generation (another application name) a job can start from.

Slices are contiguous hash ranges, so with M = k·N each old slice splits into exactly the
new slices k·s .. k·s+k-1, and with N = k·M each new slice is exactly the union of old
slices k·t .. k·t+k-1. Every entry is copied byte for byte, routed by the MD5 of the
record key it belongs to, into the new slice whose hash range holds that MD5.

The routing check: a store keeps record keys, not the hash key a record was routed by,
so only the MD5 of a key can be checked. An entry whose key's MD5 lies outside its old
slice's range (state of records routed by explicit hash key, or written with
`slice_state` under another slice's key) is refused, naming the key. A key routed by
explicit hash key whose MD5 happens to fall in the same old slice (1 in N) cannot be told
apart; with N = 1 that is every key, so re-slicing one slice is refused unless the caller
says every record was routed by its partition key's MD5 (`md5_routed`).

Verified: for every old slice, the entry count and an order-independent digest of its
entries equal those of its parts (split) or contribute to its union (merge); and every
new slice, restored back from S3, has the digest that was written.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from botocore.exceptions import ClientError

from shardless.changelog import aws, resources
from shardless.changelog.durable import DurableState
from shardless.changelog.errors import ChangelogError, CommitConflictError
from shardless.changelog.inspect import Digest, digest, opened
from shardless.changelog.layout import (
    HEAD_SK,
    TIMERS_UNKNOWN,
    AppLocation,
    Head,
    SnapRef,
    encode_log,
    encode_snaps,
    new_uid,
    slice_pk,
)
from shardless.changelog.restore import identity, materialize
from shardless.changelog.snapshot import write_snapshot
from shardless.state.keys import owner
from shardless.state.slices import key_hash, slice_bounds, slice_of
from shardless.state.store import SliceStore

_BATCH = 10_000


class ResliceError(ChangelogError):
    """The state cannot be re-sliced as asked."""


@dataclass
class ResliceReport:
    source: str
    target: str
    from_slices: int
    to_slices: int
    entries: int = 0
    bytes: int = 0
    digest: str = ""
    verified: bool = False
    slices: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def plan_groups(n: int, m: int) -> list[tuple[list[int], list[int]]]:
    """(old slices, new slices) that map onto each other exactly."""
    if m % n == 0:
        k = m // n
        return [([s], list(range(s * k, s * k + k))) for s in range(n)]
    if n % m == 0:
        k = n // m
        return [(list(range(t * k, t * k + k)), [t]) for t in range(m)]
    raise ResliceError(
        f"cannot re-slice {n} slices into {m}: the new count must be a multiple or a divisor "
        f"of the old (e.g. {n * 2} or {max(n // 2, 1)})"
    )


_MANAGED = ("changelog/", "snapshots/", "sst/", "gc/")


def check_target(source: AppLocation, target: AppLocation) -> None:
    """Refuse a new generation whose objects or heads would mix with the source's: its gc
    would take the other's objects for garbage."""
    if target.table == source.table:
        raise ResliceError(
            f"--to-table {target.table}: the source's own table; the new generation needs "
            "its own (default shardless-TO_APP)"
        )
    if target.bucket != source.bucket:
        return
    ours = [source.root + k for k in _MANAGED]
    theirs = [target.root + k for k in _MANAGED]
    if any(a.startswith(b) or b.startswith(a) for a in ours for b in theirs):
        raise ResliceError(
            f"--to-prefix {target.prefix!r} in s3://{target.bucket}: the new generation's "
            f"objects would mix with those of {source.app!r} (prefix {source.prefix!r}); give "
            "it a prefix of its own (default: the new application's name)"
        )


def check_routing(n: int, md5_routed: bool) -> None:
    """Refuse what the routing check cannot check: one source slice holds every MD5."""
    if n == 1 and not md5_routed:
        raise ResliceError(
            "the application has 1 slice, so every key's MD5 lies in it and the check that "
            "refuses state of records routed by explicit hash key cannot fail (a store does "
            "not keep the hash key a record was routed by). If every record was routed by "
            "its partition key's MD5 (no explicit hash keys, no slice_state under other "
            "keys), say so with --md5-routed"
        )


def reslice(
    source: AppLocation,
    target: AppLocation,
    to_slices: int,
    *,
    threads: int = 4,
    on_progress: Callable[[int, int], None] = lambda done, total: None,
    md5_routed: bool = False,
) -> ResliceReport:
    """Write `source`'s committed state into `target` as `to_slices` slices (`md5_routed`:
    the caller vouches that every record was routed by its partition key's MD5)."""
    check_target(source, target)
    n = resources.app_slices(source)
    groups = plan_groups(n, to_slices)
    check_routing(n, md5_routed)
    resources.ensure(target, to_slices)
    target_durable = DurableState(target)
    existing = [h for h in target_durable.heads(list(range(to_slices))).values() if h.committed]
    if existing:
        raise ResliceError(
            f"target application {target.app!r} already has state in {len(existing)} slices; "
            "re-slice into a new application name"
        )
    heads = DurableState(source).heads(list(range(n)))
    report = ResliceReport(source.app, target.app, n, to_slices)
    query = f"reslice:{source.app}:{new_uid()[:8]}"
    done = [0]

    def one(group: tuple[list[int], list[int]]) -> list[dict]:
        olds, news = group
        scratch = Path(tempfile.mkdtemp(prefix=f"shardless-reslice-{target.app}-"))
        try:
            rows = _rewrite(source, target, heads, n, to_slices, olds, news, scratch, query)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        done[0] += len(olds)
        on_progress(done[0], n)
        return rows

    with ThreadPoolExecutor(max_workers=threads) as pool:
        for rows in pool.map(one, groups):
            report.slices += rows
    total = Digest()
    for row in report.slices:
        total += Digest(row["entries"], int(row["digest"], 16))
        report.bytes += row["bytes"]
    report.entries = total.count
    report.digest = f"{total.total:016x}"
    report.verified = all(row["verified"] for row in report.slices)
    if not report.verified:
        bad = [row["slice"] for row in report.slices if not row["verified"]]
        raise ResliceError(
            f"new slices {bad} of {target.app!r} do not restore to what was written; the new "
            "generation must not be used"
        )
    return report


def _rewrite(
    source: AppLocation,
    target: AppLocation,
    heads: dict[int, Head],
    n: int,
    m: int,
    olds: list[int],
    news: list[int],
    scratch: Path,
    query: str,
) -> list[dict]:
    stores = {t: SliceStore(scratch / f"new-{t}", identity(target.app, t, m)) for t in news}
    written = {t: Digest() for t in news}
    before = Digest()
    try:
        for s in olds:
            old_lo, old_hi = slice_bounds(s, n)
            with opened(DurableState(source), heads.get(s), n) as old:
                if old is None:
                    continue
                pending: dict[int, list] = {t: [] for t in news}
                for k, v in old.user_items():
                    who = owner(k)
                    if who is None:
                        continue
                    h = key_hash(who)
                    t = slice_of(h, m)
                    if not old_lo <= h < old_hi:
                        raise ResliceError(
                            f"slice {s} of {source.app!r} holds key {who!r}, whose MD5 belongs "
                            f"to slice {slice_of(h, n)}: its records were routed by explicit "
                            "hash key (or it was written with slice_state), so the key alone "
                            "cannot say where it goes; re-slicing refused"
                        )
                    lo, hi = slice_bounds(t, m)
                    if t not in stores or not lo <= h < hi:
                        raise ResliceError(
                            f"key {who!r} of old slice {s} would land in new slice {t}, "
                            f"outside {news}; re-slicing refused"
                        )
                    before.add(k, v)
                    written[t].add(k, v)
                    pending[t].append((k, v))
                    if len(pending[t]) >= _BATCH:
                        stores[t].commit(pending[t], 1)
                        pending[t] = []
                for t, rows in pending.items():
                    if rows:
                        stores[t].commit(rows, 1)
        after = sum(written.values(), Digest())
        if (after.count, after.total) != (before.count, before.total):
            raise ResliceError(
                f"slices {olds} -> {news}: wrote {after.count} entries (digest "
                f"{after.total:016x}), read {before.count} ({before.total:016x})"
            )
        rows = []
        durable = DurableState(target)
        for t in news:
            if not written[t].count:  # no state: the slice starts at version 0
                rows.append(
                    {"slice": t, "from": olds, "entries": 0, "digest": f"{0:016x}", "bytes": 0,
                     "verified": True}
                )  # fmt: skip
                continue
            store = stores[t]
            store.commit([], 1)
            ref, _, sent = write_snapshot(target, t, 1, store.checkpoint(scratch / f"ck-{t}"), None)
            install(durable, t, 1, ref, query)
            back, _ = materialize(durable, durable.heads([t])[t], scratch / f"check-{t}", m)
            check = digest(back)
            back.close()
            rows.append(
                {
                    "slice": t,
                    "from": olds,
                    "entries": written[t].count,
                    "digest": f"{written[t].total:016x}",
                    "bytes": sent,
                    "verified": (check.count, check.total) == (written[t].count, written[t].total),
                }
            )
        return rows
    finally:
        for store in stores.values():
            store.close()


def install(
    durable: DurableState, slice_id: int, version: int, snapshot: SnapRef, query: str
) -> None:
    """Start a slice's history from a snapshot (a new state generation); refused if the
    slice already has a committed head."""
    loc = durable.loc
    try:
        aws.client("dynamodb").put_item(
            TableName=loc.table,
            Item={
                "pk": {"S": slice_pk(slice_id)},
                "sk": {"S": HEAD_SK},
                "version": {"N": str(version)},
                "query": {"S": query},
                "batch": {"N": "-1"},
                "log": {"B": encode_log(())},
                "snaps": {"B": encode_snaps((snapshot,))},
                "at": {"N": str(int(time.time() * 1000))},
                "tp": {"N": str(TIMERS_UNKNOWN)},  # its timers are not known here
            },
            ConditionExpression="attribute_not_exists(pk) OR #v = :zero",
            ExpressionAttributeNames={"#v": "version"},
            ExpressionAttributeValues={":zero": {"N": "0"}},
        )
    except ClientError as exc:
        if exc.response["Error"]["Code"] == "ConditionalCheckFailedException":
            raise CommitConflictError(
                f"slice {slice_id} of {loc.app!r} already has committed state; "
                "write a new generation to an application without state"
            ) from exc
        raise
