"""shardless's per-batch figures in Spark's own progress reports.

Each batch's figures are aggregated by `DataFrame.observe` in the query's own plan, so they
appear in `StreamingQueryProgress.observedMetrics` (the Spark UI's Structured Streaming
tab, `StreamingQueryListener`s, `query.lastProgress`, hosted platforms) with no extra job:

    "shardless"         the groups' metrics rows summed: records, outputs, slices
                        committed, restores, timers fired, dead letters, late records
                        (a job that names its event time), ... (`FIGURES`)
    "shardless_shards"  `millis_behind_latest`: `{"<stream>/<shard>": MillisBehindLatest}`
                        of every shard that gave records in the batch, from the source's
                        `behind_ms` column; `oldest_unread_arrival_ms`: the arrival time
                        (epoch ms) of the oldest record the batch's reads left unread in any
                        shard, null when every shard read caught up or ended (the source's
                        `unread_arrival_ms` column, see `shardless.processor.kinesis.reader`)

Spark counts an observation once per successful task of the plan it sits in; the job's
`foreachBatch` persists the batch before it reads it twice (metrics, then the sink), so
each figure counts each group once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from shardless.processor.kinesis.rows import UNREAD

BATCH = "shardless"
SHARDS = "shardless_shards"

# Figures summed over the batch's groups, each a field of a group's metrics row.
SUMMED = (
    "records",
    "outputs",
    "committed_slices",
    "segment_bytes",
    "timers_fired",
    "dead_letters",
    "late_records",
    "handler_retries",
    "snapshots",
    "snapshot_bytes",
)
# Figures of the restores that brought state (a first look at an empty slice is none).
RESTORES = ("restores", "restored_bytes", "restore_seconds")
FIGURES = (*SUMMED, *RESTORES, "groups")

_RESTORE_TYPE = "array<struct<bytes:long,seconds:double,rolled_back:boolean>>"


def _restored() -> Column:
    """The restores of a metrics row that brought state."""
    restores = F.from_json(F.get_json_object("value", "$.restores"), _RESTORE_TYPE)
    return F.filter(restores, lambda r: (r["bytes"] > 0) | r["rolled_back"])


def observe_batch(outputs: DataFrame) -> DataFrame:
    """`outputs` (rows of kind 'out' and one 'metrics' row per group) with the batch's
    figures observed as `BATCH`; every figure is 0 in a batch without groups."""
    is_metrics = F.col("kind") == "metrics"

    def total(value: Column, kind: str = "long") -> Column:
        zero = F.lit(0).cast(kind)
        return F.coalesce(F.sum(F.when(is_metrics, value.cast(kind))), zero)

    exprs = [total(F.get_json_object("value", f"$.{name}")).alias(name) for name in SUMMED]
    restored = _restored()
    exprs += [
        total(F.size(restored)).alias("restores"),
        total(F.aggregate(restored, F.lit(0).cast("long"), lambda a, r: a + r["bytes"])).alias(
            "restored_bytes"
        ),
        total(
            F.aggregate(restored, F.lit(0.0).cast("double"), lambda a, r: a + r["seconds"]),
            "double",
        ).alias("restore_seconds"),
        F.count(F.when(is_metrics, F.lit(1))).alias("groups"),
    ]
    return outputs.observe(BATCH, *exprs)


def observe_shards(records: DataFrame) -> DataFrame:
    """The Kinesis source's records with each shard's MillisBehindLatest and the batch's
    oldest unread arrival observed as `SHARDS` (only the last record a shard gave in a batch
    carries them); returned without the source's own lag column (`UNREAD`), in the rows
    every source of the job gives (`SCHEMA`)."""
    return records.observe(SHARDS, *shard_lag()).drop(UNREAD)


def shard_lag() -> list[Column]:
    """The aggregates `observe_shards` observes: `millis_behind_latest` and
    `oldest_unread_arrival_ms`.

    A shard is normally reported once a batch, but a read Spark runs again within the batch
    (its executor lost after the read, with the shuffle files it wrote) reports it a second
    time, and both reports reach the observation. Each shard keeps its largest lag:
    `map_from_entries` alone failed on the repeated key (Spark's scheduler logged
    DUPLICATED_MAP_KEY and the batch's lag was lost). The entries are sorted once, by shard
    then lag, and the last of each shard's run kept: O(n log n) in the batch's shards."""
    entry = F.when(
        F.col("behind_ms").isNotNull(),
        F.struct(F.concat_ws("/", "stream", "shard").alias("shard"), F.col("behind_ms")),
    )

    def last_of_each_shard(entries: Column) -> Column:
        # The next entry by `try_element_at` (1-based), null past the end where ANSI mode's
        # `entries[i + 1]` would raise, whichever of the two tests Spark evaluates first.
        def kept(e: Column, i: Column) -> Column:
            following = F.try_element_at(entries, i + 2)
            return (i == F.size(entries) - 1) | (following["shard"] != e["shard"])

        return F.filter(entries, kept)

    # `transform` over a one-element array binds the sorted entries to a lambda variable,
    # so the sort runs once rather than once per element the filter looks at.
    sorted_once = F.transform(F.array(F.array_sort(F.collect_list(entry))), last_of_each_shard)
    lag = F.map_from_entries(F.element_at(sorted_once, 1))
    oldest = F.min(UNREAD).alias("oldest_unread_arrival_ms")
    return [lag.alias("millis_behind_latest"), oldest]


def figures(observed: Mapping[str, Any]) -> dict[str, Any]:
    """A progress's shardless figures as plain values: every name of `FIGURES`,
    `millis_behind_latest` (shard key to ms) and `oldest_unread_arrival_ms` (epoch ms, None
    when the batch left nothing unread or read no records). `observed` is `observedMetrics`
    of a progress: Rows from PySpark, dicts from the progress's JSON. Empty when the
    progress has none (a trigger that ran no batch)."""
    batch = observed.get(BATCH)
    if batch is None:
        return {}
    batch = batch.asDict() if hasattr(batch, "asDict") else dict(batch)
    out: dict[str, Any] = {name: batch.get(name) or 0 for name in FIGURES}
    shards = observed.get(SHARDS)
    if shards is not None:
        shards = shards.asDict() if hasattr(shards, "asDict") else dict(shards)
    lag = (shards or {}).get("millis_behind_latest") or {}
    out["millis_behind_latest"] = {str(k): int(v) for k, v in dict(lag).items()}
    oldest = (shards or {}).get("oldest_unread_arrival_ms")
    out["oldest_unread_arrival_ms"] = None if oldest is None else int(oldest)
    return out
