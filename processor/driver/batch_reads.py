"""How a batch's outputs reach the sink, and its metrics rows the driver.

The groups run when a batch's DataFrame is first read, so every row of it must be read:
a group never read never commits, and its records would be lost once Spark records the
batch. A sink marked `reads_once` promises one DataFrame action that reads every row it is
given (a write, a count, a collect): the batch then runs once, in that action, and the
metrics rows come back as an observed metric of it. Any other sink may read its rows
partly (`show`, `take`, `isEmpty`), twice or not at all, so the batch is cached first
(`held`), its metrics rows collected, which runs every group, and the cache handed on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F

from shardless.processor.errors import ProcessorError

Sink = Callable[[DataFrame, int], None]  # as shardless.processor.driver.job.Sink
F_ = TypeVar("F_", bound=Callable[..., Any])

READS_ONCE = "shardless_reads_once"  # the mark `reads_once` sets on a function

# A held batch is cached for its two reads, the metrics rows and then the sink, and dropped
# when the batch ends. Spark compresses a cached table's columns by default, which for a
# cache read twice within one batch costs more time than it saves memory (`held`).
CACHE_COMPRESSED = "spark.sql.inMemoryColumnarStorage.compressed"


class SinkReadError(ProcessorError):
    """A sink marked `reads_once` did not read its batch in a DataFrame action."""


def reads_once(function: F_) -> F_:
    """Mark a sink `(df, batch_id)` or a `foreach_batch` function `(df, batch)` as reading
    every row of its DataFrame in exactly one DataFrame action: a write
    (`df.write...save()`, `parquet()`), `count()`, `collect()`, `toPandas()`. The batch's
    groups then run in that action instead of once into a cache and twice out of it.

    Not for a function that reads only some rows (`show`, `take`, `first`, `limit`,
    `isEmpty`) or goes through the RDD (`foreachPartition`, `df.rdd`): a batch whose marked
    sink ran no DataFrame action fails (`SinkReadError`) and runs again on restart, but a
    partial read cannot be told from a whole one, and the groups it skipped would lose their
    records. A second action on the DataFrame runs the batch's groups again (a replay: the
    same outputs, at the cost of the whole batch)."""
    setattr(function, READS_ONCE, True)
    return function


def is_read_once(function: Callable[..., Any]) -> bool:
    return bool(getattr(function, READS_ONCE, False))


def describe(sink: Sink) -> str:
    """How batches reach `sink`, for the job's log."""
    if is_read_once(sink):
        return "each batch runs once, in the sink's read (reads_once)"
    return (
        "each batch is cached for the sink, which may read it partly or more than once "
        "(a sink that reads every row in one DataFrame action can say so with "
        "@shardless.reads_once)"
    )


def held(df: DataFrame) -> DataFrame:
    """`df` persisted for the batch's two reads, with its columns cached uncompressed: less
    time for a somewhat larger cache that lives one batch (`docs/benchmarks.md`, "A batch's
    trip to the sink"). Spark reads the setting when the cache is defined, so it is changed
    around `persist` only, and put back."""
    conf = df.sparkSession.conf
    before = conf.get(CACHE_COMPRESSED)
    conf.set(CACHE_COMPRESSED, "false")
    try:
        return df.persist()
    finally:
        conf.set(CACHE_COMPRESSED, before)


def _outputs(df: DataFrame) -> DataFrame:
    return df.where("kind = 'out'").drop("kind")


def deliver(
    df: DataFrame,
    batch_id: int,
    sink: Sink,
    shape: Callable[[DataFrame], DataFrame] = lambda df: df,
) -> list[str]:
    """Hand the batch's output rows (`kind = 'out'`, shaped by `shape`) to `sink`; return
    the JSON values of its metrics rows, one per group that ran."""
    if is_read_once(sink):
        seen = Observation()
        metrics = F.collect_list(F.when(F.col("kind") == "metrics", F.col("value")))
        sink(shape(_outputs(df.observe(seen, metrics.alias("metrics")))), batch_id)
        # Spark fills an observation when a DataFrame action over it ends (SQLExecution):
        # not after an RDD action, nor when nothing was read.
        if not seen._jo.future().isCompleted():  # type: ignore[union-attr]
            name = getattr(sink, "__qualname__", repr(sink))
            raise SinkReadError(
                f"sink {name} is marked reads_once but read batch {batch_id} in no DataFrame "
                "action (an RDD action such as foreachPartition or df.rdd, or none at all): "
                "the batch fails, and runs again on restart (groups that ran commit again in "
                "the same place); read the DataFrame with one DataFrame action (a write, "
                "count, collect), or remove the mark so that the batch is cached for the sink"
            )
        return list(seen.get["metrics"])
    kept = held(df)
    try:
        values = [row.value for row in kept.where("kind = 'metrics'").select("value").collect()]
        sink(shape(_outputs(kept)), batch_id)
        return values
    finally:
        kept.unpersist()
