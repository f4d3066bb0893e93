"""Loading a user's app: a Python file that defines `process(event, ctx)`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from pyspark import cloudpickle

from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.errors import AppError


def load_handler(path: str | Path) -> HandlerFactory:
    """Import the app file and return its handler: a class named by `handler = ...`, or the
    functions `process(event, ctx)` and optionally `on_timer(timer, ctx)`.

    The module is pickled by value, so executors need no copy of the file.
    """
    path = Path(path)
    if not path.is_file():
        raise AppError(f"app file {path} does not exist")
    name = f"shardless_app_{path.stem}"
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
    spec = getattr(module, "handler", None)
    if spec is not None:
        return HandlerFactory(spec)
    process = getattr(module, "process", None)
    if not callable(process):
        raise AppError(
            f"{path}: define a function `process(event, ctx)`, or `handler = <a class with "
            "process(self, event, ctx)>`"
        )
    return HandlerFactory(process, on_timer=getattr(module, "on_timer", None))
