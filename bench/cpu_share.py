"""Where the host's CPU went between two moments of a `bench.latency` run, read from /proc.

Every process on these 2 cores is counted in a role: the job's driver (its Python process
and JVM), its executor JVMs, the Python processes under them, the emulators, the
benchmark's own producer, and the rest of the host. Each role's JVMs' JIT compiler threads
are counted apart, and so are the executors that started after the first moment (the
replacement for a killed one). It shows, after each fault, what the recovery waited for:
on these cores a replacement executor's JIT compiler takes CPU that the survivors'
batches would otherwise have.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardless.processor.local.faults import procs

ROLES = ("driver", "executors", "executor_python", "emulators", "producer", "other")
# HotSpot's compiler threads ("C2 CompilerThread0"), as /proc's 15-character comm shows them
JIT_THREADS = ("C1 CompilerThre", "C2 CompilerThre")


@dataclass(frozen=True)
class Sample:
    """One process at one moment: its role, start (with the pid, one process for good) and
    CPU seconds so far, those of its JIT compiler threads apart."""

    role: str
    started: int
    cpu_s: float
    jit_s: float


@dataclass(frozen=True)
class Snapshot:
    at: float  # time.time()
    host_busy_s: float  # every CPU's busy time since boot, summed
    procs: dict[int, Sample]


def jit_seconds(pid: int) -> float:
    """CPU seconds so far of the JIT compiler threads of JVM `pid` (0 for any other
    process, or one that is gone). A compiler thread that has exited is not counted;
    HotSpot keeps at least one of each kind running."""
    total = 0.0
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in threads:
        try:
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().startswith(JIT_THREADS):
                total += procs.stat_cpu_seconds(Path(f"/proc/{pid}/task/{tid}/stat").read_text())
        except (OSError, IndexError, ValueError):
            continue
    return total


def host_busy_seconds() -> float:
    """Busy time of every CPU since boot, summed (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def roles(driver: int, emulators: list[int], producer: int) -> dict[int, tuple[str, procs.Proc]]:
    """Every live process's role: under the driver, the executor JVMs and what runs under
    them (Python workers, their daemons and helpers) apart from the driver's own."""
    table = procs.table()
    out: dict[int, tuple[str, procs.Proc]] = {}
    for pid, p in table.items():
        out[pid] = ("other", p)
    if driver in table:
        out[driver] = ("driver", table[driver])
    under = procs.descendants(driver, table)
    jvms = {p.pid for p in under if procs.EXECUTOR_MAIN in p.cmdline}
    for p in under:  # parents before children
        parent = out.get(p.ppid, ("other", p))[0]
        if p.pid in jvms:
            out[p.pid] = ("executors", p)
        elif parent in ("executors", "executor_python"):
            out[p.pid] = ("executor_python", p)
        else:
            out[p.pid] = ("driver", p)
    for pid in emulators:
        if pid in table:
            out[pid] = ("emulators", table[pid])
            for p in procs.descendants(pid, table):
                out[p.pid] = ("emulators", p)
    if producer in table:
        out[producer] = ("producer", table[producer])
    return out


def take(driver: int, emulators: list[int], producer: int | None = None) -> Snapshot:
    """Every process's CPU so far, in its role; JVMs' compiler threads read apart."""
    samples: dict[int, Sample] = {}
    for pid, (role, p) in roles(driver, emulators, producer or os.getpid()).items():
        try:
            cpu = procs.stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
        except (OSError, IndexError, ValueError):
            continue
        jit = jit_seconds(pid) if role in ("driver", "executors") and "java" in p.cmdline else 0.0
        samples[pid] = Sample(role, p.started, cpu, jit)
    return Snapshot(time.time(), host_busy_seconds(), samples)  # read together


def spent(
    before: Snapshot, after: Snapshot, cpus: int | None = None, since: Snapshot | None = None
) -> dict[str, Any]:
    """CPU seconds each role used from `before` to `after`, its JIT compiler threads'
    apart; the executors not in `since` (default `before`: started in between) apart
    again, as `replacement`; and the host's busy share of its `cpus`. A process that
    ended in between is not counted (its last seconds are lost); one that started in
    between counts from its start."""
    seconds = after.at - before.at
    since = since or before
    cpus = cpus or len(os.sched_getaffinity(0))
    used = {role: {"cpu_s": 0.0, "jit_s": 0.0} for role in ROLES}
    replacement = {"executors": 0, "cpu_s": 0.0, "jit_s": 0.0}
    for pid, now in after.procs.items():
        then = before.procs.get(pid)
        new = then is None or then.started != now.started
        cpu = now.cpu_s - (0.0 if new else then.cpu_s)  # type: ignore[union-attr]
        jit = now.jit_s - (0.0 if new else then.jit_s)  # type: ignore[union-attr]
        used[now.role]["cpu_s"] += cpu
        used[now.role]["jit_s"] += jit
        first = since.procs.get(pid)
        if now.role == "executors" and (first is None or first.started != now.started):
            replacement["executors"] += 1
            replacement["cpu_s"] += cpu
            replacement["jit_s"] += jit
    busy = after.host_busy_s - before.host_busy_s
    return {
        "seconds": round(seconds, 1),
        "host_busy_share": round(busy / (seconds * cpus), 3) if seconds > 0 else None,
        "host_cpu_s": round(busy, 1),
        "roles": {r: {k: round(v, 2) for k, v in f.items()} for r, f in used.items()},
        "replacement": {k: round(v, 2) for k, v in replacement.items()},
    }
