"""The whole stateful job running while UpdateShardCount takes its stream 1 → 2 → 4 → 2 shards.

kinesis-local is the only emulator with UpdateShardCount; like Kinesis, it refuses more than
double or less than half the open shards in one call, so 1 → 4 is two calls (1 → 2 → 4), and
each call closes every open shard. A keyed handler keeps, per key, a count and a hash chain of
the key's records in the order it processed them, and emits both with each record. The job
runs as a continuous query on the shared session while records are put in rounds of one per
key (per key, the put order is the round order); before each UpdateShardCount a burst leaves
the shards about to close with unread records, and every call comes while the query runs. The
sink fails, once, the first batch that reads the four shards of 2 → 4, after the batch
committed its state and wrote its outputs (as a driver lost before Spark's commit log): the
query starts again from its checkpoint and runs that batch again, to the same outputs.

Then, against a plain-Python fold of the records as put: the outputs, each exactly once and
per key in put order (batch by batch); the state rebuilt from S3 and DynamoDB alone; and
records from every shard generation. It runs twice: polling, and through an enhanced
fan-out consumer. `tests/processor/kinesis/test_reshard.py` proves the
order at the source alone (2 → 4 → 2 → 1), `test_source_reshard_job.py` the whole job
across splits and merges on kinesalite.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
from pyspark.errors import StreamingQueryException

from shardless.changelog.layout import AppLocation
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.driver.config import JobConfig
from shardless.processor.driver.job import BatchReport, parquet_sink, start
from shardless.processor.kinesis.client import kinesis_client
from shardless.processor.local import demo
from shardless.processor.local.faults import check
from tests.e2e.test_source_reshard_job import processed
from tests.jobs import job_config
from tests.processor.kinesis import test_reshard
from tests.processor.kinesis.test_fan_out_source import fan_out_ends
from tests.processor.kinesis.test_reshard import (
    Producer,
    create_stream,
    update_shard_count,
)

pytestmark = pytest.mark.slow

TIMEOUT_S = 90
FAILED = "the sink fails the first batch of a new generation"
kinesis_local = test_reshard.kinesis_local  # its fixture: a kinesis-local for this module


def chain(before: str, data: str) -> str:
    return hashlib.sha256(f"{before}|{data}".encode()).hexdigest()[:16]


def process(event, ctx) -> None:  # noqa: ANN001
    data = event.data.decode()
    seen = ctx.state.get({"n": 0, "chain": ""})
    seen = {"n": seen["n"] + 1, "chain": chain(seen["chain"], data)}
    ctx.state.set(seen)
    ctx.emit({"key": event.key, **seen, "data": data, "shard": event.shard})


def fold(sent: dict[str, list[bytes]]) -> tuple[dict[str, dict], dict[str, list[tuple]]]:
    """The final state per key, and the outputs `(n, chain, data)` per key in order."""
    state: dict[str, dict] = {}
    outputs: dict[str, list[tuple]] = {}
    for key, records in sent.items():
        seen = {"n": 0, "chain": ""}
        outputs[key] = []
        for raw in records:
            data = raw.decode()
            seen = {"n": seen["n"] + 1, "chain": chain(seen["chain"], data)}
            outputs[key].append((seen["n"], seen["chain"], data))
        state[key] = seen
    return state, outputs


class FailOnce:
    """The job's Parquet sink, which fails once when armed: at the first batch with an output
    from a shard it was not armed with, once that batch's outputs are written."""

    def __init__(self, out_dir: str) -> None:
        self.write = parquet_sink(out_dir)
        self.known: set[str] | None = None
        self.failed_batch: int | None = None
        self.failed_outputs: list[str] = []

    def arm(self, known: set[str]) -> None:
        self.known = known

    def __call__(self, df, batch_id: int) -> None:  # noqa: ANN001
        self.write(df, batch_id)
        if self.known is None or self.failed_batch is not None:
            return
        values = sorted(r.value for r in df.collect())
        if any(json.loads(v)["shard"] not in self.known for v in values):
            self.failed_batch, self.failed_outputs = batch_id, values
            raise RuntimeError(f"{FAILED} (batch {batch_id})")


def wait_for(done: Callable[[], bool], query, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + TIMEOUT_S
    while not done():
        assert query.exception() is None, query.exception()
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.1)


def run(spark, cfg: JobConfig, sink: FailOnce, reports: list[BatchReport]):  # noqa: ANN001, ANN201
    return start(
        spark,
        HandlerFactory(process),
        cfg,
        sink=sink,
        on_report=reports.append,
        processing_time="200 milliseconds",
    )


@pytest.mark.parametrize("fan_out", [False, True], ids=["polling", "fan-out"])
def test_the_job_stays_exact_and_in_order_while_update_shard_count_goes_1_2_4_2(
    spark, kinesis_local: str, location: AppLocation, tmp_path: Path, fan_out: bool
) -> None:
    """With `fan_out`, the job reads through a stream consumer (`--consumer-name`): every
    batch subscribes to each shard again, which kinesis-local holds about 3 s after the last
    subscription closed, so its batches are larger and fewer."""
    kinesis = kinesis_client(kinesis_local)
    stream = create_stream(kinesis, f"u-{location.app}", 1)
    producer = Producer(kinesis, stream)  # 30 keys, one record each per round
    cfg = job_config(
        location, (stream,), tmp_path,
        kinesis_endpoint=kinesis_local, max_records_per_shard=45 if fan_out else 20,
        idle_poll_ms=200, consumer_name=f"efo-{location.app}" if fan_out else None,
    )  # fmt: skip
    out_dir = str(tmp_path / "outputs")
    sink = FailOnce(out_dir)
    reports: list[BatchReport] = []
    producer.produce(2)
    query = run(spark, cfg, sink, reports)
    try:
        wait_for(lambda: processed(reports) > 0, query, "the first batch")
        producer.produce(2)  # a backlog in the shard about to close
        update_shard_count(kinesis, stream, 2)
        producer.produce(2)
        sink.arm({s["ShardId"] for s in kinesis.list_shards(StreamName=stream)["Shards"]})
        update_shard_count(kinesis, stream, 4)
        producer.produce(2)

        with contextlib.suppress(StreamingQueryException):
            query.awaitTermination(TIMEOUT_S)
        assert sink.failed_batch is not None, f"the sink never failed: {query.exception()}"
        assert FAILED in str(query.exception())
        query = run(spark, cfg, sink, reports)  # runs the failed batch again
        wait_for(lambda: any(r.batch_id == sink.failed_batch for r in reports), query, "the re-run")

        producer.produce(2)  # a backlog in the four shards about to close
        update_shard_count(kinesis, stream, 2)
        producer.produce(2)
        wait_for(lambda: processed(reports) >= producer.total, query, "every record")
        settled = len(reports)
        wait_for(lambda: len(reports) >= settled + 2, query, "two more batches")
    finally:
        query.stop()
    assert query.exception() is None
    assert processed(reports) == producer.total == 12 * 30

    rows = sorted(check.output_rows(out_dir))
    again = [v for b, v in rows if b == sink.failed_batch]
    assert again == sink.failed_outputs, "the re-run gave the failed attempt's outputs"
    expected_state, expected_outputs = fold(producer.sent)
    got: dict[str, list[tuple]] = defaultdict(list)
    shards = set()
    for batch, value in rows:
        v = json.loads(value)
        got[v["key"]].append((batch, v["n"], v["chain"], v["data"]))
        shards.add(v["shard"])
    for key, want in expected_outputs.items():
        outputs = [o[1:] for o in sorted(got.pop(key, []))]
        assert outputs == want, f"{key}: outputs {outputs}, expected {want}"
    assert not got, f"outputs for keys never put: {sorted(got)}"
    rebuilt, _ = demo.durable_state(cfg, tmp_path / "verify")
    assert rebuilt == expected_state

    every_shard = {s["ShardId"] for s in kinesis.list_shards(StreamName=stream)["Shards"]}
    assert len(every_shard) == 1 + 2 + 4 + 2
    assert shards == every_shard, "records from every generation"
    ends = fan_out_ends(location)
    assert ends and all(e.get("fan_out", False) == fan_out for e in ends), "how batches read"
