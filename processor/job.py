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

from pyspark.sql import DataFrame, SparkSession
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


def outputs(spark: SparkSession, handlers: HandlerFactory, cfg: JobConfig) -> DataFrame:
    """The streaming DataFrame of outputs (and per-group metrics rows, kind='metrics')."""
    partitions = int(spark.conf.get("spark.sql.shuffle.partitions"))
    if partitions != cfg.groups:
        log.warning(
            "spark.sql.shuffle.partitions=%s, groups=%s: using %s",
            partitions,
            cfg.groups,
            partitions,
        )
    keys = group_keys(partitions)
    records = spark.readStream.format("shardless_kinesis").options(**cfg.source_options()).load()
    group_index = F.floor(F.col("slice") * partitions / cfg.slices).cast("int")
    key_array = F.array(*[F.lit(k) for k in keys])
    grouped = (
        records.withColumn("group", F.element_at(key_array, group_index + 1))
        .withColumn("event_time", F.col("arrival"))
        .withWatermark("event_time", f"{cfg.allowed_lateness_ms} milliseconds")
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
