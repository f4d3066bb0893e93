"""Wiring a shardless job: Kinesis source → slice groups → handlers → any Spark sink.

spark = session()
query = start(spark, handler, JobConfig(app="clicks", streams=("clicks",),
                                        checkpoint="/tmp/ck"), sink=parquet_sink("/tmp/out"))
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.streaming.state import GroupStateTimeout

from changelog import aws, resources
from changelog.errors import ConfigurationError
from processor.config import JobConfig
from processor.errors import ConfigError
from processor.grouping import group_keys
from processor.handlers import HandlerFactory
from processor.kinesis.shards import list_shards
from processor.runtime import OUTPUT_SCHEMA, STATE_SCHEMA, GroupRunner, RuntimeConfig
from state.encoding import format_code

log = logging.getLogger(__name__)

Sink = Callable[[DataFrame, int], None]

# The columns of a record that `GroupRunner.run` reads.
RECORD_COLUMNS = (
    "stream",
    "shard",
    "sequence_number",
    "subsequence",
    "partition_key",
    "arrival",
    "data",
    "slice",
    "stream_order",
)


def prepare(cfg: JobConfig) -> None:
    """Fail fast on what a running job would only find later: streams, bucket, table, slices."""
    try:
        resources.ensure(cfg.location, cfg.slices)
    except ConfigurationError as exc:
        raise ConfigError(str(exc)) from exc
    kinesis = aws.client("kinesis", fail_fast=True)
    for stream in cfg.streams:
        try:
            list_shards(kinesis, stream)
        except Exception as exc:
            if "Could not connect" in str(exc):
                raise ConfigError(
                    f"cannot reach Kinesis at {aws.where('kinesis')}: start the local emulators "
                    "(`shardless local up`) or fix AWS_ENDPOINT_URL_KINESIS"
                ) from exc
            raise ConfigError(str(exc)) from exc


def slice_column(partition_key: str, slices: int) -> Column:
    """`processor.routing.route(key, None, slices)` for the column `partition_key`, in the JVM.

    The slice is `(h * slices) >> 128` for the MD5 `h` of the key's UTF-8 bytes: for a power
    of two `2**k`, the top k bits of `h`, read from its first 8 hex digits. Any other count
    splits `h` into 64-bit halves `hi`, `lo`: `(hi * slices + (lo * slices >> 64)) >> 64`,
    exact in decimal arithmetic but slow (a 100,000-record batch took 3–5 s instead of
    1–1.3 s in `bench.vs_spark`).
    """
    digest = f"md5(`{partition_key}`)"
    if slices & (slices - 1) == 0:
        top = f"CAST(conv(substr({digest}, 1, 8), 16, 10) AS BIGINT)"
        return F.expr(f"CAST(shiftright({top}, {32 - slices.bit_length() + 1}) AS INT)")
    hi = f"CAST(conv(substr({digest}, 1, 16), 16, 10) AS DECIMAL(20, 0))"
    lo = f"CAST(conv(substr({digest}, 17, 16), 16, 10) AS DECIMAL(20, 0))"
    two_64 = str(1 << 64)
    return F.expr(f"CAST(({hi} * {slices} + ({lo} * {slices}) div {two_64}) div {two_64} AS INT)")


def as_records(df: DataFrame, slices: int, stream: str = "records") -> DataFrame:
    """Rows of any Spark source shaped as the Kinesis source emits them, for `outputs`.

    `df` needs `partition_key` (string), `sequence_number` (a long, increasing in the order
    records must be processed), `arrival` (timestamp) and `data` (binary). Every record gets
    one stream and shard, as from a single-shard Kinesis stream, so its sequence number
    alone is its `stream_order`: kept a long, which sorts like the source's padded strings
    and crosses into Python without a string per row (78-character strings cost about
    0.8 s per 100,000 rows on 2 cores, `docs/benchmarks.md`).
    """
    seq = F.col("sequence_number").cast("long")
    return df.select(
        F.lit(stream).alias("stream"),
        F.lit("shardId-000000000000").alias("shard"),
        seq.cast("string").alias("sequence_number"),
        F.lit(0).cast("long").alias("subsequence"),
        F.col("partition_key"),
        F.lit(None).cast("string").alias("explicit_hash_key"),
        F.col("arrival"),
        F.col("data"),
        slice_column("partition_key", slices).alias("slice"),
        seq.alias("stream_order"),
    )


def outputs(
    spark: SparkSession,
    handlers: HandlerFactory,
    cfg: JobConfig,
    records: DataFrame | None = None,
) -> DataFrame:
    """The streaming DataFrame of outputs (and per-group metrics rows, kind='metrics').

    The input is the Kinesis source of `cfg`, or `records`: any streaming DataFrame with the
    Kinesis source's columns (see `as_records`), e.g. files in a benchmark. Durable commits
    go to the application's S3 bucket and DynamoDB table either way.
    """
    partitions = int(spark.conf.get("spark.sql.shuffle.partitions"))
    if partitions != cfg.groups:
        log.warning(
            "spark.sql.shuffle.partitions=%s, groups=%s: using %s",
            partitions,
            cfg.groups,
            partitions,
        )
    keys = group_keys(partitions)
    if records is None:
        records = (
            spark.readStream.format("shardless_kinesis").options(**cfg.source_options()).load()
        )
    group_index = F.floor(F.col("slice") * partitions / cfg.slices).cast("int")
    key_array = F.array(*[F.lit(k) for k in keys])
    # Only what the runtime reads crosses into Python: every column costs Arrow conversion
    # and one Python object per row.
    grouped = records.withWatermark("arrival", f"{cfg.allowed_lateness_ms} milliseconds").select(
        F.element_at(key_array, group_index + 1).alias("group"), *RECORD_COLUMNS
    )
    runner = GroupRunner(
        handlers,
        RuntimeConfig(
            location=cfg.location,
            slices=cfg.slices,
            local_dir=cfg.local_dir,
            value_format=format_code(cfg.value_format),
            allow_pickle=cfg.value_format == "pickle",
            timer_poll_ms=cfg.timer_poll_ms,
            snapshot_every=cfg.snapshot_every,
            snapshot_log_bytes=cfg.snapshot_log_mb * 1024 * 1024,
            keep_snapshots=cfg.keep_snapshots,
        ),
    )
    return grouped.groupBy("group").applyInPandasWithState(
        runner, OUTPUT_SCHEMA, STATE_SCHEMA, "Update", GroupStateTimeout.ProcessingTimeTimeout
    )


@dataclass
class BatchReport:
    """What one batch did, aggregated over its groups."""

    batch_id: int
    records: int = 0
    outputs: int = 0
    committed_slices: int = 0
    segment_bytes: int = 0
    group_seconds_max: float = 0.0
    timers_fired: int = 0
    snapshots: int = 0
    snapshot_bytes: int = 0
    restored_bytes: int = 0
    restore_seconds_max: float = 0.0
    restores: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, default=str)


def parquet_sink(path: str) -> Sink:
    """Write each batch's outputs to `<path>/batch_id=<n>`, replacing a retried batch's files."""

    def write(df: DataFrame, batch_id: int) -> None:
        df.drop("batch_id").write.mode("overwrite").parquet(
            f"{path.rstrip('/')}/batch_id={batch_id}"
        )

    return write


def console_sink(df: DataFrame, batch_id: int) -> None:
    df.show(20, truncate=False)


def start(
    spark: SparkSession,
    handlers: HandlerFactory,
    cfg: JobConfig,
    sink: Sink = console_sink,
    on_report: Callable[[BatchReport], None] | None = None,
    available_now: bool = False,
    processing_time: str | None = None,
) -> StreamingQuery:
    """Start the query. Each batch's outputs go to `sink` once the state is committed."""
    prepare(cfg)

    def each_batch(df: DataFrame, batch_id: int) -> None:
        df = df.persist()
        try:
            report = BatchReport(batch_id)
            for row in df.where("kind = 'metrics'").select("value").collect():
                m = json.loads(row.value)
                report.records += m["records"]
                report.outputs += m["outputs"]
                report.committed_slices += m["committed_slices"]
                report.segment_bytes += m["segment_bytes"]
                report.group_seconds_max = max(report.group_seconds_max, m["seconds"])
                report.timers_fired += m["timers_fired"]
                report.restores += m["restores"]
                report.snapshots += m.get("snapshots", 0)
                report.snapshot_bytes += m.get("snapshot_bytes", 0)
                report.restored_bytes += sum(r["bytes"] for r in m["restores"])
                report.restore_seconds_max = max(
                    [report.restore_seconds_max, *(r["seconds"] for r in m["restores"])]
                )
            sink(df.where("kind = 'out'").drop("kind"), batch_id)
            log.info("batch %s", report.to_json())
            if on_report is not None:
                on_report(report)
        finally:
            df.unpersist()

    writer = (
        outputs(spark, handlers, cfg)
        .writeStream.outputMode("update")
        .option("checkpointLocation", cfg.checkpoint)
        .foreachBatch(each_batch)
        .queryName(f"shardless-{cfg.app}")
    )
    # Timers in slices without records fire through Spark's processing-time timeout, which
    # needs batches without data. A run that should stop once the stream is drained
    # (availableNow) must not schedule those, or it never ends; its timers fire with data.
    spark.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", str(not available_now).lower())
    if available_now:
        writer = writer.trigger(availableNow=True)
    elif processing_time:
        writer = writer.trigger(processingTime=processing_time)
    return writer.start()
