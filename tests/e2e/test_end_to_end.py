"""The whole path on real Spark and emulated AWS over HTTP: Kinesis → slices → handler →
S3/DynamoDB → outputs, compared with a plain-Python fold of the stream."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from shardless.processor.api.app import load_handler
from shardless.processor.driver.config import JobConfig
from shardless.processor.driver.job import BatchReport, parquet_sink, prepare, start
from shardless.processor.errors import ConfigError
from shardless.processor.local import demo
from tests.jobs import job_config

pytestmark = pytest.mark.slow
APP = Path(__file__).resolve().parents[2] / "examples" / "user_activity.py"


def produce(kinesis, stream: str, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, 201) ** 1.1
    users = rng.choice(200, size=n, p=weights / weights.sum())
    records = [
        {
            "PartitionKey": f"user-{u}",
            "Data": json.dumps({"user": f"user-{u}", "ts": int(rng.integers(0, 10**6))}).encode(),
        }
        for u in users
    ]
    for lo in range(0, n, 500):
        out = kinesis.put_records(StreamName=stream, Records=records[lo : lo + 500])
        assert out["FailedRecordCount"] == 0


def run_job(spark, cfg: JobConfig, out_dir: str, wipe_after: set[int]) -> list[BatchReport]:
    reports: list[BatchReport] = []

    def on_report(report: BatchReport) -> None:
        reports.append(report)
        if report.batch_id in wipe_after:
            demo.wipe(Path(cfg.local_dir), cfg.app, list(range(0, cfg.slices, 3)))

    query = start(
        spark,
        load_handler(APP),
        cfg,
        sink=parquet_sink(out_dir),
        on_report=on_report,
        available_now=True,
    )
    query.awaitTermination()
    return reports


def test_job_equals_reference_fold_across_restores_and_a_restart(
    spark, kinesis, make_stream, location, tmp_path
):
    stream = make_stream(2)
    cfg = job_config(location, (stream,), tmp_path, max_records_per_shard=400)
    out_dir = str(tmp_path / "out")
    produce(kinesis, stream, 2000, seed=1)
    first = run_job(spark, cfg, out_dir, wipe_after={0, 1})
    assert len([r for r in first if r.records]) >= 3
    restored = [r for rep in first for r in rep.restores if r["from_version"] == 0]
    assert restored, "wiped slices were not rebuilt from S3"

    produce(kinesis, stream, 700, seed=2)
    shutil.rmtree(tmp_path / "stores")  # a new cluster: no local state at all
    second = run_job(spark, cfg, out_dir, wipe_after=set())

    expected, total = demo.reference_fold(kinesis, stream)
    assert total == 2700
    assert sum(r.records for r in first + second) == total
    assert demo.check_outputs(spark, out_dir, expected) == []
    rebuilt, _ = demo.durable_state(cfg, tmp_path / "verify")
    assert rebuilt == expected


def test_missing_stream_fails_fast_naming_it(location, tmp_path, aws):
    cfg = JobConfig(
        app=location.app, streams=("no-such-stream",), checkpoint=str(tmp_path), slices=16
    )
    with pytest.raises(ConfigError, match="'no-such-stream' does not exist"):
        prepare(cfg)


def test_wrong_slice_count_for_existing_state_fails_fast(location, tmp_path, make_stream):
    cfg = JobConfig(
        app=location.app, streams=(make_stream(1),), checkpoint=str(tmp_path), slices=64
    )
    with pytest.raises(ConfigError, match="16 slices, but the job is configured with 64"):
        prepare(cfg)


def test_unreachable_kinesis_fails_fast_with_what_to_fix(location, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_KINESIS", "http://127.0.0.1:9")
    cfg = JobConfig(app=location.app, streams=("x",), checkpoint=str(tmp_path), slices=16)
    with pytest.raises(ConfigError, match="cannot reach Kinesis.*AWS_ENDPOINT_URL_KINESIS"):
        prepare(cfg)


def test_timers_fire_in_slices_that_receive_no_more_records(
    spark, kinesis, make_stream, location, tmp_path
):
    """A continuous query: Spark's processing-time timeout calls idle groups, so a timer
    set by a record fires in a later batch that holds no records at all."""
    from shardless.processor.api.handlers import HandlerFactory

    def process(event, ctx):
        ctx.timers.set(ctx.now_ms + 1500)

    def on_timer(timer, ctx):
        ctx.emit({"fired": timer.key})

    stream = make_stream(1)
    keys = [f"k{i}" for i in range(6)]
    kinesis.put_records(
        StreamName=stream, Records=[{"PartitionKey": k, "Data": b"{}"} for k in keys]
    )
    cfg = job_config(location, (stream,), tmp_path, checkpoint="ck")
    fired: list[str] = []
    reports: list[BatchReport] = []

    def sink(df, batch_id):
        fired.extend(json.loads(r.value)["fired"] for r in df.collect())

    query = start(
        spark,
        HandlerFactory(process, on_timer=on_timer),
        cfg,
        sink=sink,
        on_report=reports.append,
        processing_time="500 milliseconds",
    )
    try:
        deadline = time.monotonic() + 90
        # until every output has been sunk and also reported: a batch's report comes after
        # its sink, so stopping on the sink alone could cut the last report off
        while (
            (sorted(fired) != keys or sum(r.outputs for r in reports) < len(keys))
            and time.monotonic() < deadline
            and query.isActive
        ):
            time.sleep(0.5)
    finally:
        query.stop()
    assert sorted(fired) == keys
    firing = [r for r in reports if r.outputs]
    assert firing and all(r.records == 0 for r in firing)


def test_cli_run_reports_a_failing_handler_in_one_line(
    spark, kinesis, make_stream, location, tmp_path, capsys
):
    from shardless.processor import cli

    stream = make_stream(1)
    kinesis.put_record(StreamName=stream, PartitionKey="k", Data=b"{}")
    app = tmp_path / "bad.py"
    app.write_text("def process(event, ctx):\n    raise ValueError('boom')\n")
    code = cli.main(
        [
            "run",
            str(app),
            "--app",
            location.app,
            "--stream",
            stream,
            "--slices",
            "16",
            "--groups",
            "4",
            "--available-now",
            "--checkpoint",
            str(tmp_path / "ck"),
            "--local-dir",
            str(tmp_path / "st"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("shardless: handler failed on record ")
    assert "(key 'k', slice" in err[-1] and "ValueError: boom; --on-handler-error" in err[-1]


def test_restores_through_the_transfer_process_inside_spark_workers(
    spark, kinesis, make_stream, location, tmp_path
):
    """With `transfer_process_mb=0` every restore that fetches objects hands them to the
    helper process, started by Spark's own Python workers (which import shardless from
    their sys.path): a new cluster rebuilds its slices from snapshots that way, and the
    outputs still equal the plain fold."""
    stream = make_stream(2)
    cfg = job_config(
        location,
        (stream,),
        tmp_path,
        max_records_per_shard=300,
        snapshot_every=2,
        transfer_process_mb=0,
    )
    out_dir = str(tmp_path / "out")
    produce(kinesis, stream, 1200, seed=3)
    first = run_job(spark, cfg, out_dir, wipe_after=set())
    produce(kinesis, stream, 400, seed=4)
    shutil.rmtree(tmp_path / "stores")  # a new cluster: every slice restores
    second = run_job(spark, cfg, out_dir, wipe_after=set())

    restores = [r for rep in second for r in rep.restores]
    from_snapshots = [r for r in restores if r["snapshot_version"]]
    assert from_snapshots, "no slice restored from a snapshot"
    # the workers started their helpers in the first run: these SST files came through them
    assert any(r["transfer_process"] for r in from_snapshots)
    expected, total = demo.reference_fold(kinesis, stream)
    assert sum(r.records for r in first + second) == total == 1600
    assert demo.check_outputs(spark, out_dir, expected) == []
