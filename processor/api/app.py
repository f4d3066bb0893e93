"""Loading a user's app: a Python file that defines `process(event, ctx)`, and optionally
its output schema (`output_schema = "user STRING, total BIGINT"`), a function to hand
each batch's outputs to (`foreach_batch = write`), the key its state is bound to
(`key = "user.id"`, a JSON field path, or `def key(record) -> str`) and its records' event
time (`event_time = "ts"`, or `def event_time(record) -> int | datetime`)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark import cloudpickle

from shardless.processor.api.event_time import EventTimeChoice
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.api.keys import KeyChoice
from shardless.processor.errors import AppError


@dataclass(frozen=True)
class App:
    """What an app file defines: its handler (with its output schema, if declared) and the
    function its outputs go to, if it names one (`foreach_batch`)."""

    handlers: HandlerFactory
    foreach_batch: Callable[..., Any] | None = None


def load_app(path: str | Path) -> App:
    """Import the app file: its handler (`load_handler`) and its `foreach_batch`."""
    handlers = load_handler(path)
    module = sys.modules[_module_name(Path(path))]
    foreach_batch = getattr(module, "foreach_batch", None)
    if foreach_batch is not None and not callable(foreach_batch):
        raise AppError(
            f"{path}: foreach_batch must be a function (df, batch), not "
            f"{type(foreach_batch).__name__}"
        )
    return App(handlers, foreach_batch)


def _module_name(path: Path) -> str:
    return f"shardless_app_{path.stem}"


def load_handler(path: str | Path) -> HandlerFactory:
    """Import the app file and return its handler: a class named by `handler = ...`, or the
    functions `process(event, ctx)` and optionally `on_timer(timer, ctx)`; with the app's
    `output_schema`, `key` and `event_time` when it declares them.

    The module is pickled by value, so executors need no copy of the file.
    """
    path = Path(path)
    if not path.is_file():
        raise AppError(f"app file {path} does not exist")
    name = _module_name(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise AppError(f"{path} is not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise AppError(f"{path}: importing the app failed: {type(exc).__name__}: {exc}") from exc
    cloudpickle.register_pickle_by_value(module)
    schema = getattr(module, "output_schema", None)
    key = KeyChoice.of_app(getattr(module, "key", None), str(path))
    event_time = EventTimeChoice.of_app(getattr(module, "event_time", None), str(path))
    try:
        spec = getattr(module, "handler", None)
        if spec is not None:
            return HandlerFactory(spec, output_schema=schema, key=key, event_time=event_time)
        process = getattr(module, "process", None)
        if not callable(process):
            raise AppError(
                f"{path}: define a function `process(event, ctx)`, or `handler = <a class with "
                "process(self, event, ctx)>`"
            )
        return HandlerFactory(
            process,
            on_timer=getattr(module, "on_timer", None),
            output_schema=schema,
            key=key,
            event_time=event_time,
        )
    except AppError as exc:
        if str(exc).startswith(f"{path}:"):
            raise
        raise AppError(f"{path}: {exc}") from exc
