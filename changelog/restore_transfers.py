"""The transfers of a restore pipeline: each snapshot's manifest and files queued on the
transfer pool ahead of the stores being opened (`SnapshotTransfers`), each changelog tail's
sections fetched in the order they are applied within a budget, those of one segment that
lie together as one span (`TailSections`, `coalesce`), and a failed job's transfers
cancelled and its directory removed (`guarded`, `clean_up`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TypeVar

from shardless.changelog.coalesce import Span, coalesce
from shardless.changelog.download import IN_PROCESS, Transfers, fetch_files
from shardless.changelog.durable import DurableState, section_range
from shardless.changelog.errors import MissingObjectError
from shardless.changelog.layout import LogEntry
from shardless.changelog.manifest import Manifest, SstFile, cached_manifest, manifest_from
from shardless.changelog.objects import FILE_THREADS, OnBytes, file_pool, missing, no_progress
from shardless.changelog.restore_jobs import Progress, RestoreWork
from shardless.changelog.sst import object_size, write_sst
from shardless.changelog.transfer_process import in_helper
from shardless.state.store import Change, SliceStore

PREFETCH_BYTES = 64 << 20  # changelog sections fetched ahead of the one being applied
PREFETCH_SECTIONS = 256  # at most this many of them
OPEN_AFTER_TRANSFERS = False  # True: open no store before every transfer is done
MANIFESTS_AHEAD = FILE_THREADS  # manifests requested ahead of the slice whose files are queued
FINISH_THREADS = 4  # threads opening stores and applying tails while transfers go on
SMALL_SST_BYTES = 1 << 20  # SST files up to this size are fetched in spans; larger ones stream
T = TypeVar("T")


def then(
    whole: Future[bytes], step: Callable[[bytes], T], after: Callable[[], None] | None = None
) -> Future[T]:
    """A future of `step` applied to `whole`'s bytes once they are in, run in the thread
    that completes `whole` (its error, or a cancellation, handed on instead); `after`
    runs in any case, once. Cancelled first (its job was cleaned up), `step` does not run."""
    out: Future[T] = Future()
    if in_helper(whole):
        out.in_helper = True  # type: ignore[attr-defined] # its bytes came through the helper

    def hand_on(done: Future[bytes]) -> None:
        try:
            if not out.set_running_or_notify_cancel():
                return
            if done.cancelled():
                out.set_exception(CancelledError())
            elif done.exception() is not None:
                out.set_exception(done.exception())  # type: ignore[arg-type]
            else:
                try:
                    out.set_result(step(done.result()))
                except Exception as exc:  # noqa: BLE001 - the job's error
                    out.set_exception(exc)
        finally:
            if after is not None:
                after()

    whole.add_done_callback(hand_on)
    return out


class DirectSections:
    """Changelog sections read when they are applied, in the calling thread."""

    def __init__(self, durable: DurableState) -> None:
        self.durable = durable

    def take(self, w: RestoreWork, entry: LogEntry) -> list[Change]:
        return self.durable.read_changes(w.job.slice, entry)


def guarded(w: RestoreWork, tails: TailSections, step) -> None:  # noqa: ANN001 - a closure
    """Run one step of a job; on an error, record it and clean the job up."""
    try:
        step()
    except Exception as exc:
        w.error = exc
        tails.drop(w)
        clean_up(w)


def clean_up(w: RestoreWork) -> None:
    """Stop the job's transfers, close its store and remove its directory."""
    pending = [f for f in [w.manifest, *w.files] if f is not None]
    for f in pending:
        f.cancel()
    wait(pending)
    if w.job.store is not None:
        w.job.store.close()
        w.job.store = None
    SliceStore.destroy(w.job.path)


class SnapshotTransfers:
    """The snapshot transfers of every job, queued on the transfer pool by the calling
    thread while it hands finished transfers on: manifests `MANIFESTS_AHEAD` ahead, each
    one's files as soon as it has arrived, so the pool stays busy with bulk transfers. A
    pack keeps its manifests together at its end, so the manifests of one pack are fetched
    as one span (`coalesce`) and cut apart; so are the small SST files (up to
    `SMALL_SST_BYTES`) of the manifests that are in, each written from its span with the
    checks of a download. Larger files stream into their files as before."""

    def __init__(
        self,
        work: list[RestoreWork],
        durable: DurableState,
        tails: TailSections,
        progress: Progress | None,
    ) -> None:
        self.work = work
        self.loc = durable.loc
        self.tails = tails
        self.on_bytes = progress.add if progress else no_progress
        self.todo = deque(w for w in work if w.error is None and w.plan and w.plan.snapshot)
        self._lock = threading.Lock()  # file spans are let go from transfer threads
        self.asked: deque[RestoreWork] = deque()  # manifest requested, files not queued yet
        self.transfers = tails.transfers
        todo = list(self.todo)
        snaps = [w.plan.snapshot for w in todo]  # type: ignore[union-attr]
        spans = coalesce(
            [
                (s.key, s.at, s.length) if s.at >= 0 and cached_manifest(s) is None else None
                for s in snaps
            ]
        )
        self.spans = {id(w): span for w, span in zip(todo, spans, strict=True) if span}
        self.span_jobs: dict[Span, list[RestoreWork]] = {}  # the jobs of each manifest span
        for w, span in zip(todo, spans, strict=True):
            if span is not None:
                self.span_jobs.setdefault(span, []).append(w)
        self.planned: set[Span] = set()  # manifest spans whose jobs' files are planned
        self.fetched: dict[Span, Future[bytes]] = {}
        self.files_fetched: dict[Span, Future[bytes]] = {}
        self.decoded: dict[int, Manifest] = {}  # manifests in, by job
        self.file_spans: dict[tuple[str, int], Span] = {}  # small SST files, by (key, offset)
        self.file_users: dict[Span, int] = {}  # files of each span not written yet

    def run(self, finish: Callable[[RestoreWork], None]) -> None:
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
            found = cached_manifest(snap)
            span = self.spans.get(id(w))
            if found is None and span is not None:
                w.manifest = self._cut(span, snap.at, snap.length)
            elif found is None:
                w.manifest = self.transfers.fetch(self.loc.bucket, snap.key, snap.byte_range)
            else:
                w.manifest = done = Future()
                done.set_result(found)
            self.asked.append(w)

    def _cut(self, span: Span, at: int, length: int) -> Future[bytes]:
        """A future of the bytes `at`..`at + length` of `span`, fetched once for all."""
        whole = self.fetched.get(span)
        if whole is None:
            whole = self.fetched[span] = self.transfers.fetch(
                self.loc.bucket, span.key, span.byte_range
            )
        return then(whole, lambda data: span.cut(data, at, length))

    def _manifest(self, w: RestoreWork) -> Manifest:
        """The job's manifest, once in (verified; raises as `manifest_from` does)."""
        found = self.decoded.get(id(w))
        if found is None:
            got = w.manifest.result()  # type: ignore[union-attr]
            found = got
            if not isinstance(got, Manifest):
                snap = w.plan.snapshot  # type: ignore[union-attr]
                found = manifest_from(self.loc, snap, got, slice_id=w.job.slice)
            self.decoded[id(w)] = found
        return found

    def _plan_files(self) -> None:
        """Spans of the small SST files of every job whose pack's manifests are in (read
        together, they name the files of several jobs at once). A manifest that does not
        decode is left to its job's `queue`, which raises it there."""
        files: list[SstFile] = []
        for span, jobs in self.span_jobs.items():
            whole = self.fetched.get(span)
            if span in self.planned or whole is None or not whole.done() or whole.cancelled():
                continue
            self.planned.add(span)
            if whole.exception() is not None:
                continue
            data = whole.result()
            for w in jobs:
                snap = w.plan.snapshot  # type: ignore[union-attr]
                if w.error is not None or id(w) in self.decoded:
                    continue
                try:
                    m = manifest_from(
                        self.loc, snap, span.cut(data, snap.at, snap.length), slice_id=w.job.slice
                    )
                except Exception:  # noqa: BLE001 - raised again in its job's `queue`
                    continue
                self.decoded[id(w)] = m
                files += [f for f in m.files if f.offset >= 0 and f.size <= SMALL_SST_BYTES]
        spans = coalesce([(f.key, f.offset, object_size(f.size)) for f in files])
        with self._lock:
            for f, span in zip(files, spans, strict=True):
                if span is not None:
                    self.file_spans[(f.key, f.offset)] = span
                    self.file_users[span] = self.file_users.get(span, 0) + 1

    def _file(self, f: SstFile, dest: Path, on_bytes: OnBytes) -> Future[int] | None:
        """The write of SST file `f` from its span (fetched by the first file that needs
        it), or None: it has no span."""
        span = self.file_spans.pop((f.key, f.offset), None)
        if span is None:
            return None
        whole = self.files_fetched.get(span)
        if whole is None:
            whole = self.files_fetched[span] = self.transfers.fetch(
                self.loc.bucket, span.key, span.byte_range
            )
        bucket = self.loc.bucket

        def write(data: bytes) -> int:
            part = span.cut(data, f.offset, object_size(f.size))
            return write_sst(bucket, part, f, dest, on_bytes)

        return then(whole, write, lambda: self._written(span))

    def _written(self, span: Span) -> None:
        """One file of `span` done with; the span's bytes are let go after its last."""
        with self._lock:
            self.file_users[span] -= 1
            if not self.file_users[span]:
                del self.file_users[span]
                self.files_fetched.pop(span, None)

    def _queue(self, block: bool) -> None:
        """Queue the files of the jobs whose manifests are in (the next one: wait for it)."""
        self._plan_files()
        while self.asked and (block or self.asked[0].manifest.done()):  # type: ignore[union-attr]
            block = False
            w = self.asked.popleft()
            self._plan_files()

            def queue(w: RestoreWork = w) -> None:
                wait([w.manifest])  # type: ignore[list-item]
                self._plan_files()  # its pack's other files with its own
                manifest = self._manifest(w)
                w.files = fetch_files(
                    self.loc, manifest, w.job.path, self.on_bytes, self.transfers, self._file
                )

            if w.error is None:
                guarded(w, self.tails, queue)
            w.queued = True
            self._ask()

    def _ready(self, w: RestoreWork) -> bool:
        self._queue(block=False)
        if OPEN_AFTER_TRANSFERS and (self.todo or self.asked):
            return False
        if not w.queued and w.plan is not None and w.plan.snapshot is not None:
            return False
        pending = [f for x in self.work for f in x.files] if OPEN_AFTER_TRANSFERS else w.files
        return all(f.done() for f in pending)

    def _wait(self, w: RestoreWork) -> None:
        """Until something `w` waits for has moved: the next manifest or one of its files."""
        if self.asked and (OPEN_AFTER_TRANSFERS or not w.queued):
            self._queue(block=True)
            return
        pending = [f for x in self.work for f in x.files] if OPEN_AFTER_TRANSFERS else w.files
        running = [f for f in pending if not f.done()]
        if not running:
            raise RuntimeError(f"slice {w.job.slice}: restore waits for nothing")
        wait(running, return_when=FIRST_COMPLETED)


Ahead = tuple[Future[list[Change]] | Future[bytes], int, Span | None]


class TailSections:
    """The changelog sections of every job, fetched on the transfer pool in the order they
    are applied, ahead of the one being applied within `PREFETCH_BYTES` and
    `PREFETCH_SECTIONS` (always at least the next one). Sections the host does not keep
    and that lie together in one segment are fetched as one span (`coalesce`), once, and
    cut out of it as each is applied."""

    def __init__(self, durable: DurableState, transfers: Transfers = IN_PROCESS) -> None:
        self.durable = durable
        self.transfers = transfers  # where sections the host does not keep are fetched
        self.order: list[tuple[RestoreWork, LogEntry]] = []
        self.spans: list[Span | None] = []  # each section's span, in `order`
        self.local: list[bool] = []  # each section's segment in the host's cache (`plan`)
        self.users: dict[Span, int] = {}  # sections of each span not taken or dropped yet
        self.fetched: dict[Span, Future[bytes]] = {}
        self.next = 0  # the first section not requested yet
        self.ahead: dict[tuple[int, int], Ahead] = {}
        self.held = 0  # bytes requested and not taken
        self.dropped: set[int] = set()  # ids of jobs that failed
        self._lock = threading.RLock()  # jobs finish in several threads

    def plan(self, order: list[tuple[RestoreWork, LogEntry]]) -> None:
        durable = self.durable
        self.order = order
        self.local = [durable.cached(e) for _, e in order]
        self.spans = coalesce(
            [
                None if here else (e.key(durable.loc), e.offset, e.length)
                for (_, e), here in zip(order, self.local, strict=True)
            ]
        )
        self.users = {}
        for span in self.spans:
            if span is not None:
                self.users[span] = self.users.get(span, 0) + 1

    def top_up(self) -> None:
        with self._lock:
            while self.next < len(self.order) and (
                not self.ahead
                or (self.held < PREFETCH_BYTES and len(self.ahead) < PREFETCH_SECTIONS)
            ):
                self._request_next()

    def _request_next(self) -> None:
        w, entry = self.order[self.next]
        span = self.spans[self.next]
        local = self.local[self.next]
        self.next += 1
        if id(w) in self.dropped:
            if span is not None:
                self._release(span)
            return
        durable = self.durable
        future: Future[list[Change]] | Future[bytes]
        if span is not None:
            found = self.fetched.get(span)
            if found is None:
                found = self.transfers.fetch(durable.loc.bucket, span.key, span.byte_range)
                self.fetched[span] = found
                self.held += span.length
            self.ahead[(id(w), entry.version)] = (found, 0, span)
            return
        if local:  # `read_changes` reads S3 if the host has let it go since
            future = file_pool().submit(durable.read_changes, w.job.slice, entry)
        else:
            future = self.transfers.fetch(
                durable.loc.bucket, entry.key(durable.loc), section_range(entry)
            )
        self.ahead[(id(w), entry.version)] = (future, entry.length, None)
        self.held += entry.length

    def _release(self, span: Span) -> None:
        """One section of `span` taken or dropped; the span is let go after its last."""
        with self._lock:
            if span not in self.users:  # every transfer was dropped (`drop_all`)
                return
            self.users[span] -= 1
            if self.users[span]:
                return
            del self.users[span]
            future = self.fetched.pop(span, None)
            if future is not None:
                future.cancel()
                self.held -= span.length

    def take(self, w: RestoreWork, entry: LogEntry) -> list[Change]:
        """The section's changes (requested now if it was not yet)."""
        key = (id(w), entry.version)
        with self._lock:
            while key not in self.ahead and self.next < len(self.order):
                self._request_next()
            if key not in self.ahead:
                raise RuntimeError(f"slice {w.job.slice} v{entry.version}: section never requested")
            future, length, span = self.ahead.pop(key)
            self.held -= length
        try:
            got = future.result()
        except MissingObjectError as exc:
            raise missing(self.durable.section_where(w.job.slice, entry)) from exc
        finally:
            if span is not None:
                self._release(span)
            self.top_up()
        if isinstance(got, list):
            return got
        if span is not None:
            got = span.cut(got, entry.offset, entry.length)
        return self.durable.decode_changes(w.job.slice, entry, got)

    def drop(self, w: RestoreWork) -> None:
        """Forget a failed job's sections."""
        with self._lock:
            self.dropped.add(id(w))
            for key in [k for k in self.ahead if k[0] == id(w)]:
                future, length, span = self.ahead.pop(key)
                if span is None:
                    future.cancel()
                    self.held -= length
                else:
                    self._release(span)

    def drop_all(self) -> None:
        with self._lock:
            for future, _, _ in self.ahead.values():
                future.cancel()
            for future in self.fetched.values():
                future.cancel()
            self.ahead.clear()
            self.fetched.clear()
            self.users.clear()
            self.next = len(self.order)
