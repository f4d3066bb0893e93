"""A SparkSession configured for shardless."""

from __future__ import annotations

import logging
import os
import sys

from pyspark import SparkConf
from pyspark.sql import SparkSession

from shardless.processor.driver import placement
from shardless.processor.driver.timer_source import TimerDataSource
from shardless.processor.kinesis.source import KinesisDataSource
from shardless.processor.tools.state_source import StateDataSource

_FORWARDED_ENV = ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "SHARDLESS_")


DEFAULT_MASTER = "local[2]"
# Spark waits up to this long for a task's preferred executor, and a slice group prefers
# the executor that last ran it. With Spark's 3 s, a group whose executor was lost never
# moves back to the replacement: the survivor frees up sooner, so the queued group runs
# there, after the group already there, for the rest of the run. With 0 each group still
# gets its own executor whenever that one is free, as at the start of every batch.
LOCALITY_WAIT = "spark.locality.wait"

log = logging.getLogger(__name__)


def launched_by_spark_submit() -> bool:
    """Whether spark-submit chose the master: this process runs under it (its JVM gateway
    is already up), or PYSPARK_SUBMIT_ARGS passes `--master`."""
    if os.environ.get("PYSPARK_GATEWAY_PORT"):
        return True
    return "--master" in os.environ.get("PYSPARK_SUBMIT_ARGS", "").split()


def session(
    master: str | None = None, groups: int = 0, app_name: str = "shardless", ui: bool = True
) -> SparkSession:
    """Create (or reuse) the process's session, with the Kinesis and state sources registered.

    `master` None: spark-submit's `--master` when launched by spark-submit (or given in
    PYSPARK_SUBMIT_ARGS), else local[2]. The Spark UI stays on (`spark.ui.enabled` as the
    deployment sets it), where its Structured Streaming tab shows shardless's figures;
    `ui=False` turns it off, for tests and the demo.
    Workers must run this interpreter (its packages), and Python workers are reused so that
    slice stores stay open between batches. Tasks wait for no executor (`LOCALITY_WAIT`
    0, unless the deployment sets it). `groups` sets `spark.sql.shuffle.partitions`;
    0: one per task slot of the session's cluster, else 8 (`placement.choose_groups`).
    """
    if master is None and not launched_by_spark_submit():
        master = DEFAULT_MASTER
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if master is not None and master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder if master is None else SparkSession.builder.master(master)
    if master is None or not master.startswith("local"):
        # Executors on other hosts reach the same endpoints and region as the driver.
        for name, value in os.environ.items():
            if name.startswith(_FORWARDED_ENV):
                builder = builder.config(f"spark.executorEnv.{name}", value)
    if not ui:
        builder = builder.config("spark.ui.enabled", "false")
    if not SparkConf().contains(LOCALITY_WAIT):  # spark-submit's --conf or defaults win
        builder = builder.config(LOCALITY_WAIT, "0")
    spark = (
        builder.appName(app_name)
        .config("spark.python.worker.reuse", "true")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.streaming.stopGracefullyOnShutdown", "true")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    if groups == 0:
        sc = spark.sparkContext
        choice = placement.choose_groups(sc.master, dict(sc.getConf().getAll()))
        groups = choice.groups
        log.info("%s", choice.why)
    spark.conf.set("spark.sql.shuffle.partitions", str(groups))
    spark.dataSource.register(KinesisDataSource)
    spark.dataSource.register(StateDataSource)
    spark.dataSource.register(TimerDataSource)
    return spark
