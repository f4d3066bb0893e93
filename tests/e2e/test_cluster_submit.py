"""A real cluster submit: `spark-submit` to a Spark standalone cluster, a worker lost mid-run.

A master and two one-core workers run on loopback from PySpark's own `spark-class`
(`shardless.processor.local.cluster`), each worker with its own work and local
directories. shardless reaches the executors the way EMR and Databricks users ship native
dependencies: its wheel and dependencies in a fresh virtual environment packed by
`venv-pack`, given to `spark-submit --archives env.tar.gz#environment` with
`spark.pyspark.python=./environment/bin/python`. The driver runs here in client mode,
through the two-line launcher of `docs/running-on-a-cluster.md`, on the same environment:
Spark starts the driver's Python, and the Kinesis source's planner beside it, as
`./environment/bin/python` from the directory spark-submit runs in, where `environment`
links to the virtual environment that was packed. Each executor keeps its slice stores in
its own working directory (a relative `--local-dir`), as on a host of its own.

The job (`examples/user_activity.py`, a count and last-seen time per user) reads a
Kinesis stream on the emulators; once it has reported a batch, one worker is killed with
its executor and their Python processes: the host is gone. Spark runs the lost tasks on
the other worker, which must restore the lost slices from S3, and the job must drain the
stream. Then the durable state, rebuilt from S3 and DynamoDB alone, and the outputs are
compared with a plain-Python fold of the stream (`processor/local/faults/check.py`).
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shardless.changelog.layout import AppLocation
from shardless.processor.local import cluster
from shardless.processor.local.faults import check, events, procs
from shardless.processor.local.faults.driver import REPO, Driver
from tests.jobs import job_config

pytestmark = pytest.mark.slow

APP_FILE = REPO / "examples" / "user_activity.py"
EVENTS = 1500  # 150 records per shard and batch: five batches
USERS = 60
TIMEOUT_S = 240
# The launcher `docs/running-on-a-cluster.md` gives for spark-submit.
LAUNCHER = """\
import sys
from shardless.processor.cli import main

sys.exit(main())
"""


def submit_command(master: str, archive: Path, launcher: Path) -> list[str]:
    """spark-submit in client mode: the driver and the executors run the archive's Python
    (on the driver, `./environment` is the archive unpacked where spark-submit runs)."""
    return [
        str(cluster.SPARK_HOME / "bin" / "spark-submit"),
        "--master", master,
        "--archives", f"{archive}#environment",
        "--conf", "spark.pyspark.python=./environment/bin/python",
        "--conf", "spark.executor.cores=1",
        "--conf", "spark.dynamicAllocation.enabled=false",
        "--conf", "spark.task.maxFailures=8",
        str(launcher),
        "run",
    ]  # fmt: skip


def test_a_job_submitted_to_a_standalone_cluster_survives_a_lost_worker_exactly_once(
    kinesis, make_stream, location: AppLocation, tmp_path: Path
) -> None:
    stream = make_stream(2)
    cfg = job_config(location, (stream,), tmp_path, groups=2, local_dir="stores")
    archive, pack, out_dir = tmp_path / "env.tar.gz", tmp_path / "pack", tmp_path / "outputs"
    launcher = tmp_path / "shardless_main.py"
    launcher.write_text(LAUNCHER)
    # the driver's ./environment (module docstring)
    (tmp_path / "environment").symlink_to(pack / "env")
    args = [
        str(APP_FILE),
        "--app", cfg.app,
        "--stream", stream,
        "--slices", str(cfg.slices),
        "--groups", str(cfg.groups),
        "--checkpoint", cfg.checkpoint,
        "--local-dir", cfg.local_dir,
        "--output", str(out_dir),
        "--available-now",
        "--max-records-per-shard", "150",
    ]  # fmt: skip

    # the environment is packed while the stream is filled and the cluster starts
    with ThreadPoolExecutor(1) as pool:
        packing = pool.submit(cluster.pack_environment, archive, pack, compress_level=1)
        events.produce(kinesis, stream, 0, EVENTS, USERS, random.Random(31))
        spark = cluster.start(tmp_path / "cluster")
    driver = Driver(
        args,
        cluster.cluster_env(),
        tmp_path / "driver.log",
        command=submit_command(spark.master_url, archive, launcher),
        cwd=tmp_path,
    )
    try:
        packing.result()  # raises what failed
        driver.start()
        assert driver.wait_for_batch(0, TIMEOUT_S), driver.tail(40)
        running = [i for i in range(len(spark.workers)) if spark.executors(i)]
        assert running == [0, 1], "an executor on each worker"
        time.sleep(0.3)  # into the next batch
        killed = spark.kill_worker(1)
        kill_mark = len(driver.reports)
        code = driver.wait(TIMEOUT_S)
    finally:
        driver.kill()
        spark.stop()
    assert code == 0, driver.tail(40)
    assert any(procs.EXECUTOR_MAIN in p.cmdline for p in killed)
    assert spark.workers[1].proc.returncode is not None

    last = {r["batch_id"]: r for r in driver.reports}
    assert len(last) >= 4
    # the lost executor's slices were restored from S3 on the surviving one
    after = driver.reports[kill_mark:]
    assert any(r["restored_slices"] > 0 and r["restored_bytes"] > 0 for r in after), after
    processed = sum(r["records"] for r in last.values())
    problems, total = check.verify(kinesis, cfg, stream, str(out_dir), processed)
    assert total == EVENTS
    assert problems == []
    # about 1.5 GB of unpacked environments, removed while the next tests run (tens of
    # seconds on a slow disk; not a daemon thread: Python waits for it at exit); the logs stay
    unpacked = [pack, *(tmp_path / "cluster").glob("worker-*/work")]
    threading.Thread(target=_remove, args=(unpacked,), name="remove-environments").start()


def _remove(folders: list[Path]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
