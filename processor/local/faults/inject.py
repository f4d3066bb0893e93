"""A schedule's faults applied to the running job, and which of them happened.

Process faults: kill -9 of the whole job (`kill_driver`, maybe with a reshard), of an
executor with its disk, or of one Python worker, and an executor stalled (SIGSTOP, then
SIGCONT). Request faults: the schedule's rules installed in the fault proxy in front of
their service; `count_requests` says which of them broke at least one request.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

from shardless.processor.driver.config import JobConfig
from shardless.processor.local.faults import events, procs
from shardless.processor.local.faults.driver import Driver, running_batch
from shardless.processor.local.faults.job import USERS
from shardless.processor.local.faults.outcome import Env, Outcome, now
from shardless.processor.local.faults.schedule import (
    DRIVER_KILL,
    EXECUTOR_KILL,
    EXECUTOR_STALL,
    RESHARD,
    WORKER_KILL,
    Fault,
    Schedule,
)


def kill_driver(
    env: Env,
    driver: Driver,
    fault: Fault,
    produced: int,
    rng: random.Random,
    outcome: Outcome,
) -> int:
    """kill -9 the whole job; during recovery maybe reshard, then produce more events."""
    cfg = outcome.current.cfg
    batch = running_batch(Path(cfg.checkpoint))
    killed = driver.kill()
    outcome.happened[DRIVER_KILL] += 1
    outcome.faults.append(
        {"kind": DRIVER_KILL, "mid_batch": batch, "processes": killed, "at": now(outcome)}
    )
    if RESHARD in outcome.schedule.kinds:
        done = events.reshard(env.kinesis, cfg.streams[0], rng)
        outcome.happened[RESHARD] += 1
        outcome.faults.append({"kind": RESHARD, "what": done, "at": now(outcome)})
    return events.produce(
        env.kinesis, cfg.streams[0], produced, outcome.schedule.more_events, USERS, rng
    )


def apply_fault(
    env: Env, driver: Driver, cfg: JobConfig, fault: Fault, rng: random.Random, outcome: Outcome
) -> None:
    if fault.kind == EXECUTOR_KILL:
        _kill_executor(driver, cfg, rng, outcome)
    elif fault.kind == EXECUTOR_STALL:
        _stall_executor(driver, cfg, fault, rng, outcome)
    elif fault.kind == WORKER_KILL:
        _kill_worker(driver, cfg, rng, outcome)
    else:
        proxy = env.kinesis_proxy if fault.rules[0].service == "kinesis" else env.storage_proxy
        for rule in fault.rules:
            proxy.add(rule)
        outcome.faults.append({"kind": fault.kind, "installed": True, "at": now(outcome)})


def _kill_executor(driver: Driver, cfg: JobConfig, rng: random.Random, outcome: Outcome) -> None:
    executors = procs.executors(driver.pid)
    if not executors:
        outcome.faults.append({"kind": EXECUTOR_KILL, "missed": "no executor running"})
        return
    victim = rng.choice(executors)
    tree = procs.descendants(victim.pid)
    workers = [p.pid for p in tree if procs.is_python_worker(p)]
    batch = running_batch(Path(cfg.checkpoint))
    driver.poll()
    driver.kill_marks.append(len(driver.reports))
    outcome.kill_marks.append(len(outcome.reports))
    hit = procs.kill9([victim, *tree])
    lost = _lose_disk(Path(cfg.local_dir) / cfg.app, workers)
    outcome.happened[EXECUTOR_KILL] += 1
    outcome.faults.append(
        {
            "kind": EXECUTOR_KILL,
            "mid_batch": batch,
            "processes": len(hit),
            "stores_lost": lost,
            "at": now(outcome),
        }
    )


def _lose_disk(root: Path, pids: list[int]) -> int:
    """Remove the store directories of dead workers (renamed first: others adopt whole
    directories or nothing). Returns how many slice stores were lost."""
    lost = 0
    for pid in pids:
        folder = root / f"w{pid}"
        if not folder.is_dir():
            continue
        trash = root.parent / f".lost-{root.name}-w{pid}"
        try:
            os.rename(folder, trash)
        except OSError:
            continue
        lost += sum(1 for p in trash.iterdir() if p.name.startswith("slice-"))
        shutil.rmtree(trash, ignore_errors=True)
    return lost


def _stall_executor(
    driver: Driver, cfg: JobConfig, fault: Fault, rng: random.Random, outcome: Outcome
) -> None:
    """SIGSTOP one executor JVM and its Python processes; SIGCONT the Python processes
    `fault.worker_stall_s` later and the JVM (unless Spark has killed it) `fault.stall_s`
    later. The Python processes are resumed first on purpose: were they still stopped when
    the JVM dies, their process group would be orphaned with stopped members and the
    kernel would end them (SIGHUP) before they could act as zombies."""
    executors = procs.executors(driver.pid)
    if not executors:
        outcome.faults.append({"kind": EXECUTOR_STALL, "missed": "no executor running"})
        return
    victim = rng.choice(executors)
    tree = procs.descendants(victim.pid)
    stopped = procs.signal_all([victim, *tree], signal.SIGSTOP)
    if not stopped:
        outcome.faults.append({"kind": EXECUTOR_STALL, "missed": "the executor had ended"})
        return
    python = [p for p in stopped if p.pid != victim.pid]
    jvm = [p for p in stopped if p.pid == victim.pid]
    outcome.stalled += stopped
    outcome.happened[EXECUTOR_STALL] += 1
    entry: dict[str, Any] = {
        "kind": EXECUTOR_STALL,
        "mid_batch": running_batch(Path(cfg.checkpoint)),
        "python_processes": len(python),
        "stall_s": round(fault.stall_s, 1),
        "worker_stall_s": round(fault.worker_stall_s, 1),
        "at": now(outcome),
    }
    outcome.faults.append(entry)

    def resume_python() -> None:
        entry["python_resumed"] = len(procs.signal_all(python, signal.SIGCONT))
        entry["executor_alive_at_python_resume"] = procs.alive(victim)

    def resume_jvm() -> None:
        entry["executor_alive_at_resume"] = bool(procs.signal_all(jvm, signal.SIGCONT))

    for delay, action in ((fault.worker_stall_s, resume_python), (fault.stall_s, resume_jvm)):
        timer = threading.Timer(delay, action)
        timer.daemon = True
        outcome.resumes.append(timer)
        timer.start()


def _kill_worker(driver: Driver, cfg: JobConfig, rng: random.Random, outcome: Outcome) -> None:
    workers = [w for e in procs.executors(driver.pid) for w in procs.python_workers(e.pid)]
    if not workers:
        outcome.faults.append({"kind": WORKER_KILL, "missed": "no Python worker running"})
        return
    victim = rng.choice(workers)
    batch = running_batch(Path(cfg.checkpoint))
    hit = procs.kill9([victim])
    if not hit:
        outcome.faults.append({"kind": WORKER_KILL, "missed": "the worker had ended"})
        return
    outcome.happened[WORKER_KILL] += 1
    outcome.faults.append({"kind": WORKER_KILL, "mid_batch": batch, "at": now(outcome)})


def count_requests(env: Env, schedule: Schedule, outcome: Outcome) -> None:
    """Request faults happened when one of their rules broke at least one request."""
    for proxy in (env.storage_proxy, env.kinesis_proxy):
        for (service, op), n in proxy.injected().items():
            outcome.requests_broken[f"{service}/{op}"] = n
    for fault in schedule.faults:
        if fault.rules:
            proxy = env.kinesis_proxy if fault.rules[0].service == "kinesis" else env.storage_proxy
            n = sum(proxy.fired(rule) for rule in fault.rules)
            if n:
                outcome.happened[fault.kind] += 1
