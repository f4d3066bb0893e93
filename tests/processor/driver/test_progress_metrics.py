"""shardless's per-batch figures where Spark users look: in each batch's
`StreamingQueryProgress.observedMetrics` (what the Spark UI and listeners read), equal to
what the batch did, counted from the stream, the durable state, the dead letters and the
source's batch log; and the same figures at the optional Prometheus endpoint, scraped over
HTTP (real Spark, emulated AWS)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pyarrow.parquet as pq
import pytest

from shardless.changelog.durable import DurableState
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.driver import prometheus, recorder
from shardless.processor.driver.job import BatchReport, parquet_sink, start
from shardless.processor.driver.metrics import FIGURES, figures
from shardless.processor.kinesis.batch_log import BatchLog
from shardless.state.slices import key_hash, slice_of
from tests.jobs import capture_cli_starts, job_config

SLICES = 16


class Counting:
    """Counts records per key; a record with `boom` raises, one with `timer` sets a
    processing timer due at once, which emits when it fires."""

    def process(self, event, ctx) -> None:  # noqa: ANN001
        value = event.json()
        if value.get("boom"):
            raise ValueError("a poison record")
        ctx.state.set(ctx.state.get(0) + 1)
        ctx.emit(value["n"])
        if value.get("timer"):
            ctx.timers.set(ctx.now_ms)

    def on_timer(self, timer, ctx) -> None:  # noqa: ANN001
        ctx.emit("timer")


def payloads(n: int, first: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """(key, value): keys over 23 users; i % 41 == 7 raises; i % 50 == 4 sets a timer on a
    key of its own (so each fires once)."""
    out = []
    for i in range(first, first + n):
        if i % 50 == 4:
            out.append((f"timer-{i}", {"n": i, "timer": True}))
        else:
            out.append((f"user-{i % 23}", {"n": i, "boom": i % 41 == 7}))
    return out


def put(kinesis, stream: str, records: list[tuple[str, dict[str, Any]]]) -> None:  # noqa: ANN001
    for lo in range(0, len(records), 250):
        chunk = [
            {"PartitionKey": k, "Data": json.dumps(v).encode()} for k, v in records[lo : lo + 250]
        ]
        assert kinesis.put_records(StreamName=stream, Records=chunk)["FailedRecordCount"] == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """The endpoint's samples, `name{labels}` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        assert answer.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = answer.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


@pytest.fixture
def endpoints() -> Iterator[None]:
    yield
    prometheus.stop_all()


def run(spark, cfg, tmp_path: Path, reports: list[BatchReport]) -> list[dict[str, Any]]:  # noqa: ANN001
    """Run the job over what the stream holds; each batch's progress, as JSON."""
    query = start(
        spark,
        HandlerFactory(Counting),
        cfg,
        sink=parquet_sink(str(tmp_path / "out")),
        on_report=reports.append,
        available_now=True,
    )
    query.awaitTermination()
    return [json.loads(p.json) for p in query.recentProgress]


def lag_in_batch_log(spark, cfg, batch_id: int) -> dict[str, int]:  # noqa: ANN001
    """MillisBehindLatest of each shard that gave records in the batch, as its read
    recorded it in the source's batch log."""
    offset = recorder.checkpoint_offset(spark, cfg.checkpoint, batch_id)
    ends = BatchLog(cfg.location.table).ends(offset["run"], int(offset["n"]))
    return {k: e["behind_ms"] for k, e in ends.items() if e["user_records"]}


@pytest.mark.slow
def test_each_batch_s_progress_holds_what_it_did_and_prometheus_serves_it(
    spark, kinesis, make_stream, location, tmp_path, endpoints
):
    stream = make_stream(2)
    sent = payloads(300)
    put(kinesis, stream, sent)
    port = free_port()
    cfg = job_config(
        location, (stream,), tmp_path, slices=SLICES, max_records_per_shard=100,
        on_handler_error="dead-letter", handler_retries=1, snapshot_every=2,
        metrics_port=port, metrics_host="127.0.0.1",
    )  # fmt: skip
    reports: list[BatchReport] = []
    progress = run(spark, cfg, tmp_path, reports)

    batches = [(p["batchId"], figures(p["observedMetrics"])) for p in progress]
    assert [b for b, _ in batches] == [r.batch_id for r in reports]
    assert all(f for _, f in batches), "every batch's progress has shardless's figures"
    total = {name: sum(f[name] for _, f in batches) for name in FIGURES}

    # What the batches did, counted from outside the job.
    booms = sum(1 for _, v in sent if v.get("boom"))
    timers = sum(1 for _, v in sent if v.get("timer"))
    assert total["records"] == len(sent) == 300
    assert total["dead_letters"] == booms == 8
    assert total["handler_retries"] == booms  # each raised once more before it was set aside
    assert total["timers_fired"] == timers == 6
    written = pq.read_table(tmp_path / "out").num_rows
    assert total["outputs"] == written == len(sent) - booms + timers
    heads = DurableState(cfg.location).heads(list(range(SLICES)))
    assert total["committed_slices"] == sum(h.version for h in heads.values() if h) > 0
    s3 = boto3.client("s3")  # the dead letters themselves, one line each
    listed = s3.list_objects_v2(
        Bucket=location.bucket, Prefix=f"{location.prefix}/dead-letter/"
    ).get("Contents", [])
    lines = sum(
        len(s3.get_object(Bucket=location.bucket, Key=o["Key"])["Body"].read().splitlines())
        for o in listed
    )
    assert lines == booms

    # Batch by batch: the same as the driver's own report of the batch's metrics rows.
    for (batch_id, f), report in zip(batches, reports, strict=True):
        assert f["records"] == report.records
        assert f["committed_slices"] == report.committed_slices
        assert f["segment_bytes"] == report.segment_bytes
        assert f["snapshots"] == report.snapshots
        assert f["snapshot_bytes"] == report.snapshot_bytes
        assert f["groups"] == len(report.group_pids)
        assert f["restores"] == len(report.restored)
        assert f["millis_behind_latest"] == lag_in_batch_log(spark, cfg, batch_id)
        # the log line names where the slowest group's time went, longest first
        phases = list(report.slowest_phases.values())
        assert 0 < len(phases) <= 3 and phases == sorted(phases, reverse=True), report
    assert total["segment_bytes"] > 0 and total["snapshots"] > 0 and total["snapshot_bytes"] > 0
    assert sum(len(f["millis_behind_latest"]) for _, f in batches) >= 2  # both shards gave

    # The Prometheus endpoint: the totals, and the latest batch (listeners run a bit later).
    app = f'{{app="{location.app}"}}'
    deadline = time.monotonic() + 60
    while (got := scrape(port)).get(f"shardless_batches_total{app}") != len(batches):
        assert time.monotonic() < deadline, got
        time.sleep(0.5)
    for name, (stem, _) in prometheus._FIGURES.items():
        assert got[f"shardless_{stem}_total{app}"] == pytest.approx(total[name]), name
        assert got[f"shardless_batch_{stem}{app}"] == pytest.approx(batches[-1][1][name]), name
    assert got[f"shardless_records_total{app}"] == 300
    assert got[f"shardless_dead_letters_total{app}"] == 8
    assert got[f"shardless_batch_id{app}"] == batches[-1][0]
    lag = {k: v for k, v in got.items() if k.startswith("shardless_shard_millis_behind_latest{")}
    assert lag == {
        f'shardless_shard_millis_behind_latest{{app="{location.app}",stream="{stream}",'
        f'shard="{key.split("/")[1]}"}}': ms
        for key, ms in batches[-1][1]["millis_behind_latest"].items()
    }


def split(kinesis, stream: str) -> None:  # noqa: ANN001
    kinesis.split_shard(
        StreamName=stream, ShardToSplit="shardId-000000000000", NewStartingHashKey=str(2**127)
    )
    for _ in range(200):
        summary = kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]
        if summary["StreamStatus"] == "ACTIVE":
            return
        time.sleep(0.05)
    raise TimeoutError(f"stream {stream} not ACTIVE after the split")


@pytest.mark.slow
def test_restores_count_the_slices_rebuilt_from_s3_and_lag_is_the_shard_s_own(
    spark, kinesis, make_stream, location, tmp_path
):
    stream = make_stream(1)
    first = payloads(120)
    put(kinesis, stream, first)
    split(kinesis, stream)  # the parent's read ends its shard: kinesalite says how far behind
    cfg = job_config(location, (stream,), tmp_path, slices=SLICES, on_handler_error="dead-letter")
    before = run(spark, cfg, tmp_path, [])
    (parent,) = [
        (p["batchId"], lag)
        for p in before
        if (lag := figures(p["observedMetrics"])["millis_behind_latest"])
    ]
    assert parent[1] == lag_in_batch_log(spark, cfg, parent[0])
    assert (
        list(parent[1]) == [f"{stream}/shardId-000000000000"] and parent[1][list(parent[1])[0]] > 0
    )
    with_state = {s for s, h in DurableState(cfg.location).heads(list(range(SLICES))).items() if h}

    # The same checkpoint on a new, empty local directory: every slice with state that the
    # next batch touches is rebuilt from S3, once (one batch: all of it fits).
    second = payloads(60, first=1000)
    put(kinesis, stream, second)
    moved = job_config(
        location, (stream,), tmp_path, slices=SLICES, on_handler_error="dead-letter",
        local_dir=str(tmp_path / "new-stores"),
    )  # fmt: skip
    reports: list[BatchReport] = []
    progress = [figures(p["observedMetrics"]) for p in run(spark, moved, tmp_path, reports)]
    touched = {slice_of(key_hash(k), SLICES) for k, _ in second}
    done = [f for f in progress if f["records"]]
    assert len(done) == 1 and done[0]["records"] == len(second)
    assert done[0]["restores"] == len(touched & with_state) > 0
    restored = [r for report in reports for r in report.restored]
    assert done[0]["restored_bytes"] == sum(r["bytes"] for r in restored) > 0
    assert done[0]["restore_seconds"] == pytest.approx(sum(r["seconds"] for r in restored))
    assert done[0]["restore_seconds"] > 0


def test_the_exporter_counts_each_batch_of_its_query_once_and_renders_text():
    exporter = prometheus.Exporter("clicks", "shardless-clicks")
    batch = {name: 2 for name in FIGURES}
    progress = {
        "name": "shardless-clicks",
        "batchId": 4,
        "durationMs": {"triggerExecution": 1500},
        "observedMetrics": {
            "shardless": batch,
            "shardless_shards": {"millis_behind_latest": {'s"1/shardId-0': 250}},
        },
    }
    assert exporter.observe(progress)
    assert not exporter.observe(progress)  # the same batch again
    assert not exporter.observe({**progress, "name": "another", "batchId": 5})
    assert not exporter.observe({**progress, "batchId": 5, "observedMetrics": {}})  # idle
    assert exporter.observe({**progress, "batchId": 5})
    text = exporter.render()
    assert "# TYPE shardless_records_total counter" in text
    assert 'shardless_records_total{app="clicks"} 4\n' in text
    assert 'shardless_batch_records{app="clicks"} 2\n' in text
    assert 'shardless_batches_total{app="clicks"} 2\n' in text
    assert 'shardless_batch_duration_seconds{app="clicks"} 1.5\n' in text
    assert (
        'shardless_shard_millis_behind_latest{app="clicks",stream="s\\"1",shard="shardId-0"} 250\n'
        in text
    )


def test_shardless_run_leaves_the_spark_ui_on_and_takes_a_metrics_port(monkeypatch, tmp_path):
    from shardless.processor import cli

    sessions: list[dict[str, Any]] = []
    seen = capture_cli_starts(monkeypatch)
    monkeypatch.setattr(
        "shardless.processor.driver.spark.session", lambda *a, **k: sessions.append(k)
    )
    app = tmp_path / "app.py"
    app.write_text("def process(event, ctx):\n    pass\n")
    args = ["run", str(app), "--app", "a", "--stream", "s", "--local-dir", str(tmp_path / "l")]
    assert cli.main([*args, "--metrics-port", "9464"]) == 0
    assert sessions and sessions[0].get("ui", True) is True
    assert seen[0].metrics_port == 9464 and seen[0].metrics_host == "0.0.0.0"
    assert cli.main(args) == 0 and seen[1].metrics_port == 0  # off by default


def test_the_endpoint_serves_every_figure_of_the_batch() -> None:
    """A figure added to the batch's metrics and not to the endpoint is a blind counter."""
    assert set(prometheus._FIGURES) == set(FIGURES)
