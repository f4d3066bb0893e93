"""The slice stores a Python worker keeps open between batches.

Spark may run a slice in any Python worker of any executor from one batch to the next,
and RocksDB allows one open handle per store. Each worker therefore keeps its own store
directory per slice (`<base>/<app>/w<pid>/slice-<n>`), brings it to the committed version
before use (catching up from the changelog when another worker moved the slice on), and
adopts the directories of workers that have died instead of restoring from scratch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from changelog.durable import DurableState, owner_name
from changelog.errors import CommitConflictError
from changelog.layout import Head
from changelog.restore import Progress, RestoreStats, identity, plan, restore
from state.errors import CorruptStoreError
from state.store import SliceStore

log = logging.getLogger(__name__)

RESTORE_THREADS = 8
CLAIM_ATTEMPTS = 3


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
        self._epochs: dict[int, int] = {}
        self.owner = f"{owner_name()}:{uuid.uuid4().hex[:8]}"

    def _path(self, slice_id: int, owner: Path | None = None) -> Path:
        return (owner or self.own) / f"slice-{slice_id:05d}"

    def _identity(self, slice_id: int) -> dict[str, object]:
        return identity(self.app, slice_id, self.slices)

    def _adopt(self, slice_id: int) -> bool:
        """Take over this slice's directory from a dead worker, if one left it."""
        if not self.root.exists():
            return False
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
                return True
        return False

    def _open_store(self, slice_id: int) -> SliceStore:
        path = self._path(slice_id)
        try:
            return SliceStore(path, self._identity(slice_id))
        except CorruptStoreError as exc:
            log.warning("%s", exc)
            SliceStore.destroy(path)
            return SliceStore(path, self._identity(slice_id))

    def _ready(self, slice_id: int, target: int) -> SliceStore | None:
        """The open store if it is already at `target` and still on disk."""
        store = self._open.get(slice_id)
        if store is not None and not store.exists_on_disk():
            log.warning("slice %s: local store %s vanished; rebuilding", slice_id, store.path)
            store.close()
            del self._open[slice_id]
            return None
        return store if store is not None and store.version == target else None

    @staticmethod
    def _consistent(store: SliceStore, head: Head | None) -> bool:
        """Whether the store's version is the commit the head has for it (a re-run of a
        batch elsewhere may have committed the same version differently)."""
        if store.version == 0:
            return True
        entry = next((e for e in head.log if e.version == store.version), None) if head else None
        return entry is not None and store.tag == entry.uid

    def owns(self, slice_id: int, head: Head | None) -> bool:
        """True while this process holds the slice's newest claim (nobody took it since)."""
        return (
            head is not None
            and head.owner == self.owner
            and (self._epochs.get(slice_id) == head.epoch)
        )

    def claim(
        self, wanted: dict[int, Head | None], durable: DurableState
    ) -> dict[int, Head | None]:
        """Claim the slices this process does not own yet; return every slice's head as it
        stands after the claims. A claim that races with another claimer is retried; one
        that races with a commit fails (the caller's plan is stale)."""
        heads = dict(wanted)
        need = {s: h for s, h in heads.items() if not self.owns(s, h)}
        for attempt in range(CLAIM_ATTEMPTS):
            if not need:
                break
            try:
                claimed = durable.claim(need, self.owner)
            except CommitConflictError:
                if attempt == CLAIM_ATTEMPTS - 1:
                    raise
                fresh = durable.heads(sorted(need))
                for s, old in need.items():
                    new = fresh.get(s)
                    if (old is None) != (new is None) or (
                        old is not None and new is not None and old.version != new.version
                    ):
                        raise CommitConflictError(
                            f"slice {s} was committed by another worker while this one was "
                            "claiming it; the task is retried from the new head"
                        ) from None
                need = {s: fresh.get(s) for s in need}
                continue
            for s, h in claimed.items():
                self._epochs[s] = h.epoch
                heads[s] = h
            need = {}
        return heads

    def acquire(
        self,
        slice_id: int,
        head: Head | None,
        target: int,
        durable: DurableState,
        progress: Progress | None = None,
        owned: bool = False,
    ) -> tuple[SliceStore, RestoreStats | None]:
        """The slice's store at exactly version `target` (from `head`), and what it cost.

        Unless this process `owned` the slice since its last commit, a local store is used
        only if it holds the committed version: checked by the tag of its last commit."""
        store = self._open.pop(slice_id, None)
        if store is not None and not store.exists_on_disk():
            log.warning("slice %s: local store %s vanished; rebuilding", slice_id, store.path)
            store.close()
            store = None
        path = self._path(slice_id)
        if store is None and (path.exists() or self._adopt(slice_id)):
            store = self._open_store(slice_id)
        if store is not None and store.version == target + 1 and store.roll_back():
            log.info("slice %s: rolled back v%s locally for a re-run", slice_id, target + 1)
        if (
            store is not None
            and store.version <= target
            and not (owned and store.version == target)
            and not self._consistent(store, head)
        ):
            log.info(
                "slice %s: local v%s is not the committed one; rebuilding", slice_id, store.version
            )
            store.close()
            SliceStore.destroy(path)
            store = None
        if store is not None and store.version == target:
            self._open[slice_id] = store
            return store, None
        store, stats = restore(
            path, self._identity(slice_id), durable, head, target, store, progress
        )
        self._open[slice_id] = store
        log.info("slice %s: restored %s", slice_id, json.dumps(stats.to_dict()))
        return store, stats

    def acquire_many(
        self, wanted: list[tuple[int, Head | None, int]], durable: DurableState
    ) -> dict[int, tuple[SliceStore, Head | None, RestoreStats | None]]:
        """Claim and `acquire` several slices; returns each slice's store, its head after
        the claim (commit against it) and its restore cost. Restores run in parallel."""
        owned = {s for s, h, _ in wanted if self.owns(s, h)}
        ready = {s for s, _, v in wanted if s in owned and self._ready(s, v) is not None}
        heads = self.claim({s: h for s, h, _ in wanted}, durable)
        todo = [(s, heads[s], v) for s, _, v in wanted if s not in ready]
        progress = None
        if todo:
            total = 0
            for s, h, v in todo:
                store = self._open.get(s)
                local = store.version if store is not None and store.version <= v else None
                with contextlib.suppress(Exception):
                    total += plan(h, local, v, durable).bytes
            progress = Progress(total, len(todo))
        found: dict[int, tuple[SliceStore, RestoreStats | None]] = {}
        if len(todo) > 1:
            with ThreadPoolExecutor(max_workers=min(RESTORE_THREADS, len(todo))) as pool:
                futures = {
                    s: pool.submit(self.acquire, s, h, v, durable, progress, s in owned)
                    for s, h, v in todo
                }
                found = {s: f.result() for s, f in futures.items()}
        else:
            found = {s: self.acquire(s, h, v, durable, progress, s in owned) for s, h, v in todo}
        if progress is not None and progress.total > 0:
            log.info("%s", progress.line())
        out = {}
        for s, _, _v in wanted:
            store, stats = found[s] if s in found else (self._open[s], None)
            out[s] = (store, heads[s], stats)
        return out


_caches: dict[tuple[str, str, int], StoreCache] = {}


def cache_for(base: str, app: str, slices: int) -> StoreCache:
    """The process-wide cache for an application (module globals live as long as the worker)."""
    key = (base, app, slices)
    found = _caches.get(key)
    if found is None or found.pid != os.getpid():
        found = _caches[key] = StoreCache(Path(base), app, slices)
    return found
