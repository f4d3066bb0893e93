"""The task runtime: one Spark group (a run of slices) for one batch, inside
`applyInPandasWithState`.

For every slice with records or due timers: bring the local store to the committed
version, run the slice's records in stream order and then its due timers with writes
buffered, then commit all changed slices durably (one S3 object and one DynamoDB
transaction per 100 slices) and only then locally. Outputs are yielded after the durable
commit, so nothing is released that a restore could not reproduce.

Heads come from what this host already knows when it ran the group the batch before
(`KnownHeads.heads`), else from DynamoDB. The commit is conditional on exactly those
heads; if one was stale the run starts again once, from heads read afresh.

Each group's metrics row says where its time went (`timings`, seconds). With the
environment variable SHARDLESS_PROFILE_DIR set, each call is also profiled with cProfile
into that directory (`g<group>-b<batch>-p<pid>.prof`).

A batch that Spark runs again (same query, same batch id) finds its own earlier commit in
the slice's head; it re-processes from the version before it and re-commits in its place,
so state counts the input once and the outputs are the same.

Spark's group state holds which slices of the group have pending timers and when they are
next due; its processing-time timeout makes Spark call the group when no records arrive, so
timers fire in idle slices too, in the first batch where they can be due (`wake_after_ms`):
while an event timer is pending that is every batch, since any batch may move the
watermark. Each slice's head keeps the same (`Head.next_timer`) as the durable index: a
new checkpoint, which has no group state, wakes those slices in its first batch
(`shardless.processor.driver.timer_source`), and from then on Spark's timeout carries them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import pandas as pd

from shardless.changelog.durable import DurableState
from shardless.changelog.errors import CommitConflictError
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.runtime.attempt import Attempt, StaleHeads, dumps
from shardless.processor.runtime.config import Pending, RuntimeConfig
from shardless.processor.runtime.owner import BatchCall
from shardless.processor.runtime.owner import call as owner_call
from shardless.processor.runtime.process import no_cycle_collection, profiled
from shardless.processor.runtime.records import GroupInput, prepare
from shardless.processor.runtime.stores import cache_for

__all__ = ["GroupRunner", "RuntimeConfig", "OUTPUT_SCHEMA", "STATE_SCHEMA", "wake_after_ms"]

log = logging.getLogger(__name__)

OUTPUT_SCHEMA = "kind string, slice int, batch_id long, seq int, key string, value string"
STATE_SCHEMA = "pending string"
BATCH_ID_PROPERTY = "streaming.sql.batchId"
QUERY_ID_PROPERTY = "sql.streaming.queryId"
_COLUMNS = ["kind", "slice", "batch_id", "seq", "key", "value"]


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
        call = BatchCall(int(key[0]), query, batch, pdf, pending, now_ms, watermark_ms, took)
        run = self._in_owner if self.config.group_owner == "process" else self._here
        out, pending = run(call)
        if pending:
            state.update((dumps({str(s): v for s, v in pending.items()}),))
            state.setTimeoutDuration(wake_after_ms(pending, now_ms, self.config.timer_poll_ms))
        elif state.exists:
            state.remove()
        yield out

    def events(self, pdf: pd.DataFrame | None) -> GroupInput:
        """The group's records as events, in slice and stream order (`records.prepare`). A
        runner fed by another source than Kinesis overrides it to fill in the columns its
        source does not send."""
        return prepare(pdf)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_blob"}

    def _in_owner(self, call: BatchCall) -> tuple[pd.DataFrame, Pending]:
        """Run the batch in the group's owner process on this host
        (`shardless.processor.runtime.owner`)."""
        from pyspark import cloudpickle

        blob = self.__dict__.get("_blob")
        if blob is None:
            blob = self._blob = cloudpickle.dumps(self)
        return owner_call(self, blob, call)

    def _here(self, call: BatchCall) -> tuple[pd.DataFrame, Pending]:
        with profiled(call.group, call.batch), no_cycle_collection():
            return self.run(
                call.group, call.query, call.batch, call.pdf, call.pending, call.now_ms,
                call.watermark_ms, call.timings,
            )  # fmt: skip

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
        data = self.events(pdf)
        took["prepare"] = time.perf_counter() - started
        cache = cache_for(cfg.local_dir, cfg.location.app, cfg.slices)
        durable = DurableState(
            cfg.location,
            cfg.keep_snapshots,
            segment_cache=cache.segments,
            transfer_process_bytes=cfg.transfer_process_bytes,
        )
        args = (cfg, self.handlers, group, query, batch, data, pending, now_ms, watermark_ms)
        try:
            try:
                rows, metrics, pending_out = Attempt(*args, cache, durable, took).run()
            except StaleHeads:
                cache.known.forget(group)
                took = {k: v for k, v in took.items() if k in ("input", "prepare", "called_at")}
                attempt = Attempt(*args, cache, durable, took)
                try:
                    rows, metrics, pending_out = attempt.run(trust_known=False)
                except StaleHeads as again:  # lost even on fresh heads: a real conflict
                    raise conflict(again) from None
                metrics["attempts"] = 2
        except BaseException:
            cache.known.forget(group)
            raise
        metrics["seconds"] = time.perf_counter() - started
        metrics["pid"] = os.getpid()
        metrics["called_at"] = round(took.pop("called_at", time.time() - metrics["seconds"]), 3)
        metrics["timings"] = {k: round(v, 4) for k, v in took.items()}
        rows.append(("metrics", -1, batch, 0, "", dumps(metrics)))
        return pd.DataFrame(rows, columns=_COLUMNS), pending_out


def wake_after_ms(pending: Pending, now_ms: int, timer_poll_ms: int = 0) -> int:
    """The timeout a group with `pending` timers hands Spark (`setTimeoutDuration`, ms
    after this batch's processing time `now_ms`) so that Spark calls it, records or not, in
    the first batch where one of them can be due.

    Spark calls a group without records when its timeout is before the batch's processing
    time, strictly (`timeout < batchTimestampMs`). A processing timer due at P is due in a
    batch at P, so it asks for P - now - 1. An event timer is due once the watermark passes
    it, and any batch may move the watermark: it asks for 1 ms, the least Spark takes, so
    the group is called in every batch (a batch lasts longer than 1 ms), unless
    `timer_poll_ms` asks to be called at most that often."""
    waits = [p - now_ms - 1 for p, _ in pending.values() if p is not None]
    if any(e is not None for _, e in pending.values()):
        waits.append(timer_poll_ms)
    return max(1, min(waits, default=1))


def conflict(stale: StaleHeads) -> BaseException:
    """What an attempt that read every head afresh and still lost raises: the commit
    conflict behind it (another attempt committed first; Spark's retry adopts it)."""
    cause = stale.__cause__
    if isinstance(cause, CommitConflictError):
        return cause
    return CommitConflictError(str(stale))
