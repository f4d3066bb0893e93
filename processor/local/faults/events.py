"""The harness's input: per-user JSON events in a Kinesis stream, and resharding it.

Events are what `examples/user_activity.py` reads (`{"user", "ts", "action"}`, partition
key = user). `ts` grows with every event produced into a stream, across rounds, so per
user the order of `ts` is the stream order: a handler that saw a user's events out of
order, or one twice, leaves a trace in its outputs (`check.py`).
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

from shardless.processor.kinesis.put import Retries, put_records

BASE_TS = 1_700_000_000_000


def create_stream(kinesis: Any, stream: str, shards: int) -> None:
    kinesis.create_stream(StreamName=stream, ShardCount=shards)
    wait_active(kinesis, stream)


def wait_active(kinesis: Any, stream: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        summary = kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]
        if summary["StreamStatus"] == "ACTIVE":
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"stream {stream} is not ACTIVE after {timeout_s}s")
        time.sleep(0.05)


# A stream is UPDATING (ResourceInUseException) for a moment after a reshard.
UPDATING = frozenset({"ResourceInUseException"})


def produce(
    kinesis: Any, stream: str, first: int, count: int, users: int, rng: random.Random
) -> int:
    """Put events `first .. first+count-1` (Zipf-like users); return the next index."""
    weights = [1.0 / (u + 1) ** 1.1 for u in range(users)]
    picks = rng.choices(range(users), weights=weights, k=count)
    entries = [
        {
            "PartitionKey": f"user-{u:04d}",
            "Data": json.dumps(
                {"user": f"user-{u:04d}", "ts": BASE_TS + (first + i) * 10, "action": "view"}
            ).encode(),
        }
        for i, u in enumerate(picks)
    ]
    put_records(
        kinesis, stream, entries, Retries(attempts=60, max_delay_s=1.0, also_retry=UPDATING)
    )
    return first + count


def open_shards(kinesis: Any, stream: str) -> list[dict]:
    """Open shards in hash-key order."""
    shards = kinesis.list_shards(StreamName=stream)["Shards"]
    live = [s for s in shards if "EndingSequenceNumber" not in s["SequenceNumberRange"]]
    return sorted(live, key=lambda s: int(s["HashKeyRange"]["StartingHashKey"]))


def reshard(kinesis: Any, stream: str, rng: random.Random) -> str:
    """Split a random open shard, or merge two adjacent ones; describe what was done."""
    shards = open_shards(kinesis, stream)
    if len(shards) > 1 and rng.random() < 0.5:
        i = rng.randrange(len(shards) - 1)
        left, right = shards[i], shards[i + 1]
        kinesis.merge_shards(
            StreamName=stream,
            ShardToMerge=left["ShardId"],
            AdjacentShardToMerge=right["ShardId"],
        )
        done = f"merged {left['ShardId']} and {right['ShardId']}"
    else:
        shard = rng.choice(shards)
        lo, hi = (int(shard["HashKeyRange"][k]) for k in ("StartingHashKey", "EndingHashKey"))
        kinesis.split_shard(
            StreamName=stream, ShardToSplit=shard["ShardId"], NewStartingHashKey=str((lo + hi) // 2)
        )
        done = f"split {shard['ShardId']}"
    wait_active(kinesis, stream)
    return done
