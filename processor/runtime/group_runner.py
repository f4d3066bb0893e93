"""The task runtime: one Spark group (a run of slices) for one batch, inside
`applyInPandasWithState`.

For every slice with records or due timers: bring the local store to the committed
version, run the slice's records in stream order and then its due timers with writes
buffered, then commit all changed slices durably (one S3 object and one DynamoDB
transaction per 100 slices) and only then locally. Outputs are yielded after the durable
commit, so nothing is released that a restore could not reproduce.

Heads come from what this host already knows when it ran the group the batch before
(`StoreCache.known_heads`), else from DynamoDB. The commit is conditional on exactly those
heads; if one was stale the run starts again once, from heads read afresh.

Each group's metrics row says where its time went (`timings`, seconds). With the
environment variable SHARDLESS_PROFILE_DIR set, each call is also profiled with cProfile
into that directory (`g<group>-b<batch>-p<pid>.prof`).

A batch that Spark runs again (same query, same batch id) finds its own earlier commit in
the slice's head; it re-processes from the version before it and re-commits in its place,
so state counts the input once and the outputs are the same.

Spark's group state holds which slices of the group have pending timers and when they are
next due; its processing-time timeout makes Spark call the group when no records arrive, so
timers fire in idle slices too. Each slice's head keeps the same (`Head.next_timer`) as the
durable index: a new checkpoint, which has no group state, wakes those slices in its first
batch (`shardless.processor.driver.timer_source`), and from then on Spark's timeout carries them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from itertools import pairwise, repeat
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from shardless.changelog.durable import DurableState, HeadConflictError, SliceCommit
from shardless.changelog.layout import AppLocation, Head, SnapRef, new_uid, snapshot_due
from shardless.changelog.snapshot import snapshot_pool, upload_checkpoint
from shardless.changelog.transfer_process import TRANSFER_PROCESS_BYTES, transfer_process
from shardless.processor.api.context import Event
from shardless.processor.api.handlers import HandlerFactory, handler_for
from shardless.processor.api.policies import RecordPolicy
from shardless.processor.errors import ProcessorError
from shardless.processor.runtime.dead_letter import DeadLetter, target
from shardless.processor.runtime.grouping import slices_of_key
from shardless.processor.runtime.owner import OWNER_IDLE_SECONDS
from shardless.processor.runtime.process import no_cycle_collection, profiled
from shardless.processor.runtime.slice_runner import run_slice
from shardless.processor.runtime.stores import StoreCache, cache_for
from shardless.state import encoding
from shardless.state.transaction import Transaction

log = logging.getLogger(__name__)

OUTPUT_SCHEMA = "kind string, slice int, batch_id long, seq int, key string, value string"
STATE_SCHEMA = "pending string"
BATCH_ID_PROPERTY = "streaming.sql.batchId"
QUERY_ID_PROPERTY = "sql.streaming.queryId"
_COLUMNS = ["kind", "slice", "batch_id", "seq", "key", "value"]

Pending = dict[int, tuple[int | None, int | None]]  # slice -> (next processing, next event)


@dataclass(frozen=True)
class RuntimeConfig:
    location: AppLocation
    slices: int
    local_dir: str
    snapshot_every: int = 32
    snapshot_log_bytes: int = 64 * 1024 * 1024
    keep_snapshots: int = 3
    transfer_process_bytes: int | None = TRANSFER_PROCESS_BYTES
    # "worker": snapshots upload on threads of the process that runs the group; "helper": in
    # the worker's helper process (`shardless.changelog.transfer_process`)
    snapshot_uploads: str = "worker"
    value_format: int = encoding.MSGPACK
    allow_pickle: bool = False
    timer_poll_ms: int = 1000
    # Record columns Spark does not send, as `shardless.processor.driver.job.as_records` declares
    # them: the same value for every record, or None for `sequence_number`: the string of
    # `stream_order`.
    fixed_columns: dict[str, Any] = field(default_factory=dict)
    # the decoder and what to do with records that cannot be decoded or processed
    policy: RecordPolicy = field(default_factory=RecordPolicy)
    # where records set aside go (`shardless.processor.runtime.dead_letter.target`); None: the
    # application's bucket under `<prefix>/dead-letter`
    dead_letter: str | None = None
    # "worker": the Python worker Spark hands the group runs it with its own stores;
    # "process": the group's owner process on this host does (`shardless.processor.runtime.owner`)
    group_owner: str = "worker"
    owner_idle_seconds: int = OWNER_IDLE_SECONDS
    # the shuffle partitions the job laid its group keys out for: a group then refuses
    # slices outside its range (None: no check, for callers without Spark)
    partitions: int | None = None

    def dead_letter_target(self) -> str:
        return self.dead_letter or f"s3://{self.location.bucket}/{self.location.prefix}/dead-letter"


def _start_snapshot(
    cfg: RuntimeConfig, slice_id: int, version: int, checkpoint: Path, head: Head | None
) -> Future[tuple[SnapRef, int]]:
    """Start uploading a checkpoint taken at `version` (here, or in the helper process with
    `snapshot_uploads="helper"`); the checkpoint is removed once the upload is over."""
    previous = head.snaps[-1] if head is not None and head.snaps else None
    if cfg.snapshot_uploads == "helper":
        future = transfer_process().snapshot(cfg.location, slice_id, version, checkpoint, previous)
    else:
        future = snapshot_pool().submit(
            upload_checkpoint, cfg.location, slice_id, version, checkpoint, previous
        )
    future.add_done_callback(lambda _: shutil.rmtree(checkpoint, ignore_errors=True))
    return future


def _dumps(value: Any) -> str:
    return json.dumps(value, default=str, separators=(",", ":"))


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


_EVENT_COLUMNS = ("stream", "shard", "sequence_number", "subsequence", "partition_key")


def _column(pdf: pd.DataFrame, name: str, order: np.ndarray, fixed: dict[str, Any]) -> Any:
    """Column `name` in `order`, as a list (or an iterable of its one fixed value)."""
    if name in pdf.columns:
        return pdf[name].to_numpy()[order].tolist()
    if name == "sequence_number" and fixed.get(name) is None:
        return [str(x) for x in pdf["stream_order"].to_numpy()[order].tolist()]
    return repeat(fixed[name], len(order))


@dataclass
class _Input:
    """A group's records sorted into slices in stream order: each slice's span of events,
    and the slices woken to look for timers (`shardless.processor.driver.timer_source`)."""

    records: int
    events: list[Event]
    spans: dict[int, tuple[int, int]]
    woken: frozenset[int] = frozenset()


def _prepare(pdf: pd.DataFrame | None, fixed: dict[str, Any]) -> _Input:
    """Sort by (slice, stream_order) and make one Event per record; `arrival` is taken
    from its column only when a handler reads it. Wake-up rows (no data) are set apart."""
    if pdf is None or not len(pdf):
        return _Input(0, [], {})
    wake = pdf["data"].isna().to_numpy()
    if wake.any():
        woken = frozenset(int(s) for s in pdf["slice"].to_numpy()[wake])
        found = _prepare(pdf[~wake].reset_index(drop=True), fixed)
        return replace(found, woken=woken)
    slices = pdf["slice"].to_numpy()
    by_order = np.argsort(pdf["stream_order"].to_numpy(), kind="stable")
    order = by_order[np.argsort(slices[by_order], kind="stable")]
    ordered = slices[order]
    bounds = [0, *(np.flatnonzero(np.diff(ordered)) + 1).tolist(), len(order)]
    spans = {int(ordered[lo]): (lo, hi) for lo, hi in pairwise(bounds)}
    cols = [_column(pdf, name, order, fixed) for name in _EVENT_COLUMNS]
    arrivals = repeat(pdf["arrival"].array, len(order))
    data = pdf["data"].to_numpy()[order].tolist()
    events = list(map(Event, *cols, arrivals, data, order.tolist()))
    return _Input(len(order), events, spans)


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


class _StaleHeads(Exception):
    """A commit lost because a head this host knew was stale: run again from fresh heads."""


def _snapshot_result(s: int, future: Future, head: Head | None) -> tuple[SnapRef, int] | None:
    """A snapshot's reference (naming the batch that committed its version, from `head`'s
    log) and the bytes it sent; None when it failed."""
    try:
        ref, sent = future.result()
    except Exception as exc:  # noqa: BLE001 - a snapshot is an optimisation; commit without it
        log.warning("slice %s: snapshot failed, committing without it: %s", s, exc)
        return None
    entry = next((e for e in head.log if e.version == ref.version), None) if head else None
    if entry is not None:
        ref = replace(ref, batch=entry.batch, query=entry.query)
    return ref, sent


class GroupRunner:
    """The function Spark calls per group; pickled with the handler and the config."""

    def __init__(self, handlers: HandlerFactory, config: RuntimeConfig) -> None:
        self.handlers = handlers
        self.config = config

    def __call__(
        self, key: tuple, pdfs: Iterator[pd.DataFrame], state: Any
    ) -> Iterator[pd.DataFrame]:
        from pyspark import TaskContext

        tc = TaskContext.get()
        batch = int(tc.getLocalProperty(BATCH_ID_PROPERTY))
        query = tc.getLocalProperty(QUERY_ID_PROPERTY)
        called_at, started = time.time(), time.perf_counter()
        frames = [p for p in pdfs if len(p)]  # Arrow batches converted to pandas here
        pdf = pd.concat(frames, ignore_index=True) if len(frames) > 1 else next(iter(frames), None)
        took = {"input": time.perf_counter() - started, "called_at": called_at}
        pending: Pending = {}
        if state.exists:
            pending = {int(s): tuple(v) for s, v in json.loads(state.get[0]).items()}
        now_ms = int(state.getCurrentProcessingTimeMs())
        try:
            watermark_ms = int(state.getCurrentWatermarkMs())
        except Exception:  # noqa: BLE001 - no watermark defined on this query
            watermark_ms = -1
        group = int(key[0])
        if self.config.group_owner == "process":
            out, pending = self._in_owner(
                (group, query, batch, pdf, pending, now_ms, watermark_ms, took)
            )
        else:
            out, pending = self._here(group, query, batch, pdf, pending, now_ms, watermark_ms, took)
        if pending:
            state.update((_dumps({str(s): v for s, v in pending.items()}),))
            nexts = [p for p, _ in pending.values() if p is not None]
            wait = min(nexts) - now_ms if nexts else self.config.timer_poll_ms
            if any(e is not None for _, e in pending.values()):
                wait = min(wait, self.config.timer_poll_ms)
            state.setTimeoutDuration(max(1, wait))
        elif state.exists:
            state.remove()
        yield out

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_blob"}

    def _in_owner(self, args: tuple) -> tuple[pd.DataFrame, Pending]:
        """Run the batch in the group's owner process on this host
        (`shardless.processor.runtime.owner`)."""
        from pyspark import cloudpickle

        from shardless.processor.runtime import owner

        blob = self.__dict__.get("_blob")
        if blob is None:
            blob = self._blob = cloudpickle.dumps(self)
        return owner.call(self, blob, args)

    def _here(
        self,
        group: int,
        query: str,
        batch: int,
        pdf: pd.DataFrame | None,
        pending: Pending,
        now_ms: int,
        watermark_ms: int,
        took: dict[str, float],
    ) -> tuple[pd.DataFrame, Pending]:
        with profiled(group, batch), no_cycle_collection():
            return self.run(group, query, batch, pdf, pending, now_ms, watermark_ms, took)

    def run(
        self,
        group: int,
        query: str,
        batch: int,
        pdf: pd.DataFrame | None,
        pending: Pending | None = None,
        now_ms: int | None = None,
        watermark_ms: int = -1,
        timings: dict[str, float] | None = None,
    ) -> tuple[pd.DataFrame, Pending]:
        """Process one group's batch; return its output rows and its pending timers."""
        started = time.perf_counter()
        cfg = self.config
        took = dict(timings or {})
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        data = _prepare(pdf, cfg.fixed_columns)
        took["prepare"] = time.perf_counter() - started
        cache = cache_for(cfg.local_dir, cfg.location.app, cfg.slices)
        durable = DurableState(
            cfg.location,
            cfg.keep_snapshots,
            segment_cache=cache.segments,
            transfer_process_bytes=cfg.transfer_process_bytes,
        )
        try:
            try:
                rows, metrics, pending_out = self._attempt(
                    group, query, batch, data, pending, now_ms, watermark_ms, cache, durable, took
                )
            except _StaleHeads:
                cache.forget(group)
                took = {k: v for k, v in took.items() if k in ("input", "prepare", "called_at")}
                rows, metrics, pending_out = self._attempt(
                    group, query, batch, data, pending, now_ms, watermark_ms, cache, durable, took,
                    trust_known=False,
                )  # fmt: skip
                metrics["attempts"] = 2
        except BaseException:
            cache.forget(group)
            raise
        metrics["seconds"] = time.perf_counter() - started
        metrics["pid"] = os.getpid()
        metrics["called_at"] = round(took.pop("called_at", time.time() - metrics["seconds"]), 3)
        metrics["timings"] = {k: round(v, 4) for k, v in took.items()}
        rows.append(("metrics", -1, batch, 0, "", _dumps(metrics)))
        return pd.DataFrame(rows, columns=_COLUMNS), pending_out

    def _attempt(
        self,
        group: int,
        query: str,
        batch: int,
        data: _Input,
        pending_in: Pending | None,
        now_ms: int,
        watermark_ms: int,
        cache: StoreCache,
        durable: DurableState,
        took: dict[str, float],
        trust_known: bool = True,
    ) -> tuple[list[tuple], dict[str, Any], Pending]:
        cfg = self.config
        clock = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            took[name] = took.get(name, 0.0) + now - clock
            clock = now

        pending = dict(pending_in or {})
        spans = data.spans
        slices = sorted(set(spans) | set(_due(pending, now_ms, watermark_ms)) | data.woken)
        if cfg.partitions is not None:
            _check_range(group, slices, cfg.slices, cfg.partitions)
        metrics: dict[str, Any] = {
            "group": group,
            "records": data.records,
            "slices": len(slices),
            "restores": [],
            "timers_fired": 0,
            "attempts": 1,
        }
        known = cache.known_heads(group, query, batch, slices) if trust_known else {}
        unknown = [s for s in slices if s not in known]
        heads = {**known, **(durable.heads(unknown) if unknown else {})}
        metrics["heads_known"], metrics["heads_read"] = len(known), len(unknown)
        lap("heads")
        plans = [_plan(s, heads.get(s), query, batch, group) for s in slices]
        stores = cache.acquire_many([(s, heads.get(s), base) for s, base, _ in plans], durable)
        for _store, _head, restored in stores.values():
            if restored is not None:
                metrics["restores"].append(restored.to_dict())
        lap("restore")
        snapshots: dict[int, Future] = {}
        uploads_since = time.monotonic()  # the snapshots' uploads start from here
        for s, base, _ in plans:
            head = stores[s][1]
            if s in spans and snapshot_due(
                head, base, s, cfg.snapshot_every, cfg.snapshot_log_bytes
            ):
                point = cache.own / f"snap-{s:05d}-{new_uid()}"
                stores[s][0].checkpoint(point)
                snapshots[s] = _start_snapshot(cfg, s, base, point, head)
        lap("snapshot_checkpoints")
        rows: list[tuple] = []
        commits: list[SliceCommit] = []
        deltas: list[tuple[list, list]] = []
        letters: list[DeadLetter] = []
        metrics["handler_retries"] = 0
        events = data.events
        for s, base, rerun in plans:
            head = stores[s][1]
            tx = Transaction(stores[s][0])
            lo, hi = spans.get(s, (0, 0))
            result = run_slice(
                handler_for(self.handlers, s), tx, s, batch, now_ms, watermark_ms,
                events[lo:hi], cfg.value_format, cfg.allow_pickle, cfg.policy,
            )  # fmt: skip
            metrics["timers_fired"] += result.timers_fired
            letters += result.dead_letters
            metrics["handler_retries"] += result.handler_retries
            if result.next_processing_timer is None and result.next_event_timer is None:
                pending.pop(s, None)
            else:
                pending[s] = (result.next_processing_timer, result.next_event_timer)
            changes = tx.changes()
            timers = (result.next_processing_timer, result.next_event_timer)
            index_stale = head is not None and timers != (head.next_timer, head.next_event_timer)
            if changes or rerun or index_stale:
                commits.append(SliceCommit(s, base + 1, head, changes, timers=timers))
                deltas.append((changes, tx.undo(changes)))
            rows += [("out", s, batch, j, k, _dumps(v)) for j, (k, v) in enumerate(result.outputs)]
        lap("process")
        metrics["dead_letters"] = len(letters)
        if letters:  # before the commit: a batch whose letters are not written is not done
            where = target(cfg.dead_letter_target()).write(query, batch, group, letters)
            log.warning(
                "group %s batch %s: %d record(s) set aside in %s: %s",
                group, batch, len(letters), where,
                ", ".join(f"{x.coordinates} ({x.stage})" for x in letters[:20]),
            )  # fmt: skip
            lap("dead_letters")
        commits, metrics["snapshots"], metrics["snapshot_bytes"] = self._with_snapshots(
            commits, snapshots, {s: stores[s][1] for s in snapshots}
        )
        lap("snapshot_wait")
        try:
            done = durable.commit(
                query, batch, group, commits, owner=cache.owner, uploads_since=uploads_since
            )
        except HeadConflictError as exc:
            if set(exc.slices) & set(known):
                raise _StaleHeads(str(exc)) from exc
            raise
        for name, seconds in done.seconds.items():
            took[f"commit_{name}"] = took.get(f"commit_{name}", 0.0) + seconds
        clock = time.perf_counter()
        metrics["segment_bytes"] = done.bytes
        metrics["transactions"] = done.transactions
        for c, (changes, undo) in zip(commits, deltas, strict=True):
            store = stores[c.slice][0]
            store.commit(changes, c.version, undo, tag=done.uid)
            if snapshot_due(
                done.heads.get(c.slice), c.version, c.slice, cfg.snapshot_every,
                cfg.snapshot_log_bytes,
            ):  # fmt: skip
                store.flush_soon()  # the next batch's checkpoint then finds it done
        lap("local_commit")
        cache.remember(group, query, batch, {s: done.heads.get(s, stores[s][1]) for s in slices})
        lap("remember")
        metrics["committed_slices"] = len(commits)
        metrics["outputs"] = len(rows)
        return rows, metrics, pending

    @staticmethod
    def _with_snapshots(
        commits: list[SliceCommit], snapshots: dict[int, Future], heads: dict[int, Head | None]
    ) -> tuple[list[SliceCommit], int, int]:
        """Attach the snapshots taken this batch to their slices' commits. A snapshot that
        failed is left out (logged); one of a slice that commits nothing is unreferenced
        and garbage-collected."""
        results = {s: _snapshot_result(s, f, heads[s]) for s, f in snapshots.items()}
        out, count, sent = [], 0, 0
        for c in commits:
            found = results.get(c.slice)
            if found is not None:
                c = replace(c, snapshot=found[0])
                count += 1
                sent += found[1]
            out.append(c)
        return out, count, sent
