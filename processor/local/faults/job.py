"""The job under test: its settings, and its drivers started on a schedule's checkpoints.

`start_driver` runs `examples/user_activity.py` with `shardless run` on the current
checkpoint, through the fault proxies; `new_checkpoint` adds a NEW checkpoint at COMMITTED;
`watch_old` and `stop_old` follow the drivers a takeover left running, and stop them.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from shardless.processor.local.faults.driver import REPO, Driver
from shardless.processor.local.faults.outcome import Checkpoint, Env, Outcome, now

APP_FILE = REPO / "examples" / "user_activity.py"
MASTER = "local-cluster[2,1,1024]"
USERS = 150
SLICES = 64
GROUPS = 4
MAX_RECORDS_PER_SHARD = 150
SNAPSHOT_EVERY = 4
OLD_DRIVER_GRACE_S = 60  # after a takeover's first batch, the old driver is stopped
# Spark settings for the job's driver: more task attempts than the default 4, since a
# schedule may fail one task several times on purpose (kills, 5xx past boto3's retries).
SUBMIT_ARGS = "--conf spark.task.maxFailures=8 pyspark-shell"
# With `stalls`: an executor silent for 10 s is lost to the driver, which runs its tasks
# again elsewhere while the stalled processes (stopped for 20 to 30 s) may still resume.
STALL_ARGS = (
    "--conf spark.network.timeout=10s --conf spark.network.timeoutInterval=2s "
    "--conf spark.executor.heartbeatInterval=1s "
)


def new_checkpoint(outcome: Outcome, groups: int, why: str) -> Checkpoint:
    """A NEW checkpoint at COMMITTED (the next driver started runs it)."""
    last = outcome.current
    folder = Path(last.cfg.checkpoint).parent
    n = len(outcome.checkpoints) + 1
    seen = [c.base + r["batch_id"] for c in outcome.checkpoints for d in c.drivers
            for r in d.reports]  # fmt: skip
    cp = Checkpoint(
        n,
        replace(last.cfg, checkpoint=str(folder / f"checkpoint-{n}"), groups=groups),
        folder / f"outputs-{n}",
        True,
        why,
        base=max(seen, default=last.base - 1) + 1,
    )
    outcome.checkpoints.append(cp)
    return cp


def start_driver(env: Env, outcome: Outcome) -> Driver:
    """Start a driver on the current checkpoint."""
    cp = outcome.current
    cfg = cp.cfg
    args = [
        str(APP_FILE),
        "--app", cfg.app,
        "--stream", cfg.streams[0],
        "--slices", str(cfg.slices),
        "--groups", str(cfg.groups),
        "--checkpoint", cfg.checkpoint,
        "--local-dir", cfg.local_dir,
        "--output", str(cp.out_dir),
        "--master", MASTER,
        "--available-now",
        "--max-records-per-shard", str(MAX_RECORDS_PER_SHARD),
        "--snapshot-every", str(SNAPSHOT_EVERY),
        "--commit-format", cfg.commit_format,
        "--chain-length", str(cfg.chain_length),
    ]  # fmt: skip
    if cp.committed:
        args += ["--starting-position", "COMMITTED"]
    env_vars = {
        **os.environ,
        **env.aws_env,
        "AWS_ENDPOINT_URL_S3": env.storage_proxy.url,
        "AWS_ENDPOINT_URL_DYNAMODB": env.storage_proxy.url,
        "AWS_ENDPOINT_URL_KINESIS": env.kinesis_proxy.url,
        "PYSPARK_SUBMIT_ARGS": (STALL_ARGS if env.stalls else "") + SUBMIT_ARGS,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    folder = Path(cfg.checkpoint).parent
    driver = Driver(args, env_vars, folder / f"driver-{len(outcome.runs) + 1}.log", query_no=cp.n)
    driver.start()
    outcome.runs.append(driver)
    cp.drivers.append(driver)
    return driver


def watch_old(outcome: Outcome) -> None:
    """Follow the drivers taken over: note how each ended; stop one still running
    `OLD_DRIVER_GRACE_S` after the new query's first batch."""
    for old, entry in outcome.old:
        if "old_ended" in entry:
            continue
        code = old.poll()
        if code is not None:
            text = old.log_text()
            entry["old_ended"] = "killed" if old.killed else f"exit {code}"
            entry["old_fenced"] = (
                "QueryFencedError" in text or "is fenced" in text or ("cannot record batch" in text)
            )
            entry["old_batches_after"] = len(old.reports) - entry["old_batches"]
            entry["old_ended_at"] = now(outcome)
            continue
        firsts = [
            d.first_report_at for c in outcome.checkpoints[entry["to_query"] - 1 :]
            for d in c.drivers if d.reports and d.first_report_at is not None
        ]  # fmt: skip
        if firsts and time.monotonic() - min(firsts) > OLD_DRIVER_GRACE_S:
            old.kill()
            entry["old_stopped"] = (
                f"still running {OLD_DRIVER_GRACE_S}s after the new query's first batch"
            )


def stop_old(outcome: Outcome, why: str) -> None:
    for old, entry in outcome.old:
        if "old_ended" not in entry and old.poll() is None:
            old.kill()
            entry.setdefault("old_stopped", why)
    watch_old(outcome)
