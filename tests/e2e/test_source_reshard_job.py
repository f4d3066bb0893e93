"""The whole job running while its stream splits and merges (kinesalite).

`examples/user_activity.py` (a count and last-seen time per user) runs as a continuous query on the
shared session while events are produced in bursts and the stream reshards between them: a split, a
split of a child, a merge of a child with its neighbour. Each burst leaves the shards about to close
with unread records. Then the durable state rebuilt from S3 and DynamoDB alone, the outputs, and the
per-user order of the outputs are compared with a plain-Python fold of the stream
(`processor/local/faults/check.py`). `tests/processor/kinesis/test_reshard.py` checks the same on
the source's rows alone, and UpdateShardCount on kinesis-local.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from shardless.changelog.layout import AppLocation
from shardless.processor.api.app import load_handler
from shardless.processor.driver.job import BatchReport, parquet_sink, start
from shardless.processor.local.faults import check, events
from shardless.processor.local.faults.driver import REPO
from tests.jobs import job_config

pytestmark = pytest.mark.slow

APP = REPO / "examples" / "user_activity.py"
USERS = 40
TIMEOUT_S = 120


def split(kinesis, stream: str, shard: dict) -> None:  # noqa: ANN001
    lo, hi = (int(shard["HashKeyRange"][k]) for k in ("StartingHashKey", "EndingHashKey"))
    kinesis.split_shard(
        StreamName=stream, ShardToSplit=shard["ShardId"], NewStartingHashKey=str((lo + hi) // 2)
    )
    events.wait_active(kinesis, stream)


def merge(kinesis, stream: str, left: dict, right: dict) -> None:  # noqa: ANN001
    kinesis.merge_shards(
        StreamName=stream, ShardToMerge=left["ShardId"], AdjacentShardToMerge=right["ShardId"]
    )
    events.wait_active(kinesis, stream)


def processed(reports: list[BatchReport]) -> int:
    """Records processed, counting each batch id once (its last report)."""
    return sum(r.records for r in {r.batch_id: r for r in reports}.values())


def test_the_job_stays_exact_and_in_order_while_the_stream_splits_and_merges(
    spark, kinesis, make_stream, location: AppLocation, tmp_path: Path
) -> None:
    stream = make_stream(2)
    rng = random.Random(11)
    cfg = job_config(location, (stream,), tmp_path, max_records_per_shard=100, idle_poll_ms=200)
    out_dir = str(tmp_path / "outputs")
    reports: list[BatchReport] = []
    produced = events.produce(kinesis, stream, 0, 200, USERS, rng)
    query = start(
        spark,
        load_handler(APP),
        cfg,
        sink=parquet_sink(out_dir),
        on_report=reports.append,
        processing_time="200 milliseconds",
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while processed(reports) == 0:  # the job runs before the first reshard
            assert query.exception() is None, query.exception()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        produced = events.produce(kinesis, stream, produced, 100, USERS, rng)  # a backlog
        split(kinesis, stream, events.open_shards(kinesis, stream)[0])  # 2 -> 3
        produced = events.produce(kinesis, stream, produced, 100, USERS, rng)
        split(kinesis, stream, events.open_shards(kinesis, stream)[0])  # a child: 3 -> 4
        produced = events.produce(kinesis, stream, produced, 100, USERS, rng)
        shards = events.open_shards(kinesis, stream)
        merge(kinesis, stream, shards[1], shards[2])  # grandchild with a child: 4 -> 3
        produced = events.produce(kinesis, stream, produced, 100, USERS, rng)
        while processed(reports) < produced:
            assert query.exception() is None, query.exception()
            assert time.monotonic() < deadline, f"{processed(reports)} of {produced}"
            time.sleep(0.2)
        settled = len(reports)
        while len(reports) < settled + 2:  # two more batches: nothing else may come
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        query.stop()
    assert query.exception() is None

    every_shard = kinesis.list_shards(StreamName=stream)["Shards"]
    assert len(every_shard) == 2 + 2 + 2 + 1
    problems, total = check.verify(kinesis, cfg, stream, out_dir, processed(reports))
    assert total == produced == 600
    assert problems == []
