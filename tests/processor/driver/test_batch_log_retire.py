"""A COMMITTED start retires the batch log of the run it continues (real Spark, kinesalite,
moto): once the new query has registered, the old run's records are gone, the new query
counts every record once, and the old checkpoint, fenced anyway, fails before it reads
anything, naming the retired run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from pyspark.errors import StreamingQueryException

from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.driver import recorder
from shardless.processor.driver.job import start
from shardless.processor.kinesis.batch_log import RETIRED, BatchLog
from tests.jobs import job_config

KEYS = [f"user-{i}" for i in range(8)]


def count(event, ctx) -> None:  # noqa: ANN001
    ctx.state.set(ctx.state.get(0) + 1)


def put(kinesis, stream: str, rounds: int) -> None:  # noqa: ANN001
    records = [{"Data": b"x", "PartitionKey": k} for _ in range(rounds) for k in KEYS]
    assert kinesis.put_records(StreamName=stream, Records=records)["FailedRecordCount"] == 0


def run(spark, cfg) -> int:  # noqa: ANN001
    """Run the job over what the stream holds; the records it processed."""
    reports: list = []
    query = start(
        spark, HandlerFactory(count), cfg, sink=lambda df, b: None, on_report=reports.append,
        available_now=True,
    )  # fmt: skip
    query.awaitTermination()
    return sum(r.records for r in reports)


def kept(log: BatchLog, run_id: str) -> int:
    return len(log._keys(run_id, "end#", "end#~") + log._keys(run_id, "pos#", "pos#~"))


@pytest.mark.slow
def test_a_committed_start_retires_the_batch_log_of_the_run_it_continues(
    spark, kinesis, make_stream, location, tmp_path: Path
) -> None:
    stream = make_stream(1)
    log = BatchLog(location.table)
    put(kinesis, stream, 3)
    first = job_config(location, (stream,), tmp_path, checkpoint="a")
    assert run(spark, first) == 3 * len(KEYS)
    old_run = recorder.checkpoint_offset(spark, first.checkpoint, 0)["run"]
    assert kept(log, old_run) > 0

    put(kinesis, stream, 2)
    second = replace(
        job_config(location, (stream,), tmp_path, checkpoint="b"), starting_position="COMMITTED"
    )
    assert run(spark, second) == 2 * len(KEYS)  # only what the first query had not read
    new_run = recorder.checkpoint_offset(spark, second.checkpoint, 0)["run"]
    assert new_run != old_run
    assert kept(log, old_run) == 0 and log.collected_below(old_run) == RETIRED
    assert kept(log, new_run) > 0

    # The old checkpoint can no longer run: it stops before reading, naming the run.
    with pytest.raises(StreamingQueryException, match=rf"source run {old_run} was retired"):
        run(spark, first)
