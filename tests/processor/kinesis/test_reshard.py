"""Resharding while a query runs: every record once, and per key in the order produced.

A streaming query over the `shardless_kinesis` source collects every row through
foreachBatch while the test produces rounds of records (one per key per round, so per key the
produce order is the round order) and reshards the stream between rounds: splits and merges
on kinesalite, UpdateShardCount 2 -> 4 -> 2 -> 1 on kinesis-local (Kinesis refuses to go
below half the shards in one step, so 4 -> 1 takes two). Before each reshard a burst leaves
the parent shards with unread records, so a child read before its parents' ends would put a
key's records out of order.

The order checked is the one the job processes a key's records in: batch by batch, and
within a batch by `stream_order` (lineage depth, sequence number, sub-sequence).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from shardless.changelog.layout import AppLocation
from shardless.processor.kinesis.source import kinesis_client
from shardless.processor.local import emulators as local_aws

pytestmark = pytest.mark.slow

KEYS = [f"user-{i}" for i in range(30)]
SLICES = 16
TIMEOUT_S = 240


class Collector:
    """foreachBatch sink keeping each row with its batch id."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.batches = 0

    def __call__(self, df, batch_id: int) -> None:  # noqa: ANN001
        self.rows += [{**r.asDict(), "batch": batch_id} for r in df.collect()]
        self.batches += 1


class Producer:
    """Rounds of one record per key; remembers per key what Kinesis accepted, in order."""

    def __init__(self, kinesis, stream: str) -> None:  # noqa: ANN001
        self.kinesis = kinesis
        self.stream = stream
        self.rounds = 0
        self.sent: dict[str, list[bytes]] = defaultdict(list)

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.sent.values())

    def produce(self, rounds: int) -> None:
        for _ in range(rounds):
            pending = [{"Data": f"{k}:{self.rounds}".encode(), "PartitionKey": k} for k in KEYS]
            deadline = time.monotonic() + 30
            while pending:
                assert time.monotonic() < deadline, "records keep failing"
                try:
                    out = self.kinesis.put_records(StreamName=self.stream, Records=pending)
                except ClientError as exc:  # the stream is UPDATING on some emulators
                    if exc.response["Error"]["Code"] not in ("ResourceInUseException",):
                        raise
                    time.sleep(0.05)
                    continue
                failed = []
                for record, result in zip(pending, out["Records"], strict=True):
                    if "ErrorCode" in result:
                        failed.append(record)
                    else:
                        self.sent[record["PartitionKey"]].append(record["Data"])
                pending = failed
            self.rounds += 1


def wait_active(kinesis, stream: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 60
    while (
        kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"][
            "StreamStatus"
        ]
        != "ACTIVE"
    ):
        assert time.monotonic() < deadline, f"{stream} not ACTIVE"
        time.sleep(0.05)


def create_stream(kinesis, name: str, shards: int) -> str:  # noqa: ANN001
    kinesis.create_stream(StreamName=name, ShardCount=shards)
    wait_active(kinesis, name)
    return name


def open_shards(kinesis, stream: str) -> list[dict]:  # noqa: ANN001
    """Open shards in hash-key order."""
    shards = kinesis.list_shards(StreamName=stream)["Shards"]
    live = [s for s in shards if "EndingSequenceNumber" not in s["SequenceNumberRange"]]
    return sorted(live, key=lambda s: int(s["HashKeyRange"]["StartingHashKey"]))


def split(kinesis, stream: str, shard: dict) -> None:  # noqa: ANN001
    lo, hi = (int(shard["HashKeyRange"][k]) for k in ("StartingHashKey", "EndingHashKey"))
    kinesis.split_shard(
        StreamName=stream, ShardToSplit=shard["ShardId"], NewStartingHashKey=str((lo + hi) // 2)
    )
    wait_active(kinesis, stream)


def merge(kinesis, stream: str, left: dict, right: dict) -> None:  # noqa: ANN001
    kinesis.merge_shards(
        StreamName=stream,
        ShardToMerge=left["ShardId"],
        AdjacentShardToMerge=right["ShardId"],
    )
    wait_active(kinesis, stream)


def update_shard_count(kinesis, stream: str, target: int) -> None:  # noqa: ANN001
    kinesis.update_shard_count(
        StreamName=stream, TargetShardCount=target, ScalingType="UNIFORM_SCALING"
    )
    wait_active(kinesis, stream)
    assert len(open_shards(kinesis, stream)) == target


def start_query(spark, options: dict[str, str], checkpoint: Path, sink: Collector):  # noqa: ANN001, ANN201
    return (
        spark.readStream.format("shardless_kinesis")
        .options(**options)
        .load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(processingTime="100 milliseconds")
        .start()
    )


def wait_for(query, sink: Collector, count: int) -> None:  # noqa: ANN001
    deadline = time.monotonic() + TIMEOUT_S
    while len(sink.rows) < count:
        assert query.exception() is None, query.exception()
        assert time.monotonic() < deadline, f"{len(sink.rows)} of {count} rows"
        time.sleep(0.1)


def drain_and_stop(query, sink: Collector, producer: Producer) -> None:  # noqa: ANN001
    """Wait for every produced record, then two more batches (nothing else may come)."""
    try:
        wait_for(query, sink, producer.total)
        batches = sink.batches
        deadline = time.monotonic() + TIMEOUT_S
        while sink.batches < batches + 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        query.stop()
    assert query.exception() is None


def assert_exactly_once_in_order(rows: list[dict], producer: Producer) -> None:
    copies = Counter((r["partition_key"], bytes(r["data"])) for r in rows)
    duplicated = {k: n for k, n in copies.items() if n > 1}
    assert not duplicated
    expected = {(k, d) for k, values in producer.sent.items() for d in values}
    assert set(copies) == expected, (
        f"missing {sorted(expected - set(copies))[:5]}, extra {sorted(set(copies) - expected)[:5]}"
    )
    per_key: dict[str, list[tuple[int, str, bytes]]] = defaultdict(list)
    for r in rows:
        per_key[r["partition_key"]].append((r["batch"], r["stream_order"], bytes(r["data"])))
    for key, items in per_key.items():
        assert [d for _, _, d in sorted(items)] == producer.sent[key], key


def options(stream: str, location: AppLocation, **extra: str) -> dict[str, str]:
    return {
        "streams": stream,
        "table": location.table,
        "slices": str(SLICES),
        "maxRecordsPerShard": "20",
        "idlePollMs": "100",
        **extra,
    }


def test_splits_and_merges_on_kinesalite_lose_duplicate_and_reorder_nothing(
    spark, kinesis, make_stream: Callable[[int], str], location: AppLocation, tmp_path: Path
) -> None:
    stream = make_stream(2)
    producer = Producer(kinesis, stream)
    sink = Collector()
    query = start_query(spark, options(stream, location), tmp_path / "ck", sink)
    try:
        producer.produce(2)
        wait_for(query, sink, 1)  # the query runs before the first reshard
        producer.produce(3)  # a backlog in both shards
        first, _ = open_shards(kinesis, stream)
        split(kinesis, stream, first)  # 2 -> 3
        producer.produce(3)
        split(kinesis, stream, open_shards(kinesis, stream)[0])  # a child splits: 3 -> 4
        producer.produce(3)
        shards = open_shards(kinesis, stream)
        merge(kinesis, stream, shards[2], shards[3])  # a split child with an original: 4 -> 3
        producer.produce(3)
        shards = open_shards(kinesis, stream)
        merge(kinesis, stream, shards[0], shards[1])  # the grandchildren: 3 -> 2
        producer.produce(2)
    except BaseException:
        query.stop()
        raise
    drain_and_stop(query, sink, producer)

    assert_exactly_once_in_order(sink.rows, producer)
    every_shard = {s["ShardId"] for s in kinesis.list_shards(StreamName=stream)["Shards"]}
    assert len(every_shard) == 2 + 2 + 2 + 1 + 1
    assert {r["shard"] for r in sink.rows} == every_shard, "records in every generation"


@pytest.fixture(scope="module")
def kinesis_local(aws, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:  # noqa: ANN001
    """A kinesis-local endpoint beside the session's emulators (DynamoDB stays moto's)."""
    started = local_aws.start("kinesis-local", log_dir=tmp_path_factory.mktemp("kinesis-local"))
    try:
        yield started.kinesis_endpoint
    finally:
        started.stop()


def test_update_shard_count_2_4_2_1_on_kinesis_local_loses_duplicates_and_reorders_nothing(
    spark, kinesis_local: str, location: AppLocation, tmp_path: Path
) -> None:
    kinesis = kinesis_client(kinesis_local)
    stream = create_stream(kinesis, f"u-{location.app}", 2)
    producer = Producer(kinesis, stream)
    sink = Collector()
    source_options = options(stream, location, kinesisEndpoint=kinesis_local)
    query = start_query(spark, source_options, tmp_path / "ck", sink)
    try:
        producer.produce(2)
        wait_for(query, sink, 1)
        for target in (4, 2, 1):
            producer.produce(2)  # a backlog in the shards about to close
            update_shard_count(kinesis, stream, target)
        producer.produce(2)
    except BaseException:
        query.stop()
        raise
    drain_and_stop(query, sink, producer)

    assert_exactly_once_in_order(sink.rows, producer)
    every_shard = {s["ShardId"] for s in kinesis.list_shards(StreamName=stream)["Shards"]}
    assert len(every_shard) == 2 + 4 + 2 + 1
    assert {r["shard"] for r in sink.rows} == every_shard, "records in every generation"
