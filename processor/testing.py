"""Test a handler without Spark or AWS, on the same state and timer code that runs in a job.

    from shardless import TestDriver

    with TestDriver(process) as driver:           # or a handler class, or an app file path
        driver.set_state("user-1", 41)            # committed state, as an earlier batch left it
        driver.send("user-1", {"action": "view"})
        assert driver.run_batch() == [("user-1", {"user": "user-1", "count": 42})]
        assert driver.state("user-1") == 42
        driver.advance(60_000)                    # processing time moves; due timers fire
        driver.advance_watermark(1_700_000_060_000)  # event time too; due event timers fire
        driver.run_batch()

Each `run_batch` is one micro-batch: the queued records in order, then the due timers, then
a local commit. Processing time is the driver's clock; the watermark is the largest event
time sent before this batch minus the allowed lateness, as in a Spark job, unless a test
moves it on with `advance_watermark`. Event time is each record's arrival time (`send`'s
`event_time_ms`), or what the app names as its event time (`event_time=`), read from the
record as a job reads it; late records then go where the policy's `on_late` says. Seeded
state goes through the handler API's own writes (`Context`), so it is stored, and read
back, exactly as a handler's would be.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from shardless.processor.api.app import load_handler
from shardless.processor.api.context import Binding, Context, Event, Timer
from shardless.processor.api.event_time import EventTimeChoice
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.api.keys import KeyChoice
from shardless.processor.api.policies import RecordPolicy
from shardless.processor.runtime.dead_letter import DeadLetter
from shardless.processor.runtime.routing import route
from shardless.processor.runtime.slice_runner import run_slice
from shardless.state import encoding, keys, timers, ttl
from shardless.state.slices import DEFAULT_SLICES
from shardless.state.store import SliceStore
from shardless.state.transaction import Transaction


class TestDriver:
    """Runs a handler batch by batch on local stores, with clocks the test moves."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        handler: Any,
        *,
        slices: int = DEFAULT_SLICES,
        start_ms: int = 1_700_000_000_000,
        allowed_lateness_ms: int = 0,
        value_format: str = "msgpack",
        directory: str | Path | None = None,
        policy: RecordPolicy | None = None,
        key: str | Callable[[Event], str] | None = None,
        event_time: str | Callable[[Event], Any] | None = None,
    ) -> None:
        """`policy`: the decoder and error policies of `shardless run` (`--decoder`,
        `--on-decode-error`, `--on-handler-error`, `--handler-retries`); records set aside
        are collected in `dead_letters` instead of being written anywhere. `key`: the key
        the state is bound to, chosen from each record as a job does (a JSON field path, as
        `--key-field`, or a function); default the app's `key`, else the partition key.
        `event_time`: the records' event time, named as a job names it (a JSON field path,
        as `--event-time-field`, or a function); default the app's `event_time`, else the
        arrival time. Late records are counted in `late_records`."""
        if isinstance(handler, HandlerFactory):
            self.factory = handler
        elif isinstance(handler, str | Path):
            self.factory = load_handler(handler)
        else:
            self.factory = HandlerFactory(handler)
        self.key_choice = (
            KeyChoice.of_app(key, "TestDriver(key=...)") if key is not None else self.factory.key
        )
        self.event_time_choice = (
            EventTimeChoice.of_app(event_time, "TestDriver(event_time=...)")
            if event_time is not None
            else getattr(self.factory, "event_time", None)
        )
        if self.event_time_choice is not None:
            policy = dataclasses.replace(policy or RecordPolicy(), event_time=True)
        self.late_records = 0
        self.slices = slices
        self.now_ms = start_ms
        self.lateness = allowed_lateness_ms
        self.fmt = encoding.format_code(value_format)
        self.allow_pickle = value_format == "pickle"
        self._tmp = None if directory else tempfile.TemporaryDirectory(prefix="shardless-test-")
        self.directory = Path(directory or self._tmp.name)  # type: ignore[union-attr]
        self._stores: dict[int, SliceStore] = {}
        self._handlers: dict[int, Any] = {}
        self._queue: list[Event] = []
        self._seq = 0
        self._max_event_ms = -1
        self.watermark_ms = -1
        self.batch_id = -1
        self.outputs: list[tuple[str, Any]] = []
        self.policy = policy
        self.dead_letters: list[DeadLetter] = []
        self._closed = False

    # -- lifetime --------------------------------------------------------------------------

    def __enter__(self) -> TestDriver:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close on the way out, also when the body raised (whose exception goes on)."""
        self.close()

    def close(self) -> None:
        """Close every handler and store and remove the temporary directory (a `directory`
        given by the test is kept), so RocksDB handles and files do not outlive the test.
        Closing twice is harmless; using the driver after it raises."""
        if self._closed:
            return
        self._closed = True
        try:
            self._close_all()
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()

    # -- input and clocks ----------------------------------------------------------------

    def send(
        self, key: str, data: Any, event_time_ms: int | None = None, stream: str = "test"
    ) -> None:
        """Queue a record with partition key `key`; dicts and lists are sent as JSON, str as
        UTF-8. `event_time_ms` is its arrival time (default: the processing time), which
        moves the watermark unless the app names another event time (read from the record,
        as a job does). With a chosen key, the record's state key is read from it."""
        if isinstance(data, dict | list):
            data = json.dumps(data).encode()
        elif isinstance(data, str):
            data = data.encode()
        at = self.now_ms if event_time_ms is None else event_time_ms
        self._seq += 1
        arrival = datetime.fromtimestamp(at / 1000, tz=UTC)
        event = Event(stream, "shardId-000000000000", str(self._seq), 0, key, arrival, data)
        if self.key_choice is not None:
            event.key, event.key_error = self.key_choice.of(event)
            event.key = key if event.key is None else event.key
        if self.event_time_choice is not None:
            event.timed(*self.event_time_choice.of(event))
            at = event.event_time_ms if event.event_time_error is None else -1
        self._queue.append(event)
        self._max_event_ms = max(self._max_event_ms, at)

    def advance(self, ms: int) -> None:
        """Move processing time forward."""
        self.now_ms += ms

    def advance_watermark(self, to_ms: int) -> None:
        """Move the watermark (event time, epoch ms) forward to `to_ms` for the next batches:
        event timers at or before it fire and event-time TTLs up to it expire, as once a Spark
        job has seen records up to `to_ms` plus the allowed lateness. It never moves back."""
        if to_ms < self.watermark_ms:
            raise ValueError(
                f"the watermark only moves forward: it is {self.watermark_ms}, not {to_ms}"
            )
        self.watermark_ms = to_ms

    # -- seeding state ---------------------------------------------------------------------

    def set_state(
        self, key: str, value: Any, ttl_ms: int | None = None, on: str = "processing"
    ) -> None:
        """Store the key's value and commit it, as if an earlier batch's handler had called
        `ctx.state.set(value, ttl_ms, on)`: the same encoding (and refusals), TTL and store."""
        self._seed(key, lambda ctx: ctx.state.set(value, ttl_ms, on))

    def set_map_state(
        self,
        key: str,
        entries: dict[str, Any],
        ttl_ms: int | None = None,
        on: str = "processing",
    ) -> None:
        """Store map entries under the key (others it has stay) and commit them, as
        `ctx.state.map.set(sub, value, ttl_ms, on)` for each would."""

        def write(ctx: Context) -> None:
            for sub, value in entries.items():
                ctx.state.map.set(sub, value, ttl_ms, on)

        self._seed(key, write)

    def set_timer(self, key: str, ts_ms: int, kind: str = "processing") -> None:
        """Set a timer of the key and commit it, as `ctx.timers.set(ts_ms, kind)` would."""
        self._seed(key, lambda ctx: ctx.timers.set(ts_ms, kind))

    def _seed(self, key: str, write: Callable[[Context], None]) -> None:
        """Run `write` on a Context bound to `key` at the driver's clocks, then commit it."""
        s = self._slice(key)
        store = self._store(s)
        tx = Transaction(store)
        ctx = Context(s, self.batch_id, tx, self.fmt, self.allow_pickle)
        Binding(ctx, self.now_ms, self.watermark_ms).bind(key)
        write(ctx)
        changes = tx.changes()
        store.commit(changes, store.version + 1, tx.undo(changes))

    # -- running -------------------------------------------------------------------------

    def run_batch(self) -> list[tuple[str, Any]]:
        """Run one micro-batch; return what it emitted as (key, value) pairs."""
        self._check_open()
        self.batch_id += 1
        by_slice: dict[int, list[Event]] = {}
        for event in self._queue:  # by the chosen key, or the partition key (as a job)
            by_slice.setdefault(route(event.key, None, self.slices), []).append(event)
        self._queue = []
        emitted: list[tuple[str, Any]] = []
        for s in sorted(set(by_slice) | self._slices_with_due_timers()):
            store = self._store(s)
            tx = Transaction(store)
            result = run_slice(
                self._handler(s), tx, s, self.batch_id, self.now_ms, self.watermark_ms,
                by_slice.get(s, []), self.fmt, self.allow_pickle, self.policy,
            )  # fmt: skip
            self.dead_letters += result.dead_letters
            self.late_records += result.late_records
            changes = tx.changes()
            store.commit(changes, store.version + 1, tx.undo(changes))
            emitted += [(k, json.loads(json.dumps(v, default=str))) for k, v in result.outputs]
        if self._max_event_ms >= 0:
            self.watermark_ms = max(self.watermark_ms, self._max_event_ms - self.lateness)
        self.outputs += emitted
        return emitted

    def restart(self) -> None:
        """Close every store and handler and reopen them, as after a worker restart."""
        self._close_all()

    def _close_all(self) -> None:
        """Close every store, then every handler; the stores close even if a handler's
        `close` raises."""
        stores, handlers = list(self._stores.values()), list(self._handlers.values())
        self._stores.clear()
        self._handlers.clear()
        for store in stores:
            store.close()
        for handler in handlers:
            handler.close()

    # -- inspection ----------------------------------------------------------------------

    def _live(self, raw: bytes) -> bool:
        return not ttl.is_expired(raw, self.now_ms, self.watermark_ms)

    def state(self, key: str, default: Any = None) -> Any:
        """The key's value as a handler would see it now (expired values are absent)."""
        raw = self._store(self._slice(key)).get(keys.data_key(key))
        if raw is None or not self._live(raw):
            return default
        return encoding.decode(raw, allow_pickle=self.allow_pickle)

    def map_state(self, key: str) -> dict[str, Any]:
        """The key's map entries as a handler would see them now."""
        store = self._store(self._slice(key))
        return {
            keys.map_sub(k, key): encoding.decode(v, allow_pickle=self.allow_pickle)
            for k, v in store.items(*keys.map_range(key))
            if self._live(v)
        }

    def timers(self, key: str) -> list[Timer]:
        """The key's pending timers, by kind then time."""
        tx = Transaction(self._store(self._slice(key)))
        names = {keys.PROCESSING: "processing", keys.EVENT: "event"}
        return [Timer(key, ts, names[k]) for k, ts in timers.key_timers(tx, key)]

    def stored_entries(self) -> int:
        """Entries in every store (values, map entries, timers, TTL index): to see purges."""
        return sum(sum(1 for _ in st.user_items()) for st in self._stores.values())

    # -- internals -----------------------------------------------------------------------

    def _slice(self, key: str) -> int:
        return route(key, None, self.slices)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this TestDriver is closed")

    def _store(self, s: int) -> SliceStore:
        self._check_open()
        if s not in self._stores:
            self._stores[s] = SliceStore(self.directory / f"slice-{s:05d}", {"slice": s})
        return self._stores[s]

    def _handler(self, s: int) -> Any:
        if s not in self._handlers:
            self._handlers[s] = self.factory.make(s)
        return self._handlers[s]

    def _slices_with_due_timers(self) -> set[int]:
        due = set()
        for path in self.directory.glob("slice-*"):
            s = int(path.name.split("-")[1])
            tx = Transaction(self._store(s))
            proc = timers.next_due(tx, keys.PROCESSING)
            event = timers.next_due(tx, keys.EVENT)
            if (proc is not None and proc <= self.now_ms) or (
                event is not None and event <= self.watermark_ms
            ):
                due.add(s)
        return due
