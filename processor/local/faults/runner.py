"""Run one fault schedule against the real job and judge the result.

Per schedule: a fresh stream and application; events produced; `shardless run` started as
a subprocess on `local-cluster[2,1,1024]` with `--available-now`, its S3 and DynamoDB
traffic through one fault proxy (in front of moto) and its Kinesis traffic through
another (in front of kinesalite). Faults fire when the driver reports a given batch (plus
a delay, so kills land while the next batch runs):

- driver_kill: kill -9 of the driver, its JVM, the executors and their Python workers;
  then (reshard) a split or merge, more events, and a restart from the checkpoint;
- executor_kill: kill -9 of one executor JVM and its Python workers, and their store
  directories removed (the executor's host is gone with its disk): its slices are
  restored from S3 wherever Spark runs them next;
- worker_kill: kill -9 of one Python worker of an executor;
- executor_stall (`--stalls` only): SIGSTOP of one executor JVM and its Python processes;
  the driver gives the executor up after its network timeout and runs its tasks again
  elsewhere; the Python processes are resumed first (zombies), the JVM later if it is
  still there;
- request faults: the schedule's proxy rules are installed;
- takeover: more events, and a second driver on a NEW checkpoint at `--starting-position
  COMMITTED` while the first runs (a blue/green deployment). The new query fences the old
  one as it starts (`takeover.committed_start`, before it undoes the old one's unrecorded
  commits); the old driver then fails at its next commit (QueryFencedError) or progress
  record, or ends having drained the stream; one still running 60 s after the new query's
  first batch is killed (the operator stops the old deployment). Should the old query
  still record a batch after the new one read its starting record, the new one refuses
  at its first batch ("is another query running on it?"): then, as the refusal says, the
  harness stops the old driver and starts another NEW checkpoint at COMMITTED. Either way
  only the new checkpoint is restarted from then on;
- regroup: kill -9 of the driver, then a NEW checkpoint at COMMITTED with another
  `--groups` (a restart keeps its checkpoint's shuffle partitions);
- rollback: kill -9 of the driver, `shardless state rollback --apply --force` to a batch a
  few back from the newest recorded one (one with a progress record; `--force` because the
  killed driver's lease is held for up to a minute and its commits are seconds old: the
  operator knows the job is stopped), then a NEW checkpoint at COMMITTED;
- gc_running: `shardless state gc --delete` with the default grace (safe beside a job)
  while the driver runs: it must exit 0. After the run, `state gc --delete --grace-s 0`
  really deletes what nothing references before the checks rebuild the state.

A driver that exits with an error (a batch failed past Spark's task retries) is restarted
from its checkpoint, as an operator or a supervisor would; a NEW checkpoint at COMMITTED
that fails before its first batch is replaced by another new one (restarted, it would
start from a record that may no longer be the latest, and be refused). The operator's
tools (gc, rollback) and the harness's checks talk to the emulators directly, not through
the fault proxies. When the run has drained the stream, the checks of `check.py` decide
whether it diverged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shardless.processor.driver import progress
from shardless.processor.driver.config import JobConfig
from shardless.processor.local.faults import check, events, procs
from shardless.processor.local.faults.driver import REPO, Driver, running_batch
from shardless.processor.local.faults.fault_proxy import FaultProxy
from shardless.processor.local.faults.schedule import (
    DRIVER_KILL,
    EXECUTOR_KILL,
    EXECUTOR_STALL,
    GC_RUNNING,
    KILLS,
    NEW_QUERY,
    REGROUP,
    RESHARD,
    TAKEOVER,
    WORKER_KILL,
    Fault,
    Schedule,
)

log = logging.getLogger(__name__)

APP_FILE = REPO / "examples" / "user_activity.py"
MASTER = "local-cluster[2,1,1024]"
USERS = 150
SLICES = 64
GROUPS = 4
MAX_RECORDS_PER_SHARD = 150
SNAPSHOT_EVERY = 4
MAX_RESTARTS_AFTER_FAILURE = 4
SCHEDULE_TIMEOUT_S = 600
OLD_DRIVER_GRACE_S = 60  # after a takeover's first batch, the old driver is stopped
MAX_TAKEOVER_REFUSALS = 3  # then they count as driver failures
TOOL_TIMEOUT_S = 300
CONFLICT_MARK = "lost to another writer"  # in `HeadConflictError`'s message
# Spark settings for the job's driver: more task attempts than the default 4, since a
# schedule may fail one task several times on purpose (kills, 5xx past boto3's retries).
SUBMIT_ARGS = "--conf spark.task.maxFailures=8 pyspark-shell"
# With `stalls`: an executor silent for 10 s is lost to the driver, which runs its tasks
# again elsewhere while the stalled processes (stopped for 20 to 30 s) may still resume.
STALL_ARGS = (
    "--conf spark.network.timeout=10s --conf spark.network.timeoutInterval=2s "
    "--conf spark.executor.heartbeatInterval=1s "
)


@dataclass
class Env:
    """What every schedule shares: emulators (direct clients), the two proxies, a folder."""

    kinesis: Any  # boto3 client straight to the Kinesis emulator
    aws_env: dict[str, str]  # the emulators' endpoints and dummy credentials
    storage_proxy: FaultProxy  # S3 and DynamoDB (one moto server serves both)
    kinesis_proxy: FaultProxy
    work: Path
    keep: bool = False  # keep each schedule's folder even when it passed
    stalls: bool = False  # schedules may stall an executor (STALL_ARGS for the driver)


@dataclass
class Checkpoint:
    """One of a schedule's queries: its config (checkpoint, groups), output folder, how it
    started, and `base`, the schedule-wide batch number of its batch 0 (faults fire on
    those numbers, so a new query's batch 0 does not fire what batch 0 of the first did)."""

    n: int
    cfg: JobConfig
    out_dir: Path
    committed: bool  # started at --starting-position COMMITTED
    why: str
    base: int = 0
    drivers: list[Driver] = field(default_factory=list)

    def query_run(self) -> check.QueryRun | None:
        """What `check.verify` needs; None if Spark never wrote the checkpoint."""
        root = Path(self.cfg.checkpoint)
        try:
            query = json.loads((root / "metadata").read_text())["id"]
        except (OSError, ValueError, KeyError):
            return None
        start = None
        folder = root / "offsets"
        offsets = (
            sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())
            if (folder.is_dir())
            else []
        )
        if offsets:
            lines = (root / "offsets" / str(offsets[0])).read_text().splitlines()
            kinesis = [o for o in map(json.loads, lines[2:]) if isinstance(o, dict) and "run" in o]
            found = kinesis[0].get("from") if kinesis else None
            if found:
                start = (found["query"], int(found["batch"]))
        reports = {r["batch_id"]: r for d in self.drivers for r in d.reports}
        return check.QueryRun(query, str(self.out_dir), start, reports)


@dataclass
class Outcome:
    schedule: Schedule
    app: str
    faults: list[dict[str, Any]] = field(default_factory=list)  # what happened, in order
    happened: Counter[str] = field(default_factory=Counter)
    requests_broken: dict[str, int] = field(default_factory=dict)  # "service/op" -> count
    runs: list[Driver] = field(default_factory=list)  # every driver started, in order
    checkpoints: list[Checkpoint] = field(default_factory=list)  # every query, in order
    old: list[tuple[Driver, dict[str, Any]]] = field(default_factory=list)  # taken over
    takeover_refusals: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)  # operator commands run
    failures: list[str] = field(default_factory=list)  # drivers that ended in an error
    # at each executor kill, how many batch reports (all drivers') had been seen
    kill_marks: list[int] = field(default_factory=list)
    # mentions in the drivers' logs of a commit that lost to another attempt's (a task
    # failure may be logged more than once)
    commit_conflicts: int = 0
    commit_attempts: dict[str, int] = field(default_factory=dict)  # check.commit_attempts
    stalled: list[procs.Proc] = field(default_factory=list)  # every process ever stopped
    resumes: list[threading.Timer] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # divergences
    incomplete: str | None = None
    events: int = 0
    seconds: float = 0.0
    started: float = field(default_factory=time.monotonic)

    @property
    def reports(self) -> list[dict[str, Any]]:
        """Every driver's batch reports, in order."""
        return [r for d in self.runs for r in d.reports]

    @property
    def batches(self) -> dict[tuple[int, int], dict[str, Any]]:
        """The last report of each (query, batch id) (a batch run again reports again)."""
        return {(d.query_no, r["batch_id"]): r for d in self.runs for r in d.reports}

    @property
    def current(self) -> Checkpoint:
        return self.checkpoints[-1]

    def summary(self) -> dict[str, Any]:
        restores = [
            {k: r[k] for k in ("batch_id", "restored_slices", "restored_bytes")}
            | {"restore_seconds_max": round(r["restore_seconds_max"], 3)}
            for r in self.reports
            if r.get("restored_slices")
        ]
        return {
            **self.schedule.describe(),
            "app": self.app,
            "events": self.events,
            "happened": self.faults,
            "requests_broken": self.requests_broken,
            "drivers": len(self.runs),
            "queries": [
                {"n": c.n, "why": c.why, "groups": c.cfg.groups, "drivers": len(c.drivers)}
                for c in self.checkpoints
            ],
            "takeover_refusals": self.takeover_refusals,
            "operator_tools": self.tools,
            "commit_conflicts": self.commit_conflicts,
            "commit_attempts": self.commit_attempts,
            "driver_failures": self.failures,
            "batches": len(self.batches),
            "restores": restores,
            "divergences": self.problems,
            "incomplete": self.incomplete,
            "seconds": round(self.seconds, 1),
        }


def run(env: Env, schedule: Schedule) -> Outcome:
    """Run `schedule` to the end (drained stream) and check it."""
    app = f"faults-{schedule.seed}-{schedule.index}-{uuid.uuid4().hex[:6]}"
    outcome = Outcome(schedule, app)
    folder = env.work / app
    rng = random.Random(f"shardless-faults-run/{schedule.seed}/{schedule.index}")
    events.create_stream(env.kinesis, app, schedule.shards)
    produced = events.produce(env.kinesis, app, 0, schedule.events, USERS, rng)
    cfg = JobConfig(
        app=app,
        streams=(app,),
        checkpoint=str(folder / "checkpoint-1"),
        slices=SLICES,
        groups=GROUPS,
        local_dir=str(folder / "stores"),
    )
    for proxy in (env.storage_proxy, env.kinesis_proxy):
        proxy.clear()
        proxy.reset_counts()
    pending = [(i, f) for i, f in enumerate(schedule.faults) if f.kind != RESHARD]
    deadline = outcome.started + SCHEDULE_TIMEOUT_S
    outcome.checkpoints.append(Checkpoint(1, cfg, folder / "outputs-1", False, "first"))
    driver = _start(env, outcome)
    due_at: dict[int, float] = {}  # fault index -> when it fires
    try:
        while True:
            code = driver.poll()
            _watch_old(outcome)
            for i, fault in list(pending):
                if code is not None or not _reached(outcome, driver, fault):
                    continue
                due_at.setdefault(i, time.monotonic() + fault.delay_s)
                if time.monotonic() < due_at[i]:
                    continue
                pending.remove((i, fault))
                if fault.kind == DRIVER_KILL:
                    produced = _kill_driver(env, driver, fault, produced, rng, outcome)
                    driver = _start(env, outcome)
                    break
                if fault.kind in NEW_QUERY:
                    driver, produced = _new_query(env, driver, fault, produced, rng, outcome)
                    break
                if fault.kind == GC_RUNNING:
                    _gc_running(env, outcome)
                    continue
                _apply(env, driver, outcome.current.cfg, fault, rng, outcome)
            if code == 0 and driver.proc is not None and not driver.killed:
                break
            if code is not None and not driver.killed:
                cp = outcome.current
                early = cp.committed and not any(d.reports for d in cp.drivers)
                if (
                    early
                    and cp.why.startswith(TAKEOVER)
                    and (len(outcome.takeover_refusals) < MAX_TAKEOVER_REFUSALS)
                ):
                    outcome.takeover_refusals.append(_failure(driver))
                else:
                    outcome.failures.append(_failure(driver))
                if len(outcome.failures) > MAX_RESTARTS_AFTER_FAILURE:
                    outcome.incomplete = f"the driver failed {len(outcome.failures)} times"
                    break
                if early:
                    # its own restart would start from a record that may no longer be the
                    # latest: the operator stops the old query, if it still runs, and starts
                    # another new checkpoint at COMMITTED
                    _stop_old(outcome, "the new query failed before its first batch")
                    _new_checkpoint(outcome, cp.cfg.groups, f"{cp.why}, again")
                driver = _start(env, outcome)
            if time.monotonic() > deadline:
                driver.kill()
                outcome.incomplete = f"not done after {SCHEDULE_TIMEOUT_S}s"
                break
            time.sleep(0.1)
    finally:
        for timer in outcome.resumes:
            timer.cancel()
        procs.signal_all(outcome.stalled, signal.SIGCONT)
        driver.kill()
        _stop_old(outcome, "the run ended")
        procs.kill9(outcome.stalled)  # orphans of an executor Spark removed while stopped
        for proxy in (env.storage_proxy, env.kinesis_proxy):
            proxy.clear()
    for _, fault in pending:
        if fault.kind in (*KILLS, EXECUTOR_STALL, *NEW_QUERY, GC_RUNNING):
            outcome.faults.append({"kind": fault.kind, "missed": "the run ended before it"})
    _count_requests(env, schedule, outcome)
    outcome.commit_conflicts = sum(d.log_text().count(CONFLICT_MARK) for d in outcome.runs)
    try:
        outcome.commit_attempts = check.commit_attempts(cfg)
    except Exception as exc:  # noqa: BLE001 - a figure, not a check
        log.warning("%s: could not list the changelog segments: %s", app, exc)
    if outcome.incomplete is None:
        if GC_RUNNING in schedule.kinds:
            _gc_after(env, outcome)
        queries = [q for c in outcome.checkpoints if (q := c.query_run()) is not None]
        problems, outcome.events = check.verify(env.kinesis, cfg, app, queries)
        outcome.problems += problems
    outcome.seconds = time.monotonic() - outcome.started
    env.kinesis.delete_stream(StreamName=app, EnforceConsumerDeletion=True)
    if not env.keep and not outcome.problems and outcome.incomplete is None:
        shutil.rmtree(folder, ignore_errors=True)
    return outcome


def _new_checkpoint(outcome: Outcome, groups: int, why: str) -> Checkpoint:
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


def _start(env: Env, outcome: Outcome) -> Driver:
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


def _reached(outcome: Outcome, driver: Driver, fault: Fault) -> bool:
    base = outcome.current.base
    return fault.after_batch < 0 or any(
        base + r["batch_id"] >= fault.after_batch for r in driver.reports
    )


# ---- operator actions ---------------------------------------------------------------------


def _tool(env: Env, outcome: Outcome, *args: str) -> tuple[int, str]:
    """`shardless state ...` against the emulators directly; (exit code, output)."""
    proc = subprocess.run(
        [sys.executable, "-m", "shardless.processor.cli", "state", *args],
        cwd=REPO,
        env={**os.environ, **env.aws_env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TOOL_TIMEOUT_S,
        check=False,
    )
    out = (proc.stdout + proc.stderr).strip()
    outcome.tools.append(
        {"args": list(args), "exit": proc.returncode, "at": _now(outcome), "output": out[-600:]}
    )
    return proc.returncode, out


def _gc_running(env: Env, outcome: Outcome) -> None:
    """`state gc --delete` with the default grace while the driver runs: must succeed."""
    code, out = _tool(env, outcome, "gc", "--app", outcome.app, "--delete", "--json")
    entry: dict[str, Any] = {"kind": GC_RUNNING, "exit": code, "at": _now(outcome)}
    if code == 0:
        outcome.happened[GC_RUNNING] += 1
        try:
            found = json.loads(out.splitlines()[-1])
            entry |= {k: found.get(k) for k in ("objects", "unreferenced", "waiting")}
            entry["deleted"] = len(found.get("keys", []))
        except (ValueError, IndexError):
            pass
    else:
        outcome.problems.append(f"gc beside the running job exited {code}: {out[-400:]}")
    outcome.faults.append(entry)


def _gc_after(env: Env, outcome: Outcome) -> None:
    """After the run: gc with no grace, so that unreferenced objects really go, then the
    checks rebuild the state from what is left. The job has stopped; `--quiet-s 0` (its
    last commits are seconds old); `--force` only if the lease still looks held."""
    base = ["gc", "--app", outcome.app, "--delete", "--grace-s", "0", "--quiet-s", "0", "--json"]
    code, out = _tool(env, outcome, *base)
    forced = False
    if code == 3:
        forced = True
        code, out = _tool(env, outcome, *base, "--force")
    entry: dict[str, Any] = {"kind": "gc_after_run", "exit": code, "forced": forced}
    if code == 0:
        try:
            found = json.loads(out.splitlines()[-1])
            entry |= {k: found.get(k) for k in ("objects", "referenced", "unreferenced")}
            entry["deleted"] = len(found.get("keys", []))
        except (ValueError, IndexError):
            pass
    else:
        outcome.problems.append(f"gc after the run exited {code}: {out[-400:]}")
    outcome.faults.append(entry)


def _new_query(
    env: Env, driver: Driver, fault: Fault, produced: int, rng: random.Random, outcome: Outcome
) -> tuple[Driver, int]:
    """A takeover, regroup or rollback: a NEW checkpoint at COMMITTED, started."""
    cp = outcome.current
    entry: dict[str, Any] = {"kind": fault.kind, "from_query": cp.n, "at": _now(outcome)}
    if fault.kind == TAKEOVER:
        produced = events.produce(
            env.kinesis, cp.cfg.streams[0], produced, outcome.schedule.more_events, USERS, rng
        )
        new = _new_checkpoint(outcome, cp.cfg.groups, TAKEOVER)
        started = _start(env, outcome)
        entry |= {"old_batches": len(driver.reports), "to_query": new.n}
        outcome.old.append((driver, entry))
        outcome.happened[TAKEOVER] += 1
        outcome.faults.append(entry)
        return started, produced
    entry["mid_batch"] = running_batch(Path(cp.cfg.checkpoint))
    entry["processes"] = driver.kill()
    groups = cp.cfg.groups
    if fault.kind == REGROUP:
        groups = fault.groups if fault.groups != groups else (2 if groups != 2 else 8)
        entry["groups"] = [cp.cfg.groups, groups]
    else:
        entry |= _rollback(env, fault, outcome)
    new = _new_checkpoint(outcome, groups, fault.kind)
    entry["to_query"] = new.n
    outcome.happened[fault.kind] += 1
    outcome.faults.append(entry)
    return _start(env, outcome), produced


def _rollback(env: Env, fault: Fault, outcome: Outcome) -> dict[str, Any]:
    """`state rollback --apply` to a batch `fault.back` before the newest recorded one
    (or the nearest earlier one with a progress record)."""
    loc = outcome.current.cfg.location
    latest = progress.latest(loc)
    if latest is None:
        return {"rollback": "no progress record yet: nothing to roll back to"}
    query, target = latest["query"], max(latest["batch"] - fault.back, 0)
    while target > 0 and progress.at_batch(loc, query, target) is None:
        target -= 1
    if progress.at_batch(loc, query, target) is None:
        target = latest["batch"]
    code, out = _tool(
        env, outcome, "rollback", "--app", outcome.app, "--query", query,
        "--batch", str(target), "--apply", "--force", "--json",
    )  # fmt: skip
    done: dict[str, Any] = {"query": query[:8], "latest": latest["batch"], "to_batch": target}
    if code == 0:
        with contextlib.suppress(ValueError, IndexError):
            done["moved"] = json.loads(out.splitlines()[-1]).get("moved")
    else:
        outcome.problems.append(f"rollback to batch {target} exited {code}: {out[-400:]}")
    done["exit"] = code
    return done


def _watch_old(outcome: Outcome) -> None:
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
            entry["old_ended_at"] = _now(outcome)
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


def _stop_old(outcome: Outcome, why: str) -> None:
    for old, entry in outcome.old:
        if "old_ended" not in entry and old.poll() is None:
            old.kill()
            entry.setdefault("old_stopped", why)
    _watch_old(outcome)


def _failure(driver: Driver) -> str:
    lines = [
        line
        for line in driver.tail(200).splitlines()
        if "Error" in line or "error" in line or "shardless:" in line
    ]
    return (lines[-1] if lines else driver.tail(3))[-400:]


def _kill_driver(
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
        {"kind": DRIVER_KILL, "mid_batch": batch, "processes": killed, "at": _now(outcome)}
    )
    if RESHARD in outcome.schedule.kinds:
        done = events.reshard(env.kinesis, cfg.streams[0], rng)
        outcome.happened[RESHARD] += 1
        outcome.faults.append({"kind": RESHARD, "what": done, "at": _now(outcome)})
    return events.produce(
        env.kinesis, cfg.streams[0], produced, outcome.schedule.more_events, USERS, rng
    )


def _apply(
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
        outcome.faults.append({"kind": fault.kind, "installed": True, "at": _now(outcome)})


def _kill_executor(driver: Driver, cfg: JobConfig, rng: random.Random, outcome: Outcome) -> None:
    executors = procs.executors(driver.pid)
    if not executors:
        outcome.faults.append({"kind": EXECUTOR_KILL, "missed": "no executor running"})
        return
    victim = rng.choice(executors)
    tree = procs.descendants(victim.pid)
    workers = [p.pid for p in tree if procs.PYSPARK_DAEMON in p.cmdline]
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
            "at": _now(outcome),
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
        "at": _now(outcome),
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
    outcome.faults.append({"kind": WORKER_KILL, "mid_batch": batch, "at": _now(outcome)})


def _count_requests(env: Env, schedule: Schedule, outcome: Outcome) -> None:
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


def _now(outcome: Outcome) -> float:
    """Seconds since the schedule started."""
    return round(time.monotonic() - outcome.started, 2)
