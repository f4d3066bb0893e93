"""What the defaults `--group-owner auto` and `--groups 0` choose from the cluster's shape.

**Groups.** Each group is one task per batch, and a task has a fixed cost of Spark and
Python start-up whatever its records. One group per task slot runs a batch in one wave of
tasks; more groups than slots queue them, and every wave adds that cost to each batch and
to the latency of its records (`docs/benchmarks.md`, latency). So `--groups 0` (the
default) is one group per task slot where Spark's configuration tells the slots, else 8.

**Group owner.** An executor that runs several tasks at once has several Python workers,
and Spark hands a task whichever is idle: a group then changes process from batch to batch
and each move costs a catch-up of its slices (`docs/deployment.md`). One owner process per
group and host (`process`) keeps the group in one process; it needs Linux (abstract Unix
sockets). An executor that runs one task at a time keeps each group in its one worker
already, and an owner would only add the hop of carrying the records across. So `auto` is
`process` where executors run several tasks at once on Linux, and `worker` everywhere
else, with the reason logged.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from shardless.processor.errors import ConfigError

_LOCAL = re.compile(r"local(?:\[(?P<threads>\*|\d+)(?:,\s*\d+)?\])?$")
_LOCAL_CLUSTER = re.compile(
    r"local-cluster\[\s*(?P<executors>\d+)\s*,\s*(?P<cores>\d+)\s*,\s*\d+\s*\]$"
)


DEFAULT_GROUPS = 8  # when the cluster's slots are unknown
MAX_GROUPS = 4096


@dataclass(frozen=True)
class GroupsChoice:
    """The group count a new checkpoint gets from `--groups 0`, and why (one log line)."""

    groups: int
    why: str


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


def task_slots(master: str, conf: Mapping[str, str], cpus: int | None = None) -> int | None:
    """How many tasks the cluster runs at once: executors times `tasks_per_executor`, None
    when the configuration does not say how many executors there will be (a standalone
    cluster without `spark.executor.instances`, dynamic allocation without a maximum)."""
    tasks = tasks_per_executor(master, conf, cpus)
    if _LOCAL.match(master):
        return tasks
    cluster = _LOCAL_CLUSTER.match(master)
    if cluster:
        return int(cluster.group("executors")) * tasks
    if conf.get("spark.dynamicAllocation.enabled", "false").strip().lower() == "true":
        most = conf.get("spark.dynamicAllocation.maxExecutors", "").strip()
        if not most.isdigit() or int(most) > MAX_GROUPS:
            return None
        return int(most) * tasks
    if "spark.executor.instances" in conf:
        return _positive(conf, "spark.executor.instances") * tasks
    if master.startswith(("yarn", "k8s://")):
        return 2 * tasks  # both start two executors unless told
    return None


def choose_groups(master: str, conf: Mapping[str, str], cpus: int | None = None) -> GroupsChoice:
    """The group count `--groups 0` gives a new checkpoint: one per task slot (at most
    MAX_GROUPS), else DEFAULT_GROUPS when the configuration does not tell the slots."""
    slots = task_slots(master, conf, cpus)
    if slots is None:
        return GroupsChoice(
            DEFAULT_GROUPS,
            f"--groups 0: Spark's configuration does not say how many executors {master} "
            f"will have (set spark.executor.instances or --groups): {DEFAULT_GROUPS} groups",
        )
    groups = min(slots, MAX_GROUPS)
    return GroupsChoice(
        groups,
        f"--groups 0: {master} runs {slots} tasks at once, one group per task slot: "
        f"{groups} groups",
    )


def no_locality_wait(groups: int, slots: int | None) -> bool:
    """Whether a group's task may go to any free executor at once (`spark.locality.wait`
    0) rather than wait for the one it last ran on: when every group has a task slot of
    its own, its executor is free at the start of each batch unless it was lost."""
    return slots is not None and groups <= slots


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
