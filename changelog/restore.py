"""Bring local slice stores to committed versions: for each, the cheapest of replaying the
log from where the store is, or the newest snapshot at or below the target plus the log
after it.

Restore always has an explicit end point, the version recorded in the slice's head; it
never reads "until it looks finished". It refuses a gap, a corrupt or a foreign object,
naming the object and the reason, and reports bytes, records, rate and time left.

Several slices restore as one pipeline (`restore_many`): every object transfer (manifests,
SST files, changelog sections) of every slice goes through one set of transfer threads, and
a few finishing threads open each store and apply its changelog tail as soon as that
slice's files are in, while the transfers of later slices go on. RocksDB holds Python's GIL
while it opens a store (it creates and fsyncs several files then), so transfer threads in
the same process wait for every open; a restore with `durable.transfer_process_bytes` of
snapshots or more therefore runs its transfers in the worker's helper process
(`shardless.changelog.transfer_process`), the opens here. Opening only after the transfers would add
every open to the total.

A slice whose open store only needs segments the host already has (another worker process
of the host moved it on) is caught up first, in the calling thread: no transfers, no
threads.

A snapshot that cannot be used (its manifest or an SST object missing or failing its
checks, or RocksDB refusing the restored directory) is skipped with a warning: the slice
restores again from the next older retained snapshot, or from the whole log, with the
longer log tail that takes. Only when no other path reaches the target does the restore
fail, with the snapshot's error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from shardless.changelog.durable import DurableState, section_range
from shardless.changelog.errors import ContinuityError, CorruptObjectError, MissingObjectError
from shardless.changelog.layout import Head, LogEntry, RestorePlan, plan_restore
from shardless.changelog.snapshot import (
    FILE_THREADS,
    IN_PROCESS,
    Manifest,
    Transfers,
    cached_manifest,
    fetch_files,
    file_pool,
    manifest_from,
    missing,
    settle,
)
from shardless.changelog.transfer_process import in_helper, transfer_process
from shardless.state.errors import CorruptStoreError
from shardless.state.store import Change, SliceStore

log = logging.getLogger(__name__)

PREFETCH_BYTES = 64 << 20  # changelog sections fetched ahead of the one being applied
PREFETCH_SECTIONS = 256  # at most this many of them
OPEN_AFTER_TRANSFERS = False  # True: open no store before every transfer is done
MANIFESTS_AHEAD = FILE_THREADS  # manifests requested ahead of the slice whose files are queued
FINISH_THREADS = 4  # threads opening stores and applying tails while transfers go on


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
    transfer_process: bool = False  # its snapshot's SST files came through the helper process
    skipped_snapshots: list[int] = field(default_factory=list)  # versions found unusable

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


@dataclass
class RestoreJob:
    """One slice to bring to exactly version `target` of `head`, in the directory `path`;
    `store` is the store open there, if any."""

    path: Path
    identity: dict[str, object]
    head: Head | None
    target: int
    store: SliceStore | None = None

    @property
    def slice(self) -> int:
        return int(self.identity["slice"])  # type: ignore[call-overload]


@dataclass
class RestoreOutcome:
    """A job's result: its store at the target version and what it cost, or why it
    failed (its store then closed and its directory removed)."""

    job: RestoreJob
    store: SliceStore | None = None
    stats: RestoreStats | None = None
    error: Exception | None = None


def restore(
    path: Path,
    identity: dict[str, object],
    durable: DurableState,
    head: Head | None,
    target: int,
    store: SliceStore | None = None,
    progress: Progress | None = None,
    fallback: bool = True,
) -> tuple[SliceStore, RestoreStats]:
    """The store at `path` brought to exactly version `target` of `head`.

    `store` is the open store at `path`, if any: it is caught up, rolled back one version
    from its undo record, or replaced (snapshot or full replay) when that is cheaper or
    the only way. On failure the store is closed and its directory removed: the caller
    starts again from nothing rather than from a store in an unknown state. With
    `fallback` (`restore_many`) an unusable snapshot is skipped for an older path.
    """
    (done,) = restore_many(
        [RestoreJob(Path(path), identity, head, target, store)], durable, progress, fallback
    )
    if done.error is not None:
        raise done.error
    assert done.store is not None and done.stats is not None
    return done.store, done.stats


def restore_many(
    jobs: list[RestoreJob],
    durable: DurableState,
    progress: Progress | None = None,
    fallback: bool = True,
) -> list[RestoreOutcome]:
    """Restore several slices as one pipeline; one outcome per job, in order.

    First every job's plan; then the jobs that only replay segments cached on this host
    onto their open store, in this thread; then every object transfer goes to the transfer
    pool (changelog sections within a byte budget, manifests a window ahead, each snapshot's SST
    and inline files as soon as its manifest is in) while `FINISH_THREADS` threads open
    each store as soon as its files are in, check it and apply its changelog tail. A job
    that fails is cleaned up (store closed, directory removed) without stopping the others;
    an interrupt cleans up every unfinished job. With `fallback`, the jobs whose snapshot
    was unusable go round again without it (`_fall_back`).
    """
    started = time.perf_counter()
    work = [_Work(job, RestoreStats(job.slice, _local(job) or 0, job.target)) for job in jobs]
    try:
        todo = work
        while todo:
            _run(todo, durable, progress, started)
            todo = [w for w in todo if fallback and _fall_back(w)]
        for w in work:
            if w.done and w.error is None and not w.stats.seconds:
                w.stats.seconds = time.perf_counter() - started
    except BaseException:  # an interrupt: no store is handed over, none stays open
        for w in work:
            if w.done and w.job.store is not None:
                w.job.store.close()  # complete: its directory can be used again
            elif w.error is None:
                _clean(w)
        raise
    return [RestoreOutcome(w.job, w.job.store, w.stats, w.error) for w in work]


def _run(
    work: list[_Work], durable: DurableState, progress: Progress | None, started: float
) -> None:
    """One pass of the pipeline over `work`: each job ends done or with its error."""
    tails = _Tails(durable)
    try:
        for w in work:
            _guard(w, tails, lambda w=w: _prepare(w, durable))
        direct = _Direct(durable)
        for w in work:
            if w.error is None and _catch_up_here(w, durable):
                _guard(w, tails, lambda w=w: _finish(w, durable, direct, progress, started))
        rest = [w for w in work if w.error is None and not w.done]
        if rest:
            tails.transfers = transfers_for(
                durable, sum(w.plan.snapshot.bytes for w in rest if w.plan and w.plan.snapshot)
            )
        tails.plan([(w, e) for w in rest if w.plan for e in w.plan.entries])
        tails.top_up()
        if rest:
            _Snapshots(rest, durable, tails, progress).run(
                lambda w: _guard(w, tails, lambda: _finish(w, durable, tails, progress, started))
            )
    except BaseException:
        tails.drop_all()
        raise


def _fall_back(w: _Work) -> bool:
    """Whether the job failed on its snapshot and an older path reaches its target; if
    so, the job is reset to go round again without that snapshot (logged)."""
    how, head = w.plan, w.head
    if (
        w.error is None
        or w.snapshot_open
        or how is None
        or how.snapshot is None
        or head is None
        or not isinstance(w.error, (CorruptObjectError, MissingObjectError))
    ):
        return False
    bad = how.snapshot
    alt = replace(head, snaps=tuple(s for s in head.snaps if s != bad))
    try:
        instead = plan_restore(alt, None, w.job.target)
    except ValueError:
        return False
    start = f"snapshot v{instead.snapshot.version}" if instead.snapshot else "the whole log"
    log.warning(
        "slice %s: snapshot v%s is unusable, restoring from %s and %s log entries instead: %s",
        w.job.slice, bad.version, start, len(instead.entries), w.error,
    )  # fmt: skip
    w.head, w.error, w.plan, w.manifest, w.files = alt, None, None, None, []
    w.done = w.queued = w.snapshot_open = False
    w.stats.skipped_snapshots.append(bad.version)
    w.stats.snapshot_version, w.stats.snapshot_bytes, w.stats.transfer_process = None, 0, False
    return True


@dataclass(eq=False)
class _Work:
    """A job on its way through `restore_many`."""

    job: RestoreJob
    stats: RestoreStats
    plan: RestorePlan | None = None
    manifest: Future[bytes] | Future[Manifest] | None = None
    files: list[Future[int]] = field(default_factory=list)
    error: Exception | None = None
    done: bool = False
    queued: bool = False  # its snapshot's files are on the transfer pool
    snapshot_open: bool = False  # its snapshot opened as the version it claims
    head: Head | None = None  # the head restored from: the job's, less unusable snapshots

    def __post_init__(self) -> None:
        self.head = self.job.head

    @property
    def where(self) -> str:
        return self.plan.snapshot.key if self.plan and self.plan.snapshot else ""


def _catch_up_here(w: _Work, durable: DurableState) -> bool:
    """Whether the job only replays segments that are on this host onto its open store:
    another worker process of the host moved the slice on. Such a catch-up is a local
    read and a RocksDB write per segment, quicker done in the calling thread than handed
    to the transfer and finishing threads (which cost more than the work when a group of
    a hundred slices each needs one segment)."""
    how = w.plan
    return (
        not w.done
        and how is not None
        and how.snapshot is None
        and not how.fresh
        and w.job.store is not None
        and all(durable.cached(e) for e in how.entries)
    )


class _Direct:
    """Changelog sections read when they are applied, in the calling thread."""

    def __init__(self, durable: DurableState) -> None:
        self.durable = durable

    def take(self, w: _Work, entry: LogEntry) -> list[Change]:
        return self.durable.read_changes(w.job.slice, entry)


def _local(job: RestoreJob) -> int | None:
    return job.store.version if job.store is not None else None


def _guard(w: _Work, tails: _Tails, step) -> None:  # noqa: ANN001 - a closure
    """Run one step of a job; on an error, record it and clean the job up."""
    try:
        step()
    except Exception as exc:
        w.error = exc
        tails.drop(w)
        _clean(w)


def _clean(w: _Work) -> None:
    """Stop the job's transfers, close its store and remove its directory."""
    pending = [f for f in [w.manifest, *w.files] if f is not None]
    for f in pending:
        f.cancel()
    wait(pending)
    if w.job.store is not None:
        w.job.store.close()
        w.job.store = None
    SliceStore.destroy(w.job.path)


def _prepare(w: _Work, durable: DurableState) -> None:
    """Roll back in place if that is all it takes; otherwise plan, and discard a local
    store the plan does not build on."""
    job, stats = w.job, w.stats
    local = _local(job)
    if job.store is not None and local == job.target + 1 and job.store.roll_back():
        stats.rolled_back = True
        w.done = True
        return
    usable = local if local is not None and local <= job.target else None
    w.plan = plan(w.head, usable, job.target, durable)
    if job.store is None or w.plan.fresh or local > job.target:  # type: ignore[operator]
        if job.store is not None:
            job.store.close()
            job.store = None
        SliceStore.destroy(job.path)


def transfers_for(durable: DurableState, snapshot_bytes: int) -> Transfers:
    """Where a restore with `snapshot_bytes` of snapshots to fetch runs its transfers: the
    helper process (started now) from `durable.transfer_process_bytes` on, this process's
    transfer pool below (starting the helper costs more than a small restore saves)."""
    limit = durable.transfer_process_bytes
    if limit is not None and snapshot_bytes >= limit:
        helper = transfer_process()
        if helper.start():
            return helper
    return IN_PROCESS


class _Snapshots:
    """The snapshot transfers of every job, queued on the transfer pool by the calling
    thread while it hands finished transfers on: manifests `MANIFESTS_AHEAD` ahead, each
    one's files as soon as it has arrived, so the pool stays busy with bulk transfers."""

    def __init__(
        self, work: list[_Work], durable: DurableState, tails: _Tails, progress: Progress | None
    ) -> None:
        self.work = work
        self.loc = durable.loc
        self.tails = tails
        self.on_bytes = progress.add if progress else _ignore
        self.todo = deque(w for w in work if w.error is None and w.plan and w.plan.snapshot)
        self.asked: deque[_Work] = deque()  # manifest requested, files not queued yet
        self.transfers = tails.transfers

    def run(self, finish: Callable[[_Work], None]) -> None:
        """Call `finish` on every job that has not failed, each once its files are in
        (with `OPEN_AFTER_TRANSFERS`, once every job's are), in `FINISH_THREADS` threads;
        return when every call has returned."""
        self._ask()
        with ThreadPoolExecutor(FINISH_THREADS, thread_name_prefix="shardless-open") as pool:
            started: list[Future[None]] = []
            try:
                for w in self.work:
                    while w.error is None and not self._ready(w):
                        self._wait(w)
                    if w.error is None:
                        started.append(pool.submit(finish, w))
            except BaseException:
                for f in started:
                    f.cancel()
                raise
        for f in started:
            f.result()  # `finish` records a job's errors: only an interrupt comes out here

    def _ask(self) -> None:
        while self.todo and len(self.asked) < MANIFESTS_AHEAD:
            w = self.todo.popleft()
            snap = w.plan.snapshot  # type: ignore[union-attr]
            found = cached_manifest(snap.key)
            if found is None:
                w.manifest = self.transfers.fetch(self.loc.bucket, snap.key)
            else:
                w.manifest = done = Future()
                done.set_result(found)
            self.asked.append(w)

    def _queue(self, block: bool) -> None:
        """Queue the files of the jobs whose manifests are in (the next one: wait for it)."""
        while self.asked and (block or self.asked[0].manifest.done()):  # type: ignore[union-attr]
            block = False
            w = self.asked.popleft()

            def queue(w: _Work = w) -> None:
                got = w.manifest.result()  # type: ignore[union-attr]
                manifest = got
                if not isinstance(got, Manifest):
                    snap = w.plan.snapshot  # type: ignore[union-attr]
                    manifest = manifest_from(
                        self.loc, snap.key, got, slice_id=w.job.slice, version=snap.version
                    )
                w.files = fetch_files(self.loc, manifest, w.job.path, self.on_bytes, self.transfers)

            if w.error is None:
                _guard(w, self.tails, queue)
            w.queued = True
            self._ask()

    def _ready(self, w: _Work) -> bool:
        self._queue(block=False)
        if OPEN_AFTER_TRANSFERS and (self.todo or self.asked):
            return False
        if not w.queued and w.plan is not None and w.plan.snapshot is not None:
            return False
        pending = [f for x in self.work for f in x.files] if OPEN_AFTER_TRANSFERS else w.files
        return all(f.done() for f in pending)

    def _wait(self, w: _Work) -> None:
        """Until something `w` waits for has moved: the next manifest or one of its files."""
        if self.asked and (OPEN_AFTER_TRANSFERS or not w.queued):
            self._queue(block=True)
            return
        pending = [f for x in self.work for f in x.files] if OPEN_AFTER_TRANSFERS else w.files
        running = [f for f in pending if not f.done()]
        if not running:
            raise RuntimeError(f"slice {w.job.slice}: restore waits for nothing")
        wait(running, return_when=FIRST_COMPLETED)


def _finish(
    w: _Work,
    durable: DurableState,
    tails: _Tails | _Direct,
    progress: Progress | None,
    started: float,
) -> None:
    """Open the job's store once its files are in, check it, and apply its log tail."""
    if w.done:
        w.stats.seconds = time.perf_counter() - started
        return
    job, stats, how = w.job, w.stats, w.plan
    assert how is not None
    if how.snapshot is not None:
        snap = how.snapshot
        where = f"s3://{durable.loc.bucket}/{snap.key}"
        stats.snapshot_bytes = settle(w.files)  # its SST and inline files
        stats.transfer_process = any(in_helper(f) for f in w.files)
        stats.snapshot_version = snap.version
        stats.bytes += stats.snapshot_bytes
        try:
            job.store = SliceStore(job.path, job.identity)
        except CorruptStoreError as exc:
            raise CorruptObjectError(
                f"{where}: the snapshot does not open as this slice ({exc})"
            ) from exc
        if job.store.version != snap.version:
            got = job.store.version
            raise CorruptObjectError(
                f"{where}: the snapshot holds version {got}, its manifest says {snap.version}"
            )
        w.snapshot_open = True
    if job.store is None:
        job.store = SliceStore(job.path, job.identity)
    for entry in how.entries:
        changes = tails.take(w, entry)
        job.store.commit(changes, entry.version, tag=entry.uid)
        stats.segments += 1
        stats.records += len(changes)
        stats.bytes += entry.length
        if progress:
            progress.add(entry.length)
    if progress:
        progress.slice_done()
    w.done = True
    stats.seconds = time.perf_counter() - started


def _ignore(n: int) -> None:
    pass


class _Tails:
    """The changelog sections of every job, fetched on the transfer pool in the order they
    are applied, ahead of the one being applied within `PREFETCH_BYTES` and
    `PREFETCH_SECTIONS` (always at least the next one)."""

    def __init__(self, durable: DurableState, transfers: Transfers = IN_PROCESS) -> None:
        self.durable = durable
        self.transfers = transfers  # where sections the host does not keep are fetched
        self.order: list[tuple[_Work, LogEntry]] = []
        self.next = 0  # the first section not requested yet
        self.ahead: dict[tuple[int, int], tuple[Future[list[Change]] | Future[bytes], int]] = {}
        self.held = 0  # bytes requested and not taken
        self.dropped: set[int] = set()  # ids of jobs that failed
        self._lock = threading.RLock()  # jobs finish in several threads

    def plan(self, order: list[tuple[_Work, LogEntry]]) -> None:
        self.order = order

    def top_up(self) -> None:
        with self._lock:
            while self.next < len(self.order) and (
                not self.ahead
                or (self.held < PREFETCH_BYTES and len(self.ahead) < PREFETCH_SECTIONS)
            ):
                self._request_next()

    def _request_next(self) -> None:
        w, entry = self.order[self.next]
        self.next += 1
        if id(w) in self.dropped:
            return
        durable = self.durable
        future: Future[list[Change]] | Future[bytes]
        if durable.cached(entry):
            future = file_pool().submit(durable.read_changes, w.job.slice, entry)
        else:
            future = self.transfers.fetch(
                durable.loc.bucket, entry.key(durable.loc), section_range(entry)
            )
        self.ahead[(id(w), entry.version)] = (future, entry.length)
        self.held += entry.length

    def take(self, w: _Work, entry: LogEntry) -> list[Change]:
        """The section's changes (requested now if it was not yet)."""
        key = (id(w), entry.version)
        with self._lock:
            while key not in self.ahead and self.next < len(self.order):
                self._request_next()
            if key not in self.ahead:
                raise RuntimeError(f"slice {w.job.slice} v{entry.version}: section never requested")
            future, length = self.ahead.pop(key)
            self.held -= length
        try:
            got = future.result()
        except MissingObjectError as exc:
            raise missing(self.durable.section_where(w.job.slice, entry)) from exc
        finally:
            self.top_up()
        if isinstance(got, list):
            return got
        return self.durable.decode_changes(w.job.slice, entry, got)

    def drop(self, w: _Work) -> None:
        """Forget a failed job's sections."""
        with self._lock:
            self.dropped.add(id(w))
            for key in [k for k in self.ahead if k[0] == id(w)]:
                future, length = self.ahead.pop(key)
                future.cancel()
                self.held -= length

    def drop_all(self) -> None:
        with self._lock:
            for future, _ in self.ahead.values():
                future.cancel()
            self.ahead.clear()
            self.next = len(self.order)
