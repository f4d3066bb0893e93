"""One shard's batch read over enhanced fan-out, with the polling reader's exactly-once batches.

The source reads through a registered consumer when its option `consumerName` is set (each
`ShardRead` then carries the consumer's ARN). The batch protocol is the polling reader's
(`reader.read_batch`): an end already recorded for (run, batch, shard) is read again exactly,
with `fan_out.read(until=...)` (a recorded count of 0 reads nothing); otherwise a fresh read
with the same bounds records its end with the batch log's conditional put, and an attempt that
lost that put reads the winner's end instead. Ends have the polling reader's shape, so either
reader replays the other's; KPL aggregates are expanded by `reader.expand`, and shard lineage is
the source's (`shards.readable`: a child is read only once its parents are done).

Metrics in the end: `calls` counts the SubscribeToShard calls that delivered events and
`throttles` those refused because the shard's subscription was still held (the GetRecords
reader counts its calls and throttled calls there); `events` and `fan_out: true` are added.

Each batch subscribes once per shard, and Kinesis refuses a new SubscribeToShard on the same
consumer and shard within 5 seconds of the last successful one (kinesis-local holds a closed
subscription about 3 s). `fan_out.read` waits that out (for up to `fan_out.BUSY_RETRY_S`), so a
trigger shorter than 5 s only makes batches wait: with fan-out, use a trigger of at least 5 s
per batch.
"""

from __future__ import annotations

import time

from shardless.processor.kinesis import fan_out
from shardless.processor.kinesis.batch_log import BatchLog
from shardless.processor.kinesis.reader import (
    ShardRead,
    expand,
    finish_end,
    position_expired,
    read_batch,
    unread_arrival,
)

_now = time.time  # the wall clock; a module attribute so tests can move it


def read_shard(kinesis, batch_log: BatchLog, read: ShardRead) -> tuple[list[dict], dict]:  # noqa: ANN001
    """User records of `read` for its batch and the end recorded for it, read through the
    consumer `read.consumer_arn` (as `reader.read_shard` returns them)."""
    assert read.consumer_arn is not None, "a fan-out read needs a consumer"
    return read_batch(kinesis, batch_log, read, fresh, replay)


def fresh(kinesis, read: ShardRead) -> tuple[list[dict], dict]:  # noqa: ANN001
    """A first read of the shard for the batch, within its bounds, and the end to record."""
    began = time.monotonic()
    began_at = _now()
    from_oldest = position_expired(kinesis, read)
    got = fan_out.read(kinesis, read.consumer_arn, read, from_oldest=from_oldest)
    answered_at = _now()
    records, skipped = expand(read, list(got.records))
    after = got.after
    if after is None and not from_oldest:
        after = (read.start or {}).get("after")
    finished = got.done or got.caught_up
    if got.caught_up:
        # Nothing was left when the caught-up event came, after the subscription began: the
        # records still unread arrived later than that (and than the last record read).
        since = began_at
        if got.records:
            since = max(since, got.records[-1]["ApproximateArrivalTimestamp"].timestamp())
    elif got.records:
        since = got.records[-1]["ApproximateArrivalTimestamp"].timestamp()
    else:
        since = None  # unknown: the position keeps the previous one
    end = {
        "after": after,
        "done": got.done,
        "caught_up": finished,
        "count": len(got.records),
        "user_records": len(records),
        "bytes": got.bytes,
        "behind_ms": got.behind_ms,
        "unread_arrival_ms": unread_arrival(got.peeked, finished, got.behind_ms, answered_at),
        "throttles": got.busy_retries,
        "calls": got.subscriptions,
        "events": got.events,
        "fan_out": True,
        "read_ms": round((time.monotonic() - began) * 1000),
        "since": since,
    }
    return records, finish_end(end, read, skipped, from_oldest)


def replay(kinesis, read: ShardRead, end: dict) -> list[dict]:  # noqa: ANN001
    """Exactly the records a previous attempt read: up to and including `end.after`."""
    if end["count"] == 0:
        return []
    got = fan_out.read(
        kinesis,
        read.consumer_arn,
        read,
        until=end["after"],
        from_oldest=bool(end.get("from_oldest")),
    )
    return expand(read, got.records)[0]
