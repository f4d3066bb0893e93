"""The handler API: what `process(event, ctx)` and `on_timer(timer, ctx)` receive.

    def process(event, ctx):
        count = ctx.state.get(0) + 1
        ctx.state.set(count)
        ctx.timers.set(ctx.now_ms + 60_000)
        ctx.emit({"user": event.key, "count": count})

Reads see this batch's own writes; nothing is durable until the batch commits.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from shardless.state import encoding, keys, timers, ttl
from shardless.state.transaction import Transaction

_KINDS = {"processing": keys.PROCESSING, "event": keys.EVENT}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}


def _kind(name: str) -> bytes:
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"time kind must be 'processing' or 'event', got {name!r}") from None


class Event:
    """One Kinesis record, with its coordinates in the stream. `key` is what its state is
    bound to: the partition key, or the key the app chose from the record
    (`shardless.processor.api.keys`); `partition_key` is always the producer's."""

    __slots__ = (
        "stream",
        "shard",
        "sequence_number",
        "subsequence",
        "key",
        "partition_key",
        "key_error",
        "_arrival",
        "_row",
        "data",
        "value",
        "decode_error",
        "_event_ms",
        "_event_error",
    )

    def __init__(
        self,
        stream: str,
        shard: str,
        sequence_number: str,
        subsequence: int,
        key: str,
        arrival: datetime | Sequence[datetime],
        data: bytes,
        row: int = -1,
        partition_key: str | None = None,
    ) -> None:
        """`arrival` is the record's time, or (with `row` >= 0) a column of times to take
        row `row` of when the handler first reads it: the runtime's way of not building a
        timestamp object per record for handlers that never look (`docs/benchmarks.md`,
        "Measurements behind the code"). `partition_key` defaults to `key`."""
        self.stream = stream
        self.shard = shard
        self.sequence_number = sequence_number
        self.subsequence = subsequence
        self.key = key
        self.partition_key = key if partition_key is None else partition_key
        # why the app's chosen key could not be read from the record (its `key` is then the
        # partition key); the record policy decides what happens to it
        self.key_error: str | None = None
        self._arrival = arrival
        self._row = row
        self.data = data
        # the decoded record (`--decoder`; the bytes with the default `raw`), and why the
        # decoder could not read it when `--on-decode-error raw` passed it on anyway
        self.value: Any = data
        self.decode_error: str | None = None

    @property
    def arrival(self) -> datetime:
        """When Kinesis received the record (its ApproximateArrivalTimestamp)."""
        if self._row >= 0:
            self._arrival = self._arrival[self._row]  # type: ignore[index]
            self._row = -1
        return self._arrival  # type: ignore[return-value]

    def json(self) -> Any:
        """The record's data decoded as UTF-8 JSON."""
        return json.loads(self.data)

    @property
    def arrival_ms(self) -> int:
        return int(self.arrival.replace(tzinfo=self.arrival.tzinfo or UTC).timestamp() * 1000)

    @property
    def event_time_ms(self) -> int:
        """The record's event time (epoch ms): what the app named as its event time
        (`shardless.processor.api.event_time`), else its arrival time."""
        try:
            found = self._event_ms
        except AttributeError:  # no event time named: the arrival time, as always
            return self.arrival_ms
        return self.arrival_ms if found is None else found

    @property
    def event_time_error(self) -> str | None:
        """Why the app's named event time could not be read from the record (None when it
        was, or when no event time is named)."""
        try:
            return self._event_error
        except AttributeError:
            return None

    def timed(self, event_ms: int | None, error: str | None) -> None:
        """Give the record its event time as read (epoch ms), or why it has none: the
        runtime's call, once per record, in jobs that name an event time."""
        self._event_ms, self._event_error = event_ms, error

    def coordinates(self) -> str:
        return f"{self.stream}/{self.shard}/{self.sequence_number}.{self.subsequence}"

    def __repr__(self) -> str:
        return f"Event({self.coordinates()}, key={self.key!r}, {len(self.data)} bytes)"


@dataclass(frozen=True)
class Timer:
    """A due timer: the key it was set for, its time (epoch ms) and its kind."""

    key: str
    ts: int
    kind: str


class _Values:
    """Encoding, TTL and clocks shared by a slice's state views in one batch."""

    __slots__ = ("tx", "fmt", "allow_pickle", "now_ms", "watermark_ms")

    def __init__(self, tx: Transaction, fmt: int, allow_pickle: bool) -> None:
        self.tx = tx
        self.fmt = fmt
        self.allow_pickle = allow_pickle
        self.now_ms = 0
        self.watermark_ms = -1

    def read(self, db_key: bytes, default: Any, name: str) -> Any:
        raw = self.tx.get(db_key)
        if raw is None:
            return default
        if raw[0] == encoding.MSGPACK:
            return encoding.decode_msgpack(raw, name)
        if raw[0] & 0x80 and ttl.is_expired(raw, self.now_ms, self.watermark_ms):
            return default
        return encoding.decode(raw, key=name, allow_pickle=self.allow_pickle)

    def write(self, db_key: bytes, value: Any, name: str, ttl_ms: int | None, on: str) -> None:
        if ttl_ms is None:
            if self.fmt == encoding.MSGPACK:
                self.tx.put(db_key, encoding.encode_msgpack(value, name))
            else:
                self.tx.put(db_key, encoding.encode(value, key=name, fmt=self.fmt))
            return
        kind = _kind(on)
        base = self.now_ms if kind == keys.PROCESSING else max(self.watermark_ms, 0)
        at = base + int(ttl_ms)
        self.tx.put(db_key, encoding.encode(value, key=name, fmt=self.fmt, expires=(kind, at)))
        ttl.index(self.tx, db_key, kind, at)

    def live(self, raw: bytes) -> bool:
        return not (raw[0] & 0x80 and ttl.is_expired(raw, self.now_ms, self.watermark_ms))


class MapState:
    """Map-like state under the current key: sub-keys in sorted order."""

    __slots__ = ("_v", "_key")

    def __init__(self, values: _Values) -> None:
        self._v = values
        self._key = ""

    def get(self, sub: str, default: Any = None) -> Any:
        return self._v.read(keys.map_key(self._key, sub), default, f"{self._key}[{sub}]")

    def set(self, sub: str, value: Any, ttl_ms: int | None = None, on: str = "processing") -> None:
        self._v.write(keys.map_key(self._key, sub), value, f"{self._key}[{sub}]", ttl_ms, on)

    def delete(self, sub: str) -> None:
        self._v.tx.delete(keys.map_key(self._key, sub))

    def __contains__(self, sub: str) -> bool:
        return self.get(sub, _MISSING) is not _MISSING

    def items(self, start: str | None = None, end: str | None = None) -> Iterator[tuple[str, Any]]:
        """Entries with `start <= sub < end` in sub-key order."""
        lo, hi = keys.map_range(self._key)
        if start is not None:
            lo = keys.map_key(self._key, start)
        if end is not None:
            hi = keys.map_key(self._key, end)
        for db_key, raw in self._v.tx.items(lo, hi):
            if self._v.live(raw):
                sub = keys.map_sub(db_key, self._key)
                yield sub, encoding.decode(raw, key=sub, allow_pickle=self._v.allow_pickle)

    def keys(self) -> list[str]:
        return [k for k, _ in self.items()]

    def clear(self) -> None:
        for db_key, _ in list(self._v.tx.items(*keys.map_range(self._key))):
            self._v.tx.delete(db_key)


_MISSING = object()
# Module globals for KeyedState's per-record fast path: one lookup each instead of two.
_MSGPACK = encoding.MSGPACK
_MSGPACK_BYTE = encoding.MSGPACK_BYTE
_MAX_VALUE_BYTES = encoding.MAX_VALUE_BYTES
_pack = encoding.pack_msgpack
_unpack = encoding.unpack_msgpack


class KeyedState:
    """The state of the current record's key: one value, and a map under `.map`."""

    __slots__ = ("_v", "_key", "_db_key", "map")

    def __init__(self, values: _Values) -> None:
        self._v = values
        self._key = ""
        self._db_key = b""
        self.map = MapState(values)

    def _bind(self, key: str, db_key: bytes) -> None:
        self._key = key
        self._db_key = db_key
        self.map._key = key

    def get(self, default: Any = None) -> Any:
        raw = self._v.tx.get(self._db_key)
        if raw is None:
            return default
        if raw[0] == _MSGPACK:  # the per-record fast path (`encoding.decode_msgpack` inlined)
            try:
                return _unpack(raw[1:])
            except Exception:  # noqa: BLE001 - `read` below raises the precise error
                pass
        return self._v.read(self._db_key, default, self._key)

    def set(self, value: Any, ttl_ms: int | None = None, on: str = "processing") -> None:
        """Store a value; with `ttl_ms` it expires that long after the batch's processing time
        (`on="processing"`) or the watermark (`on="event"`)."""
        v = self._v
        if ttl_ms is None and v.fmt == _MSGPACK:  # the per-record fast path
            try:  # `encoding.encode_msgpack` inlined
                payload = _pack(value)
            except (TypeError, ValueError, OverflowError):
                pass  # `write` below raises the precise error
            else:
                if len(payload) <= _MAX_VALUE_BYTES:
                    v.tx.put(self._db_key, _MSGPACK_BYTE + payload)
                    return
        v.write(self._db_key, value, self._key, ttl_ms, on)

    def delete(self) -> None:
        self._v.tx.delete(self._db_key)

    def exists(self) -> bool:
        return self.get(_MISSING) is not _MISSING


class SliceState:
    """Every key's value in this slice, for handlers that need more than the current key."""

    __slots__ = ("_v",)

    def __init__(self, values: _Values) -> None:
        self._v = values

    def get(self, key: str, default: Any = None) -> Any:
        return self._v.read(keys.data_key(key), default, key)

    def put(self, key: str, value: Any, ttl_ms: int | None = None, on: str = "processing") -> None:
        self._v.write(keys.data_key(key), value, key, ttl_ms, on)

    def delete(self, key: str) -> None:
        self._v.tx.delete(keys.data_key(key))

    def range(self, start: str | None = None, end: str | None = None) -> Iterator[tuple[str, Any]]:
        """Keys with `start <= key < end` and their values, in key order (UTF-8 byte order)."""
        lo = keys.DATA if start is None else keys.DATA + keys.escape(start)
        hi = keys.DATA_END if end is None else keys.DATA + keys.escape(end)
        return self._scan(lo, hi)

    def prefix(self, prefix: str) -> Iterator[tuple[str, Any]]:
        """Keys starting with `prefix` and their values, in key order."""
        return self._scan(*keys.key_range(prefix))

    def _scan(self, lo: bytes, hi: bytes) -> Iterator[tuple[str, Any]]:
        for db_key, raw in self._v.tx.items(lo, hi):
            if keys.is_value_key(db_key) and self._v.live(raw):
                key = keys.record_key(db_key)
                yield key, encoding.decode(raw, key=key, allow_pickle=self._v.allow_pickle)


class Timers:
    """Timers of the current key: `on_timer` runs once each is due."""

    __slots__ = ("_v", "_key")

    def __init__(self, values: _Values) -> None:
        self._v = values
        self._key = ""

    def set(self, ts_ms: int, kind: str = "processing") -> None:
        """Fire at epoch ms `ts_ms` of processing time, or once the watermark passes it."""
        timers.set_timer(self._v.tx, self._key, _kind(kind), int(ts_ms))

    def delete(self, ts_ms: int, kind: str = "processing") -> None:
        timers.delete_timer(self._v.tx, self._key, _kind(kind), int(ts_ms))

    def list(self) -> list[Timer]:
        return [
            Timer(self._key, ts, _KIND_NAMES[k])
            for k, ts in timers.key_timers(self._v.tx, self._key)
        ]


class Context:
    """What a handler may do while processing one record or timer."""

    __slots__ = (
        "slice",
        "batch_id",
        "state",
        "slice_state",
        "timers",
        "key",
        "_values",
        "_outputs",
        "_check",
    )

    def __init__(
        self,
        slice_id: int,
        batch_id: int,
        tx: Transaction,
        value_format: int = encoding.MSGPACK,
        allow_pickle: bool = False,
        check_output: Callable[[Any, str], Any] | None = None,
    ) -> None:
        self.slice = slice_id
        self.batch_id = batch_id
        self._values = _Values(tx, value_format, allow_pickle)
        self.state = KeyedState(self._values)
        self.slice_state = SliceState(self._values)
        self.timers = Timers(self._values)
        self.key = ""
        self._outputs: list[tuple[str, Any]] = []
        self._check = check_output  # typed outputs: raises on a value that does not fit

    @property
    def now_ms(self) -> int:
        """The batch's processing time (the same on a re-run of the batch)."""
        return self._values.now_ms

    @property
    def watermark_ms(self) -> int:
        """Event time up to which the job has seen all data (-1 before any)."""
        return self._values.watermark_ms

    def _bind(self, key: str, db_key: bytes | None = None) -> None:
        # `Binding.run_each` inlines this: a view added here must be bound there
        self.key = key
        self.state._bind(key, keys.data_key(key) if db_key is None else db_key)
        self.timers._key = key

    def _clock(self, now_ms: int, watermark_ms: int) -> None:
        self._values.now_ms = now_ms
        self._values.watermark_ms = watermark_ms

    def emit(self, value: Any, key: str | None = None) -> None:
        """Send an output row (JSON-encoded) to the job's sink; `key` defaults to the record's.
        With a declared output schema, a value that does not fit raises OutputSchemaError."""
        key = self.key if key is None else key
        if self._check is not None:
            value = self._check(value, key)
        self._outputs.append((key, value))


class Binding:
    """The runtime's hold on a Context, which handlers never see: its clock, its outputs,
    the key it is bound to, and the per-record loop. It lives beside Context so that only
    this module writes the views' fields."""

    __slots__ = ("ctx", "outputs")

    def __init__(self, ctx: Context, now_ms: int, watermark_ms: int) -> None:
        self.ctx = ctx
        ctx._clock(now_ms, watermark_ms)
        self.outputs = ctx._outputs

    def bind(self, key: str, db_key: bytes | None = None) -> None:
        self.ctx._bind(key, db_key)

    def run_each(
        self,
        process: Callable[[Event, Context], None],
        events: Sequence[Event],
        db_keys: dict[str, bytes],
        failed: Callable[[Event, Exception], Exception],
    ) -> None:
        """`process(event, ctx)` for each event, bound to its key with `Context._bind`
        inlined (the per-record loop of most jobs, where every Python call shows); a
        handler's exception is raised as `failed(event, exc)`."""
        ctx = self.ctx
        state, timer_view = ctx.state, ctx.timers
        map_view = state.map
        try:
            for event in events:
                k = event.key
                ctx.key = state._key = map_view._key = timer_view._key = k
                state._db_key = db_keys[k]
                process(event, ctx)
        except Exception as exc:
            raise failed(event, exc) from exc
