"""Timers of a group that gets no records: Spark calls such a group only when the timeout
the runner hands it has passed (`ProcessingTimeTimeout`: `timeout < batchTimestampMs`),
so that timeout decides in which batch its timers fire. Here `GroupRunner.__call__` runs
under a stand-in for Spark that applies exactly that rule, batches 100 ms apart."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from typing import Any

import pandas as pd
import pytest

from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.runtime.group_runner import GroupRunner, RuntimeConfig, wake_after_ms
from shardless.processor.runtime.routing import route

SLICES = 16
T0 = 1_700_000_000_000  # the first batch's processing time


class GroupState:
    """The part of PySpark's `GroupState` the runner uses, for one call."""

    def __init__(self, value: tuple | None, now_ms: int, watermark_ms: int) -> None:
        self.value, self.now_ms, self.watermark_ms = value, now_ms, watermark_ms
        self.timeout: int | None = None  # Spark resets it on every call

    @property
    def exists(self) -> bool:
        return self.value is not None

    @property
    def get(self) -> tuple:
        return self.value  # type: ignore[return-value]

    def update(self, value: tuple) -> None:
        self.value = value

    def remove(self) -> None:
        self.value = None

    def setTimeoutDuration(self, ms: int) -> None:  # noqa: N802
        if ms <= 0:
            raise ValueError("Timeout duration must be positive")  # as PySpark's
        self.timeout = self.now_ms + ms

    def getCurrentProcessingTimeMs(self) -> int:  # noqa: N802
        return self.now_ms

    def getCurrentWatermarkMs(self) -> int:  # noqa: N802
        return self.watermark_ms


class OneGroup:
    """One group key under `applyInPandasWithState` with `ProcessingTimeTimeout`: called
    in a batch that has records for it, and in one without when its timeout is before the
    batch's timestamp (Spark's `processTimedOutState`); otherwise not at all."""

    def __init__(self, runner: GroupRunner, monkeypatch: pytest.MonkeyPatch) -> None:
        self.runner = runner
        self.value: tuple | None = None
        self.timeout: int | None = None
        self.batch = 0
        self.called: list[int] = []
        props: dict[str, str] = {}
        self.props = props

        class Task:
            def getLocalProperty(self, name: str) -> str | None:  # noqa: N802
                return props.get(name)

        monkeypatch.setattr("pyspark.TaskContext.get", lambda: Task())

    def run(self, now_ms: int, watermark_ms: int, pdf: pd.DataFrame | None = None) -> list[dict]:
        batch, self.batch = self.batch, self.batch + 1
        timed_out = self.timeout is not None and self.timeout < now_ms
        if pdf is None and not timed_out:
            return []
        self.called.append(batch)
        self.props.update({"streaming.sql.batchId": str(batch), "sql.streaming.queryId": "q"})
        state = GroupState(self.value, now_ms, watermark_ms)
        (out,) = list(self.runner((0,), iter([] if pdf is None else [pdf]), state))
        self.value, self.timeout = state.value, state.timeout if state.exists else None
        rows = out[out.kind == "out"].sort_values(["slice", "seq"])
        return [json.loads(v) for v in rows.value]


def records(*keyed: tuple[str, dict[str, Any]]) -> pd.DataFrame:
    rows = []
    for i, (key, data) in enumerate(keyed):
        seq = str(10**30 + i)
        rows.append(
            {
                "stream": "s",
                "shard": "shardId-0",
                "sequence_number": seq,
                "subsequence": 0,
                "partition_key": key,
                "explicit_hash_key": None,
                "arrival": datetime(2026, 1, 1, tzinfo=UTC),
                "data": json.dumps(data).encode(),
                "slice": route(key, None, SLICES),
                "stream_order": "0000" + seq.rjust(64, "0") + "0" * 10,
            }
        )
    return pd.DataFrame(rows)


def process(event, ctx):
    at = event.json()
    ctx.timers.set(at["ts"] if "ts" in at else ctx.now_ms + at["in"], at["kind"])


def on_timer(timer, ctx):
    ctx.emit({"key": timer.key, "kind": timer.kind, "at": timer.ts, "now": ctx.now_ms,
              "wm": ctx.watermark_ms})  # fmt: skip


def group(location, tmp_path, monkeypatch, **config: Any) -> OneGroup:
    runner = GroupRunner(
        HandlerFactory(process, on_timer=on_timer),
        RuntimeConfig(location, SLICES, str(tmp_path), **config),
    )
    return OneGroup(runner, monkeypatch)


def test_an_event_timer_fires_in_the_first_batch_whose_watermark_passes_it_without_records(
    location, tmp_path, monkeypatch
):
    """The group sets an event timer, then gets no more records while the watermark moves
    (other groups' records move it): it fires in the first batch whose watermark reaches
    it, 200 ms after it was set, not a poll interval later."""
    g = group(location, tmp_path, monkeypatch)
    assert g.run(T0, 0, records(("rare", {"ts": 9_000, "kind": "event"}))) == []
    assert g.run(T0 + 100, 8_999) == []
    assert g.run(T0 + 200, 9_000) == [
        {"key": "rare", "kind": "event", "at": 9_000, "now": T0 + 200, "wm": 9_000}
    ]
    assert g.called == [0, 1, 2]
    assert g.run(T0 + 300, 20_000) == [] and g.value is None  # fired once, nothing pending
    assert g.called == [0, 1, 2]


def test_a_processing_timer_fires_in_the_batch_whose_time_reaches_it_without_records(
    location, tmp_path, monkeypatch
):
    """Due at T0 + 300: not called before (nothing is due), called in the batch at exactly
    T0 + 300 (due: `ctx.now_ms` reached it), though Spark calls a group only once its
    timeout is before the batch's time."""
    g = group(location, tmp_path, monkeypatch)
    assert g.run(T0, -1, records(("k", {"in": 300, "kind": "processing"}))) == []
    assert g.run(T0 + 100, -1) == [] and g.run(T0 + 299, -1) == []
    assert g.called == [0]
    assert g.run(T0 + 300, -1) == [
        {"key": "k", "kind": "processing", "at": T0 + 300, "now": T0 + 300, "wm": -1}
    ]


def test_timer_poll_ms_calls_a_group_with_event_timers_at_most_that_often(
    location, tmp_path, monkeypatch
):
    """`--timer-poll-ms 1000`: fewer calls, and the event timer fires a poll later."""
    g = group(location, tmp_path, monkeypatch, timer_poll_ms=1000)
    g.run(T0, 0, records(("rare", {"ts": 9_000, "kind": "event"})))
    assert g.run(T0 + 200, 9_000) == [] and g.run(T0 + 1000, 9_500) == []
    assert [o["now"] for o in g.run(T0 + 1001, 9_500)] == [T0 + 1001]
    assert g.called == [0, 3]


@pytest.mark.parametrize(
    ("pending", "poll", "wait"),
    [
        ({3: (None, 9_000)}, 0, 1),  # event timer: every batch
        ({3: (None, 9_000)}, 1000, 1000),
        ({3: (T0 + 300, None)}, 0, 299),  # called in a batch at T0 + 300 (299 < 300)
        ({3: (T0 + 300, None)}, 1000, 299),
        ({3: (T0 + 1, None)}, 0, 1),  # the least Spark takes
        ({3: (T0 - 5, None)}, 0, 1),  # left over from a capped batch: the next one
        ({3: (T0 + 5000, None), 4: (None, 1)}, 0, 1),
        ({3: (T0 + 500, 7)}, 1000, 499),
    ],
)
def test_wake_after_ms(pending, poll, wait):
    assert wake_after_ms(pending, T0, poll) == wait


def test_timer_poll_ms_is_zero_by_default_and_never_negative(tmp_path):
    from shardless.processor.driver.config import JobConfig
    from shardless.processor.errors import ConfigError

    cfg = JobConfig("a", ("s",), "/ck", local_dir=str(tmp_path))
    runtime = {f.name: f.default for f in dataclasses.fields(RuntimeConfig)}
    assert cfg.timer_poll_ms == 0 == runtime["timer_poll_ms"]
    with pytest.raises(ConfigError, match="--timer-poll-ms -1: must be >= 0"):
        JobConfig("a", ("s",), "/ck", local_dir=str(tmp_path), timer_poll_ms=-1)
