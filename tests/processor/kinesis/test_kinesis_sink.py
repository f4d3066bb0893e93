"""The Kinesis sink against kinesalite, with a fault proxy failing single PutRecords
entries: every output lands, only failed entries are put again, a persistent failure names
the stream and the codes, and the duplicates of a retried batch are dropped by
(query, batch_id, seq)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from shardless.processor.errors import ConfigError
from shardless.processor.kinesis.put import chunks
from shardless.processor.kinesis.shards import stream_records
from shardless.processor.kinesis.sink import (
    KinesisSinkError,
    SinkConfig,
    kinesis_sink,
    put_all,
    record,
)
from shardless.processor.local.faults.fault_proxy import FaultProxy
from shardless.processor.local.faults.partial_failures import PartialFailure

pytestmark = pytest.mark.slow

SCHEMA = "slice int, batch_id long, seq int, key string, value string"


def outputs(spark, n: int, batch_id: int, partitions: int = 3):  # noqa: ANN001, ANN201
    """A batch's output rows as the job hands them to a sink: n outputs over 16 slices."""
    rows = []
    per_slice: Counter[int] = Counter()
    for i in range(n):
        s, key = i % 16, f"user-{i % 40}"
        value = json.dumps({"user": key, "i": i})
        rows.append((s, batch_id, per_slice[s], key, value))
        per_slice[s] += 1
    return spark.createDataFrame(rows, SCHEMA).repartition(partitions), rows


def read_stream(kinesis, stream: str) -> list[tuple[str, dict]]:  # noqa: ANN001
    """Every record of the stream as (partition key, decoded data)."""
    return [(r["PartitionKey"], json.loads(r["Data"])) for r in stream_records(kinesis, stream)]


def expected(rows: list[tuple]) -> dict[tuple[int, int], tuple[str, dict]]:
    return {(b, (s << 32) | q): (k, json.loads(v)) for s, b, q, k, v in rows}


@pytest.fixture
def partial_proxy(aws):  # noqa: ANN001, ANN201
    with FaultProxy(aws.kinesis_endpoint, seed=5) as proxy:
        yield proxy


def test_every_output_lands_once_keyed_and_numbered(spark, kinesis, make_stream):
    stream = make_stream(3)
    df, rows = outputs(spark, 1_300, batch_id=7)
    kinesis_sink(stream, base_delay_s=0.001, query_id="q")(df, 7)
    got = read_stream(kinesis, stream)
    assert len(got) == len(rows)
    by_id = {(d["batch_id"], d["seq"]): (pk, d) for pk, d in got}
    assert len(by_id) == len(rows)  # (batch_id, seq) is unique within the batch
    for ident, (key, value) in expected(rows).items():
        pk, data = by_id[ident]
        assert (pk, data["key"], data["value"]) == (key, key, value)


def test_the_sink_reads_its_batch_once_in_a_dataframe_action(spark, kinesis, make_stream):
    """Marked `reads_once`, the sink's read is the batch's one run: every output lands, the
    metrics rows come back observed, and nothing is cached."""
    from pyspark.sql import functions as F

    from shardless.processor.driver.batch_reads import deliver, is_read_once, reads_once
    from tests.processor.driver.test_batch_reads import cached_rdds

    stream = make_stream(2)
    df, rows = outputs(spark, 700, batch_id=3)
    metrics = spark.createDataFrame([(0, 3, 0, None, '{"group": 0}')], SCHEMA)
    batch = df.withColumn("kind", F.lit("out")).unionByName(
        metrics.withColumn("kind", F.lit("metrics"))
    )
    sink = kinesis_sink(stream, base_delay_s=0.001, query_id="q")
    cached: list[int] = []

    @reads_once  # as the sink itself is
    def watched(df, batch_id: int) -> None:  # noqa: ANN001
        sink(df, batch_id)
        cached.append(cached_rdds(spark))

    assert is_read_once(sink)
    assert deliver(batch, 3, watched) == ['{"group": 0}']
    assert cached == [0]
    got = {
        (d["batch_id"], d["seq"]): (pk, d["key"], d["value"])
        for pk, d in read_stream(kinesis, stream)
    }
    assert got == {i: (k, k, v) for i, (k, v) in expected(rows).items()}


def test_an_output_too_big_for_a_record_is_refused_with_its_coordinates():
    with pytest.raises(KinesisSinkError, match=r"batch 3 \(key 'user-1'\) is \d+ bytes"):
        record("q", 3, 2, 5, "user-1", json.dumps("x" * (1024 * 1024)))


def test_partial_failures_retry_only_the_failed_entries(spark, kinesis, make_stream, partial_proxy):
    stream = make_stream(2)
    partial_proxy.set_partial(PartialFailure(probability=0.3))
    df, rows = outputs(spark, 1_200, batch_id=2)
    kinesis_sink(
        stream, endpoint_url=partial_proxy.url, attempts=30, base_delay_s=0.001, query_id="q"
    )(df, 2)
    assert partial_proxy.entries_failed > 100 and partial_proxy.calls_altered >= 3
    calls = partial_proxy.counts()[("kinesis", "PutRecords")]
    assert calls > len(list(chunks(record("q", 2, 0, i, "k", "1") for i in range(400)))) * 3
    got = read_stream(kinesis, stream)
    # failed entries never reached the stream and were put again alone: no duplicates
    assert sorted((d["batch_id"], d["seq"]) for _, d in got) == sorted(expected(rows))


def test_persistent_throttling_fails_the_batch_naming_stream_and_codes(
    spark, make_stream, partial_proxy
):
    stream = make_stream(1)
    partial_proxy.set_partial(PartialFailure(probability=1.0))
    df, _ = outputs(spark, 10, batch_id=5, partitions=1)
    with pytest.raises(Exception) as raised:
        kinesis_sink(
            stream, endpoint_url=partial_proxy.url, attempts=3, base_delay_s=0.001, query_id="q"
        )(df, 5)
    message = str(raised.value)
    assert "KinesisSinkError" in message
    assert (
        f"10 of 10 records of batch 5 could not be put into Kinesis stream '{stream}' after 3 "
        "attempts (failures: ProvisionedThroughputExceededException x30)"
    ) in message
    assert partial_proxy.counts()[("kinesis", "PutRecords")] == 3


def test_a_missing_stream_fails_at_once_with_the_code(aws):  # noqa: ANN001
    import boto3

    cfg = SinkConfig("no-such-stream", attempts=5, base_delay_s=0.001)
    with pytest.raises(KinesisSinkError, match="'no-such-stream': ResourceNotFoundException"):
        put_all(boto3.client("kinesis"), cfg, 1, [record("q", 1, 0, 0, "k", "1")])


def test_duplicates_of_a_retried_batch_and_lost_answers_are_dropped_by_query_batch_and_seq(
    spark, kinesis, make_stream, partial_proxy
):
    """Entries written but reported failed are put again, and Spark running a batch again
    puts all of it again: the stream holds duplicates, identical per (batch_id, seq)."""
    stream = make_stream(2)
    partial_proxy.set_partial(PartialFailure(probability=0.2, applied=True))
    sink = kinesis_sink(
        stream, endpoint_url=partial_proxy.url, attempts=30, base_delay_s=0.001, query_id="q"
    )
    df, rows = outputs(spark, 600, batch_id=4)
    sink(df, 4)
    sink(df, 4)  # the batch again, as after a failure between the sink and the checkpoint
    later, later_rows = outputs(spark, 100, batch_id=5)
    sink(later, 5)
    got = read_stream(kinesis, stream)
    assert partial_proxy.entries_failed > 0
    assert len(got) >= 2 * len(rows) + len(later_rows) + partial_proxy.entries_failed
    deduplicated: dict[tuple[str, int, int], dict] = {}
    for _, data in got:
        ident = (data["query"], data["batch_id"], data["seq"])
        assert deduplicated.setdefault(ident, data) == data  # a duplicate is the same record
    want = expected(rows) | expected(later_rows)
    assert {(b, n): (d["key"], d["value"]) for (q, b, n), d in deduplicated.items()} == want


def test_two_queries_batch_0_are_told_apart_by_their_query(spark, kinesis, make_stream, tmp_path):
    """Batch ids restart at 0 in every new checkpoint: a second query's batch 0 is not an
    old query's batch 0. Each record names its query (Spark's persistent query id), and
    (query, batch_id, seq) is unique across queries."""
    stream = make_stream(1)
    source = tmp_path / "in"
    source.mkdir()
    rows = [{"slice": s, "seq": 0, "key": f"user-{s}", "value": json.dumps(s)} for s in range(3)]
    (source / "part.json").write_text("\n".join(json.dumps(r) for r in rows))
    sink = kinesis_sink(stream, base_delay_s=0.001)
    ids = []
    for n in range(2):
        query = (
            spark.readStream.schema("slice int, seq int, key string, value string")
            .json(str(source))
            .writeStream.option("checkpointLocation", str(tmp_path / f"ck{n}"))
            .foreachBatch(sink)
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        ids.append(str(query.id))
    got = read_stream(kinesis, stream)
    assert len(got) == 6 and ids[0] != ids[1]
    assert sorted({d["query"] for _, d in got}) == sorted(ids)
    assert len({(d["query"], d["batch_id"], d["seq"]) for _, d in got}) == 6
    assert {d["batch_id"] for _, d in got} == {0}


def test_the_sink_outside_a_query_needs_a_query_id(spark, make_stream):
    stream = make_stream(1)
    df, _ = outputs(spark, 3, batch_id=0, partitions=1)
    with pytest.raises(ConfigError, match="query_id"):
        kinesis_sink(stream)(df, 0)
