"""How a batch's outputs reach the sink, and its metrics rows the driver.

The groups run when a batch's DataFrame is read, and every partition of it must be read:
a partition never read leaves its groups, and Spark's own state store, uncommitted. On
Spark 4.3 Spark then fails the batch, but only after it has written the batch to its
commit log: the records of the groups that did not run are lost, and the query cannot
restart (its state store has no version for the batch). So a sink is handed the batch
cached (`held`), after a collect of its metrics rows has run every group; it may then read
it partly, twice or not at all. Only shardless's own sinks whose one DataFrame action reads
every row (Parquet, Kinesis) are marked `reads_once`: the batch then runs once, in that
action, and the metrics rows come back as an observed metric of it. The mark is not offered
to users' functions, whose reads nothing here can check.
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
    """A sink marked `reads_once` did not read its batch in a DataFrame action (a bug in
    that sink: the batch fails and runs again on restart)."""


def reads_once(function: F_) -> F_:
    """Mark one of shardless's sinks as reading every row of its DataFrame in exactly one
    DataFrame action (a write, `count()`, `collect()`), never partly and never through the
    RDD: the batch's groups then run in that action instead of once into a cache and again
    out of it. A marked sink whose read fills no observation (an RDD action, or none) fails
    the batch with `SinkReadError`; a partial read cannot be told from a whole one here."""
    setattr(function, READS_ONCE, True)
    return function


def is_read_once(function: Callable[..., Any]) -> bool:
    return bool(getattr(function, READS_ONCE, False))


def describe(sink: Sink) -> str:
    """How batches reach `sink`, for the job's log."""
    if is_read_once(sink):
        return "each batch runs once, in the sink's read (reads_once)"
    return "each batch is cached for the sink, which may read it partly or more than once"


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


def _observed(seen: Observation) -> list[str] | None:
    """The metrics values `seen` observed, or None when no DataFrame action filled it: Spark
    fills an observation when such an action ends (`SQLExecution`), not after an RDD action
    or none, and `Observation.get` would wait for it for good."""
    if not seen._jo.future().isCompleted():  # type: ignore[union-attr]
        return None
    return list(seen.get["metrics"])


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
        values = _observed(seen)
        if values is None:
            name = getattr(sink, "__qualname__", repr(sink))
            raise SinkReadError(
                f"sink {name} is marked reads_once but read batch {batch_id} in no DataFrame "
                "action (an RDD action such as foreachPartition or df.rdd, or none at all): "
                "the batch fails, and runs again on restart (groups that ran commit again in "
                "the same place); the sink must read the DataFrame in one DataFrame action "
                "(a write, count, collect), or lose the mark so that the batch is cached"
            )
        return values
    kept = held(df)
    try:
        values = [row.value for row in kept.where("kind = 'metrics'").select("value").collect()]
        sink(shape(_outputs(kept)), batch_id)
        return values
    finally:
        kept.unpersist()
