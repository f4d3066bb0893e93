"""The source reading over enhanced fan-out (`consumerName`): the polling source's batches.

Without an emulator, `fan_out.read` is scripted: the end a fresh read records has the polling
reader's shape, a recorded end is read again exactly (a count of 0 reads nothing), an attempt
that lost the conditional put reads the winner's end, and KPL aggregates are expanded.

Against kinesis-local (the one emulator that serves SubscribeToShard; DynamoDB stays moto's),
through real Spark streaming queries: every record read once, per key and per shard in order,
across several batches while the only shard splits (the parent read to its end before its
children); and a batch retried after its sink failed reads exactly the failed attempt's records.
Every batch subscribes to each shard anew, and kinesis-local holds a closed subscription about
3 s, so each batch of a shard waits for the last one's (what a trigger of at least 5 s avoids
on AWS); the record counts are small to keep that to a few batches.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections import Counter, defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import pytest
from pyspark.errors import StreamingQueryException

from shardless.changelog.layout import AppLocation
from shardless.processor.errors import ConfigError
from shardless.processor.kinesis import fan_out, fan_out_batch, source
from shardless.processor.kinesis.kpl import UserRecord
from shardless.processor.kinesis.reader import ShardRead
from shardless.processor.kinesis.source import KinesisStreamReader, kinesis_client
from tests.processor.kinesis import test_reshard
from tests.processor.kinesis.test_kinesis_reader import split_in_half
from tests.processor.kinesis.test_kpl import aggregate

kinesis_local = test_reshard.kinesis_local  # its fixture: a kinesis-local for this module

ARN = "arn:aws:kinesis:us-east-1:000000000000:stream/s/consumer/app:1"
# The keys the polling reader records (test_kinesis_reader.py, test_kinesis_lag.py).
POLLING_KEYS = {
    "after",
    "done",
    "caught_up",
    "count",
    "user_records",
    "bytes",
    "behind_ms",
    "unread_arrival_ms",
    "throttles",
    "calls",
    "read_ms",
    "since",
}


# --- without an emulator ------------------------------------------------------------------


def shard_read(start: dict | None = None, max_records: int = 3) -> ShardRead:
    return ShardRead(
        run="r",
        n=2,
        stream="s",
        shard_id="shardId-000000000000",
        depth=0,
        start=start,
        initial={"type": "TRIM_HORIZON"},
        max_records=max_records,
        max_bytes=1 << 20,
        consumer_arn=ARN,
    )


def record(seq: int, data: bytes = b"x", at: float = 1_000.0) -> dict[str, Any]:
    return {
        "SequenceNumber": str(seq),
        "ApproximateArrivalTimestamp": datetime.fromtimestamp(at, UTC),
        "PartitionKey": "k",
        "Data": data,
    }


class Reads:
    """`fan_out.read` scripted: returns the next result, remembering each call's arguments."""

    def __init__(self, *results: fan_out.FanOutRead) -> None:
        self.results = list(results)
        self.calls: list[dict[str, Any]] = []

    def __call__(self, kinesis, consumer_arn, shard, *, until=None, from_oldest=False):  # noqa: ANN001, ANN204
        self.calls.append({"arn": consumer_arn, "shard": shard, "until": until})
        return self.results.pop(0)


class Log:
    """A batch log in memory, whose conditional put another attempt may have won."""

    def __init__(self, recorded: dict | None = None, winner: dict | None = None) -> None:
        self.recorded = recorded
        self.winner = winner
        self.puts: list[dict] = []

    def recorded_end(self, run: str, n: int, shard_key: str) -> dict | None:
        return self.recorded

    def record_end(self, run: str, n: int, shard_key: str, end: dict) -> dict:
        self.puts.append(end)
        return self.winner or end


def scripted(monkeypatch: pytest.MonkeyPatch, *results: fan_out.FanOutRead) -> Reads:
    reads = Reads(*results)
    monkeypatch.setattr(fan_out, "read", reads)
    monkeypatch.setattr(fan_out_batch, "_now", lambda: 5_000.0)
    return reads


def test_a_bounded_read_records_the_polling_end_with_the_first_record_it_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    records = [record(i, b"ab", at=1_000 + i) for i in (1, 2, 3)]
    reads = scripted(
        monkeypatch,
        fan_out.FanOutRead(
            records=records,
            after="3",
            bytes=6,
            behind_ms=500,
            peeked=record(4, at=1_004.5),
            subscriptions=1,
            events=1,
            busy_retries=2,
        ),
    )
    log = Log()

    rows, end = fan_out_batch.read_shard(None, log, shard_read(start={"after": "0"}))

    assert [r["SequenceNumber"] for r in rows] == ["1", "2", "3"]
    assert reads.calls[0]["arn"] == ARN and reads.calls[0]["until"] is None
    assert log.puts == [end]
    assert set(end) == POLLING_KEYS | {"events", "fan_out"}
    assert {k: end[k] for k in POLLING_KEYS - {"read_ms"}} == {
        "after": "3",
        "done": False,
        "caught_up": False,
        "count": 3,
        "user_records": 3,
        "bytes": 6,
        "behind_ms": 500,
        "unread_arrival_ms": 1_004_500,
        "throttles": 2,
        "calls": 1,
        "since": 1_003.0,
    }


def test_a_caught_up_read_of_nothing_keeps_the_position_and_sees_the_tip(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scripted(monkeypatch, fan_out.FanOutRead(caught_up=True, behind_ms=0, subscriptions=1))

    rows, end = fan_out_batch.read_shard(None, Log(), shard_read(start={"after": "7"}))

    assert rows == []
    assert (end["after"], end["count"], end["done"], end["caught_up"]) == ("7", 0, False, True)
    assert end["unread_arrival_ms"] is None
    assert end["since"] == 5_000.0, "the records still unread arrived after the read began"


def test_a_shard_read_to_its_end_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    scripted(
        monkeypatch,
        fan_out.FanOutRead(records=[record(9)], after="9", done=True, caught_up=True, bytes=1),
    )

    _, end = fan_out_batch.read_shard(None, Log(), shard_read())

    assert (end["after"], end["done"], end["caught_up"], end["count"]) == ("9", True, True, 1)


def test_kpl_aggregates_are_expanded_as_polling_expands_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    users = [UserRecord(f"pk-{i}", None, f"u{i}".encode()) for i in range(3)]
    _, _, data = aggregate(users)
    scripted(
        monkeypatch,
        fan_out.FanOutRead(
            records=[record(1, b"plain"), record(2, data)], after="2", caught_up=True
        ),
    )

    rows, end = fan_out_batch.read_shard(None, Log(), shard_read())

    assert [(r["SequenceNumber"], r["SubSequenceNumber"], r["Data"]) for r in rows] == [
        ("1", 0, b"plain"),
        ("2", 0, b"u0"),
        ("2", 1, b"u1"),
        ("2", 2, b"u2"),
    ]
    assert (end["count"], end["user_records"]) == (2, 4)


def test_a_recorded_end_is_read_again_exactly_up_to_its_last_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recorded = {"after": "2", "done": False, "caught_up": False, "count": 2}
    reads = scripted(monkeypatch, fan_out.FanOutRead(records=[record(1), record(2)], after="2"))
    log = Log(recorded=recorded)

    rows, end = fan_out_batch.read_shard(None, log, shard_read())

    assert end is recorded and log.puts == []
    assert [r["SequenceNumber"] for r in rows] == ["1", "2"]
    assert reads.calls[0]["until"] == "2"


def test_a_recorded_end_of_no_record_reads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = scripted(monkeypatch)
    recorded = {"after": "5", "done": False, "caught_up": True, "count": 0}

    rows, end = fan_out_batch.read_shard(None, Log(recorded=recorded), shard_read())

    assert (rows, end, reads.calls) == ([], recorded, [])


def test_an_attempt_that_lost_the_conditional_put_reads_the_winners_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    winner = {"after": "1", "done": False, "caught_up": False, "count": 1}
    reads = scripted(
        monkeypatch,
        fan_out.FanOutRead(records=[record(1), record(2)], after="2", caught_up=True),
        fan_out.FanOutRead(records=[record(1)], after="1"),
    )

    rows, end = fan_out_batch.read_shard(None, Log(winner=winner), shard_read())

    assert end is winner
    assert [r["SequenceNumber"] for r in rows] == ["1"]
    assert [c["until"] for c in reads.calls] == [None, "1"]


def test_consumer_name_is_optional_and_checked() -> None:
    base = {"streams": "s", "table": "t"}
    assert KinesisStreamReader(base).consumer_name is None
    assert KinesisStreamReader({**base, "consumerName": " app.1 "}).consumer_name == "app.1"
    with pytest.raises(ConfigError, match="consumerName"):
        KinesisStreamReader({**base, "consumerName": "no spaces"})


def test_the_driver_registers_each_streams_consumer_once(monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[tuple[str, str]] = []

    def register(kinesis, stream: str, name: str) -> fan_out.Consumer:  # noqa: ANN001
        registered.append((stream, name))
        return fan_out.Consumer(name, f"arn-{stream}", stream, f"stream-{stream}")

    monkeypatch.setattr(fan_out, "register_consumer", register)
    reader = KinesisStreamReader({"streams": "a,b", "table": "t", "consumerName": "app"})
    polling = KinesisStreamReader({"streams": "a", "table": "t"})

    arns = [reader._consumer_arn(None, s) for s in ("a", "b", "a", "b")]

    assert arns == ["arn-a", "arn-b", "arn-a", "arn-b"]
    assert registered == [("a", "app"), ("b", "app")]
    assert polling._consumer_arn(None, "a") is None


# --- through Spark, on kinesis-local ------------------------------------------------------

TIMEOUT_S = 90


def fan_out_ends(location: AppLocation) -> list[dict]:
    """Every shard end recorded in the application's batch log."""
    ddb = boto3.client("dynamodb")
    items = ddb.scan(TableName=location.table)["Items"]
    return [json.loads(i["end"]["S"]) for i in items if i["sk"]["S"].startswith("end#")]


def shard_sequence_numbers(kinesis, stream: str, shard_id: str) -> list[str]:  # noqa: ANN001
    """The shard's sequence numbers in its order, by GetRecords."""
    it = kinesis.get_shard_iterator(
        StreamName=stream, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"
    )["ShardIterator"]
    out: list[str] = []
    while it:
        page = kinesis.get_records(ShardIterator=it, Limit=10_000)
        out += [r["SequenceNumber"] for r in page["Records"]]
        it = page.get("NextShardIterator") if page["Records"] else None
    return out


@pytest.mark.slow
def test_batches_over_fan_out_read_every_record_once_in_order_through_a_split(
    spark, kinesis_local: str, location: AppLocation, tmp_path: Path
) -> None:
    kinesis = kinesis_client(kinesis_local)
    stream = test_reshard.create_stream(kinesis, f"efo-{location.app}", 1)
    (parent,) = (s["ShardId"] for s in kinesis.list_shards(StreamName=stream)["Shards"])
    producer = test_reshard.Producer(kinesis, stream)
    sink = test_reshard.Collector()
    options = test_reshard.options(
        stream,
        location,
        kinesisEndpoint=kinesis_local,
        consumerName=f"app-{stream}",
        maxRecordsPerShard="15",
    )
    began = time.monotonic()
    producer.produce(2)  # 60 records (30 keys): the parent takes batches of 15
    query = test_reshard.start_query(spark, options, tmp_path / "ck", sink)
    try:
        test_reshard.wait_for(query, sink, 1)
        split_in_half(kinesis, stream, parent)  # the parent still holds unread records
        producer.produce(1)
    except BaseException:
        query.stop()
        raise
    test_reshard.drain_and_stop(query, sink, producer)
    print(f"{producer.total} records in {time.monotonic() - began:.1f} s")

    test_reshard.assert_exactly_once_in_order(sink.rows, producer)
    by_shard: dict[str, list[tuple[int, str, str]]] = defaultdict(list)
    for r in sink.rows:
        by_shard[r["shard"]].append((r["batch"], r["stream_order"], r["sequence_number"]))
    for shard_id, rows in by_shard.items():
        read = [seq for _, _, seq in sorted(rows)]
        assert read == shard_sequence_numbers(kinesis, stream, shard_id), shard_id
    batches = defaultdict(set)
    for r in sink.rows:
        batches[r["shard"]].add(r["batch"])
    assert len(batches) == 3, "the parent and both children"
    assert len(batches[parent]) >= 4, "the parent's 60 records in batches of 15"
    children = set(batches) - {parent}
    assert max(batches[parent]) < min(min(batches[c]) for c in children), "parent first"
    ends = fan_out_ends(location)
    assert ends and all(e.get("fan_out") for e in ends), "every batch read over fan-out"
    reads = sorted(e["read_ms"] for e in ends)
    print(
        f"{len(ends)} shard reads: {sum(e['throttles'] for e in ends)} subscriptions refused as "
        f"held, read_ms median {reads[len(reads) // 2]}, max {reads[-1]}"
    )


class FailingSink:
    """Keeps each batch's rows; fails the first batch with records once, after keeping that
    attempt's rows apart."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.batches: dict[int, list[dict[str, Any]]] = {}
        self.failed: tuple[int, list[dict[str, Any]]] | None = None

    def __call__(self, df, batch_id: int) -> None:  # noqa: ANN001
        rows = [r.asDict() for r in df.collect()]
        if self.fail and self.failed is None and rows:
            self.failed = (batch_id, rows)
            raise RuntimeError(f"the sink fails batch {batch_id}")
        self.batches[batch_id] = rows


def run_available_now(spark, options: dict[str, str], checkpoint: Path, sink: FailingSink):  # noqa: ANN001, ANN201
    query = (
        spark.readStream.format("shardless_kinesis")
        .options(**options)
        .load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    try:
        with contextlib.suppress(StreamingQueryException):  # the failing sink's
            query.awaitTermination(TIMEOUT_S)
    finally:
        if query.isActive:
            query.stop()
    return query


@pytest.mark.slow
def test_a_retried_batch_over_fan_out_reads_the_same_records_and_no_new_one(
    spark, kinesis_local: str, location: AppLocation, tmp_path: Path
) -> None:
    kinesis = kinesis_client(kinesis_local)
    stream = test_reshard.create_stream(kinesis, f"efo-r-{uuid.uuid4().hex[:8]}", 1)
    began = time.monotonic()
    producer = test_reshard.Producer(kinesis, stream)
    options = test_reshard.options(
        stream,
        location,
        kinesisEndpoint=kinesis_local,
        consumerName=f"app-{stream}",
        maxRecordsPerShard="50",
    )
    producer.produce(1)  # 30 records: the first batch catches up with the shard
    first = FailingSink(fail=True)
    query = run_available_now(spark, options, tmp_path / "ck", first)
    assert first.failed is not None and "the sink fails batch" in str(query.exception())
    failed_batch, attempt = first.failed
    assert len(attempt) == 30

    producer.produce(1)  # a fresh read of the failed batch would now find 50 records
    second = FailingSink(fail=False)
    query = run_available_now(spark, options, tmp_path / "ck", second)
    assert query.exception() is None

    assert min(second.batches) == failed_batch, "the failed batch runs again"
    key = ("shard", "sequence_number", "subsequence")
    assert [tuple(r[k] for k in key) for r in second.batches[failed_batch]] == [
        tuple(r[k] for k in key) for r in attempt
    ], "the retried batch replays exactly the rows of the failed attempt"
    delivered = [
        (batch, r["stream_order"], r["partition_key"], bytes(r["data"]))
        for batch, rows in second.batches.items()
        for r in rows
    ]
    assert max(Counter((k, d) for _, _, k, d in delivered).values()) == 1, "no record twice"
    per_key: dict[str, list[bytes]] = defaultdict(list)
    for _, _, k, d in sorted(delivered):
        per_key[k].append(d)
    assert dict(per_key) == producer.sent
    ends = fan_out_ends(location)
    assert ends and all(e.get("fan_out") for e in ends), "every batch read over fan-out"
    print(f"{producer.total} records, a retry, in {time.monotonic() - began:.1f} s")


def test_deregister_consumers_is_there_for_a_command(monkeypatch: pytest.MonkeyPatch) -> None:
    gone: list[tuple[str, str]] = []

    def deregister(kinesis, stream: str, name: str) -> bool:  # noqa: ANN001
        gone.append((stream, name))
        return stream == "a"

    monkeypatch.setattr(fan_out, "deregister_consumer", deregister)

    assert source.deregister_consumers(["a", "b"], "app", "http://127.0.0.1:1") == {
        "a": True,
        "b": False,
    }
    assert gone == [("a", "app"), ("b", "app")]
