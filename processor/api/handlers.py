"""Handlers: a plain function, or a class with optional `open`, `process`, `on_timer`, `close`.

    def process(event, ctx): ...                   # the simple case

    class Sessions:                                # the rest: implement only what you need
        def open(self, slice_id): ...              # once per slice, before its first batch here
        def process(self, event, ctx): ...
        def on_timer(self, timer, ctx): ...
        def close(self): ...                       # when the worker shuts down

A class is instantiated once per slice per Python worker, so instance attributes may cache
things (never state: that belongs in `ctx.state`, which is durable).
"""

from __future__ import annotations

import atexit
import copy
import inspect
import uuid
from collections.abc import Callable
from typing import Any

from pyspark.sql.types import StructType

from shardless.processor.api.context import Context, Event, Timer
from shardless.processor.api.event_time import EventTimeChoice
from shardless.processor.api.keys import KeyChoice
from shardless.processor.api.outputs import OutputCheck, check_schema
from shardless.processor.errors import AppError


def _noop(*_: Any) -> None:
    return None


class SliceHandler:
    """A uniform view of one slice's handler."""

    __slots__ = ("process", "on_timer", "close", "has_timers", "check_output")

    def __init__(
        self,
        process: Callable[[Event, Context], None],
        on_timer: Callable[[Timer, Context], None] | None,
        close: Callable[[], None],
        check_output: OutputCheck | None = None,
    ) -> None:
        self.process = process
        self.on_timer = on_timer or _noop
        self.has_timers = on_timer is not None
        self.close = close
        self.check_output = check_output  # what `ctx.emit` checks values with (typed outputs)


class HandlerFactory:
    """Makes each slice's handler from what the app defines (pickled to executors).

    `output_schema`: the app's declared outputs, a Spark DDL string or a pyspark
    StructType (`shardless.processor.api.outputs`); None for untyped JSON outputs. A DDL
    string is parsed by Spark when the job starts; a StructType is checked by the
    `TestDriver` too.

    `key`: how the app chooses the key its state is bound to (a JSON field path such as
    "user.id", a function of the record, or a `KeyChoice`); None for the partition key.

    `event_time`: how the app names its records' event time (a JSON field path such as
    "ts", a function of the record, or an `EventTimeChoice`); None for the arrival time."""

    def __init__(
        self,
        spec: Any,
        on_timer: Callable[[Timer, Context], None] | None = None,
        output_schema: str | StructType | None = None,
        app: str | None = None,
        key: str | Callable[[Event], str] | KeyChoice | None = None,
        event_time: str | Callable[[Event], Any] | EventTimeChoice | None = None,
    ):
        if inspect.isclass(spec):
            if not callable(getattr(spec, "process", None)):
                raise AppError(f"handler class {spec.__name__} must define process(event, ctx)")
        elif not callable(spec):
            raise AppError(f"a handler must be a function or a class, not {type(spec).__name__}")
        if output_schema is not None and not isinstance(output_schema, str):
            check_schema(output_schema)
        self.spec = spec
        self.on_timer = on_timer
        self.output_schema = output_schema
        self.app = app  # named in output schema errors
        self.key = (
            key if isinstance(key, KeyChoice) or key is None else KeyChoice.of_app(key, "key")
        )
        self.event_time = (
            event_time
            if isinstance(event_time, EventTimeChoice) or event_time is None
            else EventTimeChoice.of_app(event_time, "event_time")
        )
        self.token = uuid.uuid4().hex  # stable across pickling: one handler per slice per worker

    def with_outputs(self, schema: StructType, app: str) -> HandlerFactory:
        """A copy whose outputs are checked against `schema` (the declared one, parsed),
        naming `app` in errors; same token, so one handler per slice per worker still."""
        made = copy.copy(self)
        made.output_schema, made.app = check_schema(schema), app
        return made

    def output_check(self) -> OutputCheck | None:
        """The check of emitted values, when the schema is a StructType (a DDL string
        needs Spark to parse it: `with_outputs`)."""
        if isinstance(self.output_schema, StructType):
            return OutputCheck(self.output_schema, self.app)
        return None

    def make(self, slice_id: int) -> SliceHandler:
        check = self.output_check()
        if not inspect.isclass(self.spec):
            return SliceHandler(self.spec, self.on_timer, _noop, check)
        instance = self.spec()
        if callable(getattr(instance, "open", None)):
            instance.open(slice_id)
        close = getattr(instance, "close", None) or _noop
        atexit.register(close)
        return SliceHandler(instance.process, getattr(instance, "on_timer", None), close, check)


_made: dict[tuple[str, int], SliceHandler] = {}


def handler_for(factory: HandlerFactory, slice_id: int) -> SliceHandler:
    """This worker's handler of a slice, made (and opened) on first use."""
    key = (factory.token, slice_id)
    found = _made.get(key)
    if found is None:
        found = _made[key] = factory.make(slice_id)
    return found
