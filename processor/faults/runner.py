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
- request faults: the schedule's proxy rules are installed.

A driver that exits with an error (a batch failed past Spark's task retries) is restarted
from its checkpoint, as an operator or a supervisor would. When the run has drained the
stream, the checks of `check.py` decide whether it diverged.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from processor.config import JobConfig
from processor.faults import check, events, procs
from processor.faults.driver import REPO, Driver, running_batch
from processor.faults.proxy import Proxy
from processor.faults.schedule import (
    DRIVER_KILL,
    EXECUTOR_KILL,
    EXECUTOR_STALL,
    KILLS,
    RESHARD,
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
    storage_proxy: Proxy  # S3 and DynamoDB (one moto server serves both)
    kinesis_proxy: Proxy
    work: Path
    keep: bool = False  # keep each schedule's folder even when it passed
    stalls: bool = False  # schedules may stall an executor (STALL_ARGS for the driver)


@dataclass
class Outcome:
    schedule: Schedule
    app: str
    faults: list[dict[str, Any]] = field(default_factory=list)  # what happened, in order
    happened: Counter[str] = field(default_factory=Counter)
    requests_broken: dict[str, int] = field(default_factory=dict)  # "service/op" -> count
    runs: list[Driver] = field(default_factory=list)  # every driver started, in order
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
    def batches(self) -> dict[int, dict[str, Any]]:
        """The last report of each batch id (a batch run again reports again)."""
        return {r["batch_id"]: r for r in self.reports}

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
        checkpoint=str(folder / "checkpoint"),
        slices=SLICES,
        groups=GROUPS,
        local_dir=str(folder / "stores"),
    )
    out_dir = folder / "outputs"
    for proxy in (env.storage_proxy, env.kinesis_proxy):
        proxy.clear()
        proxy.reset_counts()
    pending = [(i, f) for i, f in enumerate(schedule.faults) if f.kind != RESHARD]
    deadline = outcome.started + SCHEDULE_TIMEOUT_S
    driver = _start(env, cfg, out_dir, folder, outcome)
    due_at: dict[int, float] = {}  # fault index -> when it fires
    try:
        while True:
            code = driver.poll()
            for i, fault in list(pending):
                if code is not None or not _reached(driver, fault):
                    continue
                due_at.setdefault(i, time.monotonic() + fault.delay_s)
                if time.monotonic() < due_at[i]:
                    continue
                pending.remove((i, fault))
                if fault.kind == DRIVER_KILL:
                    produced = _kill_driver(env, driver, cfg, fault, produced, rng, outcome)
                    driver = _start(env, cfg, out_dir, folder, outcome)
                    break
                _apply(env, driver, cfg, fault, rng, outcome)
            if code == 0 and driver.proc is not None and not driver.killed:
                break
            if code is not None and not driver.killed:
                outcome.failures.append(_failure(driver))
                if len(outcome.failures) > MAX_RESTARTS_AFTER_FAILURE:
                    outcome.incomplete = f"the driver failed {len(outcome.failures)} times"
                    break
                driver = _start(env, cfg, out_dir, folder, outcome)
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
        procs.kill9(outcome.stalled)  # orphans of an executor Spark removed while stopped
        for proxy in (env.storage_proxy, env.kinesis_proxy):
            proxy.clear()
    for _, fault in pending:
        if fault.kind in (*KILLS, EXECUTOR_STALL):
            outcome.faults.append({"kind": fault.kind, "missed": "the run ended before it"})
    _count_requests(env, schedule, outcome)
    outcome.commit_conflicts = sum(d.log_text().count(CONFLICT_MARK) for d in outcome.runs)
    try:
        outcome.commit_attempts = check.commit_attempts(cfg)
    except Exception as exc:  # noqa: BLE001 - a figure, not a check
        log.warning("%s: could not list the changelog segments: %s", app, exc)
    if outcome.incomplete is None:
        processed = sum(r["records"] for r in outcome.batches.values())
        outcome.problems, outcome.events = check.verify(
            env.kinesis, cfg, app, str(out_dir), processed
        )
    outcome.seconds = time.monotonic() - outcome.started
    env.kinesis.delete_stream(StreamName=app, EnforceConsumerDeletion=True)
    if not env.keep and not outcome.problems and outcome.incomplete is None:
        shutil.rmtree(folder, ignore_errors=True)
    return outcome


def _start(env: Env, cfg: JobConfig, out_dir: Path, folder: Path, outcome: Outcome) -> Driver:
    args = [
        str(APP_FILE),
        "--app", cfg.app,
        "--stream", cfg.streams[0],
        "--slices", str(cfg.slices),
        "--groups", str(cfg.groups),
        "--checkpoint", cfg.checkpoint,
        "--local-dir", cfg.local_dir,
        "--output", str(out_dir),
        "--master", MASTER,
        "--available-now",
        "--max-records-per-shard", str(MAX_RECORDS_PER_SHARD),
        "--snapshot-every", str(SNAPSHOT_EVERY),
    ]  # fmt: skip
    env_vars = {
        **os.environ,
        **env.aws_env,
        "AWS_ENDPOINT_URL_S3": env.storage_proxy.url,
        "AWS_ENDPOINT_URL_DYNAMODB": env.storage_proxy.url,
        "AWS_ENDPOINT_URL_KINESIS": env.kinesis_proxy.url,
        "PYSPARK_SUBMIT_ARGS": (STALL_ARGS if env.stalls else "") + SUBMIT_ARGS,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    driver = Driver(args, env_vars, folder / f"driver-{len(outcome.runs) + 1}.log")
    driver.start()
    outcome.runs.append(driver)
    return driver


def _reached(driver: Driver, fault: Fault) -> bool:
    return fault.after_batch < 0 or any(r["batch_id"] >= fault.after_batch for r in driver.reports)


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
    cfg: JobConfig,
    fault: Fault,
    produced: int,
    rng: random.Random,
    outcome: Outcome,
) -> int:
    """kill -9 the whole job; during recovery maybe reshard, then produce more events."""
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
