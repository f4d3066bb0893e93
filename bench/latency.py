"""Put-to-output latency and recovery time: `python -m bench.latency --json`.

One `shardless run` job with its defaults (256 slices, chains, `--group-owner auto`), a
1-second trigger and the Kinesis source, on `local-cluster[2,1,1024]` against kinesalite
and moto, runs `bench/latency_app.py`: every record carries the producer's wall clock at
its put, and the `foreach_batch` sink notes when each batch's outputs reached the driver
after the state commit. In one run:

1. **saturation**: a backlog put before the job starts; its drain rate (records of every
   batch after the first over the time between their deliveries) is the throughput;
2. **load phases** at 25 %, 50 % and 75 % of it, records put at a fixed rate: p50, p99
   and max put-to-output latency of the records put after each phase settled, and the
   batch durations from Spark's progress reports;
3. **executor kill** at 50 %: after a pre-kill window (its own p99 is the bar), kill -9 of
   one executor JVM and its Python workers, its slice stores removed (its host is gone);
   recovery is the seconds from the kill until a 5-second window of outputs of records put
   after the kill has its p99 back under the bar; with the slices restored and their bytes.
   Three kills one after the other (`--kills`), each with its own pre-kill window and bar;
   the figure is their median, since one kill's recovery varies by tens of seconds with
   where the kill meets a batch. Each bar is also judged against its own pre-kill windows
   (`windows_over_bar`): how often the steady job itself is over it;
4. **driver restart** at 50 %: the same, the whole job killed -9 and started again at once
   on the same checkpoint.

Every record put is checked to come out exactly once (per key the counts are 1..n). The
figures are only meaningful on an idle machine: the job, the emulators and the producer
share its cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import cpu_share, latency_app
from bench.latency_rig import MASTER, TRIGGER_S, Deliveries, Job, Producer, read_progress
from bench.latency_stats import (
    RecoveryWatch,
    distribution,
    drain_rate,
    exactly_once_problems,
    latency_summary,
    median_recovery,
    phase_rates,
    window_p99s,
)
from shardless.processor.local import emulators as local_aws
from shardless.processor.local.faults.events import create_stream
from shardless.processor.local.faults.procs import cpu_seconds

LOADS = (0.25, 0.50, 0.75)
RECOVERY_LOAD = 0.50
CPU_EVERY_S = 2.0  # how often the host's CPU is read after a fault (a few ms each)
GOAL_P99_MS_AT_50PCT = 2_500
GOAL_RECOVERY_S = 30.0


@dataclass(frozen=True)
class Plan:
    """How long each part runs (`--quick` shortens them)."""

    shards: int = 2
    keys: int = 10_000
    backlog: int = 200_000
    phase_s: float = 120.0
    settle_s: float = 15.0  # the start of each phase, left out of its percentiles
    pre_kill_s: float = 60.0
    kills: int = 3  # executor kills, one after the other; the figure is their median
    recovery_limit_s: float = 180.0
    window_s: float = 5.0
    drain_timeout_s: float = 300.0
    start_timeout_s: float = 300.0
    driver_restart: bool = True

    def __post_init__(self) -> None:
        # A phase or pre-fault window no longer than the settle time it skips has no
        # outputs to measure: the run would end minutes later on a missing percentile.
        if self.kills < 1:
            raise ValueError(f"--kills {self.kills}: at least one executor kill is measured")
        for name in ("phase_s", "pre_kill_s"):
            if getattr(self, name) <= self.settle_s:
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} {getattr(self, name):g}: must be longer than --settle-s "
                    f"{self.settle_s:g}, the start of each window left out of its figures"
                )

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            backlog=60_000,
            phase_s=20.0,
            settle_s=5.0,
            pre_kill_s=15.0,
            recovery_limit_s=90.0,
            kills=1,
        )


def wait_delivered(deliveries: Deliveries, ids: list[int], job: Job, timeout_s: float) -> bool:
    """Wait until every one of `ids` is delivered (True), or the driver ends or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        deliveries.poll()
        if all(i in deliveries.delivered for i in ids):
            return True
        if job.driver.poll() is not None:
            raise RuntimeError(f"the driver ended:\n{job.driver.tail(30)}")
        time.sleep(0.2)
    return False


def reported(deliveries: Deliveries, job: Job, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Spark's progress reports once they, and the driver's batch reports, cover the newest
    batch delivered: both are written after the sink returns."""
    newest = max((b for _, b in deliveries.batches), default=-1)
    path = job.work / latency_app.PROGRESS
    deadline = time.monotonic() + timeout_s
    while True:
        progress = read_progress(path)
        done = max((p["batch"] for p in progress), default=-1) >= newest
        done = done and max((r["batch_id"] for r in job.reports()), default=-1) >= newest
        if done or time.monotonic() > deadline:
            return progress
        time.sleep(0.2)


def phase_figures(
    deliveries: Deliveries,
    producer: Producer,
    phase: dict[str, Any],
    settle_s: float,
    progress: list[dict[str, Any]],
) -> dict[str, Any]:
    """Latency of a phase's records put after it settled, the rate reached, and how long
    the batches that delivered those records took (`batches`: their ids)."""
    cut = phase["started"] + settle_s
    kept = {i: producer.put_at[i] for i in phase["ids"] if producer.put_at[i] >= cut}
    lat = [latency for _, latency in deliveries.latencies(kept)]
    batches = deliveries.batch_ids(set(kept))
    return {
        "put_rate": round(phase["put_rate"], 1),
        "records": len(phase["ids"]),
        **latency_summary(lat),
        "undelivered": len(kept) - len(lat),
        "put_calls": phase["put_calls"],
        "producer_cpu_s": phase["producer_cpu_s"],
        "batch_seconds": distribution(batch_seconds(progress, batches)),
        "batches": sorted(batches),
    }


def batch_seconds(progress: list[dict[str, Any]], batches: set[int]) -> list[float]:
    """Spark's triggerExecution seconds of `batches` (the last report of each: a batch
    run again after a restart reports once more)."""
    last = {p["batch"]: p for p in progress if p["batch"] in batches}
    return [p["duration_ms"].get("triggerExecution", 0) / 1000 for _, p in sorted(last.items())]


def recovery_phase(
    name: str,
    fault: Callable[[], dict[str, Any]],
    rate: float,
    plan: Plan,
    producer: Producer,
    deliveries: Deliveries,
    job: Job,
    emulators: list[int],
) -> dict[str, Any]:
    """At `rate`: a pre-fault window (and load until its records are out), the fault,
    then load until latency is back under the pre-fault p99 (or `plan.recovery_limit_s`).
    The host's CPU is read every `CPU_EVERY_S` from the fault on (`bench.cpu_share`)."""
    pre = producer.at_rate(rate, plan.pre_kill_s)

    def pre_delivered(_: list[int]) -> bool:
        deliveries.poll()
        return all(i in deliveries.delivered for i in pre["ids"])

    # the load goes on until the pre-fault records are out: the fault meets a busy job
    producer.at_rate(rate, plan.drain_timeout_s, stop=pre_delivered)
    progress = reported(deliveries, job)
    before = phase_figures(deliveries, producer, pre, plan.settle_s, progress)
    before.pop("batches")
    bar_s = before["p99_ms"] / 1000
    min_records = max(1, round(rate * plan.window_s / 2))
    # the same windows judged over the steady stretch before the fault, against its own p99
    cut = pre["started"] + plan.settle_s
    steady = deliveries.latencies({i: producer.put_at[i] for i in pre["ids"]
                                   if producer.put_at[i] >= cut})  # fmt: skip
    windows = window_p99s(steady, plan.window_s, 0.5, min_records)
    before["windows"] = len(windows)
    before["windows_over_bar"] = (
        round(sum(w > bar_s for w in windows) / len(windows), 3) if windows else None
    )
    reports_before = len(job.reports())
    # read just before the fault: an executor that is not in it is the replacement
    snapshots = [cpu_share.take(job.driver.pid, emulators)]
    loading = True  # readings are taken while the load goes on, and once as it ends
    fault_at = time.time()
    what = fault()
    found: float | None = None
    watch = RecoveryWatch(fault_at, bar_s, plan.window_s, 0.5, min_records)
    in_flight: dict[int, float] = {}  # put after the fault, not yet delivered: put time
    asked = 0  # of the ids put after the fault, how many are in `in_flight` or `watch`

    def recovered(ids: list[int]) -> bool:
        """Asked twice a second while the load goes on: only the records new since the last
        question, and those still in flight, are looked at."""
        nonlocal found, asked
        if loading and time.time() - snapshots[-1].at >= CPU_EVERY_S:
            snapshots.append(cpu_share.take(job.driver.pid, emulators))
        deliveries.poll()
        in_flight.update((i, producer.put_at[i]) for i in ids[asked:])
        asked = len(ids)
        at = deliveries.delivered
        out = [i for i in in_flight if i in at]
        watch.add((at[i], at[i] - in_flight.pop(i)) for i in out)
        found = watch.seconds()
        return found is not None

    after = producer.at_rate(rate, plan.recovery_limit_s, stop=recovered)
    # the last reading as the load ends, so that the readings span what `observed_s` does
    if len(snapshots) > 1 and time.time() - snapshots[-1].at < CPU_EVERY_S / 2:
        snapshots.pop()  # a last reading moments after the one before says little alone
    snapshots.append(cpu_share.take(job.driver.pid, emulators))
    loading = False
    wait_delivered(deliveries, after["ids"], job, plan.drain_timeout_s)
    recovered(after["ids"])
    reported(deliveries, job)
    reports = job.reports()[reports_before:]
    post = {i: producer.put_at[i] for i in after["ids"]}
    return {
        f"recovery_s_{name}": found,
        "pre_fault": before,
        "pre_fault_p99_ms": before["p99_ms"],
        "after_fault": latency_summary([lat for _, lat in deliveries.latencies(post)]),
        "fault": what,
        "observed_s": round(after["ended"] - fault_at, 1),
        # this process's CPU while it put the load and watched for the recovery
        "producer_cpu_s": after["producer_cpu_s"],
        "windows_judged": watch.judged,
        "restored_slices": sum(r.get("restored_slices", 0) for r in reports),
        "restored_bytes": sum(r.get("restored_bytes", 0) for r in reports),
        "restore_seconds_max": max((r.get("restore_seconds_max", 0) for r in reports), default=0),
        "batches_reported": len(reports),
        "group_processes_before": group_processes(job.reports()[:reports_before]),
        "group_processes_at_end": group_processes(reports),
        **cpu_after_fault(snapshots, fault_at, found),
    }


def cpu_after_fault(
    snapshots: list[cpu_share.Snapshot], fault_at: float, found: float | None
) -> dict[str, Any]:
    """Where the host's CPU went from the fault to the recovery (to the first reading at
    or after it; without one, to the last, taken as the load ended), and, reading by
    reading, the cores the host, the executors' JIT compilers and the replacement's used."""
    first = snapshots[0]
    end = snapshots[-1]
    if found is not None:
        end = next((s for s in snapshots if s.at >= fault_at + found), end)
    timeline = []
    for before, after in itertools.pairwise(snapshots):
        used = cpu_share.spent(before, after, since=first)  # replacement: new since the fault
        seconds = after.at - before.at
        timeline.append({
            "t": round(after.at - fault_at, 1),
            "host_cores": round(used["host_cpu_s"] / seconds, 2),
            "executors_jit_cores": round(used["roles"]["executors"]["jit_s"] / seconds, 2),
            "replacement_jit_cores": round(used["replacement"]["jit_s"] / seconds, 2),
        })  # fmt: skip
    return {"cpu_to_recovery": cpu_share.spent(first, end), "cpu_timeline": timeline}


def kill_summary(recovery_s: float | None, kill: dict[str, Any]) -> dict[str, Any]:
    """One executor kill's figures, for the list of every kill in a run."""
    return {
        "recovery_s": recovery_s,
        "pid": kill["fault"]["pid"],
        "stores_removed": kill["fault"]["stores_removed"],
        "pre_fault_p99_ms": kill["pre_fault_p99_ms"],
        "pre_fault_windows_over_bar": kill["pre_fault"]["windows_over_bar"],
        "after_fault_max_ms": kill["after_fault"].get("max_ms"),
        "restored_slices": kill["restored_slices"],
        "restore_seconds_max": round(kill["restore_seconds_max"], 2),
        "host_busy_share": kill["cpu_to_recovery"]["host_busy_share"],
        "replacement_jit_s": kill["cpu_to_recovery"]["replacement"]["jit_s"],
        "replacement_cpu_s": kill["cpu_to_recovery"]["replacement"]["cpu_s"],
    }


def group_processes(reports: list[dict[str, Any]]) -> int | None:
    """How many processes ran the groups in the last of `reports` that called every group
    (a batch without records for a group does not call it); None without such a report."""
    full = [r["group_pids"] for r in reports if r.get("group_pids")]
    most = max((len(g) for g in full), default=0)
    last = [g for g in full if len(g) == most]
    return len(set(last[-1].values())) if last else None


def run(plan: Plan, aws: local_aws.LocalAws, work: Path, seed: int = 7) -> dict[str, Any]:
    """The whole benchmark against running emulators; the JSON summary."""
    started = time.monotonic()
    app = f"latency-{uuid.uuid4().hex[:8]}"
    kinesis = aws.kinesis_client()
    create_stream(kinesis, app, plan.shards)
    producer = Producer(kinesis, app, plan.keys, random.Random(seed))
    deliveries = Deliveries(work / latency_app.DELIVERIES)
    job = Job(work, app, aws.env())
    try:
        backlog_put = time.time()
        backlog = producer.put(plan.backlog)
        backlog_put_s = time.time() - backlog_put
        job.start()
        drain_s = plan.start_timeout_s + plan.drain_timeout_s
        if not wait_delivered(deliveries, backlog, job, drain_s):
            raise RuntimeError(f"the backlog was not drained:\n{job.driver.tail(30)}")
        throughput = drain_rate(deliveries.with_records(set(backlog)))
        if not throughput:
            raise RuntimeError("the backlog came out in one batch: raise --backlog")
        out: dict[str, Any] = {
            "throughput_records_per_s": round(throughput, 1),
            "backlog": {"records": plan.backlog, "put_s": round(backlog_put_s, 2),
                        "batches": len(deliveries.with_records(set(backlog)))},
        }  # fmt: skip
        progress_path = work / latency_app.PROGRESS
        phases = {}
        for fraction, rate in zip(LOADS, phase_rates(throughput, LOADS), strict=True):
            emulators_cpu = sum(cpu_seconds(pid) for pid in aws.pids)
            phase = producer.at_rate(rate, plan.phase_s)
            emulators_cpu = sum(cpu_seconds(pid) for pid in aws.pids) - emulators_cpu
            wait_delivered(deliveries, phase["ids"], job, plan.drain_timeout_s)
            progress = reported(deliveries, job)
            figures = phase_figures(deliveries, producer, phase, plan.settle_s, progress)
            figures["target_rate"] = round(rate, 1)
            # the harness's share of the 2 cores while it put the phase's records
            figures["emulators_cpu_s"] = round(emulators_cpu, 2)
            phases[f"{round(fraction * 100)}pct"] = figures
            for name in ("p50_ms", "p99_ms", "max_ms"):
                out[f"{name[:-3]}_ms_at_{round(fraction * 100)}pct"] = figures.get(name)
        out["phases"] = phases
        every = {b for p in phases.values() for b in p.pop("batches")}
        out["batch_seconds"] = distribution(batch_seconds(read_progress(progress_path), every))
        rate = throughput * RECOVERY_LOAD
        kills = [
            recovery_phase(
                "executor_kill", job.kill_executor, rate, plan, producer, deliveries, job, aws.pids
            )  # fmt: skip
            for _ in range(plan.kills)
        ]
        figures = [k.pop("recovery_s_executor_kill") for k in kills]
        median = median_recovery(figures)
        kill = kills[figures.index(median)]  # the kill whose figure is the median
        out["recovery_s_executor_kill"] = median
        out["recovery_s_executor_kills"] = figures
        out["restored_slices"] = kill["restored_slices"]
        out["restored_bytes"] = kill["restored_bytes"]
        out["executor_kill"] = kill
        out["executor_kills"] = [kill_summary(f, k) for f, k in zip(figures, kills, strict=True)]
        if plan.driver_restart:
            restart = recovery_phase("driver_restart", job.restart_driver, rate, plan, producer,
                                     deliveries, job, aws.pids)  # fmt: skip
            out["recovery_s_driver_restart"] = restart.pop("recovery_s_driver_restart")
            out["driver_restart"] = restart
        deliveries.poll()
        problems = exactly_once_problems(
            (outs for _, outs in deliveries.batches.values()), producer.put_keys
        )
    finally:
        job.stop()
    out.update(_verdicts(out, plan, problems, deliveries, producer))
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def _verdicts(
    out: dict[str, Any],
    plan: Plan,
    problems: list[str],
    deliveries: Deliveries,
    producer: Producer,
) -> dict[str, Any]:
    p99 = out.get("p99_ms_at_50pct")
    rec = out.get("recovery_s_executor_kill")
    return {
        "records_put": len(producer.put_keys),
        "records_delivered": len(deliveries.delivered),
        "batches_delivered": len(deliveries.batches),
        "sink_calls": deliveries.calls,
        "exactly_once": not problems,
        "problems": problems[:10],
        "p99_at_50pct_over_trigger": None if p99 is None else round(p99 / 1000 / TRIGGER_S, 2),
        "goals": {
            "p99_ms_at_50pct_le_2500": p99 is not None and p99 <= GOAL_P99_MS_AT_50PCT,
            "recovery_s_executor_kill_le_30": rec is not None and rec <= GOAL_RECOVERY_S,
        },
        "config": {
            "master": MASTER,
            "trigger_s": TRIGGER_S,
            "slices": 256,
            "shards": plan.shards,
            "keys": plan.keys,
            "plan": plan.__dict__,
            "cpus": os.cpu_count(),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the JSON summary only")
    parser.add_argument("--quick", action="store_true", help="short phases (a few minutes)")
    parser.add_argument("--work", help="folder for the checkpoint, stores, logs, deliveries")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--shards", type=int)
    parser.add_argument("--keys", type=int)
    parser.add_argument("--backlog", type=int, help="records of the saturation phase")
    parser.add_argument("--phase-s", type=float, help="seconds of each load phase")
    parser.add_argument("--settle-s", type=float, help="start of a phase left out")
    parser.add_argument("--pre-kill-s", type=float, help="load before each fault")
    parser.add_argument("--recovery-limit-s", type=float, help="load after a fault, at most")
    parser.add_argument("--window-s", type=float, help="the recovery check's window")
    parser.add_argument("--kills", type=int, help="executor kills; the figure is their median")
    parser.add_argument("--no-driver-restart", action="store_true")
    args = parser.parse_args(argv)
    plan = Plan.quick() if args.quick else Plan()
    given = {
        name: getattr(args, name)
        for name in ("shards", "keys", "backlog", "phase_s", "settle_s", "pre_kill_s",
                     "recovery_limit_s", "window_s", "kills")
        if getattr(args, name) is not None
    }  # fmt: skip
    try:
        plan = Plan(**{**plan.__dict__, **given, "driver_restart": not args.no_driver_restart})
    except ValueError as exc:
        parser.error(str(exc))
    work = Path(args.work or tempfile.mkdtemp(prefix="shardless-latency-"))
    if work.is_dir() and any(work.iterdir()):
        # a used folder holds an earlier run's checkpoint and deliveries: the job would
        # resume that checkpoint and the check would count that run's outputs too
        parser.error(f"--work {work}: not empty (an earlier run's files); give a new folder")
    work.mkdir(parents=True, exist_ok=True)
    print(f"bench.latency: working in {work}", file=sys.stderr)
    emulators = local_aws.start("kinesalite", log_dir=work / "local-aws")
    try:
        summary = run(plan, emulators, work, args.seed)
    finally:
        emulators.stop()
    print(json.dumps(summary, indent=2 if args.json else None))
    return 0 if summary["exactly_once"] else 1


if __name__ == "__main__":
    sys.exit(main())
