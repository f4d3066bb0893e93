"""A user's function as the sink: it receives each batch's outputs once the batch's state
is committed, with an identity that stays the same when Spark runs the batch again.

    def write(df, batch):            # batch.query_id, batch.batch_id
        df.write.format("delta").option("txnAppId", batch.query_id) \\
            .option("txnVersion", batch.batch_id).mode("append").save("/data/totals")

    start(spark, handler, cfg, sink=foreach_batch_sink(write))
    shardless run app.py ... --foreach-batch mymodule:write   # or `foreach_batch = write`

Delivery to the function is at least once: a batch whose function raises (or whose driver
dies before Spark's checkpoint records it) runs again when the query restarts from its
checkpoint, recomputes the same outputs (its state was committed; a re-run commits in the
same place), and calls the function again with the same `(query_id, batch_id)`. A function
that writes idempotently per identity is therefore exactly once.

The batch reaches the function cached, so whatever it reads (part of it, all of it twice),
every group has run once before it is called (`shardless.processor.driver.batch_reads`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame

from shardless.processor.errors import ConfigError, ProcessorError

Sink = Callable[[DataFrame, int], None]  # as shardless.processor.driver.job.Sink
QUERY_ID_PROPERTY = "sql.streaming.queryId"  # set by Spark on the batch's thread


@dataclass(frozen=True)
class BatchIdentity:
    """A batch's identity, the same on every run of it: Spark's query id (kept in the
    checkpoint: new only with a new checkpoint, whose batch ids restart at 0) and batch id."""

    query_id: str
    batch_id: int

    def __str__(self) -> str:
        return f"{self.query_id}/{self.batch_id}"


class ForeachBatchError(ProcessorError):
    """The user's foreach_batch function raised: the batch fails and runs again on restart."""


def foreach_batch_sink(
    function: Callable[[DataFrame, BatchIdentity], Any],
    *,
    name: str | None = None,
    query_id: str | None = None,
) -> Sink:
    """A sink for `shardless.processor.driver.job.start` calling `function(df, batch)`.

    `name`: how errors name the function (default: its module and name). `query_id`: the
    identity's query when the sink is called outside a streaming query.
    """
    if not callable(function):
        raise ConfigError(f"foreach_batch: {function!r} is not a function (df, batch)")
    label = name or f"{getattr(function, '__module__', '?')}:{getattr(function, '__name__', '?')}"

    def write(df: DataFrame, batch_id: int) -> None:
        query = df.sparkSession.sparkContext.getLocalProperty(QUERY_ID_PROPERTY) or query_id
        if not query:
            raise ConfigError(
                f"foreach_batch {label}: batch {batch_id} is not run by a streaming query (no "
                "sql.streaming.queryId): give foreach_batch_sink(..., query_id=...)"
            )
        batch = BatchIdentity(query, int(batch_id))
        try:
            function(df, batch)
        except Exception as exc:
            raise ForeachBatchError(
                f"foreach_batch {label} failed on batch {batch}: {type(exc).__name__}: {exc}; "
                "the batch's state is committed: restarting the job runs the batch again and "
                "calls the function again with the same batch identity"
            ) from exc

    return write


def import_function(spec: str) -> Callable[..., Any]:
    """The function `module:function` names (`--foreach-batch`): the module imported from
    the Python path or the current directory."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--foreach-batch {spec!r}: give MODULE:FUNCTION, e.g. sinks:write")
    here = str(Path.cwd())
    if here not in sys.path:
        sys.path.append(here)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - whatever importing the user's module raised
        raise ConfigError(
            f"--foreach-batch {spec!r}: cannot import {module_name!r}: {type(exc).__name__}: "
            f"{exc} (the module must be on the Python path or in the current directory)"
        ) from exc
    function = module
    for part in attr.split("."):
        function = getattr(function, part, None)
        if function is None:
            raise ConfigError(f"--foreach-batch {spec!r}: {module_name} has no {attr!r}")
    if not callable(function):
        raise ConfigError(f"--foreach-batch {spec!r}: {attr} is not a function (df, batch)")
    return function
