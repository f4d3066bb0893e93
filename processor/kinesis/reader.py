"""Reading one shard for one batch, on an executor.

A fresh read stops at the first of: the per-batch record or byte bound, the shard's end,
or catching up with the stream; then it records where it stopped, with the read's
metrics. A repeated read of the same batch (retry or speculative copy) reads exactly up to
the recorded end. KPL aggregates are expanded into their user records (see `kpl`); an
aggregate is never split across batches, so positions stay whole Kinesis records.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import ClientError

from shardless.processor.errors import SourceError
from shardless.processor.kinesis import kpl
from shardless.processor.kinesis.batch_log import BatchLog
from shardless.processor.kinesis.positions import Position, iterator_args

log = logging.getLogger(__name__)

MIN_CALL_INTERVAL_S = 0.2  # Kinesis allows 5 GetRecords calls per second per shard
_THROTTLED = {"ProvisionedThroughputExceededException", "LimitExceededException"}
# Kinesis keeps records at least 24 hours. A position whose unread records are younger than
# the retention less this margin is resumed without asking Kinesis whether it still holds it.
MIN_RETENTION_S = 24 * 3600
RETENTION_MARGIN_S = 3600
POLICIES = ("fail", "oldest")
CORRUPT_POLICIES = ("fail", "skip")
_now = time.time  # the wall clock; a module attribute so tests can move it


@dataclass(frozen=True)
class ShardRead:
    """One input partition: a shard, where to start, and the batch it belongs to."""

    run: str
    n: int
    stream: str
    shard_id: str
    depth: int
    start: Position | None
    initial: dict[str, Any]
    max_records: int
    max_bytes: int
    closed: bool = False
    on_trimmed: str = "fail"
    on_corrupt: str = "fail"
    # The enhanced fan-out consumer to read through (`fan_out_batch`); None: GetRecords.
    consumer_arn: str | None = None

    @property
    def shard_key(self) -> str:
        return f"{self.stream}/{self.shard_id}"

    def where(self, sequence_number: str | None = None) -> str:
        at = f"stream {self.stream!r} shard {self.shard_id}"
        return at if sequence_number is None else f"{at} sequence number {sequence_number}"


class _ThrottleCounter:
    """Counts throttled Kinesis calls, including those botocore retries on its own."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, response=None, **_: Any) -> None:  # noqa: ANN001 - botocore's hook
        if response is not None and response[1].get("Error", {}).get("Code") in _THROTTLED:
            self.count += 1


class _Shard:
    """GetRecords over one shard with call pacing, throttling backoff and iterator renewal.

    Throttles are counted through botocore's `needs-retry` hook on the client, so they are
    attributed to this read as long as the process reads one shard at a time (a Spark Python
    worker runs one task at a time). Call `close()` to remove the hook.
    """

    def __init__(self, kinesis, read: ShardRead, from_oldest: bool = False) -> None:  # noqa: ANN001
        self.kinesis = kinesis
        self.read = read
        self.from_oldest = from_oldest
        self.last_seq: str | None = None if from_oldest else (read.start or {}).get("after")
        self._last_call = 0.0
        self.calls = 0
        self.tip_seen_at: float | None = None
        self._throttles = _ThrottleCounter()
        self._hook_id = f"shardless-throttles-{uuid.uuid4().hex}"
        kinesis.meta.events.register("needs-retry.kinesis", self._throttles, self._hook_id)
        self._iterator: str | None = None

    @property
    def throttles(self) -> int:
        return self._throttles.count

    def close(self) -> None:
        self.kinesis.meta.events.unregister("needs-retry.kinesis", unique_id=self._hook_id)

    def _call(self, method: str, **kwargs: Any) -> dict:
        """One Kinesis call, retried with jittered backoff while throttled; GetRecords calls
        are paced (GetShardIterator has a quota of its own)."""
        attempt = 0
        while True:
            if method == "get_records":
                wait = self._last_call + MIN_CALL_INTERVAL_S - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self._last_call = time.monotonic()
            try:
                return getattr(self.kinesis, method)(**kwargs)
            except ClientError as exc:
                if exc.response["Error"]["Code"] in _THROTTLED and attempt < 10:
                    attempt += 1
                    time.sleep(random.uniform(0, min(5.0, 0.1 * 2**attempt)))
                    continue
                raise

    def _new_iterator(self, args: dict[str, Any] | None = None) -> str:
        if args is None:
            if self.last_seq is not None:
                args = iterator_args({"after": self.last_seq}, self.read.initial)
            elif self.from_oldest:
                args = {"ShardIteratorType": "TRIM_HORIZON"}
            else:
                args = iterator_args(None, self.read.initial)
        try:
            return self._call(
                "get_shard_iterator",
                StreamName=self.read.stream,
                ShardId=self.read.shard_id,
                **args,
            )["ShardIterator"]
        except ClientError as exc:
            code = exc.response["Error"]["Code"]
            if code == "ResourceNotFoundException":
                raise SourceError(
                    f"shard {self.read.shard_key} is gone (stream deleted, or the position "
                    f"{self.last_seq} is past the stream's retention)"
                ) from exc
            if code == "InvalidArgumentException" and self.last_seq is not None:
                raise SourceError(
                    f"{self.read.where()}: Kinesis refuses the source's position (after "
                    f"sequence number {self.last_seq}): {exc.response['Error'].get('Message')}; "
                    "was the stream deleted and created again under the same name?"
                ) from exc
            raise

    def next(self, limit: int) -> tuple[list[dict], bool, int | None]:
        """One GetRecords call: records, whether the shard ended, MillisBehindLatest."""
        while True:
            if self._iterator is None:
                self._iterator = self._new_iterator()
            called_at = _now()
            try:
                out = self._call("get_records", ShardIterator=self._iterator, Limit=limit)
            except ClientError as exc:
                code = exc.response["Error"]["Code"]
                if code == "ExpiredIteratorException":
                    self._iterator = None
                    continue
                if code == "ResourceNotFoundException":
                    raise SourceError(
                        f"shard {self.read.shard_key} is gone (stream deleted while it was "
                        "being read)"
                    ) from exc
                raise
            self.calls += 1
            records = out["Records"]
            behind = out.get("MillisBehindLatest")
            if records:
                self.last_seq = records[-1]["SequenceNumber"]
            if len(records) < limit and behind in (0, None):
                self.tip_seen_at = called_at
            self._iterator = out.get("NextShardIterator")
            return records, self._iterator is None, behind

    def holds(self, sequence_number: str) -> bool:
        """Whether the record `sequence_number` is still readable (not past retention)."""
        try:
            it = self._new_iterator(
                {
                    "ShardIteratorType": "AT_SEQUENCE_NUMBER",
                    "StartingSequenceNumber": sequence_number,
                }
            )
        except (SourceError, ClientError):
            return False  # kinesis-local and AWS refuse some expired sequence numbers outright
        for _ in range(5):  # AWS may answer with empty pages before the first record
            out = self._call("get_records", ShardIterator=it, Limit=1)
            if out["Records"]:
                return out["Records"][0]["SequenceNumber"] == sequence_number
            it = out.get("NextShardIterator")
            if not it or not out.get("MillisBehindLatest"):
                return False
        return False


def read_shard(kinesis, batch_log: BatchLog, read: ShardRead) -> tuple[list[dict], dict]:  # noqa: ANN001
    """User records of `read` for its batch and the end recorded for it, by GetRecords.

    Each user record is a dict with Kinesis' own names plus `SubSequenceNumber` (its index in
    a KPL aggregate, 0 for a plain record) and `ExplicitHashKey` (from the aggregate, else
    None: GetRecords does not return it for plain records).
    """
    return read_batch(kinesis, batch_log, read, _fresh, _replay)


Fresh = Callable[[Any, ShardRead], tuple[list[dict], dict]]
Replay = Callable[[Any, ShardRead, dict], list[dict]]


def read_batch(
    kinesis,  # noqa: ANN001
    batch_log: BatchLog,
    read: ShardRead,
    fresh: Fresh,
    replay: Replay,
) -> tuple[list[dict], dict]:
    """The batch's records of one shard, exactly once whichever attempt reads them: a recorded
    end is replayed; else a fresh read records its end with a conditional put, and an attempt
    that lost the put replays the winner's end. `fresh` and `replay` read the shard (GetRecords
    here, SubscribeToShard in `fan_out_batch`); both record and replay ends of one shape."""
    recorded = batch_log.recorded_end(read.run, read.n, read.shard_key)
    if recorded is not None:
        return replay(kinesis, read, recorded), recorded
    records, end = fresh(kinesis, read)
    winner = batch_log.record_end(read.run, read.n, read.shard_key, end)
    if winner != end:
        log.info(
            "batch %s shard %s: another attempt recorded its end first", read.n, read.shard_key
        )
        return replay(kinesis, read, winner), winner
    return records, end


def _fresh(kinesis, read: ShardRead) -> tuple[list[dict], dict]:  # noqa: ANN001
    began = time.monotonic()
    from_oldest = position_expired(kinesis, read)
    shard = _Shard(kinesis, read, from_oldest=from_oldest)
    try:
        raw: list[dict] = []
        size = 0
        done = caught_up = False
        behind: int | None = None
        peeked: dict | None = None  # the oldest record left unread, when the last call saw it
        answered_at = _now()
        while len(raw) < read.max_records and size < read.max_bytes:
            want = read.max_records - len(raw)
            # One record more than the bound allows, when a call may return it: the oldest
            # record the batch leaves unread, whose arrival is the batch's lag (`unread_arrival`).
            limit = min(10_000, want + 1)
            got, done, behind = shard.next(limit)
            answered_at = _now()
            if len(got) > want:
                peeked, got = got[want], got[:want]
                shard.last_seq = got[-1]["SequenceNumber"]
            raw += got
            size += sum(len(r["Data"]) for r in got)
            caught_up = peeked is None and len(got) < limit and behind in (0, None)
            # A closed shard is read until Kinesis says it ended, so its children can start.
            if done or peeked is not None or (caught_up and not read.closed):
                break
    finally:
        shard.close()
    if peeked is not None:
        done = False  # the shard has records left: the iterator went past one of them
    records, skipped = expand(read, raw)
    if caught_up and shard.tip_seen_at is not None:
        since = shard.tip_seen_at  # every record that arrived before this call was read
    elif raw:
        since = raw[-1]["ApproximateArrivalTimestamp"].timestamp()
    else:
        since = None  # unknown: the position keeps the previous one
    end = {
        "after": shard.last_seq,
        "done": done,
        "caught_up": done or caught_up,
        "count": len(raw),
        "user_records": len(records),
        "bytes": size,
        "behind_ms": behind,
        "unread_arrival_ms": unread_arrival(peeked, done or caught_up, behind, answered_at),
        "throttles": shard.throttles,
        "calls": shard.calls,
        "read_ms": round((time.monotonic() - began) * 1000),
        "since": since,
    }
    return records, finish_end(end, read, skipped, from_oldest)


def finish_end(end: dict, read: ShardRead, skipped: int, from_oldest: bool) -> dict:
    """A shard's batch end with the marks only some reads carry, logged: what either reader
    (polling, or `fan_out_batch`) records for the batch."""
    if skipped:
        end["skipped_aggregates"] = skipped
    if from_oldest:
        end["from_oldest"] = True
    log.info("batch %s shard %s: %s", read.n, read.shard_key, metrics_text(end))
    return end


def unread_arrival(
    peeked: dict | None, finished: bool, behind: int | None, answered_at: float
) -> int | None:
    """Arrival time (epoch ms) of the oldest record a read left unread in its shard; None
    when it left none (it caught up with the stream or reached the shard's end).

    Exact when the read's last call returned that record (see `_fresh`); otherwise
    Kinesis' own measure, the last answer's time less its MillisBehindLatest. A read that
    stopped at its bounds with MillisBehindLatest 0 left nothing Kinesis counts as behind.
    """
    if peeked is not None:
        return round(peeked["ApproximateArrivalTimestamp"].timestamp() * 1000)
    if finished or not behind:
        return None
    return round(answered_at * 1000) - int(behind)


def metrics_text(end: dict) -> str:
    """The metrics of a recorded end, for the log."""
    calls = (
        f"{end.get('throttles', 0)} subscriptions refused as held, {end.get('calls', 0)} "
        f"subscriptions, {end.get('events', 0)} events"
        if end.get("fan_out")
        else f"{end.get('throttles', 0)} throttled calls, {end.get('calls', 0)} GetRecords calls"
    )
    return (
        f"{end['count']} records ({end.get('user_records', end['count'])} user records), "
        f"{end.get('bytes', 0)} bytes, {end.get('behind_ms')} ms behind, {calls} in "
        f"{end.get('read_ms', 0)} ms"
    )


def _replay(kinesis, read: ShardRead, end: dict) -> list[dict]:  # noqa: ANN001
    """Read exactly the records a previous attempt read: up to and including `end.after`."""
    if end["count"] == 0:
        return []
    shard = _Shard(kinesis, read, from_oldest=bool(end.get("from_oldest")))
    raw: list[dict] = []
    try:
        while True:
            got, done, behind = shard.next(10_000)
            for r in got:
                raw.append(r)
                if r["SequenceNumber"] == end["after"]:
                    return expand(read, raw)[0]
            if done or (not got and behind in (0, None)):
                raise SourceError(
                    f"batch {read.n} {read.where()}: replay found {len(raw)} of the "
                    f"{end['count']} records recorded, without reaching recorded end "
                    f"{end['after']}; the records may be past the stream's retention"
                )
    finally:
        shard.close()


def expand(read: ShardRead, raw: list[dict]) -> tuple[list[dict], int]:
    """User records of the Kinesis records `raw`, KPL aggregates expanded; and how many
    corrupt aggregates were skipped (only with on_corrupt="skip", else SourceError)."""
    out: list[dict] = []
    skipped = 0
    for r in raw:
        data = r["Data"]
        if not kpl.is_aggregated(data):
            r["SubSequenceNumber"] = 0  # the response's own dict: cheaper than a copy
            r["ExplicitHashKey"] = None
            out.append(r)
            continue
        try:
            users = kpl.deaggregate(data)
        except kpl.CorruptAggregate as exc:
            where = read.where(r["SequenceNumber"])
            if read.on_corrupt == "skip":
                skipped += 1
                log.warning("skipping a corrupt KPL aggregate at %s: %s", where, exc)
                continue
            raise SourceError(
                f"corrupt KPL aggregate at {where}: {exc}; to skip such records (each one "
                "logged), set the source option onCorruptAggregate=skip"
            ) from exc
        for sub, user in enumerate(users):
            out.append(
                {
                    "SequenceNumber": r["SequenceNumber"],
                    "SubSequenceNumber": sub,
                    "ApproximateArrivalTimestamp": r["ApproximateArrivalTimestamp"],
                    "PartitionKey": user.partition_key,
                    "ExplicitHashKey": user.explicit_hash_key,
                    "Data": user.data,
                }
            )
    return out, skipped


def position_expired(kinesis, read: ShardRead) -> bool:  # noqa: ANN001
    """Whether the read must start at the oldest record because its position expired.

    A position is suspect only when its unread records (those after `after`) may be older
    than the stream's retention: `since` is a lower bound on their arrival time. Kinesis is
    then asked whether it still holds the record at `after`; trimming goes oldest first, so
    if it does, nothing after it was lost. Otherwise the read fails (on_trimmed="fail") or
    restarts at TRIM_HORIZON with a warning (on_trimmed="oldest").
    """
    start = read.start or {}
    after, since = start.get("after"), start.get("since")
    if after is None or since is None:
        return False
    age_s = _now() - float(since)
    if age_s < MIN_RETENTION_S - RETENTION_MARGIN_S:
        return False
    summary = kinesis.describe_stream_summary(StreamName=read.stream)["StreamDescriptionSummary"]
    hours = int(summary["RetentionPeriodHours"])
    if age_s < hours * 3600 - RETENTION_MARGIN_S:
        return False
    probe = _Shard(kinesis, read)
    try:
        if probe.holds(after):
            return False
    finally:
        probe.close()
    unread_since = datetime.fromtimestamp(float(since), UTC).isoformat(timespec="seconds")
    message = (
        f"{read.where()}: the source's position (after sequence number {after}) is older "
        f"than the stream's retention of {hours} h: that record is no longer readable, and "
        f"records that arrived after it from {unread_since} on may have expired unread"
    )
    if read.on_trimmed == "oldest":
        log.warning("%s; onTrimmed=oldest: continuing from the oldest record in the shard", message)
        return True
    raise SourceError(
        f"{message}. To continue from the oldest record still in the shard, set the source "
        "option onTrimmed=oldest"
    )
