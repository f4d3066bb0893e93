"""The `shardless_kinesis` Spark streaming source end to end: kinesalite → Spark → foreachBatch,
batch ends in moto's DynamoDB, through the one shared SparkSession."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardless.changelog.layout import AppLocation
from shardless.processor.runtime.routing import route

pytestmark = pytest.mark.slow

SLICES = 16
MAX_PER_SHARD = 50
KEYS = [f"user-{i}" for i in range(30)]
TIMEOUT_S = 240


class Collector:
    """A foreachBatch sink that keeps every row on the driver, and each batch's size."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.batches: list[tuple[int, int]] = []

    def __call__(self, df, batch_id: int) -> None:  # noqa: ANN001
        rows = [r.asDict() for r in df.collect()]
        self.rows += rows
        self.batches.append((batch_id, len(rows)))


def produce(kinesis, stream: str, rounds: range, keys: list[str] = KEYS) -> list[dict]:  # noqa: ANN001
    """One PutRecords call per round with one record per key, so per key the produce order is
    the round order. Returns the records as produced (sequence number, key, data)."""
    out = []
    for r in rounds:
        batch = [{"Data": f"{k}:{r}".encode(), "PartitionKey": k} for k in keys]
        resp = kinesis.put_records(StreamName=stream, Records=batch)
        assert resp["FailedRecordCount"] == 0
        out += [
            {"seq": res["SequenceNumber"], "pk": b["PartitionKey"], "data": b["Data"]}
            for res, b in zip(resp["Records"], batch, strict=True)
        ]
    return out


def reader(spark, **options: str):  # noqa: ANN001, ANN201
    return spark.readStream.format("shardless_kinesis").options(**options).load()


def options_for(stream: str, location: AppLocation) -> dict[str, str]:
    return {
        "streams": stream,
        "table": location.table,
        "slices": str(SLICES),
        "maxRecordsPerShard": str(MAX_PER_SHARD),
    }


def run_available_now(spark, options: dict[str, str], checkpoint: Path) -> Collector:  # noqa: ANN001
    sink = Collector()
    query = (
        reader(spark, **options)
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    finished = query.awaitTermination(TIMEOUT_S)
    if not finished:
        query.stop()
    assert finished, "availableNow query did not finish"
    assert query.exception() is None
    return sink


def assert_exactly(sink: Collector, produced: list[dict]) -> None:
    counts = Counter(r["sequence_number"] for r in sink.rows)
    duplicates = {seq: c for seq, c in counts.items() if c > 1}
    assert not duplicates
    assert set(counts) == {p["seq"] for p in produced}
    by_seq = {p["seq"]: p for p in produced}
    for row in sink.rows:
        p = by_seq[row["sequence_number"]]
        assert (row["partition_key"], bytes(row["data"])) == (p["pk"], p["data"])


def test_available_now_reads_every_record_once_routed_and_ordered_per_key(
    spark, kinesis, make_stream: Callable[[int], str], location: AppLocation, tmp_path: Path
) -> None:
    stream = make_stream(2)
    produced = produce(kinesis, stream, range(10))
    assert len(produced) == 300

    sink = run_available_now(spark, options_for(stream, location), tmp_path / "ck")

    assert_exactly(sink, produced)
    sizes = [n for _, n in sink.batches if n]
    assert len(sizes) >= 3, sink.batches  # 300 records, at most 2 x 50 per batch
    assert max(sizes) <= 2 * MAX_PER_SHARD, sink.batches
    for row in sink.rows:
        assert row["stream"] == stream
        assert row["slice"] == route(row["partition_key"], None, SLICES)
    per_key: dict[str, list[tuple[str, bytes]]] = defaultdict(list)
    for row in sink.rows:
        per_key[row["partition_key"]].append((row["stream_order"], bytes(row["data"])))
    assert set(per_key) == set(KEYS)
    for key, items in per_key.items():
        in_stream_order = [data for _, data in sorted(items)]
        assert in_stream_order == [f"{key}:{r}".encode() for r in range(10)], key


def test_available_now_again_from_the_checkpoint_reads_exactly_the_new_records(
    spark, kinesis, make_stream: Callable[[int], str], location: AppLocation, tmp_path: Path
) -> None:
    stream = make_stream(2)
    options = options_for(stream, location)
    first = produce(kinesis, stream, range(4))
    assert_exactly(run_available_now(spark, options, tmp_path / "ck"), first)
    later = produce(kinesis, stream, range(4, 8), KEYS[:25])
    assert len(later) == 100

    sink = run_available_now(spark, options, tmp_path / "ck")

    assert_exactly(sink, later)


def test_restart_from_the_checkpoint_reads_only_the_new_records(
    spark, kinesis, make_stream: Callable[[int], str], location: AppLocation, tmp_path: Path
) -> None:
    """The same restart with a processing-time trigger: nothing of the first run comes again."""
    stream = make_stream(2)
    options = {**options_for(stream, location), "idlePollMs": "200"}
    first = produce(kinesis, stream, range(4))
    assert_exactly(run_available_now(spark, options, tmp_path / "ck"), first)
    later = produce(kinesis, stream, range(4, 8), KEYS[:25])

    sink = Collector()
    query = (
        reader(spark, **options)
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len(sink.rows) < len(later) and time.monotonic() < deadline:
            assert query.exception() is None
            time.sleep(0.2)
        batches_then = len(sink.batches)
        while len(sink.batches) < batches_then + 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # a couple of idle batches more: nothing else may arrive
    finally:
        query.stop()
    assert query.exception() is None
    assert_exactly(sink, later)


def test_available_now_reads_a_split_shard_and_then_its_children(
    spark, kinesis, make_stream: Callable[[int], str], location: AppLocation, tmp_path: Path
) -> None:
    stream = make_stream(1)
    (parent,) = (s["ShardId"] for s in kinesis.list_shards(StreamName=stream)["Shards"])
    before = produce(kinesis, stream, range(2))
    shard = kinesis.list_shards(StreamName=stream)["Shards"][0]
    top = int(shard["HashKeyRange"]["EndingHashKey"])
    kinesis.split_shard(StreamName=stream, ShardToSplit=parent, NewStartingHashKey=str(top // 2))
    deadline = time.monotonic() + 30
    while (
        kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"][
            "StreamStatus"
        ]
        != "ACTIVE"
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = produce(kinesis, stream, range(2, 4))
    assert {p["seq"] for p in after}.isdisjoint({p["seq"] for p in before})

    sink = run_available_now(spark, options_for(stream, location), tmp_path / "ck")

    seen = {r["sequence_number"] for r in sink.rows}
    assert {p["seq"] for p in before} <= seen, "the parent's records"
    assert {p["seq"] for p in after} <= seen, "the children's records"
    assert_exactly(sink, before + after)


@pytest.mark.parametrize("missing", ["streams", "table"])
def test_a_missing_required_option_is_named_when_the_query_starts(
    spark, make_stream: Callable[[int], str], location: AppLocation, tmp_path: Path, missing: str
) -> None:
    options = options_for(make_stream(1), location)
    del options[missing]

    with pytest.raises(Exception) as info:  # noqa: B017 - Spark wraps the ConfigError
        query = (
            reader(spark, **options)
            .writeStream.foreachBatch(Collector())
            .option("checkpointLocation", str(tmp_path / "ck"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(TIMEOUT_S)
        query.stop()

    assert f"needs option {missing}=" in str(info.value)
