"""Timers that fire in a micro-batch without new data (Spark runs such batches for the
processing-time timeout of `applyInPandasWithState`, no source offset moving) are counted
where users look: in that batch's `StreamingQueryProgress.observedMetrics` and at the
Prometheus endpoint, as the driver's own batch report counts them (real Spark, emulated
AWS, a continuous query)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pyspark.sql.streaming import StreamingQueryListener

from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.driver import prometheus
from shardless.processor.driver.job import BatchReport, start
from shardless.processor.driver.metrics import figures
from tests.jobs import job_config
from tests.processor.driver.test_progress_metrics import free_port, scrape

# The second timer of each key is due this long after the first fired: past the batch
# right after the records and the source's one look for more, so it fires in a batch of
# the processing-time timeout alone.
GAP_MS = 10_000


@pytest.fixture
def endpoint_stopped() -> Iterator[None]:
    yield
    prometheus.stop_all()


class Reminders:
    """Each key's timer fires twice: at once (in the next batch), then `GAP_MS` later, when
    its state is dropped (as a session closing after an inactivity gap, docs/handlers.md).
    Every firing emits."""

    def process(self, event, ctx) -> None:  # noqa: ANN001
        ctx.state.set({"events": (ctx.state.get() or {}).get("events", 0) + 1, "round": 0})
        ctx.timers.set(ctx.now_ms + 1)

    def on_timer(self, timer, ctx) -> None:  # noqa: ANN001
        state = ctx.state.get()
        state["round"] += 1
        ctx.emit({"key": ctx.key, "round": state["round"]})
        if state["round"] == 1:
            ctx.state.set(state)
            ctx.timers.set(ctx.now_ms + GAP_MS)
        else:
            ctx.state.delete()


class Progresses(StreamingQueryListener):
    """Every progress Spark reports (recentProgress keeps only the latest ones)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def onQueryStarted(self, event: Any) -> None:  # noqa: N802
        pass

    def onQueryProgress(self, event: Any) -> None:  # noqa: N802
        self.seen.append(json.loads(event.progress.json))

    def onQueryIdle(self, event: Any) -> None:  # noqa: N802
        pass

    def onQueryTerminated(self, event: Any) -> None:  # noqa: N802
        pass


def ran_a_batch(progress: dict[str, Any]) -> bool:
    """A trigger that ran no batch reports the query's progress too, without `addBatch`."""
    return "addBatch" in (progress.get("durationMs") or {})


def without_new_data(progress: dict[str, Any]) -> bool:
    """A batch that Spark ran with no source offset moving: a no-data batch."""
    return all(s["startOffset"] == s["endOffset"] for s in progress["sources"])


@pytest.mark.slow
def test_timers_fired_in_a_batch_without_new_data_are_in_the_progress_and_prometheus(
    spark, kinesis, make_stream, location, tmp_path, endpoint_stopped
):
    stream = make_stream(1)
    keys = [f"user-{i}" for i in range(5)]
    kinesis.put_records(
        StreamName=stream, Records=[{"PartitionKey": k, "Data": b"{}"} for k in keys]
    )
    port = free_port()
    # The source looks for new records once when idle, then not for ten minutes: every
    # later batch is one Spark runs for the timeout alone.
    cfg = job_config(
        location, (stream,), tmp_path, metrics_port=port, metrics_host="127.0.0.1",
        idle_poll_ms=600_000,
    )  # fmt: skip
    fired: list[tuple[str, int]] = []
    reports: list[BatchReport] = []

    def sink(df, batch_id) -> None:  # noqa: ANN001
        fired.extend((o["key"], o["round"]) for o in (json.loads(r.value) for r in df.collect()))

    listener = Progresses()
    spark.streams.addListener(listener)
    query = start(
        spark, HandlerFactory(Reminders), cfg, sink=sink, on_report=reports.append,
        processing_time="500 milliseconds",
    )  # fmt: skip
    name = f"shardless-{cfg.app}"
    try:
        # until every timer fired, the driver reported its batch, and Spark's progress of
        # that batch reached the listener (listeners run a bit later)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and query.isActive:
            last = max((r.batch_id for r in reports if r.timers_fired), default=None)
            if sum(r.timers_fired for r in reports) == 2 * len(keys) and any(
                p["batchId"] == last and ran_a_batch(p) for p in listener.seen
            ):
                break
            time.sleep(0.5)
    finally:
        query.stop()
        spark.streams.removeListener(listener)
    assert query.exception() is None
    assert sorted(fired) == sorted((k, n) for k in keys for n in (1, 2))
    ours = [p for p in listener.seen if p["name"] == name]
    ran = {p["batchId"]: p for p in ours if ran_a_batch(p)}

    # Each batch that fired timers, as the driver reported it and as Spark's progress has it.
    firing = [r for r in reports if r.timers_fired]
    assert sum(r.timers_fired for r in firing) == 2 * len(keys)
    for r in firing:
        f = figures(ran[r.batch_id]["observedMetrics"] or {})
        assert f, f"batch {r.batch_id} fired {r.timers_fired} timers; its progress has no figures"
        assert (f["timers_fired"], f["outputs"], f["records"]) == (r.timers_fired, r.outputs, 0)
        assert r.records == 0 and ran[r.batch_id]["numInputRows"] == 0
    # The second round fired in a no-data batch: no source offset moved.
    (idle,) = [r for r in firing if without_new_data(ran[r.batch_id])]
    assert idle.timers_fired == len(keys) == idle.outputs

    # A trigger that ran no batch reports no figures, so every progress adds up.
    every = [figures(p["observedMetrics"] or {}) for p in ours]
    assert sum(f.get("timers_fired", 0) for f in every) == len(fired) == 2 * len(keys)
    assert sum(f.get("outputs", 0) for f in every) == len(fired)
    assert sum(f.get("records", 0) for f in every) == len(keys)

    # The Prometheus endpoint counts them too.
    app = f'{{app="{location.app}"}}'
    deadline = time.monotonic() + 30
    while (got := scrape(port)).get(f"shardless_timers_fired_total{app}") != len(fired):
        assert time.monotonic() < deadline, got
        time.sleep(0.5)
    assert got[f"shardless_outputs_total{app}"] == len(fired)
    assert got[f"shardless_records_total{app}"] == len(keys)
