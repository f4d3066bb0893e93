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

This module is the run loop; the faults are applied by `inject.py` and
`operator_actions.py`, drivers started by `job.py`, and what a run records is `outcome.py`.
"""

from __future__ import annotations

import logging
import random
import shutil
import signal
import time
import uuid

from shardless.processor.driver.config import JobConfig
from shardless.processor.local.faults import check, events, procs
from shardless.processor.local.faults.driver import Driver
from shardless.processor.local.faults.inject import apply_fault, count_requests, kill_driver
from shardless.processor.local.faults.job import (
    GROUPS,
    SLICES,
    USERS,
    new_checkpoint,
    start_driver,
    stop_old,
    watch_old,
)
from shardless.processor.local.faults.operator_actions import gc_after, gc_running, new_query
from shardless.processor.local.faults.outcome import Checkpoint, Env, Outcome
from shardless.processor.local.faults.schedule import (
    DRIVER_KILL,
    EXECUTOR_STALL,
    GC_RUNNING,
    KILLS,
    NEW_QUERY,
    RESHARD,
    TAKEOVER,
    Fault,
    Schedule,
)

log = logging.getLogger(__name__)

MAX_RESTARTS_AFTER_FAILURE = 4
SCHEDULE_TIMEOUT_S = 600
MAX_TAKEOVER_REFUSALS = 3  # then they count as driver failures
CONFLICT_MARK = "lost to another writer"  # in `HeadConflictError`'s message


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
        commit_format=env.commit_format,
        chain_length=env.chain_length,
    )
    for proxy in (env.storage_proxy, env.kinesis_proxy):
        proxy.clear()
        proxy.reset_counts()
    pending = [(i, f) for i, f in enumerate(schedule.faults) if f.kind != RESHARD]
    deadline = outcome.started + SCHEDULE_TIMEOUT_S
    outcome.checkpoints.append(Checkpoint(1, cfg, folder / "outputs-1", False, "first"))
    driver = start_driver(env, outcome)
    due_at: dict[int, float] = {}  # fault index -> when it fires
    try:
        while True:
            code = driver.poll()
            watch_old(outcome)
            for i, fault in list(pending):
                if code is not None or not _reached(outcome, driver, fault):
                    continue
                due_at.setdefault(i, time.monotonic() + fault.delay_s)
                if time.monotonic() < due_at[i]:
                    continue
                pending.remove((i, fault))
                if fault.kind == DRIVER_KILL:
                    produced = kill_driver(env, driver, fault, produced, rng, outcome)
                    driver = start_driver(env, outcome)
                    break
                if fault.kind in NEW_QUERY:
                    driver, produced = new_query(env, driver, fault, produced, rng, outcome)
                    break
                if fault.kind == GC_RUNNING:
                    gc_running(env, outcome)
                    continue
                apply_fault(env, driver, outcome.current.cfg, fault, rng, outcome)
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
                    stop_old(outcome, "the new query failed before its first batch")
                    new_checkpoint(outcome, cp.cfg.groups, f"{cp.why}, again")
                driver = start_driver(env, outcome)
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
        stop_old(outcome, "the run ended")
        procs.kill9(outcome.stalled)  # orphans of an executor Spark removed while stopped
        for proxy in (env.storage_proxy, env.kinesis_proxy):
            proxy.clear()
    for _, fault in pending:
        if fault.kind in (*KILLS, EXECUTOR_STALL, *NEW_QUERY, GC_RUNNING):
            outcome.faults.append({"kind": fault.kind, "missed": "the run ended before it"})
    count_requests(env, schedule, outcome)
    outcome.commit_conflicts = sum(d.log_text().count(CONFLICT_MARK) for d in outcome.runs)
    try:
        outcome.commit_attempts = check.commit_attempts(cfg)
    except Exception as exc:  # noqa: BLE001 - a figure, not a check
        log.warning("%s: could not list the changelog segments: %s", app, exc)
    if outcome.incomplete is None:
        if GC_RUNNING in schedule.kinds:
            gc_after(env, outcome)
        queries = [q for c in outcome.checkpoints if (q := c.query_run()) is not None]
        problems, outcome.events = check.verify(env.kinesis, cfg, app, queries)
        outcome.problems += problems
    outcome.seconds = time.monotonic() - outcome.started
    env.kinesis.delete_stream(StreamName=app, EnforceConsumerDeletion=True)
    if not env.keep and not outcome.problems and outcome.incomplete is None:
        shutil.rmtree(folder, ignore_errors=True)
    return outcome


def _reached(outcome: Outcome, driver: Driver, fault: Fault) -> bool:
    base = outcome.current.base
    return fault.after_batch < 0 or any(
        base + r["batch_id"] >= fault.after_batch for r in driver.reports
    )


def _failure(driver: Driver) -> str:
    lines = [
        line
        for line in driver.tail(200).splitlines()
        if "Error" in line or "error" in line or "shardless:" in line
    ]
    return (lines[-1] if lines else driver.tail(3))[-400:]
