"""Source offsets and per-shard positions, as plain JSON-able data.

Spark's offset for this source is `{"run": <uuid>, "n": <k>, "initial": <position>}`:
a logical batch counter, not shard positions. What batch k actually read from each
shard is recorded by the executor that read it (see `batch_log`), so a retried batch
finds the same end positions and reads exactly the same records, and the driver never
reads records to find where a batch ends.

A run that starts at COMMITTED carries `"from": {"query", "batch"}` in its offsets: the
progress record it continues. Its positions before its first batch are that record's
positions, saved in the batch log as the run's batch 0 (see `batch_log`).

A shard position is `{"after": <sequence number or None>, "done": <bool>, "since": <epoch
seconds>}`; a shard not yet in the map starts at the run's initial position (TRIM_HORIZON or
AT_TIMESTAMP). `since` is a lower bound on the arrival time of the records not read yet (the
time the reader last saw the shard's tip, or the arrival of the last record read): a position
whose `since` is older than the stream's retention may have lost records (see `reader`).
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime
from typing import Any

from shardless.processor.errors import ConfigError

Position = dict[str, Any]
Positions = dict[str, Position]


COMMITTED = "COMMITTED"
_EXPECTED = "expected TRIM_HORIZON, LATEST, AT_TIMESTAMP:<time> or COMMITTED"


def is_committed(spec: str) -> bool:
    """Whether a starting position option says "where the application's state left off"."""
    return spec.strip().upper() == COMMITTED


def check_starting(spec: str) -> str:
    """Validate a starting position option (raising ConfigError); return it stripped."""
    if not is_committed(spec):
        initial_position(spec)
    return spec.strip()


def initial_position(spec: str, now: float | None = None) -> dict[str, Any]:
    """Resolve a starting position option once, at the first batch of a run.

    LATEST becomes AT_TIMESTAMP(now): a fixed point that a replay finds again, where a
    LATEST iterator taken later would silently skip what arrived in between. COMMITTED is
    not resolved here: its positions come from the application's progress record
    (`shardless.processor.driver.progress`).
    """
    spec = spec.strip()
    upper = spec.upper()
    if upper == COMMITTED:
        raise ConfigError(
            f"startingPosition {spec!r} takes its positions from the application's progress "
            "record, not from a fixed position"
        )
    if upper == "TRIM_HORIZON":
        return {"type": "TRIM_HORIZON"}
    if upper == "LATEST":
        return {"type": "AT_TIMESTAMP", "ts": time.time() if now is None else now}
    if upper.startswith("AT_TIMESTAMP:"):
        value = spec.split(":", 1)[1]
        try:
            ts = float(value)
        except ValueError:
            try:
                ts = datetime.fromisoformat(value).timestamp()
            except ValueError as exc:
                raise ConfigError(
                    f"startingPosition {spec!r}: expected AT_TIMESTAMP:<epoch seconds or ISO "
                    "8601 time>"
                ) from exc
        if ts != ts or ts in (float("inf"), float("-inf")):
            raise ConfigError(f"startingPosition {spec!r}: not a finite time")
        return {"type": "AT_TIMESTAMP", "ts": ts}
    raise ConfigError(f"startingPosition {spec!r}: {_EXPECTED}")


def new_offset(initial: dict[str, Any]) -> dict[str, Any]:
    return {"run": uuid.uuid4().hex, "n": 0, "initial": initial}


def next_offset(offset: dict[str, Any]) -> dict[str, Any]:
    return {**offset, "n": int(offset["n"]) + 1}


def advance(positions: Positions, ends: dict[str, Position]) -> Positions:
    """Positions after a batch: the previous ones updated with what the batch recorded."""
    out = dict(positions)
    for shard_key, end in ends.items():
        before = out.get(shard_key, {"after": None, "done": False})
        position: Position = {
            "after": end["after"] if end["after"] is not None else before["after"],
            "done": bool(end["done"]),
        }
        since = end.get("since")
        if since is None:
            since = before.get("since")
        if since is not None:
            position["since"] = since
        out[shard_key] = position
    return out


def iterator_args(position: Position | None, initial: dict[str, Any]) -> dict[str, Any]:
    """GetShardIterator arguments that resume a shard from its position."""
    if position and position.get("after") is not None:
        return {
            "ShardIteratorType": "AFTER_SEQUENCE_NUMBER",
            "StartingSequenceNumber": position["after"],
        }
    if initial["type"] == "AT_TIMESTAMP":
        return {"ShardIteratorType": "AT_TIMESTAMP", "Timestamp": initial["ts"]}
    return {"ShardIteratorType": "TRIM_HORIZON"}


def sequence_sort_key(sequence_number: str) -> str:
    """Kinesis sequence numbers are decimal strings of varying length; pad to compare."""
    return sequence_number.rjust(64, "0")
