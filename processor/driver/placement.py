"""Who runs a group's batches when `--group-owner auto` (the default) is left to choose.

An executor that runs several tasks at once has several Python workers, and Spark hands a
task whichever is idle: a group then changes process from batch to batch and each move
costs a catch-up of its slices (`docs/deployment.md`). One owner process per group and host
(`process`) keeps the group in one process; it needs Linux (abstract Unix sockets). An
executor that runs one task at a time keeps each group in its one worker already, and an
owner would only add the hop of carrying the records across. So `auto` is `process` where
executors run several tasks at once on Linux, and `worker` everywhere else, with the
reason logged.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from shardless.processor.errors import ConfigError

_LOCAL = re.compile(r"local(?:\[(?P<threads>\*|\d+)(?:,\s*\d+)?\])?$")
_LOCAL_CLUSTER = re.compile(r"local-cluster\[\s*\d+\s*,\s*(?P<cores>\d+)\s*,\s*\d+\s*\]$")


@dataclass(frozen=True)
class OwnerChoice:
    """The group owner a job runs with, and why (one log line)."""

    owner: str  # "worker" or "process"
    why: str
    fallback: bool = False  # owner processes would help but this platform has none


def tasks_per_executor(master: str, conf: Mapping[str, str], cpus: int | None = None) -> int:
    """How many tasks one executor runs at once: its cores over `spark.task.cpus`.

    `local[N]` has N (`local[*]`: this host's cores), `local-cluster[n,c,m]` c per executor;
    on a cluster manager `spark.executor.cores`, whose default is 1 on YARN and Kubernetes
    and every core of the worker on a standalone cluster (counted as more than one)."""
    cores: int
    local = _LOCAL.match(master)
    cluster = _LOCAL_CLUSTER.match(master)
    if local:
        threads = local.group("threads")
        if threads is None:
            cores = 1
        elif threads == "*":
            cores = cpus if cpus is not None else os.cpu_count() or 1
        else:
            cores = int(threads)
    elif cluster:
        cores = int(cluster.group("cores"))
    elif "spark.executor.cores" in conf:
        cores = _positive(conf, "spark.executor.cores")
    elif master.startswith("spark://"):
        cores = 2  # standalone: every core of the worker unless spark.executor.cores says
    else:
        cores = 1  # YARN, Kubernetes
    task_cpus = _positive(conf, "spark.task.cpus") if "spark.task.cpus" in conf else 1
    return max(1, cores // task_cpus)


def choose_group_owner(choice: str, tasks: int, platform: str = sys.platform) -> OwnerChoice:
    """The owner for `--group-owner choice` when executors run `tasks` tasks at once."""
    if choice in ("worker", "process"):
        return OwnerChoice(choice, f"--group-owner {choice}")
    if choice != "auto":
        raise ConfigError(f"--group-owner {choice!r}: use auto, worker or process")
    if tasks <= 1:
        return OwnerChoice(
            "worker",
            "--group-owner auto: executors run one task at a time, so each group stays in "
            "its Python worker",
        )
    if not platform.startswith("linux"):
        return OwnerChoice(
            "worker",
            f"--group-owner auto: executors run {tasks} tasks at once, but owner processes "
            f"need Linux and this is {platform}; groups may change Python worker between "
            "batches and catch up",
            fallback=True,
        )
    return OwnerChoice(
        "process",
        f"--group-owner auto: executors run {tasks} tasks at once, so one owner process per "
        "group and host keeps each group's stores in one process",
    )


def _positive(conf: Mapping[str, str], name: str) -> int:
    value = conf[name]
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ConfigError(f"{name}={value!r}: Spark needs a whole number of at least 1")
    return number
