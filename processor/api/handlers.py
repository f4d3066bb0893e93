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
import inspect
import uuid
from collections.abc import Callable
from typing import Any

from shardless.processor.api.context import Context, Event, Timer
from shardless.processor.errors import AppError


def _noop(*_: Any) -> None:
    return None


class SliceHandler:
    """A uniform view of one slice's handler."""

    __slots__ = ("process", "on_timer", "close", "has_timers")

    def __init__(
        self,
        process: Callable[[Event, Context], None],
        on_timer: Callable[[Timer, Context], None] | None,
        close: Callable[[], None],
    ) -> None:
        self.process = process
        self.on_timer = on_timer or _noop
        self.has_timers = on_timer is not None
        self.close = close


class HandlerFactory:
    """Makes each slice's handler from what the app defines (pickled to executors)."""

    def __init__(self, spec: Any, on_timer: Callable[[Timer, Context], None] | None = None):
        if inspect.isclass(spec):
            if not callable(getattr(spec, "process", None)):
                raise AppError(f"handler class {spec.__name__} must define process(event, ctx)")
        elif not callable(spec):
            raise AppError(f"a handler must be a function or a class, not {type(spec).__name__}")
        self.spec = spec
        self.on_timer = on_timer
        self.token = uuid.uuid4().hex  # stable across pickling: one handler per slice per worker

    def make(self, slice_id: int) -> SliceHandler:
        if not inspect.isclass(self.spec):
            return SliceHandler(self.spec, self.on_timer, _noop)
        instance = self.spec()
        if callable(getattr(instance, "open", None)):
            instance.open(slice_id)
        close = getattr(instance, "close", None) or _noop
        atexit.register(close)
        return SliceHandler(instance.process, getattr(instance, "on_timer", None), close)


_made: dict[tuple[str, int], SliceHandler] = {}


def handler_for(factory: HandlerFactory, slice_id: int) -> SliceHandler:
    """This worker's handler of a slice, made (and opened) on first use."""
    key = (factory.token, slice_id)
    found = _made.get(key)
    if found is None:
        found = _made[key] = factory.make(slice_id)
    return found
