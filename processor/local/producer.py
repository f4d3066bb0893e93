"""Sample events for demos and trials: per-user JSON events, Zipf-skewed like real user ids.

shardless produce --stream demo-user-events --events 100000 --users 5000
"""

from __future__ import annotations

import json
import time

import numpy as np
from botocore.exceptions import ClientError

from shardless.processor.kinesis.put import Retries, put_records

# A trial's producer keeps going through throttling rather than give up on a record.
RETRIES = Retries(attempts=100, max_delay_s=1.0)


def ensure_stream(kinesis, stream: str, shards: int) -> None:  # noqa: ANN001 - boto3 client
    """Create the stream unless it exists, and wait until it is ACTIVE."""
    try:
        kinesis.create_stream(StreamName=stream, ShardCount=shards)
    except ClientError as exc:
        if exc.response["Error"]["Code"] != "ResourceInUseException":
            raise
    kinesis.get_waiter("stream_exists").wait(
        StreamName=stream, WaiterConfig={"Delay": 0.1, "MaxAttempts": 600}
    )


def produce(
    kinesis,  # noqa: ANN001 - boto3 client
    stream: str,
    events: int,
    users: int,
    zipf_s: float = 1.1,
    seed: int = 7,
) -> float:
    """Put `events` events keyed by user; return the seconds taken.

    Each event is `{"id", "user", "ts", "action", "page", "category", "amount"}`, enough for
    every example app but the enrichment one.

    Failed records of a PutRecords call are put again (`put_records`) until every one is in.
    """
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, users + 1) ** zipf_s
    picks = rng.choice(users, size=events, p=weights / weights.sum())
    actions = rng.choice(["view", "click", "buy"], size=events, p=[0.8, 0.17, 0.03])
    pages = rng.choice(["/", "/search", "/item", "/cart", "/checkout"], size=events)
    categories = rng.choice(["books", "games", "music", "garden"], size=events)
    amounts = np.round(rng.gamma(2.0, 15.0, size=events), 2)
    base = 1_700_000_000_000
    started = time.perf_counter()
    for lo in range(0, events, 500):
        batch = [
            {
                "PartitionKey": f"user-{picks[i]:05d}",
                "Data": json.dumps(
                    {
                        "id": f"e{seed}-{i}",
                        "user": f"user-{picks[i]:05d}",
                        "ts": base + i * 10,
                        "action": str(actions[i]),
                        "page": str(pages[i]),
                        "category": str(categories[i]),
                        "amount": float(amounts[i]),
                    }
                ).encode(),
            }
            for i in range(lo, min(lo + 500, events))
        ]
        put_records(kinesis, stream, batch, RETRIES)
    return time.perf_counter() - started
