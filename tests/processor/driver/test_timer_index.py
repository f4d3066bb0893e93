"""The durable index of pending timers: each slice's head says when its next timers are
due, so a new checkpoint (which has none of Spark's group state) fires the timers of
slices that get no more records."""

from __future__ import annotations

import json
import time

import pandas as pd
import pytest

from shardless.changelog import rollback
from shardless.changelog.durable import DurableState
from shardless.changelog.layout import TIMERS_UNKNOWN
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.driver.job import BatchReport, start
from shardless.processor.driver.timer_source import pending_slices, wake_rows
from shardless.processor.runtime.group_runner import GroupRunner
from tests.jobs import job_config
from tests.processor.runtime.test_runtime import SLICES, frame, outputs, runner


def set_timer(event, ctx):
    ctx.timers.set(5_000)


def on_timer(timer, ctx):
    ctx.emit({"fired": timer.key})


def timers_runner(location, path):
    r = runner(location, path)
    r.inner = GroupRunner(HandlerFactory(set_timer, on_timer=on_timer), r.inner.config)
    return r


def wake(slices: list[int]) -> pd.DataFrame:
    return wake_rows(slices).to_pandas()


def test_heads_index_the_next_due_timer_and_clear_it_once_fired(location, tmp_path):
    r = timers_runner(location, tmp_path)
    r.run(0, "q", 0, frame(["a", "b"]), now_ms=1_000)
    heads = DurableState(location).heads(list(range(SLICES)))
    pending = {s for s, h in heads.items() if h.timers_pending}
    assert pending and all(heads[s].next_timer == 5_000 for s in pending)
    assert pending_slices(location, SLICES) == sorted(pending)
    r.pending = {}  # a new checkpoint: Spark's group state is gone
    assert outputs(r.run(0, "q2", 0, None, now_ms=6_000)) == []  # nothing wakes them
    fired = outputs(r.run(0, "q2", 1, wake(sorted(pending)), now_ms=6_000))
    assert sorted(o["fired"] for o in fired) == ["a", "b"]
    assert pending_slices(location, SLICES) == []


def test_a_woken_slice_whose_timers_are_not_due_hands_them_to_spark(location, tmp_path):
    r = timers_runner(location, tmp_path)
    r.run(0, "q", 0, frame(["a"]), now_ms=1_000)
    [s] = pending_slices(location, SLICES)
    r.pending = {}
    assert outputs(r.run(0, "q2", 0, wake([s]), now_ms=2_000)) == []
    assert r.pending == {s: (5_000, None)}  # Spark's timeout carries it from here
    assert outputs(r.run(0, "q2", 1, None, now_ms=5_000)) == [{"fired": "a"}]


def test_a_rollback_marks_timers_unknown_and_the_wake_up_mends_the_index(location, tmp_path):
    r = timers_runner(location, tmp_path)
    r.run(0, "q", 0, frame(["a"]), now_ms=1_000)
    r.run(0, "q", 1, frame(["zz"], 100), now_ms=1_000)
    rollback.apply(location, rollback.plan(location, "q", 0))
    heads = DurableState(location).heads(list(range(SLICES)))
    moved = [s for s, h in heads.items() if h.owner == "rollback"]
    assert moved and all(heads[s].next_timer == TIMERS_UNKNOWN for s in moved)
    woken = pending_slices(location, SLICES)
    assert set(moved) <= set(woken)
    r.pending = {}
    r.run(0, "q2", 0, wake(woken), now_ms=2_000)  # not due yet: the index is mended
    after = DurableState(location).heads(woken)
    assert {s for s, h in after.items() if h.timers_pending} == {
        s for s, h in after.items() if h.next_timer == 5_000
    }


@pytest.mark.slow
def test_a_new_checkpoint_fires_timers_of_slices_that_get_no_more_records(
    spark, kinesis, make_stream, location, tmp_path
):
    """Query one sets a timer per key and stops before it is due. A new checkpoint at
    COMMITTED reads no more records for those keys, and still fires every timer once."""

    def process(event, ctx):
        ctx.timers.set(ctx.now_ms + 2_000)

    stream = make_stream(1)
    keys = [f"k{i}" for i in range(6)]
    kinesis.put_records(
        StreamName=stream, Records=[{"PartitionKey": k, "Data": b"{}"} for k in keys]
    )
    handlers = HandlerFactory(process, on_timer=on_timer)
    fired: list[str] = []

    def sink(df, batch_id):
        fired.extend(json.loads(r.value)["fired"] for r in df.collect())

    first = job_config(location, (stream,), tmp_path, checkpoint="ck-one")
    start(spark, handlers, first, sink=sink, available_now=True).awaitTermination()
    assert fired == [] and pending_slices(location, first.slices)
    second = job_config(
        location, (stream,), tmp_path, checkpoint="ck-two", starting_position="COMMITTED"
    )
    reports: list[BatchReport] = []
    query = start(
        spark, handlers, second, sink=sink, on_report=reports.append,
        processing_time="500 milliseconds",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while sorted(fired) != keys and time.monotonic() < deadline and query.isActive:
            time.sleep(0.5)
    finally:
        query.stop()
    assert sorted(fired) == keys
    assert sum(r.records for r in reports) == 0
    assert pending_slices(location, first.slices) == []


@pytest.mark.slow
def test_a_checkpoint_written_before_the_timer_source_restarts_with_its_one_source(
    spark, kinesis, make_stream, location, tmp_path, monkeypatch
):
    """Checkpoints of earlier versions read the Kinesis source alone, and Spark refuses to
    restart a query with another number of sources: such a checkpoint keeps one."""
    from shardless.processor.driver import recorder

    stream = make_stream(1)
    kinesis.put_records(
        StreamName=stream, Records=[{"PartitionKey": f"k{i}", "Data": b"{}"} for i in range(5)]
    )
    handlers = HandlerFactory(lambda event, ctx: ctx.state.set(1))
    cfg = job_config(location, (stream,), tmp_path, checkpoint="ck-old")
    real = recorder.checkpoint_layout
    with monkeypatch.context() as m:  # as an earlier version laid the query out
        m.setattr(recorder, "checkpoint_layout", lambda *a: real(*a) or (None, 1))
        start(spark, handlers, cfg, sink=lambda df, b: None, available_now=True).awaitTermination()
    assert real(spark, cfg.checkpoint)[1] == 1
    kinesis.put_records(
        StreamName=stream, Records=[{"PartitionKey": f"k{i}", "Data": b"{}"} for i in range(5)]
    )
    reports: list[BatchReport] = []
    query = start(
        spark, handlers, cfg, sink=lambda df, b: None, on_report=reports.append,
        available_now=True,
    )  # fmt: skip
    query.awaitTermination()
    assert query.exception() is None and sum(r.records for r in reports) == 5
    assert real(spark, cfg.checkpoint)[1] == 1
    fresh = job_config(location, (stream,), tmp_path, checkpoint="ck-new", allow_recount=True)
    start(spark, handlers, fresh, sink=lambda df, b: None, available_now=True).awaitTermination()
    assert real(spark, fresh.checkpoint)[1] == 2  # a new checkpoint reads both
