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

from shardless.changelog import aws, resources
from shardless.changelog.errors import ConfigurationError
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.driver import (
    batch_reads,
    event_time,
    heartbeat,
    keys,
    metrics,
    placement,
    typed_outputs,
)
from shardless.processor.driver.config import JobConfig
from shardless.processor.driver.imports import check_import_done
from shardless.processor.driver.spark import LOCALITY_WAIT
from shardless.processor.errors import ConfigError
from shardless.processor.kinesis.shards import list_shards
from shardless.processor.runtime.group_runner import (
    OUTPUT_SCHEMA,
    STATE_SCHEMA,
    GroupRunner,
    RuntimeConfig,
)
from shardless.processor.runtime.grouping import group_keys
from shardless.state.encoding import format_code

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


def prepare(cfg: JobConfig, spark: SparkSession | None = None) -> None:
    """Fail fast on what a running job would only find later: streams, bucket, table, slices.

    With `--starting-position COMMITTED` on a new checkpoint, first undo the slice commits
    of batches that never completed (committed, but no progress recorded: the driver died
    in between), so the new query reads those records again and counts them once. A
    checkpoint that already planned a batch is resumed as it is (`spark` lets remote
    checkpoints be seen; without it only local paths are).
    """
    from shardless.processor.driver import recorder, takeover
    from shardless.processor.kinesis.client import kinesis_client
    from shardless.processor.kinesis.positions import is_committed

    cfg.share_roles(spark)  # the driver's clients, and the slice groups' workers
    try:
        resources.ensure(cfg.location, cfg.slices)
    except ConfigurationError as exc:
        raise ConfigError(str(exc)) from exc
    kinesis = kinesis_client(cfg.kinesis_endpoint, fail_fast=True)
    where = cfg.kinesis_endpoint or aws.where("kinesis")
    fix = "--kinesis-endpoint" if cfg.kinesis_endpoint else "AWS_ENDPOINT_URL_KINESIS"
    for stream in cfg.streams:
        try:
            list_shards(kinesis, stream)
        except Exception as exc:
            if "Could not connect" in str(exc):
                raise ConfigError(
                    f"cannot reach Kinesis at {where}: start the local emulators "
                    f"(`shardless local up`) or fix {fix}"
                ) from exc
            raise ConfigError(str(exc)) from exc
    check_import_done(cfg.location)
    if not (
        is_committed(cfg.starting_position)
        or cfg.allow_recount
        or recorder.checkpoint_started(spark, cfg.checkpoint)
    ):
        takeover.check_new_start(cfg.location, tuple(cfg.streams))
    if is_committed(cfg.starting_position):
        if recorder.checkpoint_started(spark, cfg.checkpoint):
            log.info(
                "checkpoint %s has batches: resuming it (--starting-position COMMITTED applies "
                "to a new checkpoint only)",
                cfg.checkpoint,
            )
        else:
            found, _ = takeover.committed_start(cfg.location)
            log.info(
                "application %r continues from query %s's batch %s (%d shard positions)",
                cfg.app,
                found["query"],
                found["batch"],
                len(found["positions"]),
            )


def partitions_for(spark: SparkSession, cfg: JobConfig) -> tuple[int, tuple[int, int] | None]:
    """The shuffle partitions the groups are laid out for (the checkpoint's, when it fixed
    them, else the session's: `--groups 0` leaves the count to `session()`), and the
    checkpoint's layout (partitions, sources), None for a new checkpoint."""
    from shardless.processor.driver import recorder

    partitions = int(spark.conf.get("spark.sql.shuffle.partitions"))
    layout = recorder.checkpoint_layout(spark, cfg.checkpoint)
    fixed_by_checkpoint = layout[0] if layout is not None else None
    if fixed_by_checkpoint is not None and fixed_by_checkpoint != partitions:
        log.warning(
            "spark.sql.shuffle.partitions=%s, but checkpoint %s fixed %s partitions for its "
            "state: laying the groups out for %s (a new group count needs a new checkpoint "
            "with --starting-position COMMITTED)",
            partitions,
            cfg.checkpoint,
            fixed_by_checkpoint,
            fixed_by_checkpoint,
        )
        partitions = fixed_by_checkpoint
    elif cfg.groups == 0 and partitions > cfg.slices:  # a session not sized for the slices
        log.warning(
            "spark.sql.shuffle.partitions=%s is more than the %s slices: %s groups",
            partitions,
            cfg.slices,
            cfg.slices,
        )
        partitions = cfg.slices
        spark.conf.set("spark.sql.shuffle.partitions", str(partitions))
    if cfg.groups and partitions != cfg.groups:
        log.warning(
            "spark.sql.shuffle.partitions=%s, groups=%s: using %s",
            partitions,
            cfg.groups,
            partitions,
        )
    sc = spark.sparkContext
    conf = dict(sc.getConf().getAll())
    slots = placement.task_slots(sc.master, conf)
    waits = conf.get(LOCALITY_WAIT) not in ("0", "0s", "0ms")
    if not waits and not placement.no_locality_wait(partitions, slots):
        log.warning(
            "%s groups on %s task slots with %s=0: a group queued behind another moves to "
            "whichever executor is free and catches up its slices there; set %s (Spark's "
            "default is 3s), or start a new checkpoint with --groups 0 --starting-position "
            "COMMITTED",
            partitions,
            slots,
            LOCALITY_WAIT,
            LOCALITY_WAIT,
        )
    if cfg.slices > 100 * partitions:
        log.warning(
            "%s slices in %s partitions: a partition whose slices all changed commits them in "
            "%s DynamoDB transactions (100 items each, sent together); %s or more partitions "
            "make it one",
            cfg.slices,
            partitions,
            -(-cfg.slices // partitions // 100),
            -(-cfg.slices // 100),
        )
    return partitions, layout


def group_owner_for(spark: SparkSession, cfg: JobConfig) -> placement.OwnerChoice:
    """The group owner the job runs with on this session's executors (`--group-owner auto`
    chooses by how many tasks an executor runs at once: `shardless.processor.driver.placement`)."""
    sc = spark.sparkContext
    conf = dict(sc.getConf().getAll())
    return placement.choose_group_owner(
        cfg.group_owner, placement.tasks_per_executor(sc.master, conf)
    )


def runtime_config(
    cfg: JobConfig, partitions: int, group_owner: str | None = None
) -> RuntimeConfig:
    """What the group runner on the executors needs of the job's configuration;
    `group_owner` is the owner chosen for `--group-owner auto` (`group_owner_for`)."""
    owner = group_owner or cfg.group_owner
    if owner not in ("worker", "process"):
        raise ValueError(f"group owner {owner!r}: resolve --group-owner auto first")
    return RuntimeConfig(
        location=cfg.location,
        slices=cfg.slices,
        local_dir=cfg.local_dir,
        value_format=format_code(cfg.value_format),
        allow_pickle=cfg.value_format == "pickle",
        timer_poll_ms=cfg.timer_poll_ms,
        snapshot_every=cfg.snapshot_every,
        snapshot_log_bytes=cfg.snapshot_log_mb * 1024 * 1024,
        keep_snapshots=cfg.keep_snapshots,
        transfer_process_bytes=int(cfg.transfer_process_mb * 1024 * 1024),
        snapshot_uploads=cfg.snapshot_uploads,
        group_owner=owner,
        owner_idle_seconds=cfg.owner_idle_seconds,
        commit_format=cfg.commit_format,
        chain_length=cfg.chain_length or None,
        policy=cfg.record_policy(),
        dead_letter=cfg.dead_letter,
        partitions=partitions,
    )


def group_plan(
    records: DataFrame,
    cfg: JobConfig,
    partitions: int,
    group_function: Callable[..., Any],
    columns: tuple[str, ...] = RECORD_COLUMNS,
    watermark: str = "arrival",
) -> DataFrame:
    """Records (with their `slice`) grouped into the job's slice groups, one per shuffle
    partition, and `group_function` run per group under `applyInPandasWithState`: the
    DataFrame of outputs and per-group metrics rows. Only `columns` cross into Python; the
    watermark follows the timestamp column `watermark`."""
    keys = group_keys(partitions)
    group_index = F.floor(F.col("slice") * partitions / cfg.slices).cast("int")
    key_array = F.array(*[F.lit(k) for k in keys])
    grouped = records.withWatermark(watermark, f"{cfg.allowed_lateness_ms} milliseconds").select(
        F.element_at(key_array, group_index + 1).alias("group"), *columns
    )
    return grouped.groupBy("group").applyInPandasWithState(
        group_function,
        OUTPUT_SCHEMA,
        STATE_SCHEMA,
        "Update",
        GroupStateTimeout.ProcessingTimeTimeout,
    )


def outputs(spark: SparkSession, handlers: HandlerFactory, cfg: JobConfig) -> DataFrame:
    """The streaming DataFrame of outputs (and per-group metrics rows, kind='metrics') of
    the job's Kinesis source. Durable commits go to the application's S3 bucket and
    DynamoDB table."""
    partitions, layout = partitions_for(spark, cfg)
    records = spark.readStream.format("shardless_kinesis").options(**cfg.source_options()).load()
    records = metrics.observe_shards(records)  # per-shard lag in Spark's progress
    # A new checkpoint's first batch wakes the slices whose timers are pending
    # (`shardless.processor.driver.timer_source`); the Kinesis source stays the first in the
    # offset log. A checkpoint written with the Kinesis source alone (before this source
    # existed) keeps its one source: Spark refuses a restart with another count, and its
    # group state holds its pending timers anyway.
    if layout is None or layout[1] >= 2:
        loc = cfg.location
        wake = spark.readStream.format("shardless_timers").options(
            app=loc.app, bucket=loc.bucket, prefix=loc.prefix, table=loc.table,
            slices=str(cfg.slices),
        )  # fmt: skip
        records = records.unionByName(wake.load())
    columns = RECORD_COLUMNS
    choice = keys.chosen(cfg.key_field, handlers)
    if choice is not None:  # routed by the app's key, in the same shuffle
        records = keys.keyed(records, choice, cfg.slices)
        columns = (*RECORD_COLUMNS, *keys.KEY_COLUMNS)
        log.info("application %r: state is keyed by the %s", cfg.app, choice.describe())
    handlers, _ = typed_outputs.declared(handlers, cfg.app)  # checked where emitted
    owner = group_owner_for(spark, cfg)
    log.log(
        logging.WARNING if owner.fallback else logging.INFO,
        "application %r: groups run in %s processes (%s)",
        cfg.app,
        owner.owner,
        owner.why,
    )
    runtime = runtime_config(cfg, partitions, owner.owner)
    timed = event_time.chosen(cfg.event_time_field, handlers)
    if timed is None:
        if cfg.on_late != "process":
            raise ConfigError(
                f"--on-late {cfg.on_late}: late records need a named event time; give "
                "--event-time-field or the app's event_time (without one, event time is the "
                "arrival time and every record is processed)"
            )
        runner = GroupRunner(handlers, runtime)
        plan = group_plan(records, cfg, partitions, runner, columns)
    else:  # the watermark follows the records' own event time
        records = event_time.timed(records, timed)
        columns = (*columns, *event_time.EVENT_TIME_COLUMNS)
        runner = GroupRunner(handlers, event_time.event_time_config(runtime, cfg.on_late))
        plan = group_plan(records, cfg, partitions, runner, columns, watermark="event_time")
        log.info("application %r: event time is the %s", cfg.app, timed.describe())
    return metrics.observe_batch(plan)


SLOWEST_PHASES = 3


def longest_phases(timings: dict[str, float], n: int = SLOWEST_PHASES) -> dict[str, float]:
    """The `n` phases of a group's batch that took longest (its metrics row's `timings`),
    longest first, in seconds: what a slow batch's log line names as the cause."""
    ranked = sorted(timings.items(), key=lambda kv: kv[1], reverse=True)[:n]
    return {name: round(seconds, 3) for name, seconds in ranked}


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
    dead_letters: int = 0
    late_records: int = 0  # at or before the watermark (a job that names its event time)
    handler_retries: int = 0
    snapshots: int = 0
    snapshot_bytes: int = 0
    restored_bytes: int = 0
    restore_seconds_max: float = 0.0
    restores: list[dict[str, Any]] = field(default_factory=list)
    group_pids: dict[int, int] = field(default_factory=dict)  # the process that ran each group
    # where the slowest group's time went: its longest phases, longest first (seconds)
    slowest_phases: dict[str, float] = field(default_factory=dict)

    @property
    def restored(self) -> list[dict[str, Any]]:
        """The restores that brought state (not a first look at a slice without any)."""
        return [r for r in self.restores if r["bytes"] or r["rolled_back"]]

    @classmethod
    def of(cls, batch_id: int, metrics: list[str]) -> BatchReport:
        """The report of a batch whose groups sent `metrics` (one JSON row per group)."""
        report = cls(batch_id)
        for value in metrics:
            m = json.loads(value)
            report.records += m["records"]
            report.outputs += m["outputs"]
            report.committed_slices += m["committed_slices"]
            report.segment_bytes += m["segment_bytes"]
            if m["seconds"] >= report.group_seconds_max:
                report.group_seconds_max = m["seconds"]
                report.slowest_phases = longest_phases(m.get("timings", {}))
            report.timers_fired += m["timers_fired"]
            report.dead_letters += m.get("dead_letters", 0)
            report.handler_retries += m.get("handler_retries", 0)
            report.late_records += m.get("late_records", 0)
            report.restores += m["restores"]
            report.group_pids[m["group"]] = m.get("pid", 0)
            report.snapshots += m.get("snapshots", 0)
            report.snapshot_bytes += m.get("snapshot_bytes", 0)
            report.restored_bytes += sum(r["bytes"] for r in m["restores"])
            report.restore_seconds_max = max(
                [report.restore_seconds_max, *(r["seconds"] for r in m["restores"])]
            )
        return report

    def summary(self) -> dict[str, Any]:
        """The report without the per-slice restore list: one log line per batch."""
        out = {k: v for k, v in self.__dict__.items() if k != "restores"}
        out["restored_slices"] = len(self.restored)
        return out

    def to_json(self) -> str:
        return json.dumps(self.__dict__, default=str)


def parquet_sink(path: str) -> Sink:
    """Write each batch's outputs to `<path>/batch_id=<n>`, replacing a retried batch's
    files. One write reads every row, so the batch runs once, in it (`reads_once`)."""

    @batch_reads.reads_once
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
    """Start the query. Each batch's outputs go to `sink` once the state is committed (as
    the columns of the handler's output schema, when it declares one; a sink marked
    `reads_once` runs the groups in its own read: `shardless.processor.driver.batch_reads`); then
    the batch's source positions are recorded as the application's progress
    (`shardless.processor.driver.progress`), which `--starting-position COMMITTED` continues
    from."""
    from shardless.processor.driver.recorder import Recorder

    handlers, schema = typed_outputs.declared(handlers, cfg.app)
    prepare(cfg, spark)
    recorder = Recorder(spark, cfg.location, cfg.checkpoint, cfg.allow_recount, tuple(cfg.streams))
    log.info("application %r: %s", cfg.app, batch_reads.describe(sink))

    def each_batch(df: DataFrame, batch_id: int) -> None:
        recorder.begin(batch_id)  # once per driver run, before anything of it is committed
        values = batch_reads.deliver(
            df, batch_id, sink, lambda out: typed_outputs.shaped(out, schema)
        )
        report = BatchReport.of(batch_id, values)
        recorder.after_sink(batch_id, report.records, report.committed_slices, report.outputs)
        log.info("batch %s", json.dumps(report.summary()))
        for r in report.restored:
            log.debug("restored %s", json.dumps(r))
        if on_report is not None:
            on_report(report)

    if cfg.metrics_port:
        from shardless.processor.driver import prometheus

        prometheus.serve(spark, cfg.app, cfg.metrics_host, cfg.metrics_port)
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
    query = writer.start()
    heartbeat.hold(cfg.location, query)  # tells the state tools the application runs
    return query
