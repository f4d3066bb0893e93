"""A batch retried through Spark: the same rows again, whatever arrived in between.

The sink fails the first batch that caught up with a shard (so a fresh read of that shard
would now find more). Spark has logged the batch's offsets but not committed it; the query
restarted from its checkpoint runs the same batch again, and the source must replay exactly
the recorded ends: the same rows, none of the records produced after the failure. Then the
rest of the stream follows, and per key the delivered records fold to what a plain-Python
fold of the produced records gives.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException

from shardless.changelog.layout import AppLocation

pytestmark = pytest.mark.slow

KEYS = [f"user-{i}" for i in range(30)]
MAX_PER_SHARD = 50
TIMEOUT_S = 120


class SinkFailure(Exception):
    pass


class Sink:
    """Keeps each batch's rows; fails the first batch that is short of the bound (a shard
    caught up in it) once, after keeping that attempt's rows apart."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.batches: dict[int, list[dict[str, Any]]] = {}
        self.failed: tuple[int, list[dict[str, Any]]] | None = None

    def __call__(self, df, batch_id: int) -> None:  # noqa: ANN001
        rows = [r.asDict() for r in df.collect()]
        if self.fail and self.failed is None and 0 < len(rows) < 2 * MAX_PER_SHARD:
            self.failed = (batch_id, rows)
            raise SinkFailure(f"the sink fails batch {batch_id}")
        self.batches[batch_id] = rows


def produce(kinesis, stream: str, rounds: range) -> dict[str, list[bytes]]:  # noqa: ANN001
    """One record per key per round; per key, the data in produce order."""
    sent: dict[str, list[bytes]] = defaultdict(list)
    for r in rounds:
        batch = [{"Data": f"{k}:{r}".encode(), "PartitionKey": k} for k in KEYS]
        assert kinesis.put_records(StreamName=stream, Records=batch)["FailedRecordCount"] == 0
        for record in batch:
            sent[record["PartitionKey"]].append(record["Data"])
    return sent


def run(spark, stream: str, location: AppLocation, checkpoint: Path, sink: Sink):  # noqa: ANN001, ANN201
    query = (
        spark.readStream.format("shardless_kinesis")
        .options(
            streams=stream,
            table=location.table,
            slices="16",
            maxRecordsPerShard=str(MAX_PER_SHARD),
        )
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


def test_a_batch_retried_after_a_failure_reads_the_same_records_and_no_new_one(
    spark, kinesis, make_stream: Callable[[int], str], location: AppLocation, tmp_path: Path
) -> None:
    stream = make_stream(2)
    sent = produce(kinesis, stream, range(4))  # 120 records: one batch bounded, then short
    first = Sink(fail=True)
    query = run(spark, stream, location, tmp_path / "ck", first)
    assert first.failed is not None, "no batch caught up"
    assert "the sink fails batch" in str(query.exception())
    failed_batch, attempt = first.failed

    later = produce(kinesis, stream, range(4, 8))  # what a fresh read would now also find
    second = Sink(fail=False)
    query = run(spark, stream, location, tmp_path / "ck", second)
    assert query.exception() is None

    assert min(second.batches) == failed_batch, "the failed batch runs again"
    again = second.batches[failed_batch]
    key = ("shard", "sequence_number", "subsequence")
    assert sorted(tuple(r[k] for k in key) for r in again) == sorted(
        tuple(r[k] for k in key) for r in attempt
    ), "the retried batch replays exactly the rows of the failed attempt"
    assert not {bytes(r["data"]) for r in again} & {d for v in later.values() for d in v}

    delivered = [
        (batch, r["stream_order"], r["partition_key"], bytes(r["data"]))
        for sink in (first, second)
        for batch, rows in sink.batches.items()
        for r in rows
    ]
    copies = Counter((key, data) for _, _, key, data in delivered)
    assert max(copies.values()) == 1, "no record twice"
    per_key: dict[str, list[bytes]] = defaultdict(list)
    for _, _, key, data in sorted(delivered):  # the order a job processes them in
        per_key[key].append(data)
    # The reference fold per key is its records in produce order (any fold follows from it).
    assert per_key == {k: sent[k] + later[k] for k in KEYS}
