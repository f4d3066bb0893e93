"""The vs-Spark benchmark's workload and its file-fed path into shardless's group plan
(`as_records`, `FileFedRunner`), checked against a plain-Python fold of the same records."""

from __future__ import annotations

import argparse
import json
import random
import string
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from bench import chart, vs_spark, vs_spark_contenders, vs_spark_run, vs_spark_workload
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.driver.config import JobConfig
from shardless.processor.driver.job import (
    RECORD_COLUMNS,
    group_owner_for,
    group_plan,
    partitions_for,
    runtime_config,
)
from shardless.processor.runtime.routing import route, slice_column


def test_workload_files_and_expected_counts_match_a_python_fold(tmp_path: Path) -> None:
    w = vs_spark_workload.build("zipf", "zipf", 500, 2_500, 1_000, 7, tmp_path)
    assert w.sizes == [1_000, 1_000, 500]
    folded: Counter[str] = Counter()
    seqs: list[int] = []
    for b, path in enumerate(w.files):
        table = pq.read_table(path).to_pydict()
        folded.update(table["partition_key"])
        seqs += table["sequence_number"]
        assert w.distinct[b] == len(set(table["partition_key"]))
        assert w.totals[b] == sum(folded[k] for k in set(table["partition_key"]))
    assert seqs == list(range(2_500))  # files in batch order, records in stream order
    assert {f"user-{i}": int(n) for i, n in enumerate(w.counts) if n} == dict(folded)
    assert folded.most_common(1)[0][0] == "user-0"  # Zipf: rank 1 is the hottest key


@pytest.mark.slow
def test_slice_column_routes_exactly_as_the_kinesis_source(spark) -> None:
    rng = random.Random(3)
    keys = [f"user-{i}" for i in range(300)] + ["", "é", "日本語", "a\x00b", "🎉"]
    keys += ["".join(rng.choices(string.printable, k=rng.randint(1, 30))) for _ in range(300)]
    df = spark.createDataFrame([(k,) for k in keys], "partition_key string")
    for n in (1, 7, 16, 256, 1000, 65536):
        got = [r[0] for r in df.select(slice_column("partition_key", n)).collect()]
        assert got == [route(k, None, n) for k in keys], n


def emit_count(event, ctx) -> None:
    n = ctx.state.get(0) + 1
    ctx.state.set(n)
    ctx.emit(n)


@pytest.mark.slow
def test_file_fed_outputs_count_each_key_in_stream_order(spark, location, tmp_path) -> None:
    w = vs_spark_workload.build("small", "uniform", 40, 900, 300, 1, tmp_path / "data")
    src = (
        spark.readStream.schema(vs_spark_workload.SOURCE_SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .parquet(str(w.root / "all"))
    )
    groups = int(spark.conf.get("spark.sql.shuffle.partitions"))
    cfg = JobConfig(app=location.app, streams=("files",), checkpoint="", slices=16,
                    groups=groups, local_dir=str(tmp_path / "stores"))  # fmt: skip
    partitions, _ = partitions_for(spark, cfg)
    owner = group_owner_for(spark, cfg).owner
    runner = vs_spark_contenders.FileFedRunner(
        HandlerFactory(emit_count), runtime_config(cfg, partitions, owner)
    )
    records = vs_spark_contenders.as_records(src, 16)
    columns = tuple(c for c in RECORD_COLUMNS if c in records.columns)
    df = group_plan(records, cfg, partitions, runner, columns)
    seen: dict[int, list[tuple[str, int]]] = {}

    def collect(batch, batch_id: int) -> None:
        rows = batch.where("kind = 'out'").orderBy("slice", "seq").collect()
        seen[batch_id] = [(r.key, json.loads(r.value)) for r in rows]

    # as `job.start` does for availableNow: no batches without data, or the timers' timeout
    # keeps the query running
    spark.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    query = (
        df.writeStream.outputMode("update")
        .option("checkpointLocation", str(tmp_path / "ck"))
        .foreachBatch(collect)
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(300), "the query did not finish"
    assert sorted(seen) == [0, 1, 2]
    per_key: dict[str, list[int]] = {}
    for b in sorted(seen):
        for key, n in seen[b]:
            per_key.setdefault(key, []).append(n)
    # one output per record, each key counting 1, 2, 3, ... across batches
    assert sum(len(ns) for ns in per_key.values()) == 900
    assert all(ns == list(range(1, len(ns) + 1)) for ns in per_key.values())
    assert {k: len(ns) for k, ns in per_key.items()} == {
        f"user-{i}": int(n) for i, n in enumerate(w.counts) if n
    }


@pytest.mark.slow
def test_harness_runs_and_checks_spark_sql_and_shardless(spark, aws, tmp_path) -> None:
    w = vs_spark_workload.build("tiny", "uniform", 50, 600, 200, 2, tmp_path / "data")
    spark.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    moto = aws.pids[0]
    # shardless: 256 slices, as benchmarked; the floor: its plan with a no-op function
    contenders = ("spark_sql_count", "shardless", "shardless_worker_stores", "python_floor")
    for contender in (*contenders, "rocksdb_floor", "handler_floor"):
        summary = vs_spark_run.run(contender, spark, w, 3, tmp_path, moto).summary()
        assert summary["errors"] == [], contender
        assert summary["measured_records"] == 400 and summary["warmup_records"] == 200
        assert summary["records_per_s"] > 0
        if contender == "shardless":  # one owner process per group, the same every batch
            pids = [sorted(b["pids"]) for b in summary["groups"]]
            groups = int(spark.conf.get("spark.sql.shuffle.partitions"))
            assert len(set(pids[0])) == groups and pids == [pids[0]] * 3


def test_the_floor_runner_counts_its_input_and_keeps_no_state() -> None:
    import pandas as pd

    from shardless.processor.runtime.group_runner import _COLUMNS

    frames = [pd.DataFrame({"partition_key": ["a", "b"]}), pd.DataFrame({"partition_key": ["c"]})]
    (out,) = vs_spark_contenders.FloorRunner(None, None)(("g",), iter(frames), None)
    assert list(out.columns) == _COLUMNS and list(out.kind) == ["metrics"]
    metrics = json.loads(out.value[0])
    assert metrics["records"] == 3 and metrics["floor"] is True
    assert metrics["called_at"] > 0 and metrics["seconds"] >= 0  # the floor's timeline


def test_a_groups_return_in_the_timeline_counts_its_input_and_the_trip_to_its_owner() -> None:
    from datetime import UTC, datetime

    start = datetime(2026, 11, 25, tzinfo=UTC)
    t0 = start.timestamp()
    run = vs_spark_run.Run("shardless", records=[100], seconds=[1.0], started=[start])
    run.groups.append(
        {
            "called_at": [t0 + 0.2, t0 + 0.25],
            "group_s": [0.3, 0.28],
            # the group's run began after the worker read its input and the owner got it
            "timings": [{"input": 0.02, "owner_request": 0.03}, {"input": 0.01}],
        }
    )
    floor = vs_spark_run.Run("python_floor", records=[100, 100], seconds=[0.5, 0.5])
    floor.started = [start, start]
    floor.groups.append({"called_at": [t0 + 0.2], "group_s": [0.1]})  # from its call on
    # a group without a call time is left out, not paired with another group's seconds
    floor.groups.append({"called_at": [None, t0 + 0.1], "group_s": [0.4, 0.05]})
    (line,) = run.timeline()
    assert line == {"first_call_s": 0.2, "last_return_s": 0.55, "trigger_s": 1.0}
    assert [x["last_return_s"] for x in floor.timeline()] == [0.3, 0.15]


@pytest.mark.slow
def test_every_contender_warms_the_session_up_unmeasured_before_the_first_run(
    spark,
    aws,
    tmp_path,
) -> None:
    spark.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    args = argparse.Namespace(
        warmup_batches=2,
        batch=300,
        seed=5,
        slices=vs_spark_contenders.SLICES,
        group_owner="process",
    )
    contenders = ["spark_sql_count", "shardless", "python_floor"]
    warm = vs_spark.warm_up(spark, args, contenders, tmp_path, aws.pids[0])
    assert list(warm) == contenders  # each ran, in order, over its own workload, checked
    for contender, summary in warm.items():
        assert summary["errors"] == [], contender
        assert len(summary["batch_s"]) == 2
    assert not (tmp_path / "warm-up").exists()  # its files are gone
    assert (
        vs_spark.warm_up(spark, argparse.Namespace(warmup_batches=0), contenders, tmp_path, 0) == {}
    )


def test_goals_are_judged_for_the_default_and_the_few_slices_contender() -> None:
    rates = {
        "shardless": 80_000,
        "shardless_few_slices": 120_000,
        "apply_in_pandas_with_state": 12_000,
        "transform_with_state_in_pandas": 6_000,
        "spark_sql_count": 100_000,
        "python_floor": 160_000,
    }
    goals = vs_spark.goals({"zipf_1m": rates, "uniform_1m": rates, "small_1k": rates})
    assert goals["zipf_1m_vs_faster_pandas"] == {"target": 12.0, "value": 6.67, "met": False}
    assert goals["uniform_1m_vs_faster_pandas"]["target"] == 10.0  # Zipf's bar is higher
    assert goals["zipf_1m_vs_python_floor"] == {"target": 0.75, "value": 0.5, "met": False}
    assert goals["uniform_1m_vs_python_floor_few_slices"] == {
        "target": 0.75,
        "value": 0.75,
        "met": True,
    }
    assert goals["zipf_1m_vs_spark_sql_count"] == {"target": 1.0, "value": 0.8, "met": False}
    assert goals["zipf_1m_vs_faster_pandas_few_slices"]["met"] is False  # 10.0 < 12
    assert goals["zipf_1m_vs_spark_sql_count_few_slices"] == {
        "target": 1.0,
        "value": 1.2,
        "met": True,
    }
    assert not any(k.startswith("small_1k") for k in goals)  # goals are for 1M keys only
    args = argparse.Namespace(slices=256, few_slices=32)
    assert [vs_spark.slices_of(c, args) for c in vs_spark_contenders.SHARDLESS] == [
        256,
        256,
        32,
        256,
        256,
    ]


def test_measure_warms_every_contender_up_before_any_measured_run(monkeypatch, tmp_path) -> None:
    """The order only (the runs themselves are checked above): no contender is measured
    before every contender has had its warm-up batches in the session."""
    calls: list[tuple[str, str, int]] = []

    def fake_run(contender, spark, w, batches, *rest):
        calls.append((w.name, contender, batches))
        r = vs_spark_run.Run(contender)
        r.records, r.seconds = [w.sizes[0]] * batches, [1.0] * batches
        return r

    without_spark(monkeypatch, fake_run, calls)
    args = measure_args(records=600, warmup_batches=2)
    contenders = ["shardless", "spark_sql_count"]
    _, runs = vs_spark.measure("local[2]", args, contenders, ["small_1k"], tmp_path, None)
    assert calls == [
        ("warm_up", "shardless", 2),
        ("warm_up", "spark_sql_count", 2),
        ("small_1k", "shardless", 2),
        ("small_1k", "spark_sql_count", 2),
        ("session", "stopped", 0),
    ]
    assert set(runs["warm_up"]) == set(contenders)


def test_also_batch_reruns_everything_in_the_other_batch_size_and_judges_its_goals(
    monkeypatch, tmp_path
) -> None:
    """The rerun measures every contender and workload again in batches of --also-batch
    records, leaves the first run's arguments alone, and judges the goals on its own rates."""
    calls: list[tuple[str, str, int, int]] = []

    def fake_run(contender, spark, w, batches, *rest):
        calls.append((w.name, contender, batches, w.sizes[0]))
        r = vs_spark_run.Run(contender)
        rate = {"shardless": 110_000, "apply_in_pandas_with_state": 10_000}.get(contender, 1)
        r.records, r.seconds = [w.sizes[0]] * batches, [w.sizes[0] / rate] * batches
        return r

    without_spark(monkeypatch, fake_run)
    args = argparse.Namespace(
        records=1_200, batch=200, also_batch=400, slow_batches=2, warmup_batches=0, seed=1,
        groups=2, slices=256, few_slices=32, group_owner="process", master="local[2]",
        rounds=1,
    )  # fmt: skip
    contenders = ["shardless", "apply_in_pandas_with_state"]
    again = vs_spark.also_batch(args, contenders, ["zipf_1m"], tmp_path, None)
    assert calls == [
        ("zipf_1m", "shardless", 3, 400),  # 1,200 records in batches of 400
        ("zipf_1m", "apply_in_pandas_with_state", 2, 400),  # --slow-batches on 1M keys
    ]
    assert args.batch == 200  # the first run's batch size is left alone
    assert (again["batch_records"], again["batches"]) == (400, 3)
    assert again["workloads"]["zipf_1m"]["shardless"] == 110_000
    assert again["goals"]["zipf_1m_vs_faster_pandas"] == {
        "target": 12.0,
        "value": 11.0,
        "met": False,
    }


def test_the_chart_draws_a_panel_per_batch_size() -> None:
    result = {
        "config": {"batch_records": 100_000, "master": "local[2]"},
        "workloads": {"zipf_1m": {"shardless": 1.0, "spark_sql_count": 2.0}},
        "also": {"master": "local-cluster", "workloads": {"zipf_1m": {"shardless": 0.5}}},
        "also_batch": {"batch_records": 200_000, "workloads": {"zipf_1m": {"shardless": 3.0}}},
    }
    (first, first_run, with_also), (second, second_run, second_also) = chart.panels(result)
    assert (first, with_also, first_run["workloads"]) == (100_000, True, result["workloads"])
    assert (second, second_also) == (200_000, False)
    assert second_run["workloads"] == {"zipf_1m": {"shardless": 3.0}}
    assert [c for c, _, _ in chart.bars(second_run)][:1] == ["shardless"]
    del result["also_batch"]
    assert len(chart.panels(result)) == 1


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--also-batch", "-3"], "--also-batch must be a number of records, or 0 for none, not -3"),
        (["--batch", "0"], "--batch must be a positive number of records, not 0"),
        (["--records", "-1"], "--records must be a positive number of records, not -1"),
        (["--rounds", "0"], "--rounds must be 1 or more, not 0"),
    ],
)
def test_batch_sizes_that_are_not_record_counts_are_refused_before_anything_starts(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        vs_spark.main(argv)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


def test_hand_overs_count_each_group_that_ran_in_another_process_than_before() -> None:
    batches = [
        {"group_ids": [0, 1], "pids": [10, 11]},
        {"group_ids": [1, 0], "pids": [10, 11]},  # both moved
        {"group_ids": [0, 1], "pids": [11, 10]},  # stayed (rows in another order)
        {"group_ids": [0, 1], "pids": [11, 12]},  # group 1 to a new worker
    ]
    assert vs_spark_run.handovers(batches) == 3
    assert vs_spark_run.handovers(batches[2:3]) == 0


def test_the_rocksdb_floor_keeps_each_keys_count_in_its_slices_store(tmp_path: Path) -> None:
    import pandas as pd

    config = argparse.Namespace(local_dir=tmp_path, slices=8)
    runner = vs_spark_contenders.RocksdbFloorRunner(None, config)
    batches = [
        [pd.DataFrame({"slice": [3, 3, 5], "partition_key": ["a", "a", "b"]})],
        [
            pd.DataFrame({"slice": [3], "partition_key": ["a"]}),
            pd.DataFrame({"slice": [1, 5], "partition_key": ["c", "b"]}),
        ],
    ]
    seen = []
    for frames in batches:
        (out,) = runner(("g",), iter(frames), None)
        seen.append(json.loads(out.value[0]))
    assert [m["records"] for m in seen] == [3, 3] and all(m["floor"] for m in seen)
    assert vs_spark_contenders.stored_counts(str(tmp_path), 8) == {"a": 3, "b": 2, "c": 1}
    stores = vs_spark_contenders.floor_stores(str(tmp_path), 8)
    # each key in its slice's store, and every slice's store opened at the first call
    assert sorted(bytes(k) for k, _ in stores[3].items()) == [b"a"]
    assert sorted(bytes(k) for k, _ in stores[1].items()) == [b"c"]
    assert len(list(tmp_path.glob("rocksdb-floor-p*/s*"))) == 8


def test_the_handler_floor_calls_the_handler_per_record_and_keeps_counts_of_its_own(
    monkeypatch, tmp_path: Path
) -> None:
    """The handler floor folds each record through the contender's handler, in the group's
    order within each slice, into stores of its own: the RocksDB floor's stay untouched."""
    import pandas as pd

    calls: list[str] = []
    real = vs_spark_contenders.counter

    def counting(event, ctx):  # noqa: ANN001, ANN202
        calls.append(event)
        real(event, ctx)

    monkeypatch.setattr(vs_spark_contenders, "counter", counting)
    config = argparse.Namespace(local_dir=tmp_path, slices=8)
    runner = vs_spark_contenders.HandlerFloorRunner(None, config)
    batches = [
        [pd.DataFrame({"slice": [5, 3, 3], "partition_key": ["b", "a", "x"]})],
        [
            pd.DataFrame({"slice": [3], "partition_key": ["a"]}),
            pd.DataFrame({"slice": [], "partition_key": []}),
            pd.DataFrame({"slice": [1, 5, 3], "partition_key": ["c", "b", "a"]}),
        ],
        [],
    ]
    # long enough that an unstable sort by slice would reorder a slice's records
    interleaved = [f"o{i:02d}" for i in range(48)]
    batches.append([pd.DataFrame({"slice": [7, 2, 5] * 16, "partition_key": interleaved})])
    seen = []
    for frames in batches:
        (out,) = runner(("g",), iter(frames), None)
        seen.append(json.loads(out.value[0]))
    assert [m["records"] for m in seen] == [3, 4, 0, 48] and all(m["floor"] for m in seen)
    # slice by slice, each slice's records in the order the group got them
    assert calls[:7] == ["a", "x", "b", "c", "a", "a", "b"]
    assert calls[7:] == [interleaved[i] for first in (1, 2, 0) for i in range(first, 48, 3)]
    kind = vs_spark_contenders.HandlerFloorRunner.stores
    counts = vs_spark_contenders.stored_counts(str(tmp_path), 8, kind)
    assert counts == {"a": 3, "b": 2, "c": 1, "x": 1, **dict.fromkeys(interleaved, 1)}
    assert vs_spark_contenders.stored_counts(str(tmp_path), 8) == {}
    assert len(list(tmp_path.glob(f"{kind}-p*/s*"))) == 8


def test_rounds_take_turns_and_report_each_contenders_median_run(monkeypatch, tmp_path) -> None:
    """With --rounds the contenders take turns on a workload, so that a slow stretch of the
    host falls on each of them, and each one's rate is its median run's."""
    calls: list[tuple[str, str]] = []
    rates = iter([100, 200, 300, 150, 50, 180])  # shardless, floor, shardless, floor, ...

    def fake_run(contender, spark, w, batches, *rest):
        calls.append((w.name, contender))
        r = vs_spark_run.Run(contender)
        rate = next(rates)
        r.records, r.seconds = [w.sizes[0]] + [rate] * 2, [1.0, 1.0, 1.0]
        return r

    without_spark(monkeypatch, fake_run)
    args = measure_args(records=900, rounds=3)
    contenders = ["shardless", "python_floor"]
    rates_by, runs = vs_spark.measure("local[2]", args, contenders, ["small_1k"], tmp_path, None)
    assert calls == [("small_1k", c) for c in contenders] * 3
    assert runs["small_1k"]["rounds"] == {
        "shardless": [100, 300, 50],
        "python_floor": [200, 150, 180],
    }
    assert rates_by["small_1k"] == {"shardless": 100, "python_floor": 180}
    assert runs["small_1k"]["shardless"]["records_per_s"] == 100  # the median run itself
    assert runs["small_1k"]["ratios"]["shardless_vs_python_floor"] == 0.56
    # two rounds: the lower of the middle two; a run without a rate counts as the slowest
    found = [{"records_per_s": 10}, {"records_per_s": None}, {"records_per_s": 30}]
    assert vs_spark.median_run(found)["records_per_s"] == 10
    assert vs_spark.median_run(found[:1] + found[2:])["records_per_s"] == 10


def measure_args(**given: Any) -> argparse.Namespace:
    """`vs_spark.measure`'s arguments for a small run: batches of 300 records, one slow batch,
    no warm-up and one round unless `given` says otherwise."""
    defaults = dict(
        records=600, batch=300, slow_batches=1, warmup_batches=0, seed=1, groups=2,
        slices=256, few_slices=32, group_owner="process", rounds=1,
    )  # fmt: skip
    return argparse.Namespace(**{**defaults, **given})


def without_spark(
    monkeypatch: pytest.MonkeyPatch, fake_run: Any, calls: list | None = None
) -> None:
    """`vs_spark.measure` with `fake_run` for its runs and a session that only records its
    stop in `calls`."""

    class Session:
        def stop(self) -> None:
            if calls is not None:
                calls.append(("session", "stopped", 0))

    monkeypatch.setattr(vs_spark, "run", fake_run)
    monkeypatch.setattr(vs_spark, "spark_session", lambda master, groups: Session())


def test_the_contenders_reach_a_process_without_bench_on_its_path(tmp_path) -> None:
    """Spark's workers and the owner processes unpickle the contenders' runners; they run
    where `bench` cannot be imported, so the runners must travel by value."""
    import subprocess
    import sys

    from pyspark import cloudpickle

    cfg = JobConfig(app="bench-pickle", streams=("bench",), checkpoint="", slices=8, groups=1)
    blob = cloudpickle.dumps(
        [
            vs_spark_contenders.FileFedRunner(HandlerFactory(vs_spark_contenders.counter), cfg),
            vs_spark_contenders.RocksdbFloorRunner(None, cfg),
            vs_spark_contenders.HandlerFloorRunner(None, cfg),
        ]
    )
    (tmp_path / "blob").write_bytes(blob)
    script = (
        "import pickle, sys; r = pickle.loads(open('blob', 'rb').read()); "
        "assert 'bench' not in sys.modules, 'bench was imported'; "
        "print(*(type(x).__name__ for x in r))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["FileFedRunner", "RocksdbFloorRunner", "HandlerFloorRunner"]
