"""The source's batch log collected as tightly as it allows (`batchLogRetain=0`,
`batchLogGcEvery=1`) under a query that fails and is restarted (real Spark, kinesalite,
moto): everything before the last batch Spark committed is gone, and the restart still
replays the failed batch exactly, from records that must therefore still be there."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException

from shardless.changelog.layout import AppLocation
from shardless.processor.driver import recorder
from shardless.processor.kinesis.batch_log import BatchLog

pytestmark = pytest.mark.slow

BOUND = 10
FAIL_AT = 3  # the Spark batch whose sink fails once
TIMEOUT_S = 120


class Sink:
    """Keeps each batch's rows; with `fail`, fails batch FAIL_AT once, keeping that
    attempt's rows apart."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.batches: dict[int, list[tuple[str, bytes]]] = {}
        self.failed: list[tuple[str, bytes]] | None = None

    def __call__(self, df, batch_id: int) -> None:  # noqa: ANN001
        rows = sorted((r.sequence_number, bytes(r.data)) for r in df.collect())
        if self.fail and batch_id == FAIL_AT:
            self.failed = rows
            raise RuntimeError(f"the sink fails batch {batch_id}")
        self.batches[batch_id] = rows


def produce(kinesis, stream: str, first: int, count: int) -> list[bytes]:  # noqa: ANN001
    data = [f"r-{i}".encode() for i in range(first, first + count)]
    records = [{"Data": d, "PartitionKey": "k"} for d in data]
    assert kinesis.put_records(StreamName=stream, Records=records)["FailedRecordCount"] == 0
    return data


def run(spark, stream: str, location: AppLocation, checkpoint: Path, sink: Sink) -> Any:  # noqa: ANN001
    query = (
        spark.readStream.format("shardless_kinesis")
        .options(
            streams=stream,
            table=location.table,
            slices="16",
            maxRecordsPerShard=str(BOUND),
            batchLogRetain="0",
            batchLogGcEvery="1",
        )  # fmt: skip
        .load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    try:
        with contextlib.suppress(StreamingQueryException):
            query.awaitTermination(TIMEOUT_S)
    finally:
        if query.isActive:
            query.stop()
    return query


def kept(log: BatchLog, run_id: str) -> tuple[list[int], list[int]]:
    """The batches of the run whose ends, and whose positions, the batch log still holds."""
    ends = sorted({int(sk.split("#")[1]) for sk in log._keys(run_id, "end#", "end#~")})
    positions = sorted(int(sk.split("#")[1]) for sk in log._keys(run_id, "pos#", "pos#~"))
    return ends, positions


def test_a_restart_replays_its_failed_batch_from_a_batch_log_collected_to_the_bone(
    spark, kinesis, make_stream: Callable[[int], str], location: AppLocation, tmp_path: Path
) -> None:
    stream = make_stream(1)
    sent = produce(kinesis, stream, 0, 6 * BOUND)
    checkpoint = tmp_path / "ck"
    log = BatchLog(location.table)

    first = Sink(fail=True)
    query = run(spark, stream, location, checkpoint, first)
    assert "the sink fails batch 3" in str(query.exception())
    assert first.failed is not None and len(first.failed) == BOUND
    offset = recorder.checkpoint_offset(spark, str(checkpoint), FAIL_AT)
    run_id, failed_n = offset["run"], int(offset["n"])
    committed_n = int(recorder.checkpoint_offset(spark, str(checkpoint), FAIL_AT - 1)["n"])
    assert failed_n == committed_n + 1 == FAIL_AT + 1
    # Spark committed batch 2 (source batch 3) before it planned batch 3: everything
    # before it is gone; its positions, its ends and the failed batch's ends are not.
    assert kept(log, run_id) == ([committed_n, failed_n], [committed_n])
    assert log.collected_below(run_id) == committed_n

    later = produce(kinesis, stream, 6 * BOUND, 2 * BOUND)  # a fresh read would find these
    second = Sink(fail=False)
    query = run(spark, stream, location, checkpoint, second)
    assert query.exception() is None
    assert min(second.batches) == FAIL_AT
    assert second.batches[FAIL_AT] == first.failed, "the restart replays the failed batch"

    delivered = [
        d for s in (first, second) for _, rows in sorted(s.batches.items()) for _, d in rows
    ]
    assert delivered == sent + later, "every record once, in order"

    last = max(second.batches)
    last_n = int(recorder.checkpoint_offset(spark, str(checkpoint), last)["n"])
    before_n = int(recorder.checkpoint_offset(spark, str(checkpoint), last - 1)["n"])
    assert kept(log, run_id) == ([before_n, last_n], [before_n, last_n])
