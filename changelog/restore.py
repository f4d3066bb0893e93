"""Bring a local slice store to a committed version: the cheapest of replaying the log
from where the store is, or the newest snapshot at or below the target plus the log
after it.

Restore always has an explicit end point, the version recorded in the slice's head; it
never reads "until it looks finished". It refuses a gap, a corrupt or a foreign object,
naming the object and the reason, and reports bytes, records, rate and time left.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from changelog.durable import DurableState
from changelog.errors import ContinuityError, CorruptObjectError
from changelog.layout import Head, RestorePlan, plan_restore
from changelog.snapshot import download_snapshot, file_pool, read_manifest
from state.errors import CorruptStoreError
from state.store import SliceStore

log = logging.getLogger(__name__)

_PREFETCH = 8  # changelog sections fetched ahead of the one being applied


@dataclass
class RestoreStats:
    slice: int
    from_version: int
    to_version: int
    snapshot_version: int | None = None
    snapshot_bytes: int = 0
    segments: int = 0
    records: int = 0
    bytes: int = 0
    seconds: float = 0.0
    rolled_back: bool = False

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "mb_per_s": round(self.mb_per_s, 2)}


class Progress:
    """Bytes restored across threads, logged with rate and time left every few seconds."""

    def __init__(self, total_bytes: int, slices: int, every_s: float = 2.0) -> None:
        self.total = total_bytes
        self.slices = slices
        self.every_s = every_s
        self.done = 0
        self.slices_done = 0
        self.started = time.monotonic()
        self._last = self.started
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._last < self.every_s:
                return
            self._last = now
        log.info("%s", self.line())

    def slice_done(self) -> None:
        with self._lock:
            self.slices_done += 1

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        return (
            f"restoring {self.slices} slices: {self.slices_done} done, "
            f"{self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB, {rate / 1e6:.1f} MB/s, "
            f"~{left:.0f}s left"
        )


def identity(app: str, slice_id: int, slices: int) -> dict[str, object]:
    """What a slice store records about itself; a snapshot of another slice will not open."""
    return {"app": app, "slice": slice_id, "slices": slices}


def materialize(
    durable: DurableState, head: Head, path: Path, slices: int, version: int | None = None
) -> tuple[SliceStore, RestoreStats]:
    """A new store at `path` holding the slice at `version` (default: the head's)."""
    ident = identity(durable.loc.app, head.slice, slices)
    target = head.version if version is None else version
    return restore(Path(path), ident, durable, head, target)


def plan(head: Head | None, local: int | None, target: int, durable: DurableState) -> RestorePlan:
    """`plan_restore` with the error naming the slice and the table."""
    if head is None:
        if target != 0:
            raise ContinuityError(f"no head for a slice at version {target}")
        return RestorePlan(None, (), fresh=local not in (None, 0))
    try:
        return plan_restore(head, local, target)
    except ValueError as exc:
        raise ContinuityError(
            f"slice {head.slice}: {exc} (table {durable.loc.table}); refusing to restore a "
            "state with a gap"
        ) from exc


def restore(
    path: Path,
    identity: dict[str, object],
    durable: DurableState,
    head: Head | None,
    target: int,
    store: SliceStore | None = None,
    progress: Progress | None = None,
) -> tuple[SliceStore, RestoreStats]:
    """The store at `path` brought to exactly version `target` of `head`.

    `store` is the open store at `path`, if any: it is caught up, rolled back one version
    from its undo record, or replaced (snapshot or full replay) when that is cheaper or
    the only way. On failure the store is closed and its directory removed: the caller
    starts again from nothing rather than from a store in an unknown state.
    """
    box: list[SliceStore | None] = [store]
    try:
        return _restore(path, identity, durable, head, target, box, progress)
    except BaseException:
        if box[0] is not None:
            box[0].close()
        SliceStore.destroy(path)
        raise


def _restore(
    path: Path,
    identity: dict[str, object],
    durable: DurableState,
    head: Head | None,
    target: int,
    box: list[SliceStore | None],
    progress: Progress | None,
) -> tuple[SliceStore, RestoreStats]:
    store = box[0]
    started = time.perf_counter()
    slice_id = int(identity["slice"])  # type: ignore[call-overload]
    local = store.version if store is not None else None
    stats = RestoreStats(slice_id, local or 0, target)
    if store is not None and local == target + 1 and store.roll_back():
        stats.rolled_back = True
        stats.seconds = time.perf_counter() - started
        return store, stats
    how = plan(head, local if local is not None and local <= target else None, target, durable)
    if store is None or how.fresh or local > target:  # type: ignore[operator]
        if store is not None:
            store.close()
        SliceStore.destroy(path)
        store = box[0] = None
    if how.snapshot is not None:
        snap = how.snapshot
        manifest = read_manifest(durable.loc, snap.key, slice_id=slice_id, version=snap.version)
        where = f"s3://{durable.loc.bucket}/{snap.key}"
        on_bytes = progress.add if progress else (lambda n: None)
        stats.snapshot_bytes = download_snapshot(durable.loc, manifest, path, on_bytes)
        stats.snapshot_version = snap.version
        stats.bytes += stats.snapshot_bytes
        try:
            store = box[0] = SliceStore(path, identity)
        except CorruptStoreError as exc:
            raise CorruptObjectError(
                f"{where}: the snapshot does not open as this slice ({exc})"
            ) from exc
        if store.version != snap.version:
            got = store.version
            raise CorruptObjectError(
                f"{where}: the snapshot holds version {got}, its manifest says {snap.version}"
            )
    if store is None:
        store = box[0] = SliceStore(path, identity)
    entries = list(how.entries)
    pool = file_pool()
    futures = [pool.submit(durable.read_changes, slice_id, e) for e in entries[:_PREFETCH]]
    for i, entry in enumerate(entries):
        changes = futures[i].result()
        if i + _PREFETCH < len(entries):
            nxt = entries[i + _PREFETCH]
            futures.append(pool.submit(durable.read_changes, slice_id, nxt))
        store.commit(changes, entry.version, tag=entry.uid)
        stats.segments += 1
        stats.records += len(changes)
        stats.bytes += entry.length
        if progress:
            progress.add(entry.length)
    if progress:
        progress.slice_done()
    stats.seconds = time.perf_counter() - started
    return store, stats
