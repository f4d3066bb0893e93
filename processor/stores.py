"""The slice stores a Python worker keeps open between batches.

Spark may run a slice in any Python worker of any executor from one batch to the next,
and RocksDB allows one open handle per store. Each worker therefore keeps its own store
directory per slice (`<base>/<app>/w<pid>/slice-<n>`), brings it to the committed version
before use (catching up from the changelog when another worker moved the slice on), and
adopts the directories of workers that have died instead of restoring from scratch.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from changelog.durable import DurableState
from changelog.layout import Head
from changelog.restore import RebuildRequired, RestoreStats, catch_up
from state.errors import CorruptStoreError
from state.store import SliceStore

log = logging.getLogger(__name__)

RESTORE_THREADS = 8


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StoreCache:
    """Open stores of this process, by slice."""

    def __init__(self, base: Path, app: str, slices: int) -> None:
        self.root = Path(base) / app
        self.app = app
        self.slices = slices
        self.pid = os.getpid()
        self.own = self.root / f"w{self.pid}"
        self._open: dict[int, SliceStore] = {}

    def _path(self, slice_id: int, owner: Path | None = None) -> Path:
        return (owner or self.own) / f"slice-{slice_id:05d}"

    def _identity(self, slice_id: int) -> dict[str, object]:
        return {"app": self.app, "slice": slice_id, "slices": self.slices}

    def _adopt(self, slice_id: int) -> None:
        """Take over this slice's directory from a dead worker, if one left it."""
        if not self.root.exists():
            return
        for other in self.root.glob("w*"):
            try:
                pid = int(other.name[1:])
            except ValueError:
                continue
            candidate = self._path(slice_id, other)
            if pid != self.pid and not _alive(pid) and candidate.exists():
                self.own.mkdir(parents=True, exist_ok=True)
                os.replace(candidate, self._path(slice_id))
                log.info("slice %s: adopted the store of dead worker %s", slice_id, pid)
                return

    def _open_store(self, slice_id: int) -> SliceStore:
        path = self._path(slice_id)
        if not path.exists():
            self._adopt(slice_id)
        try:
            return SliceStore(path, self._identity(slice_id))
        except CorruptStoreError as exc:
            log.warning("%s", exc)
            SliceStore.destroy(path)
            return SliceStore(path, self._identity(slice_id))

    def _reopen(self, store: SliceStore) -> SliceStore:
        store.close()
        SliceStore.destroy(store.path)
        fresh = self._open_store(store.identity["slice"])  # type: ignore[arg-type]
        self._open[fresh.identity["slice"]] = fresh  # type: ignore[index]
        return fresh

    def acquire(
        self, slice_id: int, head: Head | None, target: int, durable: DurableState
    ) -> tuple[SliceStore, RestoreStats | None]:
        """The slice's store at exactly version `target` (from `head`'s log), and its cost."""
        store = self._open.get(slice_id)
        if store is not None and not store.exists_on_disk():
            log.warning("slice %s: local store %s vanished; rebuilding", slice_id, store.path)
            store.close()
            store = None
        if store is None:
            store = self._open[slice_id] = self._open_store(slice_id)
        if store.version == target:
            return store, None
        if store.version == target + 1 and store.roll_back():
            log.info("slice %s: rolled back v%s locally for a re-run", slice_id, target + 1)
            return store, None
        if store.version > target:
            log.info(
                "slice %s: local v%s is ahead of v%s; rebuilding", slice_id, store.version, target
            )
            store = self._reopen(store)
            if target == 0:
                return store, None
        assert head is not None, f"slice {slice_id}: a target above 0 needs a head"
        try:
            stats = catch_up(store, durable, head, target)
        except RebuildRequired:
            store = self._reopen(store)
            stats = catch_up(store, durable, head, target)
        log.info(
            "slice %s: restored v%s..v%s, %s records, %s bytes in %.3fs",
            slice_id,
            stats.from_version,
            stats.to_version,
            stats.records,
            stats.bytes,
            stats.seconds,
        )
        return store, stats

    def acquire_many(
        self, wanted: list[tuple[int, Head | None, int]], durable: DurableState
    ) -> dict[int, tuple[SliceStore, RestoreStats | None]]:
        """`acquire` for several slices; restores run in parallel threads (they wait on I/O)."""
        ready = all(s in self._open and self._open[s].version == v for s, _, v in wanted)
        if len(wanted) <= 1 or ready:
            return {s: self.acquire(s, h, v, durable) for s, h, v in wanted}
        with ThreadPoolExecutor(max_workers=min(RESTORE_THREADS, len(wanted))) as pool:
            futures = {s: pool.submit(self.acquire, s, h, v, durable) for s, h, v in wanted}
            return {s: f.result() for s, f in futures.items()}


_caches: dict[tuple[str, str, int], StoreCache] = {}


def cache_for(base: str, app: str, slices: int) -> StoreCache:
    """The process-wide cache for an application (module globals live as long as the worker)."""
    key = (base, app, slices)
    found = _caches.get(key)
    if found is None or found.pid != os.getpid():
        found = _caches[key] = StoreCache(Path(base), app, slices)
    return found
