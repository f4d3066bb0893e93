"""A SparkSession configured for shardless."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from pyspark import SparkConf, SparkContext
from pyspark.sql import SparkSession

from shardless.processor.driver import placement
from shardless.processor.driver.timer_source import TimerDataSource
from shardless.processor.kinesis.source import KinesisDataSource
from shardless.processor.runtime import installed_pyspark
from shardless.processor.tools.state_source import StateDataSource

_FORWARDED_ENV = ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "SHARDLESS_")


DEFAULT_MASTER = "local[2]"
# Spark waits up to this long for a task's preferred executor, and a slice group prefers
# the executor that last ran it. With Spark's 3 s, a group whose executor was lost never
# moves to the replacement: the survivor frees up sooner, so the group runs there, after
# the group already there, for the rest of the run. With at most one group per task slot,
# 0 loses nothing: at the start of every batch each group's executor is free. With more
# groups than slots it would move queued groups every batch, so it is left alone.
LOCALITY_WAIT = "spark.locality.wait"
# Python workers forked by shardless's daemon import PySpark's compiled package rather
# than compile it from Spark's zip (`installed_pyspark`). Set where executors run this
# interpreter (local masters); elsewhere it is the deployment's to set, where shardless is
# installed on the nodes (`docs/running-on-a-cluster.md`). Where it is set, Spark's other
# Python processes start through `installed_pyspark.launcher` (`_python_exec`); a
# deployment that sets its own daemon module keeps PySpark's way for both.
DAEMON_MODULE = "spark.python.daemon.module"

log = logging.getLogger(__name__)


def launched_by_spark_submit() -> bool:
    """Whether spark-submit chose the master: this process runs under it (its JVM gateway
    is already up), or PYSPARK_SUBMIT_ARGS passes `--master`."""
    if os.environ.get("PYSPARK_GATEWAY_PORT"):
        return True
    return "--master" in os.environ.get("PYSPARK_SUBMIT_ARGS", "").split()


def deployed_conf() -> SparkConf:
    """The configuration the deployment gives a session: spark-submit's `--master` and
    `--conf`, and `spark-defaults.conf`. They live in the JVM, so it is started first (as
    building the session would); before it, PySpark's `SparkConf()` is empty."""
    SparkContext._ensure_initialized()
    return SparkConf()


def session(
    master: str | None = None, groups: int = 0, app_name: str = "shardless", ui: bool = True
) -> SparkSession:
    """Create (or reuse) the process's session, with the Kinesis and state sources registered.

    `master` None: spark-submit's `--master` when launched by spark-submit (or given in
    PYSPARK_SUBMIT_ARGS), else local[2]. The Spark UI stays on (`spark.ui.enabled` as the
    deployment sets it), where its Structured Streaming tab shows shardless's figures;
    `ui=False` turns it off, for tests and the demo.
    Workers must run this interpreter (its packages), and Python workers are reused so that
    slice stores stay open between batches. `groups` sets `spark.sql.shuffle.partitions`;
    0: one per task slot of the session's cluster, else 8 (`placement.choose_groups`).
    With at most one group per slot, tasks wait for no executor (`LOCALITY_WAIT` 0,
    unless the deployment sets it). Under a local master, Python workers and the planners of
    Python data sources import PySpark's installed package (`DAEMON_MODULE` and
    `_python_exec`, unless the deployment sets the daemon module).
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
    deployed = deployed_conf()
    where = master or deployed.get("spark.master", DEFAULT_MASTER)
    settings = dict(deployed.getAll())
    if groups == 0:
        choice = placement.choose_groups(where, settings)
        groups = choice.groups
        log.info("%s", choice.why)
    slots = placement.task_slots(where, settings)
    if placement.no_locality_wait(groups, slots) and not deployed.contains(LOCALITY_WAIT):
        builder = builder.config(LOCALITY_WAIT, "0")
    prefer_installed = (
        where.startswith("local")
        and not deployed.contains(DAEMON_MODULE)
        and installed_pyspark.daemon_importable(os.environ["PYSPARK_PYTHON"])
    )
    if prefer_installed:
        builder = builder.config(DAEMON_MODULE, installed_pyspark.DAEMON)
    builder = (
        builder.appName(app_name)
        .config("spark.python.worker.reuse", "true")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.streaming.stopGracefullyOnShutdown", "true")
    )
    with _python_exec(prefer_installed):
        spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    spark.conf.set("spark.sql.shuffle.partitions", str(groups))
    spark.dataSource.register(KinesisDataSource)
    spark.dataSource.register(StateDataSource)
    spark.dataSource.register(TimerDataSource)
    return spark


@contextlib.contextmanager
def _python_exec(prefer_installed: bool) -> Iterator[None]:
    """Where the workers' daemon is shardless's (`prefer_installed`) and PYSPARK_PYTHON is
    this interpreter, the context created here starts every Python process through
    `installed_pyspark.launcher`: the planners of Python data sources too, which the daemon
    does not start. PySpark reads PYSPARK_PYTHON once, when the context is created; it is
    put back afterwards, since a process this one starts later (a driver of its own) must
    not inherit a script that is removed when this one exits."""
    python = os.environ["PYSPARK_PYTHON"]
    launcher = None
    if prefer_installed and _same_file(python, sys.executable):
        launcher = installed_pyspark.launcher(python)
    if launcher is None:
        yield
        return
    os.environ["PYSPARK_PYTHON"] = launcher
    try:
        yield
    finally:
        os.environ["PYSPARK_PYTHON"] = python


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
