"""Each batch's lag where users look (real Spark, kinesalite, moto): the shards'
MillisBehindLatest and the batch's oldest unread arrival in the batch's
`StreamingQueryProgress.observedMetrics`, and the latest batch's at the Prometheus endpoint.

One shard holds more than `maxRecordsPerShard`, so batches stop short of it: each such
batch's oldest unread arrival is the arrival time of the first record the next batch reads
(read back from Kinesis here), and the batch that catches up reports none."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.driver import prometheus, recorder
from shardless.processor.driver.job import parquet_sink, start
from shardless.processor.driver.metrics import figures, shard_lag
from shardless.processor.kinesis.batch_log import BatchLog
from shardless.processor.kinesis.client import kinesis_client
from shardless.processor.kinesis.rows import UNREAD
from shardless.processor.local import emulators as local_aws
from tests.jobs import job_config
from tests.processor.driver.test_progress_metrics import free_port, scrape
from tests.processor.kinesis.test_reshard import create_stream

BOUND = 10
BUSY, QUIET = 25, 3  # records put into each shard


@pytest.fixture
def endpoints() -> Iterator[None]:
    yield
    prometheus.stop_all()


def count(event, ctx) -> None:  # noqa: ANN001
    ctx.state.set(ctx.state.get(0) + 1)


def put_into(kinesis, stream: str, hash_key: int, n: int, tag: str) -> None:  # noqa: ANN001
    """`n` records into the shard that holds `hash_key`, a few ms apart (distinct arrivals)."""
    for i in range(n):
        kinesis.put_record(
            StreamName=stream,
            Data=f"{tag}-{i}".encode(),
            PartitionKey=f"{tag}-{i}",
            ExplicitHashKey=str(hash_key),
        )
        time.sleep(0.003)


def arrivals(kinesis, stream: str, shard_id: str) -> list[int]:  # noqa: ANN001
    """The arrival time (epoch ms) of each record of the shard, in shard order."""
    it = kinesis.get_shard_iterator(
        StreamName=stream, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"
    )["ShardIterator"]
    records = kinesis.get_records(ShardIterator=it, Limit=10_000)["Records"]
    return [round(r["ApproximateArrivalTimestamp"].timestamp() * 1000) for r in records]


@pytest.mark.slow
def test_each_batch_reports_its_shards_lag_and_its_oldest_unread_arrival(
    spark, kinesis, make_stream, location, tmp_path, endpoints
) -> None:
    stream = make_stream(2)
    busy, quiet = (s["ShardId"] for s in kinesis.list_shards(StreamName=stream)["Shards"])
    put_into(kinesis, stream, 1, BUSY, "busy")  # shard 0 holds hash keys below 2**127
    put_into(kinesis, stream, 2**127 + 1, QUIET, "quiet")
    held = arrivals(kinesis, stream, busy)
    assert len(held) == BUSY and len(arrivals(kinesis, stream, quiet)) == QUIET

    port = free_port()
    cfg = job_config(
        location, (stream,), tmp_path, max_records_per_shard=BOUND,
        metrics_port=port, metrics_host="127.0.0.1",
    )  # fmt: skip
    query = start(
        spark, HandlerFactory(count), cfg, sink=parquet_sink(str(tmp_path / "out")),
        available_now=True,
    )  # fmt: skip
    query.awaitTermination()
    progress = [json.loads(p.json) for p in query.recentProgress]
    batches = [(p["batchId"], figures(p["observedMetrics"])) for p in progress]
    read = [(b, f) for b, f in batches if f["records"]]
    assert [f["records"] for _, f in read] == [BOUND + QUIET, BOUND, BUSY - 2 * BOUND]

    # The oldest unread arrival: the busy shard's next record after each bounded batch (the
    # quiet shard caught up in the first batch), and none once both caught up.
    assert [f["oldest_unread_arrival_ms"] for _, f in read] == [held[BOUND], held[2 * BOUND], None]
    now_ms = time.time() * 1000
    assert all(now_ms - 600_000 < f["oldest_unread_arrival_ms"] < now_ms for _, f in read[:2])

    # MillisBehindLatest of every shard that gave records, as each read recorded it: both
    # shards in the first batch, the busy one after; kinesalite answers 0 for open shards.
    shard = f"{stream}/{{}}".format
    assert [sorted(f["millis_behind_latest"]) for _, f in read] == [
        sorted([shard(busy), shard(quiet)]),
        [shard(busy)],
        [shard(busy)],
    ]
    for batch_id, f in read:
        offset = recorder.checkpoint_offset(spark, cfg.checkpoint, batch_id)
        ends = BatchLog(location.table).ends(offset["run"], int(offset["n"]))
        assert f["millis_behind_latest"] == {
            k: e["behind_ms"] for k, e in ends.items() if e["user_records"]
        }
        assert all(ms >= 0 for ms in f["millis_behind_latest"].values())
        unread = [e["unread_arrival_ms"] for e in ends.values() if e["unread_arrival_ms"]]
        assert f["oldest_unread_arrival_ms"] == (min(unread) if unread else None)

    # The Prometheus endpoint serves the latest batch's: caught up, so no unread arrival.
    app = f'{{app="{location.app}"}}'
    deadline = time.monotonic() + 60
    while (got := scrape(port)).get(f"shardless_batch_id{app}") != batches[-1][0]:
        assert time.monotonic() < deadline, got
        time.sleep(0.5)
    assert f"shardless_oldest_unread_arrival_timestamp_seconds{app}" not in got
    lag = {k for k in got if k.startswith("shardless_shard_millis_behind_latest{")}
    assert len(lag) == len(batches[-1][1]["millis_behind_latest"])
    # ... and a batch that left records unread, its oldest one's arrival (in seconds).
    exporter = prometheus.Exporter(location.app, f"shardless-{location.app}")
    first = next(p for p in progress if p["batchId"] == read[0][0])
    assert exporter.observe(first)
    gauge = f"shardless_oldest_unread_arrival_timestamp_seconds{app} "
    (line,) = [x for x in exporter.render().splitlines() if x.startswith(gauge)]
    assert float(line.split()[-1]) == pytest.approx(held[BOUND] / 1000)


@pytest.fixture(scope="module")
def kinesis_local(aws, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:  # noqa: ANN001
    """A kinesis-local endpoint beside the session's emulators (DynamoDB stays moto's):
    unlike kinesalite, it answers MillisBehindLatest above 0 while records remain."""
    started = local_aws.start("kinesis-local", log_dir=tmp_path_factory.mktemp("kinesis-local"))
    try:
        yield started.kinesis_endpoint
    finally:
        started.stop()


@pytest.mark.slow
def test_a_shard_left_behind_by_the_bound_reports_millis_behind_latest_above_0(
    spark, kinesis_local: str, location, tmp_path
) -> None:
    kinesis = kinesis_client(kinesis_local)
    stream = create_stream(kinesis, f"lag-{location.app}", 1)
    put_into(kinesis, stream, 1, BUSY, "busy")
    (shard,) = (
        f"{stream}/{s['ShardId']}" for s in kinesis.list_shards(StreamName=stream)["Shards"]
    )
    cfg = job_config(
        location, (stream,), tmp_path, max_records_per_shard=BOUND, kinesis_endpoint=kinesis_local
    )
    query = start(
        spark, HandlerFactory(count), cfg, sink=parquet_sink(str(tmp_path / "out")),
        available_now=True,
    )  # fmt: skip
    query.awaitTermination()
    read = [
        f
        for p in query.recentProgress
        if (f := figures(json.loads(p.json)["observedMetrics"])) and f["records"]
    ]
    assert [f["records"] for f in read] == [BOUND, BOUND, BUSY - 2 * BOUND]
    behind = [f["millis_behind_latest"][shard] for f in read]
    assert behind[0] > 0 and behind[1] > 0, "records remained unread after the bounded batches"
    assert behind[2] == 0, "the last batch caught up"
    assert read[0]["oldest_unread_arrival_ms"] is not None
    assert read[2]["oldest_unread_arrival_ms"] is None


def test_a_shard_reported_twice_in_a_batch_keeps_its_largest_lag(spark) -> None:
    """A read that Spark runs again in the same batch (its executor was lost after the read
    succeeded, so the shuffle files it wrote are gone) reports its shard a second time.
    Both reports reach the batch's observation: each shard must appear once, with the
    larger lag, not fail the observation (Spark logged DUPLICATED_MAP_KEY from its
    scheduler and the batch's lag went missing, seen in `bench.latency` after an executor
    kill that met a running batch)."""
    rows = [
        ("s", "shardId-1", 7, 250),
        ("s", "shardId-0", 9, None),
        ("s", "shardId-0", None, None),  # a record that is not its shard's last
        ("s", "shardId-0", 4, 120),  # the same shard, from the read's second run
        ("t", "shardId-0", 0, None),  # another stream's shard of the same name
    ]
    schema = f"stream string, shard string, behind_ms long, {UNREAD} long"
    got = spark.createDataFrame(rows, schema).agg(*shard_lag()).first()
    assert dict(got["millis_behind_latest"]) == {
        "s/shardId-0": 9,
        "s/shardId-1": 7,
        "t/shardId-0": 0,
    }
    assert got["oldest_unread_arrival_ms"] == 120
    empty = spark.createDataFrame([], schema).agg(*shard_lag()).first()
    assert dict(empty["millis_behind_latest"]) == {}
    assert empty["oldest_unread_arrival_ms"] is None
