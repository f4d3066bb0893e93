"""Reading one shard for one batch, on an executor.

A fresh read stops at the first of: the per-batch record or byte bound, the shard's end,
or catching up with the stream; then it records where it stopped. A repeated read of
the same batch (retry or speculative copy) reads exactly up to the recorded end.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from processor.errors import SourceError
from processor.kinesis.batch_log import BatchLog
from processor.kinesis.positions import Position, iterator_args

log = logging.getLogger(__name__)

MIN_CALL_INTERVAL_S = 0.2  # Kinesis allows 5 GetRecords calls per second per shard
_THROTTLED = {"ProvisionedThroughputExceededException", "LimitExceededException"}


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

    @property
    def shard_key(self) -> str:
        return f"{self.stream}/{self.shard_id}"


class _Shard:
    """GetRecords over one shard with call pacing, throttling backoff and iterator renewal."""

    def __init__(self, kinesis, read: ShardRead) -> None:  # noqa: ANN001 - boto3 client
        self.kinesis = kinesis
        self.read = read
        self.last_seq: str | None = read.start.get("after") if read.start else None
        self._iterator: str | None = self._new_iterator()
        self._last_call = 0.0
        self.throttles = 0

    def _new_iterator(self) -> str:
        args = iterator_args({"after": self.last_seq} if self.last_seq else None, self.read.initial)
        try:
            return self.kinesis.get_shard_iterator(
                StreamName=self.read.stream, ShardId=self.read.shard_id, **args
            )["ShardIterator"]
        except ClientError as exc:
            if exc.response["Error"]["Code"] == "ResourceNotFoundException":
                raise SourceError(
                    f"shard {self.read.shard_key} is gone (stream deleted, or the position "
                    f"{self.last_seq} is past the stream's retention)"
                ) from exc
            raise

    def next(self, limit: int) -> tuple[list[dict], bool, int | None]:
        """One GetRecords call: records, whether the shard ended, MillisBehindLatest."""
        attempt = 0
        while True:
            wait = self._last_call + MIN_CALL_INTERVAL_S - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self._last_call = time.monotonic()
            try:
                out = self.kinesis.get_records(ShardIterator=self._iterator, Limit=limit)
            except ClientError as exc:
                code = exc.response["Error"]["Code"]
                if code == "ExpiredIteratorException":
                    self._iterator = self._new_iterator()
                    continue
                if code == "ResourceNotFoundException":
                    raise SourceError(
                        f"shard {self.read.shard_key} is gone (stream deleted while it was "
                        "being read)"
                    ) from exc
                if code in _THROTTLED and attempt < 10:
                    self.throttles += 1
                    attempt += 1
                    time.sleep(random.uniform(0, min(5.0, 0.1 * 2**attempt)))
                    continue
                raise
            records = out["Records"]
            if records:
                self.last_seq = records[-1]["SequenceNumber"]
            self._iterator = out.get("NextShardIterator")
            return records, self._iterator is None, out.get("MillisBehindLatest")


def read_shard(kinesis, batch_log: BatchLog, read: ShardRead) -> tuple[list[dict], dict]:  # noqa: ANN001
    """Records of `read` for its batch and the end recorded for it."""
    recorded = batch_log.recorded_end(read.run, read.n, read.shard_key)
    if recorded is not None:
        return _replay(kinesis, read, recorded), recorded
    records, end = _fresh(kinesis, read)
    winner = batch_log.record_end(read.run, read.n, read.shard_key, end)
    if winner != end:
        log.info(
            "batch %s shard %s: another attempt recorded its end first", read.n, read.shard_key
        )
        return _replay(kinesis, read, winner), winner
    return records, end


def _fresh(kinesis, read: ShardRead) -> tuple[list[dict], dict]:  # noqa: ANN001
    shard = _Shard(kinesis, read)
    records: list[dict] = []
    size = 0
    done = caught_up = False
    behind: int | None = None
    while len(records) < read.max_records and size < read.max_bytes:
        limit = min(10_000, read.max_records - len(records))
        got, done, behind = shard.next(limit)
        records += got
        size += sum(len(r["Data"]) for r in got)
        caught_up = len(got) < limit and behind in (0, None)
        # A closed shard is read until Kinesis says it ended, so its children can start.
        if done or (caught_up and not read.closed):
            break
    end = {
        "after": shard.last_seq,
        "done": done,
        "caught_up": done or caught_up,
        "count": len(records),
        "bytes": size,
        "behind_ms": behind,
        "throttles": shard.throttles,
    }
    return records, end


def _replay(kinesis, read: ShardRead, end: dict) -> list[dict]:  # noqa: ANN001
    """Read exactly the records a previous attempt read: up to and including `end.after`."""
    if end["count"] == 0:
        return []
    shard = _Shard(kinesis, read)
    records: list[dict] = []
    while True:
        got, done, behind = shard.next(10_000)
        for r in got:
            records.append(r)
            if r["SequenceNumber"] == end["after"]:
                return records
        if done or (not got and behind in (0, None)):
            raise SourceError(
                f"batch {read.n} shard {read.shard_key}: replay found {len(records)} of the "
                f"{end['count']} records recorded, without reaching recorded end "
                f"{end['after']}; the records may be past the stream's retention"
            )
