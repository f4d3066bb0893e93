"""One attempt at a group's batch, as the steps of the commit protocol in their order.

Read the heads (from this host's memory of the previous batch when it ran the group, else
from DynamoDB); bring each slice's store to the version it starts from; take the due
snapshots' checkpoints; run each slice's records and due timers with writes buffered;
write dead letters; wait for the snapshots; commit durably (one S3 segment and DynamoDB
transactions conditional on the heads read); only then apply locally; remember the heads.
A commit lost to a stale head this host remembered raises `StaleHeads`, and the runner
tries once more from heads read afresh.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from shardless.changelog import fence
from shardless.changelog.chain_commits import PositionTakenError, commit_link
from shardless.changelog.chain_writes import ChainTip
from shardless.changelog.durable import (
    CommitResult,
    DurableState,
    HeadConflictError,
    SliceCommit,
)
from shardless.changelog.history import snapshot_due
from shardless.changelog.layout import Head, SnapRef, new_uid
from shardless.changelog.pack import Due, upload_pack
from shardless.changelog.snapshot import snapshot_pool
from shardless.changelog.transactions import GuardFailedError
from shardless.changelog.transfer_process import transfer_process
from shardless.processor.api.handlers import HandlerFactory, handler_for
from shardless.processor.errors import ProcessorError
from shardless.processor.runtime.config import Pending, RuntimeConfig
from shardless.processor.runtime.dead_letter import DeadLetter, target
from shardless.processor.runtime.group_chain import (
    adopt,
    find_chain,
    join,
    roll_over,
    unchanged_since,
)
from shardless.processor.runtime.grouping import slices_of_key
from shardless.processor.runtime.records import GroupInput
from shardless.processor.runtime.slice_runner import run_slice
from shardless.processor.runtime.stores import StoreCache
from shardless.state.transaction import Transaction

log = logging.getLogger(__name__)


def dumps(value: Any) -> str:
    return json.dumps(value, default=str, separators=(",", ":"))


class StaleHeads(Exception):
    """A commit lost because a head this host knew was stale: run again from fresh heads."""


class Attempt:
    """One try at one group's batch: each method is one step, timed into `took`."""

    def __init__(
        self,
        cfg: RuntimeConfig,
        handlers: HandlerFactory,
        group: int,
        query: str,
        batch: int,
        data: GroupInput,
        pending: Pending | None,
        now_ms: int,
        watermark_ms: int,
        cache: StoreCache,
        durable: DurableState,
        took: dict[str, float],
    ) -> None:
        self.cfg, self.handlers = cfg, handlers
        self.group, self.query, self.batch = group, query, batch
        self.data, self.now_ms, self.watermark_ms = data, now_ms, watermark_ms
        self.cache, self.durable, self.took = cache, durable, took
        self.pending: Pending = dict(pending or {})
        self.slices = sorted(
            set(data.spans) | set(_due(self.pending, now_ms, watermark_ms)) | data.woken
        )
        if cfg.partitions is not None:
            _check_range(group, self.slices, cfg.slices, cfg.partitions)
        self.metrics: dict[str, Any] = {
            "group": group,
            "records": data.records,
            "slices": len(self.slices),
            "restores": [],
            "timers_fired": 0,
            "attempts": 1,
            "handler_retries": 0,
            "late_records": 0,
        }
        self.known: dict[int, Head | None] = {}
        self.heads: dict[int, Head | None] = {}
        self.plans: list[tuple[int, int, bool]] = []
        self.stores: dict[int, tuple[Any, Head | None, Any]] = {}
        self.snapshots: dict[int, Head | None] = {}  # the slices snapshotted: their heads
        self.pack: Future[dict[int, tuple[SnapRef, int]]] | None = None
        self.uploads_since = 0.0
        self.rows: list[tuple] = []
        self.commits: list[SliceCommit] = []
        self.deltas: list[tuple[list, list]] = []
        self.letters: list[DeadLetter] = []
        self.done: Any = None
        self.tip: ChainTip | None = None  # the group's chain, with commit_format "chains"
        self._clock = time.perf_counter()

    def run(self, trust_known: bool = True) -> tuple[list[tuple], dict[str, Any], Pending]:
        self.read_heads(trust_known)
        if self.cfg.commit_format == "chains":
            self.join_chain(trust_known)
        self.restore()
        self.checkpoint_snapshots()
        self.process()
        self.write_dead_letters()
        self.attach_snapshots()
        self.commit_durably()
        self.commit_locally()
        self.remember()
        self.metrics["committed_slices"] = len(self.commits)
        self.metrics["outputs"] = len(self.rows)
        return self.rows, self.metrics, self.pending

    def _lap(self, name: str) -> None:
        now = time.perf_counter()
        self.took[name] = self.took.get(name, 0.0) + now - self._clock
        self._clock = now

    def read_heads(self, trust_known: bool) -> None:
        """The slices' heads: remembered from this host's previous batch of the group when
        it can be trusted, the rest read from DynamoDB; and each slice's starting version."""
        slices = self.slices
        if trust_known and self.cfg.commit_format == "chains":
            self.vouch_idle()
        known = (
            self.cache.known.heads(self.group, self.query, self.batch, slices)
            if trust_known
            else {}
        )
        unknown = [s for s in slices if s not in known]
        self.known = known
        self.heads = {**known, **(self.durable.heads(unknown) if unknown else {})}
        self.metrics["heads_known"], self.metrics["heads_read"] = len(known), len(unknown)
        self.plans = [
            _plan(s, self.heads.get(s), self.query, self.batch, self.group) for s in slices
        ]
        self._lap("heads")

    def vouch_idle(self) -> None:
        """A group back on the host that ran it last after batches Spark did not call it in
        (no records, no timer due): what the host knew then is current if DynamoDB shows
        nothing committed to its slices since (`unchanged_since`), which costs two reads
        where reading the heads through the chain costs a Query and a GET per link."""
        found = self.cache.known.stale(self.group, self.query, self.batch)
        if found is None:
            return
        tip, heads = found
        if unchanged_since(self.durable, tip, heads):
            self.cache.known.vouch(self.group, self.query, self.batch, tip, heads)
            self.metrics["heads_vouched"] = len(heads)

    def join_chain(self, trust_known: bool) -> None:
        """The group's chain (`group_chain`), and the batch's slices taken over into it."""
        tip = self.cache.known.tip(self.group, self.query, self.batch) if trust_known else None
        remembered = tip is not None
        if tip is None:
            tip = find_chain(self.durable, self.cfg, self.group, self.query, self.heads)
            if tip.position:  # read again, after the tip: a commit at tip + 1 is then
                # conditional on every link the heads are read through
                self.heads.update(self.durable.heads(self.slices))
                self.metrics["heads_read"] += len(self.slices)
        tip, settled = roll_over(
            self.durable, self.cfg, self.group, self.query, tip, self.cache.owner
        )
        try:
            taken = join(
                self.durable, tip, self.heads, self.slices, self.cache.owner, self.query, settled
            )
        except HeadConflictError as exc:
            if set(exc.slices) & set(self.known) or (
                remembered and isinstance(exc, GuardFailedError)
            ):  # the chain this host remembers moved on, or is gone: read afresh
                raise StaleHeads(str(exc)) from exc
            raise
        self.heads.update(taken)
        self.plans = [
            _plan(s, self.heads.get(s), self.query, self.batch, self.group) for s in self.slices
        ]
        self.tip = tip
        self.metrics["heads_taken"] = len(taken)
        self._lap("chain")

    def restore(self) -> None:
        """Each slice's local store at the version it starts from (restored if need be)."""
        wanted = [(s, self.heads.get(s), base) for s, base, _ in self.plans]
        self.stores = self.cache.acquire_many(wanted, self.durable)
        for _store, _head, restored in self.stores.values():
            if restored is not None:
                self.metrics["restores"].append(restored.to_dict())
        self._lap("restore")

    def checkpoint_snapshots(self) -> None:
        """A checkpoint of each store whose snapshot is due; their upload, as one pack,
        started at once."""
        cfg = self.cfg
        self.uploads_since = time.monotonic()  # the snapshots' uploads start from here
        due = []
        for s, base, _ in self.plans:
            head = self.stores[s][1]
            if s in self.data.spans and snapshot_due(
                head, base, s, cfg.snapshot_every, cfg.snapshot_log_bytes
            ):
                point = self.cache.own / f"snap-{s:05d}-{new_uid()}"
                self.stores[s][0].checkpoint(point)
                previous = head.snaps[-1] if head is not None and head.snaps else None
                due.append(Due(s, base, point, previous))
                self.snapshots[s] = head
        if due:
            self.pack = _start_pack(cfg, due)
        self._lap("snapshot_checkpoints")

    def process(self) -> None:
        """Each slice's records in stream order, then its due timers, writes buffered."""
        cfg = self.cfg
        for s, base, rerun in self.plans:
            head = self.stores[s][1]
            tx = Transaction(self.stores[s][0])
            lo, hi = self.data.spans.get(s, (0, 0))
            result = run_slice(
                handler_for(self.handlers, s), tx, s, self.batch, self.now_ms, self.watermark_ms,
                self.data.events[lo:hi], cfg.value_format, cfg.allow_pickle, cfg.policy,
            )  # fmt: skip
            self.metrics["timers_fired"] += result.timers_fired
            self.letters += result.dead_letters
            self.metrics["handler_retries"] += result.handler_retries
            self.metrics["late_records"] += result.late_records
            if result.next_processing_timer is None and result.next_event_timer is None:
                self.pending.pop(s, None)
            else:
                self.pending[s] = (result.next_processing_timer, result.next_event_timer)
            changes = tx.changes()
            timers = (result.next_processing_timer, result.next_event_timer)
            index_stale = head is not None and timers != (head.next_timer, head.next_event_timer)
            if changes or rerun or index_stale:
                self.commits.append(SliceCommit(s, base + 1, head, changes, timers=timers))
                self.deltas.append((changes, tx.undo(changes)))
            self.rows += [
                ("out", s, self.batch, j, k, dumps(v)) for j, (k, v) in enumerate(result.outputs)
            ]
        self._lap("process")

    def write_dead_letters(self) -> None:
        """Records set aside go out before the commit: a batch whose letters are not
        written is not done."""
        letters = self.letters
        self.metrics["dead_letters"] = len(letters)
        if not letters:
            return
        where = target(self.cfg.dead_letter_target()).write(
            self.query, self.batch, self.group, letters
        )
        log.warning(
            "group %s batch %s: %d record(s) set aside in %s: %s",
            self.group, self.batch, len(letters), where,
            ", ".join(f"{x.coordinates} ({x.stage})" for x in letters[:20]),
        )  # fmt: skip
        self._lap("dead_letters")

    def attach_snapshots(self) -> None:
        """The snapshots' uploads awaited and referenced from their slices' commits."""
        self.commits, self.metrics["snapshots"], self.metrics["snapshot_bytes"] = with_snapshots(
            self.commits, self.pack, self.snapshots
        )
        self._lap("snapshot_wait")

    def commit_durably(self) -> None:
        """One segment to S3, then the heads in DynamoDB, conditional on the heads read.

        A group with nothing to commit sends no transaction, so no fence check goes with
        it; when it read heads another query wrote, it asks the fence item itself: a
        query that was taken over must not release outputs computed on the new query's
        state either."""
        if not self.commits and any(
            h is not None and h.query != self.query for h in self.heads.values()
        ):
            loc = self.cfg.location
            if self.query in fence.fenced(loc):
                raise fence.fenced_error(loc, self.query, f"group {self.group} batch {self.batch}")
        try:
            if self.tip is not None:
                self.done = self._commit_link(self.tip)
            else:
                self.done = self.durable.commit(
                    self.query, self.batch, self.group, self.commits,
                    owner=self.cache.owner, uploads_since=self.uploads_since,
                )  # fmt: skip
        except PositionTakenError as exc:
            raise StaleHeads(str(exc)) from exc  # another attempt, or a seal: read afresh
        except HeadConflictError as exc:
            if set(exc.slices) & set(self.known):
                raise StaleHeads(str(exc)) from exc
            raise
        for name, seconds in self.done.seconds.items():
            self.took[f"commit_{name}"] = self.took.get(f"commit_{name}", 0.0) + seconds
        self._clock = time.perf_counter()
        self.metrics["segment_bytes"] = self.done.bytes
        self.metrics["transactions"] = self.done.transactions

    def _commit_link(self, tip: ChainTip) -> CommitResult:
        """The batch as one link of the group's chain; or, when an attempt of this very
        batch committed already (Spark runs it again), its changes adopted, not replaced:
        a chain is append-only."""
        last = tip.last
        if last and not last.sealed and last.query == self.query and last.batch > self.batch:
            raise ProcessorError(
                f"group {self.group}: chain {tip.chain} holds batch {last.batch} of this "
                f"query, but Spark is running batch {self.batch}; the checkpoint is "
                "older than the state"
            )
        reruns = {s for s, _, rerun in self.plans if rerun}
        if reruns and self.known and reruns - set(self.known):
            # another attempt committed this batch after what this host remembers: the
            # heads it knows may miss that commit too, so none of them can be trusted
            raise StaleHeads(
                f"group {self.group}: batch {self.batch} was committed by another attempt "
                f"(slices {sorted(reruns - set(self.known))}) after the heads this host "
                "remembers; reading them afresh"
            )
        if reruns:
            self.commits, self.deltas, uid = adopt(
                self.durable, reruns, self.commits, self.heads, self.stores
            )
            heads = {c.slice: c.expected for c in self.commits if c.expected is not None}
            return CommitResult(uid, 0, 0, heads, tip=tip)
        return commit_link(
            self.durable, self.query, self.batch, tip, self.commits, self.uploads_since
        )

    def commit_locally(self) -> None:
        """The committed changes applied to the local stores, with their undo records."""
        cfg, done = self.cfg, self.done
        for c, (changes, undo) in zip(self.commits, self.deltas, strict=True):
            store = self.stores[c.slice][0]
            store.commit(changes, c.version, undo, tag=done.uid)
            if snapshot_due(
                done.heads.get(c.slice), c.version, c.slice, cfg.snapshot_every,
                cfg.snapshot_log_bytes,
            ):  # fmt: skip
                store.flush_soon()  # the next batch's checkpoint then finds it done
        self._lap("local_commit")

    def remember(self) -> None:
        """The heads after this batch, for this host's next batch of the group."""
        heads = {s: self.done.heads.get(s, self.stores[s][1]) for s in self.slices}
        if self.tip is not None:  # first: the hint `remember` writes carries it too
            tip = self.done.tip or self.tip
            self.cache.known.remember_tip(self.group, self.query, self.batch, tip)
        self.cache.remember(self.group, self.query, self.batch, heads)
        self._lap("remember")


def _start_pack(cfg: RuntimeConfig, due: list[Due]) -> Future[dict[int, tuple[SnapRef, int]]]:
    """Start uploading the checkpoints of `due` as one pack (here, or in the helper
    process with `snapshot_uploads="helper"`). The future returned is done once the upload
    is over and the checkpoints are removed, in that order: a future's waiters wake before
    its callbacks run, so removing them in a callback of the upload's own future left them
    on disk for a while after the batch that waited for it."""
    if cfg.snapshot_uploads == "helper":
        upload = transfer_process().pack(cfg.location, due)
    else:
        upload = snapshot_pool().submit(upload_pack, cfg.location, due)
    done: Future[dict[int, tuple[SnapRef, int]]] = Future()

    def remove(finished: Future) -> None:
        try:
            for d in due:
                shutil.rmtree(d.checkpoint, ignore_errors=True)
        finally:  # whatever the removal meets, the batch waiting for the pack goes on
            _settle(done, finished)

    upload.add_done_callback(remove)
    return done


def _settle(done: Future, finished: Future) -> None:
    """`done` given `finished`'s outcome: its result, its exception, or its cancellation."""
    if finished.cancelled():
        done.cancel()
    elif finished.exception() is not None:
        done.set_exception(finished.exception())
    else:
        done.set_result(finished.result())


def _plan(s: int, head: Head | None, query: str, batch: int, group: int) -> tuple[int, int, bool]:
    """The version slice `s` must start this batch from, and whether this is a re-run.

    A head written by this very batch of this query, by this group, means Spark is running
    the batch again: start from the version before it and commit in its place. Written in
    this batch by another group, it is not ours to replace: two groups touched the slice
    (a group layout that changed under a running checkpoint), and the batch fails.
    """
    if head is not None and head.query == query and head.batch > batch:
        raise ProcessorError(
            f"slice {s}: committed by batch {head.batch} of this query, but Spark is running "
            f"batch {batch}; the checkpoint is older than the state"
        )
    rerun = head is not None and head.query == query and head.batch == batch
    if rerun and head is not None and head.log and head.log[-1].group != group:
        raise ProcessorError(
            f"slice {s}: group {head.log[-1].group} already committed it in batch {batch} of "
            f"this query, and group {group} is running it too: the job's group layout "
            "changed under its checkpoint (spark.sql.shuffle.partitions must stay as the "
            "checkpoint has it)"
        )
    base = 0 if head is None else head.version - (1 if rerun else 0)
    return s, base, rerun


def _due(pending: Pending, now_ms: int, watermark_ms: int) -> list[int]:
    return [
        s
        for s, (proc, event) in pending.items()
        if (proc is not None and proc <= now_ms) or (event is not None and event <= watermark_ms)
    ]


def _check_range(group: int, slices: list[int], total: int, partitions: int) -> None:
    """Refuse slices (records or pending timers) outside the group's range: another group
    owns them, and two groups committing one slice in a batch would each take the other's
    commit for a re-run of its own."""
    own = slices_of_key(group, total, partitions)
    stray = [s for s in slices if s not in own]
    if stray:
        raise ProcessorError(
            f"group {group} was given slices {stray[:10]} outside its range "
            f"{own.start}-{own.stop - 1} of {total} slices in {partitions} partitions: the "
            "job's group layout does not match the one this checkpoint's state was built "
            "with (keep spark.sql.shuffle.partitions as the checkpoint has it)"
        )


def _with_batch(ref: SnapRef, head: Head | None) -> SnapRef:
    """A snapshot's reference naming the batch that committed its version (from `head`'s
    log)."""
    entry = next((e for e in head.log if e.version == ref.version), None) if head else None
    return ref if entry is None else replace(ref, batch=entry.batch, query=entry.query)


def with_snapshots(
    commits: list[SliceCommit],
    pack: Future[dict[int, tuple[SnapRef, int]]] | None,
    heads: dict[int, Head | None],
) -> tuple[list[SliceCommit], int, int]:
    """Attach the snapshots of the batch's pack to their slices' commits (`heads`: the
    slices snapshotted, each with its head before the batch). A pack that failed is left
    out (logged): a snapshot is an optimisation. One of a slice that commits nothing is
    unreferenced and garbage-collected."""
    results: dict[int, tuple[SnapRef, int]] = {}
    if pack is not None:
        try:
            results = pack.result()
        except Exception as exc:  # noqa: BLE001 - commit without the snapshots
            log.warning("slices %s: snapshots failed, committing without them: %s",
                        sorted(heads), exc)  # fmt: skip
    out, count, sent = [], 0, 0
    for c in commits:
        found = results.get(c.slice)
        if found is not None:
            c = replace(c, snapshot=_with_batch(found[0], heads.get(c.slice)))
            count += 1
            sent += found[1]
        out.append(c)
    return out, count, sent
