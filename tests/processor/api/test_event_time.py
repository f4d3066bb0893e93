"""Event time from the record without Spark: reading it from a field or a function, the
late rule, the `--on-late` policies and records without a readable event time in the
`TestDriver` (the same `run_slice` a job runs), and the job's reading step on Arrow
batches and its late count agreeing with what `run_slice` counts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardless.processor.api.context import Event
from shardless.processor.api.event_time import (
    MAX_MS,
    MIN_MS,
    EventTimeChoice,
    is_late,
    json_event_time,
)
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.api.policies import RecordPolicy
from shardless.processor.driver.config import JobConfig
from shardless.processor.driver.event_time import EventTimeStep
from shardless.processor.errors import AppError, ConfigError, ProcessorError
from shardless.processor.kinesis.rows import ARROW_SCHEMA
from shardless.processor.runtime.records import prepare
from shardless.processor.runtime.slice_runner import run_slice
from shardless.processor.testing import TestDriver
from shardless.state.encoding import MSGPACK
from shardless.state.store import SliceStore
from shardless.state.transaction import Transaction

T = 1_700_000_000_000
times = st.integers(min_value=MIN_MS, max_value=MAX_MS)


@given(times)
def test_a_field_of_epoch_ms_or_its_iso_string_is_that_event_time(ms: int) -> None:
    assert json_event_time(f'{{"a": {{"ts": {ms}}}}}'.encode(), "a.ts") == (ms, None)
    assert json_event_time(f'{{"ts": {ms}.0}}'.encode(), "ts") == (ms, None)
    at = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms)
    assert json_event_time(f'{{"ts": "{at.isoformat()}"}}'.encode(), "ts") == (ms, None)
    local = at.astimezone(timezone(timedelta(hours=-5)))
    assert json_event_time(f'{{"ts": "{local.isoformat()}"}}'.encode(), "ts") == (ms, None)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b'{"other": 1}', "it has no field 'ts'"),
        (b'{"ts": "soon"}', "its field 'ts' is 'soon', not an ISO 8601 time"),
        (b'{"ts": true}', "its field 'ts' is true, not a time"),
        (b'{"ts": null}', "its field 'ts' is null, not a time"),
        (b'{"ts": 1.5}', "its field 'ts' is 1.5, not whole epoch milliseconds"),
        (b'{"ts": [1]}', "its field 'ts' is a list, not a time"),
        (b'{"ts": 1e300}', "its field 'ts' is 1e+300 ms, outside 1677-09-22 to 2262-04-11"),
        (b'{"ts": 99999999999999999}', "outside 1677-09-22 to 2262-04-11"),
        (b"[1]", "its data is not a JSON object"),
        (b"\xff{", "its data is not UTF-8 JSON"),
        (b'{"ts": ', "its data is not UTF-8 JSON"),
    ],
)
def test_a_field_that_is_not_a_time_says_why(data: bytes, why: str) -> None:
    found, error = json_event_time(data, "ts")
    assert found is None and why in error


def test_a_naive_iso_time_is_utc_and_a_function_may_return_a_datetime() -> None:
    assert json_event_time(b'{"ts": "2023-11-14T22:13:20"}', "ts") == (T, None)
    choice = EventTimeChoice(function=lambda r: datetime(2023, 11, 14, 22, 13, 20, 5000))
    assert choice.of(None) == (T + 5, None)


def test_a_function_that_raises_or_returns_no_time_names_itself() -> None:
    def event_time(record):  # noqa: ANN001, ANN202
        return record.json()["at"]

    choice = EventTimeChoice(function=event_time)
    event = Event("s", "shardId-0", "1", 0, "k", datetime.now(UTC), b'{"x": 1}')
    assert choice.of(event) == (None, "event-time function event_time() raised KeyError: 'at'")
    event.data = b'{"at": "x"}'
    assert choice.of(event)[1] == (
        "what event-time function event_time() returned is 'x', not an ISO 8601 time"
    )


@given(times, st.integers(min_value=-1, max_value=MAX_MS))
def test_late_means_at_or_before_a_watermark_once_there_is_one(at: int, wm: int) -> None:
    assert is_late(at, wm) == (wm >= 0 and at <= wm)


def count(event, ctx) -> None:  # noqa: ANN001
    ctx.state.set(ctx.state.get(0) + 1)
    ctx.emit({"n": event.json()["n"], "at": event.event_time_ms, "why": event.decode_error})


def sent_in_two_batches(policy: RecordPolicy) -> TestDriver:
    """Batch 1: n=0 at T+10 s (the watermark becomes T+9 s with 1 s lateness). Batch 2:
    n=1 at T+9 s (late: at the watermark), n=2 at T+9.001 s (on time), n=3 at T+1 s (late)."""
    t = TestDriver(count, event_time="ts", allowed_lateness_ms=1000, policy=policy)
    t.send("k", {"n": 0, "ts": T + 10_000})
    t.run_batch()
    for n, at in ((1, T + 9000), (2, T + 9001), (3, T + 1000)):
        t.send("k", {"n": n, "ts": at})
    return t


@pytest.mark.parametrize(
    ("on_late", "processed"), [("process", [1, 2, 3]), ("drop", [2]), ("dead-letter", [2])]
)
def test_late_records_go_where_on_late_says_and_are_counted(on_late, processed) -> None:  # noqa: ANN001
    with sent_in_two_batches(RecordPolicy(on_late=on_late)) as t:
        assert t.watermark_ms == T + 9000
        assert sorted(v["n"] for _, v in t.run_batch()) == processed
        assert t.late_records == 2
        assert t.state("k") == 1 + len(processed)
        letters = t.dead_letters
        if on_late == "dead-letter":
            assert [(x.sequence_number, x.stage) for x in letters] == [("2", "late"), ("4", "late")]
            assert letters[0].error == (
                f"late: event time {T + 9000} ms is at or before the watermark {T + 9000} ms"
            )
        else:
            assert letters == []


def test_without_a_named_event_time_nothing_is_late_and_event_time_is_arrival() -> None:
    with TestDriver(count, allowed_lateness_ms=0, policy=RecordPolicy(on_late="drop")) as t:
        t.send("k", {"n": 0}, event_time_ms=T + 5000)
        t.run_batch()
        t.send("k", {"n": 1}, event_time_ms=T)  # before the watermark, but not judged
        assert t.run_batch() == [("k", {"n": 1, "at": T, "why": None})]
        assert t.late_records == 0


def test_a_record_without_its_event_time_fails_the_batch_naming_it_and_the_field() -> None:
    with TestDriver(count, event_time="meta.ts") as t:
        t.send("k", {"n": 0, "meta": {"ts": T}})
        t.send("k", {"n": 1, "meta": {}})
        with pytest.raises(ProcessorError) as err:
            t.run_batch()
    assert (
        "record test/shardId-000000000000/2.0 has no event time: it has no field 'meta.ts' "
        "(key 'k', slice"
    ) in str(err.value)


def test_dead_letter_or_raw_deal_with_records_without_an_event_time() -> None:
    policy = RecordPolicy(on_decode_error="dead-letter")
    with TestDriver(count, event_time="ts", policy=policy) as t:
        t.send("k", {"n": 0, "ts": "never"})
        assert t.run_batch() == []
        (letter,) = t.dead_letters
        assert letter.stage == "event-time"
        assert letter.error == "no event time: its field 'ts' is 'never', not an ISO 8601 time"
    with TestDriver(count, event_time="ts", policy=RecordPolicy(on_decode_error="raw")) as t:
        t.send("k", {"n": 0}, event_time_ms=T)
        assert t.run_batch() == [
            ("k", {"n": 0, "at": T, "why": "no event time: it has no field 'ts'"})
        ]
        assert t.watermark_ms == -1  # it did not move the watermark


def test_an_app_file_names_its_event_time_and_a_bad_one_is_refused(tmp_path) -> None:  # noqa: ANN001
    app = tmp_path / "app.py"
    app.write_text(
        "def event_time(record):\n    return record.json()['t'] * 1000\n\n"
        "def process(event, ctx):\n    ctx.state.set(event.event_time_ms)\n"
    )
    with TestDriver(app) as t:
        t.send("k", {"t": 1_700_000_000})
        t.run_batch()
        assert t.state("k") == T
        assert t.watermark_ms == T
    app.write_text("event_time = 7\n\ndef process(event, ctx):\n    pass\n")
    with pytest.raises(AppError, match="event_time must be a JSON field path"):
        TestDriver(app)


def test_the_job_flags_are_checked() -> None:
    with pytest.raises(ConfigError, match="--on-late 'late': use process"):
        JobConfig(app="a", streams=("s",), checkpoint="/tmp/x", on_late="late")
    with pytest.raises(ConfigError, match="--event-time-field: event-time field 'a..b'"):
        JobConfig(app="a", streams=("s",), checkpoint="/tmp/x", event_time_field="a..b")
    cfg = JobConfig(app="a", streams=("s",), checkpoint="/tmp/x", on_late="drop")
    assert cfg.record_policy().on_late == "drop"
    assert not cfg.record_policy().event_time


def rows(data: list[bytes | None]) -> pa.RecordBatch:
    n = len(data)
    columns = {
        "stream": ["s"] * n,
        "shard": ["shardId-0"] * n,
        "sequence_number": [str(i) for i in range(n)],
        "subsequence": [0] * n,
        "partition_key": ["k"] * n,
        "explicit_hash_key": [None] * n,
        "arrival": [datetime(2026, 1, 1, tzinfo=UTC)] * n,
        "data": data,
        "slice": [3] * n,
        "stream_order": [f"{i:04d}" for i in range(n)],
        "behind_ms": [None] * n,
    }
    return pa.RecordBatch.from_arrays(
        [pa.array(columns[f.name], f.type) for f in ARROW_SCHEMA], schema=ARROW_SCHEMA
    )


def test_the_job_step_adds_the_time_the_watermark_follows_and_why_there_is_none() -> None:
    batch = rows([b'{"ts": 1700000000000}', b'{"x": 1}', None])
    (out,) = EventTimeStep(EventTimeChoice(field="ts"))(iter([batch]))
    assert out.column("event_time_ms").to_pylist() == [T, 0, 0]
    assert out.column("event_time_error").to_pylist() == [None, "it has no field 'ts'", None]
    stamps = out.column("event_time").to_pylist()
    assert stamps[0] == datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)
    assert stamps[1] == stamps[2] == datetime(1970, 1, 1, tzinfo=UTC)  # never moves it


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.one_of(st.none(), st.integers(min_value=0, max_value=50)), max_size=30),
    st.integers(min_value=-1, max_value=50),
)
def test_run_slice_counts_every_late_record_and_sets_it_aside(
    tmp_path_factory, ats: list[int | None], wm: int
) -> None:  # noqa: ANN001
    data = [
        b'{"n": 1}' if at is None else f'{{"n": {i}, "ts": {at}}}'.encode()
        for i, at in enumerate(ats)
    ]
    (out,) = EventTimeStep(EventTimeChoice(field="ts"))(iter([rows(data)]))
    pdf = out.to_pandas()
    found = prepare(pdf)
    store = SliceStore(tmp_path_factory.mktemp("s") / "slice", {"slice": 3})
    try:
        policy = RecordPolicy(on_late="drop", on_decode_error="dead-letter", event_time=True)
        handler = HandlerFactory(count).make(3)
        tx = Transaction(store)
        result = run_slice(handler, tx, 3, 0, T, wm, found.events, MSGPACK, False, policy)
    finally:
        store.close()
    assert result.late_records == sum(1 for at in ats if at is not None and is_late(at, wm))
    assert len(result.dead_letters) == ats.count(None)
    assert len(result.outputs) == len(ats) - ats.count(None) - result.late_records
    assert isinstance(pdf, pd.DataFrame)
