"""The handler API: what a user's `process(event, ctx)` receives.

def process(event, ctx):
    count = ctx.state.get(0) + 1
    ctx.state.set(count)
    ctx.emit({"user": event.key, "count": count})
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from state import encoding
from state.keys import data_key
from state.transaction import Transaction

_MISSING = object()


class Event:
    """One Kinesis record, with its coordinates in the stream."""

    __slots__ = ("stream", "shard", "sequence_number", "subsequence", "key", "arrival", "data")

    def __init__(
        self,
        stream: str,
        shard: str,
        sequence_number: str,
        subsequence: int,
        key: str,
        arrival: datetime,
        data: bytes,
    ) -> None:
        self.stream = stream
        self.shard = shard
        self.sequence_number = sequence_number
        self.subsequence = subsequence
        self.key = key
        self.arrival = arrival
        self.data = data

    def json(self) -> Any:
        """The record's data decoded as UTF-8 JSON."""
        return json.loads(self.data)

    @property
    def arrival_ms(self) -> int:
        return int(self.arrival.replace(tzinfo=self.arrival.tzinfo or UTC).timestamp() * 1000)

    def coordinates(self) -> str:
        return f"{self.stream}/{self.shard}/{self.sequence_number}.{self.subsequence}"

    def __repr__(self) -> str:
        return f"Event({self.coordinates()}, key={self.key!r}, {len(self.data)} bytes)"


class KeyedState:
    """The state of the current record's key: one msgpack value."""

    __slots__ = ("_tx", "_key", "_db_key")

    def __init__(self, tx: Transaction) -> None:
        self._tx = tx
        self._key = ""
        self._db_key = b""

    def _bind(self, key: str) -> None:
        self._key = key
        self._db_key = data_key(key)

    def get(self, default: Any = None) -> Any:
        raw = self._tx.get(self._db_key)
        return default if raw is None else encoding.decode(raw, key=self._key)

    def set(self, value: Any) -> None:
        self._tx.put(self._db_key, encoding.encode(value, key=self._key))

    def delete(self) -> None:
        self._tx.delete(self._db_key)

    def exists(self) -> bool:
        return self._tx.get(self._db_key) is not None


class Context:
    """What a handler may do while processing one record."""

    __slots__ = ("slice", "batch_id", "state", "key", "_outputs")

    def __init__(self, slice_id: int, batch_id: int, tx: Transaction) -> None:
        self.slice = slice_id
        self.batch_id = batch_id
        self.state = KeyedState(tx)
        self.key = ""
        self._outputs: list[tuple[str, Any]] = []

    def _bind(self, key: str) -> None:
        self.key = key
        self.state._bind(key)

    def emit(self, value: Any, key: str | None = None) -> None:
        """Send an output row (JSON-encoded) to the job's sink; `key` defaults to the record's."""
        self._outputs.append((self.key if key is None else key, value))
