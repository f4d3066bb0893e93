"""The driver killed (kill -9) in the middle of a batch and restarted from its checkpoint.

`shardless run` runs `examples/user_activity.py` (a count and last-seen time per user) as a
subprocess on `local[2]`, so that the whole driver (Python, its JVM, the Python workers) can
be killed at once, mid-batch: once the source has recorded where the batch's shard reads
ended, before Spark commits the batch. More events arrive while it is down; a new driver on
the same checkpoint re-runs the interrupted batch, which must read exactly the recorded
ends (none of the new events), and drains the stream. Then the durable state, rebuilt from S3 and
DynamoDB alone, and the outputs are compared with a plain-Python fold of the stream
(`processor/local/faults/check.py`): every event counted once, per user in stream order.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from pathlib import Path

import pytest

from shardless.changelog.layout import AppLocation
from shardless.processor.driver.config import JobConfig
from shardless.processor.kinesis.batch_log import BatchLog
from shardless.processor.local.faults import check, events
from shardless.processor.local.faults.driver import REPO, Driver, running_batch
from tests.jobs import job_config

pytestmark = pytest.mark.slow

APP_FILE = REPO / "examples" / "user_activity.py"
USERS = 60
TIMEOUT_S = 120


def driver(cfg: JobConfig, out_dir: Path, log: Path) -> Driver:
    args = [
        str(APP_FILE),
        "--app", cfg.app,
        "--stream", cfg.streams[0],
        "--slices", str(cfg.slices),
        "--groups", str(cfg.groups),
        "--checkpoint", cfg.checkpoint,
        "--local-dir", cfg.local_dir,
        "--output", str(out_dir),
        "--master", "local[2]",
        "--available-now",
        "--max-records-per-shard", "250",
    ]  # fmt: skip
    started = Driver(args, {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}, log)
    started.start()
    return started


def source_offset(checkpoint: Path, batch: int) -> dict:
    """The Kinesis source's offset (`run`, `n`) in Spark's offset log for `batch` (the
    timer source has a line too)."""
    lines = (checkpoint / "offsets" / str(batch)).read_text().splitlines()
    return next(o for o in map(json.loads, lines[2:]) if isinstance(o, dict) and "run" in o)


def kill_mid_batch(first: Driver, checkpoint: Path, table: str) -> tuple[int, dict]:
    """kill -9 the driver once the shard reads of a batch after the first have recorded
    their ends, before the batch commits; the batch and its recorded ends."""
    assert first.wait_for_batch(0, TIMEOUT_S), first.tail()
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        assert first.poll() is None, f"the driver ended before it could be killed\n{first.tail()}"
        assert time.monotonic() < deadline, first.tail()
        batch = running_batch(checkpoint)
        if batch is not None and batch >= 1:
            with contextlib.suppress(OSError, ValueError, IndexError):  # still being written
                offset = source_offset(checkpoint, batch)
                ends = BatchLog(table).ends(offset["run"], int(offset["n"]))
                if len(ends) == 2:  # both shards read
                    first.kill()
                    return batch, ends
        time.sleep(0.05)


def test_a_driver_killed_mid_batch_resumes_from_its_checkpoint_exactly_once(
    kinesis, make_stream, location: AppLocation, tmp_path: Path
) -> None:
    stream = make_stream(2)
    rng = random.Random(5)
    produced = events.produce(kinesis, stream, 0, 800, USERS, rng)
    cfg = job_config(location, (stream,), tmp_path, groups=2)
    out_dir = tmp_path / "outputs"

    first = driver(cfg, out_dir, tmp_path / "driver-1.log")
    try:
        killed_in, recorded = kill_mid_batch(first, Path(cfg.checkpoint), location.table)
    finally:
        first.kill()
    assert running_batch(Path(cfg.checkpoint)) == killed_in, "planned, never committed"
    events.produce(kinesis, stream, produced, 200, USERS, rng)  # arrives while it is down

    second = driver(cfg, out_dir, tmp_path / "driver-2.log")
    try:
        code = second.wait(TIMEOUT_S)
    finally:
        second.kill()
    assert code == 0, second.tail(40)

    resumed = {r["batch_id"]: r for r in second.reports}
    assert min(resumed) == killed_in, (killed_in, sorted(resumed))  # re-run, not restarted
    # The re-run replays exactly what the killed run's reads recorded (200 more events wait).
    assert resumed[killed_in]["records"] == sum(e["count"] for e in recorded.values())
    last_report = {r["batch_id"]: r for r in first.reports + second.reports}
    processed = sum(r["records"] for r in last_report.values())
    problems, total = check.verify(kinesis, cfg, stream, str(out_dir), processed)
    assert total == 1000
    assert problems == []
