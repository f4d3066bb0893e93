"""shardless: exactly-once, locally stateful stream processing for Kinesis on Spark.

The front door: `from shardless import JobConfig, start, session, TestDriver`. Names load
on first use, so `import shardless.state` stays free of Spark. The rooms beneath:
`shardless.processor` (handler API, runtime, driver, tools), `shardless.changelog`
(durable state in S3 and DynamoDB) and `shardless.state` (the local slice store).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module that defines it
_EXPORTS = {
    "JobConfig": "shardless.processor.driver.config",
    "start": "shardless.processor.driver.job",
    "parquet_sink": "shardless.processor.driver.job",
    "console_sink": "shardless.processor.driver.job",
    "BatchReport": "shardless.processor.driver.job",
    "session": "shardless.processor.driver.spark",
    "kinesis_sink": "shardless.processor.kinesis.sink",
    "TestDriver": "shardless.processor.testing",
    "load_handler": "shardless.processor.api.app",
    "HandlerFactory": "shardless.processor.api.handlers",
    "RecordPolicy": "shardless.processor.api.policies",
    "Event": "shardless.processor.api.context",
    "Context": "shardless.processor.api.context",
    "Timer": "shardless.processor.api.context",
}

__all__ = [
    "BatchReport",
    "Context",
    "Event",
    "HandlerFactory",
    "JobConfig",
    "RecordPolicy",
    "TestDriver",
    "Timer",
    "console_sink",
    "kinesis_sink",
    "load_handler",
    "parquet_sink",
    "session",
    "start",
]

if TYPE_CHECKING:
    from shardless.processor.api.app import load_handler
    from shardless.processor.api.context import Context, Event, Timer
    from shardless.processor.api.handlers import HandlerFactory
    from shardless.processor.api.policies import RecordPolicy
    from shardless.processor.driver.config import JobConfig
    from shardless.processor.driver.job import BatchReport, console_sink, parquet_sink, start
    from shardless.processor.driver.spark import session
    from shardless.processor.kinesis.sink import kinesis_sink
    from shardless.processor.testing import TestDriver


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardless' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
