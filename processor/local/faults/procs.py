"""The process tree of a Spark job started as a subprocess, read from /proc.

`local-cluster[n,1,mem]` runs: the Python driver → its JVM (spark-submit) → one
`CoarseGrainedExecutorBackend` JVM per executor → one Python worker daemon per executor
(shardless's `worker_daemon` in front of `pyspark.daemon`, or `pyspark.daemon` itself) →
the Python workers it forks (same command line as the daemon). Daemons put themselves in
a process group of their own, so killing the driver's group does not reach them: every
kill here is by pid, of a process found under the driver we started, re-checked by its
start time so that a recycled pid is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from shardless.processor.runtime import installed_pyspark

EXECUTOR_MAIN = "CoarseGrainedExecutorBackend"
# the daemons that fork Python workers: PySpark's own, and shardless's in front of it
WORKER_DAEMONS = ("pyspark.daemon", installed_pyspark.DAEMON)


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    started: int  # clock ticks since boot: with the pid, names one process for good
    cmdline: str


def read(pid: int) -> Proc | None:
    """The process `pid` as /proc shows it now, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) is in parentheses and may hold spaces: split after it
    rest = stat[stat.rindex(")") + 2 :].split()
    if rest[0] == "Z":
        return None  # exited, waiting to be reaped: nothing left to kill
    return Proc(pid, int(rest[1]), int(rest[19]), raw.replace(b"\0", b" ").decode(errors="replace"))


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of process `pid` so far, 0 where unknown (gone, or no /proc)."""
    try:
        return stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, IndexError):
        return 0.0


def stat_cpu_seconds(stat: str) -> float:
    """User + system CPU seconds in a /proc `stat` line (a process's or a thread's)."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def table() -> dict[int, Proc]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (proc := read(int(entry))) is not None:
            out[proc.pid] = proc
    return out


def descendants(root: int, procs: dict[int, Proc] | None = None) -> list[Proc]:
    """Every live process under `root` (not `root` itself), parents before children."""
    procs = table() if procs is None else procs
    children: dict[int, list[Proc]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p)
    out: list[Proc] = []
    todo = [root]
    while todo:
        for child in sorted(children.get(todo.pop(0), []), key=lambda p: p.pid):
            out.append(child)
            todo.append(child.pid)
    return out


def executors(driver: int) -> list[Proc]:
    """The executor JVMs of the job whose driver is `driver`."""
    return [p for p in descendants(driver) if EXECUTOR_MAIN in p.cmdline]


def is_python_worker(proc: Proc) -> bool:
    """A Python worker daemon, or a worker it forked (same command line)."""
    return any(daemon in proc.cmdline for daemon in WORKER_DAEMONS)


def python_workers(under: int) -> list[Proc]:
    """Python workers (forked by a worker daemon) anywhere under `under`."""
    procs = table()
    return [
        p
        for p in descendants(under, procs)
        if is_python_worker(p) and p.ppid in procs and is_python_worker(procs[p.ppid])
    ]


def kill9(procs: list[Proc], wait_s: float = 10.0) -> list[Proc]:
    """SIGKILL each process that is still the one recorded; wait until they are gone.

    Returns the processes that were signalled."""
    hit = signal_all(procs, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        alive = [p for p in hit if (now := read(p.pid)) is not None and now.started == p.started]
        if not alive:
            break
        time.sleep(0.05)
    return hit


def signal_all(procs: list[Proc], sig: signal.Signals) -> list[Proc]:
    """Send `sig` to each process that is still the one recorded; those signalled."""
    hit = []
    for p in procs:
        now = read(p.pid)
        if now is None or now.started != p.started:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)
            hit.append(p)
    return hit


def alive(p: Proc) -> bool:
    """Whether `p` is still running (or stopped), not exited."""
    now = read(p.pid)
    return now is not None and now.started == p.started
