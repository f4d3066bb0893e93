"""`bench.latency`: its pure parts (percentiles, pacing, drain rate, recovery, the
exactly-once check), its sink and the reader of what the sink wrote, and one quick run of
the whole benchmark against the emulators."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bench import latency, latency_app, latency_rig
from bench.latency_stats import (
    Output,
    RecoveryWatch,
    distribution,
    drain_rate,
    due,
    exactly_once_problems,
    latency_summary,
    median_recovery,
    percentile,
    phase_rates,
    recovery_seconds,
    window_p99s,
)

finite = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@given(st.lists(finite, min_size=1, max_size=200), st.floats(min_value=0.5, max_value=100))
def test_percentile_is_a_value_with_q_percent_at_or_below_it(values: list[float], q: float) -> None:
    p = percentile(values, q)
    assert p in values
    at_or_below = sum(1 for v in values if v <= p)
    below = sum(1 for v in values if v < p)
    assert at_or_below >= q / 100 * len(values)  # enough values at or below it
    assert below < q / 100 * len(values)  # and it is the smallest such value


def test_percentile_nearest_rank_examples() -> None:
    values = list(range(1, 101))
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100
    assert percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_latency_summary_and_distribution_in_their_units() -> None:
    assert latency_summary([0.5, 1.0, 2.0]) == {
        "records": 3,
        "p50_ms": 1000,
        "p99_ms": 2000,
        "max_ms": 2000,
    }
    assert latency_summary([]) == {"records": 0}
    d = distribution([1.0, 2.0, 3.0, 4.0])
    assert d["count"] == 4 and d["mean"] == 2.5 and d["p50"] == 2.0 and d["max"] == 4.0


@given(
    st.floats(min_value=0.1, max_value=50_000),
    st.lists(st.floats(min_value=0.0, max_value=0.5), min_size=1, max_size=100),
)
def test_pacing_keeps_the_rate_whatever_the_call_gaps(rate: float, gaps: list[float]) -> None:
    """However late the producer comes back, after each put it is exactly on schedule."""
    elapsed, sent = 0.0, 0
    for gap in gaps:
        elapsed += gap
        sent += due(rate, elapsed, sent)
        assert sent == math.floor(rate * elapsed)


@given(st.floats(min_value=1, max_value=1e6))
def test_phase_rates_are_the_shares_of_the_throughput(throughput: float) -> None:
    rates = phase_rates(throughput, latency.LOADS)
    assert rates == pytest.approx([throughput * 0.25, throughput * 0.5, throughput * 0.75])
    with pytest.raises(ValueError):
        phase_rates(0, latency.LOADS)


@given(st.lists(st.integers(min_value=1, max_value=20_000), min_size=2, max_size=20))
def test_drain_rate_counts_every_batch_after_the_first(sizes: list[int]) -> None:
    # one batch per second after a slow first one: the rate is the later batches' records/s
    deliveries = [(100.0 + i, n) for i, n in enumerate(sizes)]
    random.Random(len(sizes)).shuffle(deliveries)  # order of the file does not matter
    rate = drain_rate(deliveries)
    assert rate == pytest.approx(sum(sizes[1:]) / (len(sizes) - 1))
    assert drain_rate(deliveries[:1]) is None


def _series(fault_at: float, outage_s: float, steady_s: float, rate: float = 20.0):
    """Records put every 1/rate s after a fault: those put during the outage come out when
    it ends; afterwards each comes out `steady_s` after its put."""
    out = []
    for i in range(int(rate * 120)):
        put = fault_at + i / rate
        deliver = max(put + steady_s, fault_at + outage_s)
        out.append((deliver, deliver - put))
    return out


@given(st.floats(min_value=1.0, max_value=60.0), st.floats(min_value=0.2, max_value=1.5))
def test_recovery_ends_after_the_outage_within_a_window(outage: float, steady: float) -> None:
    samples = _series(1000.0, outage, steady)
    found = recovery_seconds(samples, 1000.0, threshold_s=2.0, window_s=5.0, step_s=0.5)
    assert found is not None
    # the first window under the bar ends after the backlog came out, at most a window and a
    # step later than the first moment its p99 can have dropped below the bar
    assert outage < found <= outage + 2.0 + 5.0 + 0.5


# deliveries over 30 s, mostly under the bar of 2 s: windows fail on a slow record or on
# too few records, and pass once more come in
samples_st = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=300).map(lambda t: t / 10),
        st.sampled_from([0.5, 0.5, 0.5, 3.0]),
    ),
    max_size=200,
)


@settings(max_examples=300)
@example(  # a late sample makes a window judged for good pass after all: it is judged again
    samples=[(1.0, 0.5), (2.0, 0.5), (20.0, 3.0), (3.0, 0.5)], cuts=[3], in_time_order=False
)
@given(samples_st, st.lists(st.integers(min_value=0, max_value=300), max_size=8), st.booleans())
def test_a_watch_asked_after_each_delivery_answers_as_the_whole_series_would(
    samples: list[tuple[float, float]], cuts: list[int], in_time_order: bool
) -> None:
    """`RecoveryWatch` skips the windows it already judged; whatever the chunks, and whether
    or not they come in time order, each answer is `recovery_seconds` of all so far."""
    if in_time_order:
        samples = sorted(samples)
    watch = RecoveryWatch(0.0, threshold_s=2.0, window_s=5.0, step_s=0.5, min_records=3)
    bounds = sorted({0, len(samples), *(c for c in cuts if c <= len(samples))})
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        watch.add(samples[lo:hi])
        so_far = samples[:hi]
        assert watch.seconds() == recovery_seconds(so_far, 0.0, 2.0, 5.0, 0.5, min_records=3)


def test_a_watch_judges_each_complete_window_once() -> None:
    """Asked twice a second for two minutes of deliveries that never recover, the watch
    judges the windows still open and the new ones, not every window since the fault:
    judging from the fault each time costs a core of a 2-core host a minute after it."""
    watch = RecoveryWatch(0.0, threshold_s=1.0, window_s=5.0, step_s=0.5)
    questions = 0
    for tick in range(240):  # deliveries every 0.05 s, a question every 0.5 s
        watch.add((tick * 0.5 + k * 0.05, 3.0) for k in range(10))
        assert watch.seconds() is None
        questions += 1
    open_windows = 5.0 / 0.5 + 2
    assert watch.judged <= questions * open_windows  # 2,880: from the fault each time, 28,000+
    assert watch.judged >= 230  # every window was judged at least once: the counter counts


def test_recovery_is_none_when_latency_never_comes_back() -> None:
    samples = _series(0.0, 500.0, 0.5)  # the outage outlasts the series
    assert recovery_seconds(samples, 0.0, threshold_s=2.0) is None
    assert recovery_seconds([], 0.0, threshold_s=2.0) is None


def test_recovery_needs_enough_records_in_a_window() -> None:
    samples = [(10.0, 0.1)]  # one fast record is no recovery when a window needs 10
    assert recovery_seconds(samples, 0.0, 1.0, window_s=5.0, min_records=10) is None
    assert recovery_seconds(samples, 0.0, 1.0, window_s=5.0, min_records=1) is not None


@given(samples_st.filter(bool))
def test_steady_windows_are_those_the_recovery_check_judges(
    samples: list[tuple[float, float]],
) -> None:
    """Each of the steady stretch's window p99s is what the recovery check would find for a
    window starting there: a stretch judged with the same windows as the recovery."""
    got = window_p99s(samples, window_s=5.0, step_s=0.5, min_records=3)
    first, last = min(t for t, _ in samples), max(t for t, _ in samples)
    starts = [first + k * 0.5 for k in range(int((last - first - 5.0) / 0.5) + 1)]
    starts = [s for s in starts if s + 5.0 <= last]
    want = []
    for start in starts:
        window = [lat for t, lat in samples if start <= t < start + 5.0]
        if len(window) >= 3:
            want.append((start, percentile(window, 99)))
    assert got == [p99 for _, p99 in want]
    # at a window's own p99 as the bar, the recovery check passes the window at once
    for start, p99 in want:
        found = recovery_seconds(samples, start, p99, 5.0, 0.5, min_records=3)
        assert found is not None and found <= 5.0 + 1e-9


def test_a_steady_stretch_has_windows_over_its_own_p99() -> None:
    """A batch a second, one in ten slower: the stretch's p99 is set by the slow batches,
    and the windows that hold one lie over it, the others under it."""
    samples = []
    for batch in range(60):
        slow = batch % 10 == 9
        for k in range(100):  # records put over the second before the batch, then its run
            samples.append((batch + 1.0, (1.0 - k / 100) + (1.6 if slow else 0.9)))
    bar = percentile([lat for _, lat in samples], 99)
    windows = window_p99s(samples, window_s=5.0, step_s=0.5)
    over = sum(w > bar for w in windows) / len(windows)
    assert 0.2 < over < 0.8, over  # the check's bar is tight, even before any fault
    assert window_p99s([], 5.0) == []
    assert window_p99s([(1.0, 0.5), (3.0, 0.5)], window_s=5.0) == []  # no complete window


def test_the_median_of_kills_counts_a_kill_never_recovered_as_the_slowest() -> None:
    assert median_recovery([29.5, None, 35.0]) == 35.0
    assert median_recovery([None, 30.0, None]) is None
    assert median_recovery([42.0]) == 42.0
    assert median_recovery([30.0, 40.0]) == 40.0  # the slower middle: it never flatters
    assert median_recovery([None, 25.0]) is None
    assert median_recovery([]) is None


@given(st.lists(st.one_of(st.none(), st.floats(min_value=0.5, max_value=180)), min_size=1))
def test_the_median_of_kills_is_one_of_them_with_half_at_or_under_it(
    figures: list[float | None],
) -> None:
    got = median_recovery(figures)
    assert got in figures
    slow = math.inf if got is None else got
    at_or_under = sum((math.inf if f is None else f) <= slow for f in figures)
    assert at_or_under >= len(figures) / 2
    assert sum((math.inf if f is None else f) >= slow for f in figures) >= len(figures) / 2


def _batch(*outs: tuple[str, int, int]) -> list[tuple[str, Output]]:
    return [(key, Output(record, 0, count)) for key, record, count in outs]


def test_exactly_once_accepts_each_record_once_with_counts_one_to_n() -> None:
    put = {0: "a", 1: "b", 2: "a"}
    batches = [_batch(("a", 0, 1), ("b", 1, 1)), _batch(("a", 2, 2))]
    assert exactly_once_problems(batches, put) == []


@pytest.mark.parametrize(
    ("batches", "found"),
    [
        ([_batch(("a", 0, 1))], "never delivered"),
        ([_batch(("a", 0, 1), ("b", 1, 1)), _batch(("a", 2, 2), ("b", 1, 1))], "two batches"),
        ([_batch(("a", 0, 1), ("b", 1, 1), ("a", 2, 1))], "counts are not"),
        ([_batch(("a", 0, 1), ("a", 1, 2), ("a", 2, 3))], "under key"),
        ([_batch(("a", 0, 1), ("b", 1, 1), ("a", 2, 2), ("c", 9, 1))], "never put"),
    ],
)
def test_exactly_once_names_each_kind_of_problem(batches, found: str) -> None:
    problems = exactly_once_problems(batches, {0: "a", 1: "b", 2: "a"})
    assert any(found in p for p in problems), problems


class _Rows:
    def __init__(self, rows: list[SimpleNamespace]) -> None:
        self.rows = rows

    def select(self, *_: str) -> _Rows:
        return self

    def collect(self) -> list[SimpleNamespace]:
        return self.rows


def test_sink_lines_read_back_once_per_batch_with_first_delivery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every output the sink is given is read back, a batch delivered twice (a re-run
    after a driver restart) counts once, and its records keep their first delivery."""
    monkeypatch.setenv(latency_app.OUT_VARIABLE, str(tmp_path))
    monkeypatch.setattr(latency_app, "_listening", [object()])  # no Spark session here
    rows = [SimpleNamespace(key=f"k{i}", value=json.dumps([i, 1000 + i, 1])) for i in range(7)]
    reader = latency_rig.Deliveries(tmp_path / latency_app.DELIVERIES)
    latency_app.deliver(_Rows(rows[:3]), SimpleNamespace(query_id="q", batch_id=0))
    reader.poll()
    latency_app.deliver(_Rows(rows[3:]), SimpleNamespace(query_id="q", batch_id=1))
    latency_app.deliver(_Rows(rows[3:]), SimpleNamespace(query_id="q", batch_id=1))
    reader.poll()
    assert reader.calls == 3
    assert len(reader.batches) == 2
    assert sorted(reader.delivered) == list(range(7))
    first_of_1 = reader.batches[("q", 1)][0]
    assert all(reader.delivered[i] == first_of_1 for i in range(3, 7))
    lat = reader.latencies({i: reader.delivered[i] - 0.25 for i in range(7)})
    assert [round(x, 6) for _, x in lat] == [0.25] * 7
    assert reader.with_records({4}) == [(first_of_1, 4)]
    assert reader.batch_ids({0, 5}) == {0, 1} and reader.batch_ids({99}) == set()


def test_a_line_being_written_waits_for_the_next_poll(tmp_path: Path) -> None:
    path = tmp_path / latency_app.DELIVERIES
    line = {"query": "q", "batch": 0, "t": 5.0, "keys": ["k"], "values": ["[0, 1, 1]"]}
    text = json.dumps(line) + "\n"
    path.write_text(text[:10])
    reader = latency_rig.Deliveries(path)
    reader.poll()
    assert reader.calls == 0
    path.write_text(text)
    reader.poll()
    assert reader.calls == 1 and reader.delivered == {0: 5.0}


class _Kinesis:
    """put_records as Kinesis answers it when every record goes in."""

    def __init__(self) -> None:
        self.calls: list[list[dict]] = []

    def put_records(self, StreamName: str, Records: list[dict]) -> dict:  # noqa: N803
        self.calls.append(Records)
        return {"FailedRecordCount": 0, "Records": [{"SequenceNumber": "1"} for _ in Records]}


def test_producer_puts_each_record_once_with_its_key_and_put_time() -> None:
    kinesis = _Kinesis()
    producer = latency_rig.Producer(kinesis, "s", keys=50, rng=random.Random(1))
    assert producer.put(1_234) == list(range(1_234))
    phase = producer.at_rate(400.0, 0.5)
    assert 150 <= len(phase["ids"]) <= 200 and phase["ids"][0] == 1_234
    assert phase["put_rate"] == pytest.approx(len(phase["ids"]) / 0.5, rel=0.2)
    put = [e for call in kinesis.calls for e in call]
    assert max(len(call) for call in kinesis.calls) == latency_rig.PUT_CHUNK
    assert len(put) == len(producer.put_keys) == len(producer.put_at) == 1_234 + len(phase["ids"])
    for entry in put:
        body = json.loads(entry["Data"])
        assert entry["PartitionKey"] == producer.put_keys[body["id"]]
        assert body["put_ms"] == round(producer.put_at[body["id"]] * 1000)


def test_producer_stops_when_asked() -> None:
    producer = latency_rig.Producer(_Kinesis(), "s", keys=5, rng=random.Random(2))
    asked: list[int] = []

    def stop(ids: list[int]) -> bool:
        asked.append(len(ids))
        return len(asked) == 2

    phase = producer.at_rate(100.0, 30.0, stop=stop)
    assert len(asked) == 2 and phase["ended"] - phase["started"] < 5


def test_group_processes_are_counted_in_the_last_batch_that_called_every_group() -> None:
    reports = [
        {"group_pids": {"0": 10, "2": 11}},
        {"group_pids": {"0": 10, "2": 10}},
        {"group_pids": {"2": 12}},  # group 0 had no records: not called
        {"group_pids": {}},
    ]
    assert latency.group_processes(reports) == 1
    assert latency.group_processes(reports[:1]) == 2
    assert latency.group_processes([{"group_pids": {}}, {}]) is None


def test_batch_seconds_are_those_of_the_batches_asked_for_last_report_wins() -> None:
    progress = [
        {"batch": 3, "input_rows": 5, "duration_ms": {"triggerExecution": 1500}},
        {"batch": 4, "input_rows": 0, "duration_ms": {"triggerExecution": 100}},
        {"batch": 5, "input_rows": 9, "duration_ms": {"triggerExecution": 9000}},
        {"batch": 5, "input_rows": 9, "duration_ms": {"triggerExecution": 2500}},  # re-run
    ]
    assert latency.batch_seconds(progress, {3, 5}) == [1.5, 2.5]
    assert latency.batch_seconds(progress, {5, 6}) == [2.5]
    assert latency.batch_seconds(progress, set()) == []


@pytest.mark.slow
def test_quick_run_reports_every_figure(tmp_path: Path) -> None:
    """The whole benchmark, short: the job drains a backlog, runs three load phases and
    loses an executor; every record put comes out exactly once. (The driver restart is
    the same recovery phase with another fault; the suite leaves its Spark start out.)"""
    # Recovery is not asserted (None is an answer), so the load after the fault only
    # needs to outlast the batches that restore the lost slices. The backlog must span two
    # batches: more than 10,000 records (maxRecordsPerShard) on each of the 2 shards.
    plan = latency.Plan(
        backlog=30_000,
        phase_s=4.0,
        settle_s=1.5,
        pre_kill_s=4.0,
        recovery_limit_s=12.0,
        kills=2,
        driver_restart=False,
    )
    from shardless.processor.local import emulators as local_aws

    aws = local_aws.start("kinesalite", log_dir=tmp_path / "local-aws")
    try:
        out = latency.run(plan, aws, tmp_path)
    finally:
        aws.stop()
    print(json.dumps(out, indent=1))  # shown when an assertion below fails
    assert out["exactly_once"], out["problems"]
    assert out["records_put"] == out["records_delivered"] > 30_000
    assert out["backlog"]["batches"] >= 2
    assert out["throughput_records_per_s"] > 0
    for pct in ("25pct", "50pct", "75pct"):
        phase = out["phases"][pct]
        assert phase["records"] > 0 and phase["undelivered"] == 0
        assert 0.8 * phase["target_rate"] <= phase["put_rate"] <= 1.05 * phase["target_rate"]
        # one PutRecords call a tick, each counted: not one per record as it was
        ticks = plan.phase_s / latency_rig.PUT_TICK_S
        assert 0.5 * ticks <= phase["put_calls"] <= ticks + 1
        assert phase["put_calls"] >= phase["records"] / latency_rig.PUT_CHUNK
        assert phase["producer_cpu_s"] > 0 and phase["emulators_cpu_s"] > 0
        assert 0 < phase["p50_ms"] <= phase["p99_ms"] <= phase["max_ms"]
        assert phase["batch_seconds"]["count"] > 0  # Spark's progress reports were heard
        assert out[f"p99_ms_at_{pct}"] == phase["p99_ms"]
    assert out["batch_seconds"]["count"] >= sum(
        out["phases"][p]["batch_seconds"]["count"] for p in out["phases"]
    )
    kill = out["executor_kill"]
    assert kill["fault"]["processes"] >= 2 and kill["fault"]["stores_removed"] > 0
    assert out["restored_slices"] > 0 and out["restored_bytes"] > 0
    assert out["recovery_s_executor_kill"] is None or out["recovery_s_executor_kill"] > 0
    # two kills, the second of a live executor (the first one's replacement or the
    # survivor), each losing slices that were restored; the figure is their median
    kills = out["executor_kills"]
    assert len(kills) == plan.kills
    assert len({k["pid"] for k in kills}) == plan.kills
    assert all(k["restored_slices"] > 0 and k["stores_removed"] > 0 for k in kills), kills
    assert out["recovery_s_executor_kills"] == [k["recovery_s"] for k in kills]
    assert out["recovery_s_executor_kill"] == median_recovery(out["recovery_s_executor_kills"])
    assert kill["pre_fault"]["windows_over_bar"] is None  # no 5 s window in 2.5 s settled
    # asked twice a second, the watch judges the windows still open and the new ones only
    questions = kill["observed_s"] / 0.5 + 2
    assert 0 < kill["windows_judged"] <= questions * (plan.window_s / 0.5 + 2), kill
    assert kill["producer_cpu_s"] > 0
    # the host's CPU after each kill, by role: every role of the job is seen, and the
    # replacement executor (started after the kill) with its JIT compiler threads
    for k in kills:
        assert k["replacement_cpu_s"] >= k["replacement_jit_s"] > 0, k
        assert 0 < k["host_busy_share"] <= 1.05, k
    used = kill["cpu_to_recovery"]
    assert used["replacement"]["executors"] == 1, used
    for role in ("driver", "executors", "executor_python", "emulators", "producer"):
        assert used["roles"][role]["cpu_s"] > 0, used
    assert used["roles"]["driver"]["jit_s"] > 0 and used["roles"]["executors"]["jit_s"] > 0
    # the readings end as the load does, not after the wait for its last deliveries
    assert used["seconds"] <= kill["observed_s"] + 1
    assert kill["cpu_timeline"][-1]["t"] <= kill["observed_s"] + 1
    times = [r["t"] for r in kill["cpu_timeline"]]
    assert times == sorted(times) and len(times) >= kill["observed_s"] / latency.CPU_EVERY_S / 2
    assert all(0 < r["host_cores"] <= 2.1 for r in kill["cpu_timeline"]), kill["cpu_timeline"]
    # the replacement compiles over several readings, each counted against the fault's
    assert sum(r["replacement_jit_cores"] > 0 for r in kill["cpu_timeline"]) >= 2
    # the groups spread over both executors again once the lost one was replaced
    assert kill["group_processes_before"] == kill["group_processes_at_end"] == 2, kill
    assert "driver_restart" not in out and "recovery_s_driver_restart" not in out
    assert out["sink_calls"] >= out["batches_delivered"]


def test_a_used_work_folder_is_refused_before_anything_starts(tmp_path, capsys) -> None:
    """An earlier run's checkpoint would be resumed and its deliveries counted again."""
    (tmp_path / "deliveries.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit) as stop:
        latency.main(["--work", str(tmp_path)])
    assert stop.value.code == 2
    assert f"--work {tmp_path}: not empty" in capsys.readouterr().err


def test_a_window_no_longer_than_the_settle_time_is_refused_before_anything_starts(
    tmp_path, capsys
) -> None:
    """`--quick --pre-kill-s 5` left the pre-fault window no outputs past its 5 s settle
    time, and the run failed minutes later on a missing percentile (KeyError 'p99_ms')."""
    with pytest.raises(SystemExit) as stop:
        latency.main(["--quick", "--pre-kill-s", "5", "--work", str(tmp_path / "w")])
    assert stop.value.code == 2
    assert "--pre-kill-s 5: must be longer than --settle-s 5" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # refused before the folder or the emulators
    with pytest.raises(ValueError, match="--phase-s 4: must be longer than --settle-s 15"):
        latency.Plan(phase_s=4.0)
    latency.Plan(phase_s=4.0, settle_s=1.5, pre_kill_s=4.0)  # the harness test's plan
