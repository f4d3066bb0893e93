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

The jobs, outcomes and stats are in `restore_jobs`; the pipeline's transfers in
`restore_transfers`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

from shardless.changelog.download import IN_PROCESS, Transfers, settle
from shardless.changelog.durable import DurableState
from shardless.changelog.errors import ContinuityError, CorruptObjectError, MissingObjectError
from shardless.changelog.history import RestorePlan, plan_restore
from shardless.changelog.layout import Head
from shardless.changelog.restore_jobs import (
    Progress,
    RestoreJob,
    RestoreOutcome,
    RestoreStats,
    RestoreWork,
)
from shardless.changelog.restore_transfers import (
    DirectSections,
    SnapshotTransfers,
    TailSections,
    clean_up,
    guarded,
)
from shardless.changelog.transfer_process import in_helper, transfer_process
from shardless.state.errors import CorruptStoreError
from shardless.state.store import SliceStore

log = logging.getLogger(__name__)


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


def materialize_heads(
    durable: DurableState, heads: dict[int, Head], root: Path, slices: int
) -> list[tuple[int, SliceStore]]:
    """A new store under `root` for each slice of `heads`, at its head's version, restored
    as one pipeline (`restore_many`), in slice order. If any slice fails, every store
    restored is closed and the first failure raised, naming its slice."""
    jobs = [
        RestoreJob(Path(root) / f"slice-{s}", identity(durable.loc.app, s, slices), h, h.version)
        for s, h in sorted(heads.items())
    ]
    done = restore_many(jobs, durable) if jobs else []
    failed = [d for d in done if d.error is not None or d.store is None]
    if failed:
        for d in done:
            if d.store is not None:
                d.store.close()
        first = failed[0]
        raise ContinuityError(
            f"slice {first.job.slice}: restore failed: {first.error} "
            f"({len(failed)} of {len(jobs)} slices failed)"
        ) from first.error
    return [(d.job.slice, d.store) for d in done if d.store is not None]


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
    work = [RestoreWork(job, RestoreStats(job.slice, _local(job) or 0, job.target)) for job in jobs]
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
                clean_up(w)
        raise
    return [RestoreOutcome(w.job, w.job.store, w.stats, w.error) for w in work]


def _run(
    work: list[RestoreWork], durable: DurableState, progress: Progress | None, started: float
) -> None:
    """One pass of the pipeline over `work`: each job ends done or with its error."""
    tails = TailSections(durable)
    try:
        for w in work:
            guarded(w, tails, lambda w=w: _prepare(w, durable))
        direct = DirectSections(durable)
        for w in work:
            if w.error is None and _catch_up_here(w, durable):
                guarded(w, tails, lambda w=w: _finish(w, durable, direct, progress, started))
        rest = [w for w in work if w.error is None and not w.done]
        if rest:
            tails.transfers = transfers_for(
                durable, sum(w.plan.snapshot.bytes for w in rest if w.plan and w.plan.snapshot)
            )
        tails.plan([(w, e) for w in rest if w.plan for e in w.plan.entries])
        tails.top_up()
        if rest:
            SnapshotTransfers(rest, durable, tails, progress).run(
                lambda w: guarded(w, tails, lambda: _finish(w, durable, tails, progress, started))
            )
    except BaseException:
        tails.drop_all()
        raise


def _fall_back(w: RestoreWork) -> bool:
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


def _catch_up_here(w: RestoreWork, durable: DurableState) -> bool:
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


def _local(job: RestoreJob) -> int | None:
    return job.store.version if job.store is not None else None


def _prepare(w: RestoreWork, durable: DurableState) -> None:
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


def _finish(
    w: RestoreWork,
    durable: DurableState,
    tails: TailSections | DirectSections,
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
