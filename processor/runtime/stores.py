"""The slice stores a Python worker keeps open between batches.

Spark may run a slice in any Python worker of any executor from one batch to the next,
and RocksDB allows one open handle per store. Each worker therefore keeps its own store
directory per slice (`<base>/<app>/w<pid>/slice-<n>`), brings it to the committed version
before use (catching up from the changelog when another worker moved the slice on), and
adopts the directories of workers that have died instead of restoring from scratch.

The heads a worker knows without asking DynamoDB are its `known`
(`shardless.processor.runtime.known_heads`). Committed segments are kept on the host
(`<base>/<app>/segments/`): catching up a slice that another worker of the host moved on
reads local files, not S3.

Open stores cost file descriptors (a RocksDB store holds six, and one per SST file), so a
process that runs many slices (4,096 slices on a few cores) keeps at most
`open_store_limit()` open across its caches and closes the least recently used between
batches; a closed store stays on disk and reopens in milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import uuid
import weakref
from collections.abc import Iterable
from pathlib import Path

from shardless.changelog.durable import DurableState, owner_name
from shardless.changelog.layout import Head
from shardless.changelog.restore import identity, plan, restore, restore_many
from shardless.changelog.restore_jobs import Progress, RestoreJob, RestoreStats
from shardless.processor.runtime.known_heads import KnownHeads
from shardless.processor.runtime.local_dirs import private_dir
from shardless.processor.runtime.process import pid_alive
from shardless.state.errors import CorruptStoreError
from shardless.state.store import SliceStore

log = logging.getLogger(__name__)

FDS_PER_STORE = 12  # a store's directory, WAL, MANIFEST, LOCK, info LOG and SST files
FDS_KEPT_FREE = 512  # for sockets, the transfer process's pipes, Spark's own files


# every cache of the process: the store limit counts the descriptors of all of them
_live: weakref.WeakSet[StoreCache] = weakref.WeakSet()


def open_store_limit() -> int:
    """How many stores this process may keep open: what its file descriptor limit leaves
    after FDS_KEPT_FREE, at FDS_PER_STORE each (at least 16)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(16, (soft - FDS_KEPT_FREE) // FDS_PER_STORE)


class StoreCache:
    """Open stores of this process, by slice."""

    def __init__(self, base: Path, app: str, slices: int, max_open: int | None = None) -> None:
        self.root = Path(base) / app
        self.app = app
        self.slices = slices
        self.pid = os.getpid()
        self.own = self.root / f"w{self.pid}"
        self._open: dict[int, SliceStore] = {}  # least recently used first
        self.max_open = max_open or open_store_limit()
        _live.add(self)
        self._epochs: dict[int, int] = {}
        self.known = KnownHeads(self.root / "hints", self.pid)
        self.owner = f"{owner_name()}:{uuid.uuid4().hex[:8]}"
        self.segments = self.root / "segments"

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
            if pid != self.pid and not pid_alive(pid) and candidate.exists():
                self.own.mkdir(parents=True, exist_ok=True)
                os.replace(candidate, self._path(slice_id))
                log.info("slice %s: adopted the store of dead worker %s", slice_id, pid)
                return True
        return False

    def _make_room(self, wanted: Iterable[int]) -> None:
        """Close least recently used open stores, this cache's first, then other caches' of
        the process, until `wanted` fits under `max_open` stores open in the process (their
        files stay; the next use reopens them). Stores in `wanted` stay open."""
        keep = set(wanted)
        others = [c for c in _live if c is not self]
        opening = sum(1 for s in keep if s not in self._open)
        excess = len(self._open) + opening + sum(len(c._open) for c in others) - self.max_open
        if excess <= 0:  # the common case, once per batch: nothing to close
            return
        closed = 0
        for cache in [self, *others]:
            idle = [s for s in cache._open if cache is not self or s not in keep]
            for s in idle[: excess - closed]:
                cache._open.pop(s).close()
                closed += 1
        log.info("closed %s idle stores (at most %s open)", closed, self.max_open)

    def _used(self, slices: Iterable[int]) -> None:
        """Mark `slices` the most recently used."""
        for s in slices:
            if s in self._open:
                self._open[s] = self._open.pop(s)

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

    def _usable(self, slice_id: int, head: Head | None, target: int, owned: bool) -> bool:
        """Whether the open store is ready for `target` as it is: at that version, on disk,
        and either this process holds the slice's newest claim or the store's last commit
        is the committed one. A group that moved here commits into its chain without
        claiming its slices again, so its heads keep naming the host it left."""
        store = self._ready(slice_id, target)
        return store is not None and (owned or self._consistent(store, head))

    @staticmethod
    def _consistent(store: SliceStore, head: Head | None) -> bool:
        """Whether the store's version is the commit the head has for it (a re-run of a
        batch elsewhere may have committed the same version differently). The log is in
        version order, and a store is usually at its newest entry: read from the end."""
        version = store.version
        if version == 0:
            return True
        for entry in reversed(head.log if head else ()):
            if entry.version <= version:
                return entry.version == version and store.tag == entry.uid
        return False

    def owns(self, slice_id: int, head: Head | None) -> bool:
        """True while this process holds the slice's newest claim (nobody took it since)."""
        return (
            head is not None
            and head.owner == self.owner
            and (self._epochs.get(slice_id) == head.epoch)
        )

    def remember(self, group: int, query: str, batch: int, heads: dict[int, Head | None]) -> None:
        """After `batch` of `group` committed: the epochs of the slices this process owns,
        and what it knows of the group's heads (`KnownHeads.remember`)."""
        for s, head in heads.items():
            if head is not None and head.owner == self.owner:
                self._epochs[s] = head.epoch
        self.known.remember(group, query, batch, heads)

    def close(self) -> None:
        """Close every open store (their files stay: the next cache for the application
        reopens them) and forget what this cache knew of heads and claims."""
        for store in self._open.values():
            store.close()
        self._open.clear()
        self._epochs.clear()
        self.known.clear()

    def _local(
        self, slice_id: int, head: Head | None, target: int, owned: bool
    ) -> SliceStore | None:
        """The slice's local store as a starting point for `target`, or None: this
        process's open one, else the one on disk (adopted from a dead worker if need be),
        rolled back in place when it is one version ahead, and discarded when it does not
        hold the committed version (unless this process `owned` the slice since)."""
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
        return store

    def _job(self, slice_id: int, head: Head | None, target: int, owned: bool) -> RestoreJob | None:
        """What it takes to bring the slice to `target`: None when its local store is
        there already (then it is open in the cache), else a restore job."""
        store = self._local(slice_id, head, target, owned)
        if store is not None and store.version == target:
            self._open[slice_id] = store
            return None
        return RestoreJob(self._path(slice_id), self._identity(slice_id), head, target, store)

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
        self._make_room([slice_id])
        job = self._job(slice_id, head, target, owned)
        if job is None:
            return self._open[slice_id], None
        store, stats = restore(
            job.path, job.identity, durable, job.head, job.target, job.store, progress
        )
        self._open[slice_id] = store
        log.info("slice %s: restored %s", slice_id, json.dumps(stats.to_dict()))
        return store, stats

    def acquire_many(
        self, wanted: list[tuple[int, Head | None, int]], durable: DurableState
    ) -> dict[int, tuple[SliceStore, Head | None, RestoreStats | None]]:
        """`acquire` several slices; returns each slice's store, its head (commit against
        it) and its restore cost.

        The slices that need one restore as one pipeline (`restore_many`: every transfer
        on the transfer pool, the stores opened once the transfers are done). A slice that
        fails is left with no store and no directory, the others restored; then the first
        failure, in the order of `wanted`, is raised."""
        self._make_room(s for s, _, _ in wanted)
        owned = {s for s, h, _ in wanted if self.owns(s, h)}
        ready = {s for s, h, v in wanted if self._usable(s, h, v, s in owned)}
        heads = {s: h for s, h, _ in wanted}
        errors: dict[int, Exception] = {}
        jobs: list[RestoreJob] = []
        try:
            for s, h, v in wanted:
                if s in ready:
                    continue
                try:
                    job = self._job(s, h, v, s in owned)
                except Exception as exc:  # noqa: BLE001 - raised below, after the others
                    errors[s] = exc
                    continue
                if job is not None:
                    jobs.append(job)
        except BaseException:  # an interrupt: the local stores taken so far stay usable
            for job in jobs:
                if job.store is not None:
                    self._open[job.slice] = job.store
            raise
        found: dict[int, RestoreStats] = {}
        if jobs:
            total = 0
            for job in jobs:
                store = job.store
                local = store.version if store is not None and store.version <= job.target else None
                with contextlib.suppress(Exception):
                    total += plan(job.head, local, job.target, durable).bytes
            progress = Progress(total, len(jobs))
            for done in restore_many(jobs, durable, progress):
                s = done.job.slice
                if done.error is not None:
                    errors[s] = done.error
                    continue
                assert done.store is not None and done.stats is not None
                self._open[s] = done.store
                found[s] = done.stats
                log.info("slice %s: restored %s", s, json.dumps(done.stats.to_dict()))
            if progress.total > 0:
                log.info("%s", progress.line())
        for s, _, _v in wanted:
            if s in errors:
                raise errors[s]
        self._used(heads)
        return {s: (self._open[s], heads[s], found.get(s)) for s, _, _v in wanted}


_caches: dict[tuple[str, str, int], StoreCache] = {}


def cache_for(base: str, app: str, slices: int) -> StoreCache:
    """The process-wide cache for an application (module globals live as long as the worker)."""
    key = (base, app, slices)
    found = _caches.get(key)
    if found is None or found.pid != os.getpid():
        private_dir(base)  # made 0o700; refused if another user owns it or others may write
        found = _caches[key] = StoreCache(Path(base), app, slices)
    return found


def close_caches(base: str | None = None) -> int:
    """Close this process's caches (those under `base`, or all) and their stores; return how
    many stores were open. A worker's caches otherwise live as long as it does; this is for
    a process that runs groups of many short-lived applications (tests, tools)."""
    closed = 0
    for key in [k for k in _caches if base is None or k[0] == base]:
        cache = _caches.pop(key)
        if cache.pid == os.getpid():  # a forked copy's stores are its parent's to close
            closed += len(cache._open)
            cache.close()
    return closed
