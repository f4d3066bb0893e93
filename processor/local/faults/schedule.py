"""Seeded fault schedules: which faults hit a run of the job, and when.

A schedule is a pure function of (seed, index), so `--seed S` names the same plans on
every machine; what the faults hit (which task was running, which request failed) is up to
timing. Every schedule has one process kill, cycling driver → executor → Python worker so
that any two consecutive schedules cover two kinds, plus AWS and Kinesis faults drawn at
random, and maybe a second kill. A reshard happens only during recovery: between a driver
kill and its restart.

Every schedule also has one operator action (unless drawn with `operator=False`), cycling
takeover → regroup → rollback → gc_running, drawn apart from the rest (the kills and AWS
faults of a (seed, index) are the same with or without it), and 30% of schedules a second
`gc_running`:

- takeover: a second driver on a NEW checkpoint at `--starting-position COMMITTED` while the
  first runs (these schedules put 2,000 to 3,000 more events in the stream first, so that
  the first query still has work when the second starts); the first is fenced and never
  restarted again;
- regroup: the driver killed, a NEW checkpoint at COMMITTED with another `--groups`;
- rollback: the driver killed, `shardless state rollback --apply` to an earlier batch that
  has a progress record, a NEW checkpoint at COMMITTED;
- gc_running: `shardless state gc --delete` (default grace) while the driver runs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from shardless.processor.local.faults.rules import Rule

DRIVER_KILL = "driver_kill"
EXECUTOR_KILL = "executor_kill"
WORKER_KILL = "worker_kill"
RESHARD = "reshard"
S3_ERRORS = "s3_errors"
DYNAMODB_ERRORS = "dynamodb_errors"
APPLIED_BUT_FAILED = "applied_but_failed"
KINESIS_THROTTLE = "kinesis_throttle"
KINESIS_EXPIRED_ITERATOR = "kinesis_expired_iterator"
EXECUTOR_STALL = "executor_stall"  # only with `with_stall` (`--stalls`)
TAKEOVER = "takeover"
REGROUP = "regroup"
ROLLBACK = "rollback"
GC_RUNNING = "gc_running"

KILLS = (DRIVER_KILL, EXECUTOR_KILL, WORKER_KILL)
REQUEST_FAULTS = (
    S3_ERRORS,
    DYNAMODB_ERRORS,
    APPLIED_BUT_FAILED,
    KINESIS_THROTTLE,
    KINESIS_EXPIRED_ITERATOR,
)
# operator actions: each starts a new query (checkpoint) except gc_running
OPERATOR_ACTIONS = (TAKEOVER, REGROUP, ROLLBACK, GC_RUNNING)
NEW_QUERY = (TAKEOVER, REGROUP, ROLLBACK)
KINDS = (*KILLS, RESHARD, *REQUEST_FAULTS, EXECUTOR_STALL, *OPERATOR_ACTIONS)


@dataclass(frozen=True)
class Fault:
    """`kind`, applied `delay_s` after the job reports batch `after_batch` (-1: at start).

    Request faults carry the proxy rules they install; they stay until the schedule ends.
    A stall stops an executor's JVM for `stall_s` and its Python processes for
    `worker_stall_s`. A regroup names the new checkpoint's `groups`; a rollback goes back
    `back` recorded batches from the newest."""

    kind: str
    after_batch: int
    delay_s: float = 0.0
    rules: tuple[Rule, ...] = ()
    stall_s: float = 0.0
    worker_stall_s: float = 0.0
    groups: int = 0
    back: int = 0

    def describe(self) -> dict:
        out: dict = {"kind": self.kind, "after_batch": self.after_batch}
        if self.delay_s:
            out["delay_s"] = round(self.delay_s, 2)
        if self.stall_s:
            out["stall_s"] = round(self.stall_s, 2)
            out["worker_stall_s"] = round(self.worker_stall_s, 2)
        if self.groups:
            out["groups"] = self.groups
        if self.back:
            out["back"] = self.back
        if self.rules:
            out["rules"] = [
                {k: v for k, v in vars(r).items() if v not in (None, False, 0.0)}
                for r in self.rules
            ]
        return out


@dataclass(frozen=True)
class Schedule:
    index: int
    seed: int
    shards: int
    events: int  # produced before the job starts
    more_events: int  # produced during recovery, after a driver kill (and reshard)
    faults: tuple[Fault, ...] = field(default=())

    @property
    def kinds(self) -> list[str]:
        return [f.kind for f in self.faults]

    def describe(self) -> dict:
        return {
            "index": self.index,
            "shards": self.shards,
            "events": self.events,
            "faults": [f.describe() for f in self.faults],
        }


def _request_fault(kind: str, after: int, rng: random.Random) -> Fault:
    if kind == S3_ERRORS:
        rules = (
            Rule(
                "s3",
                rng.choice(["PutObject", "PutObject", "GetObject"]),
                status=rng.choice([500, 503]),
                probability=0.3,
                times=rng.randint(2, 4),
            ),
        )
    elif kind == DYNAMODB_ERRORS:
        status, error = rng.choice(
            [
                (500, "InternalServerError"),
                (400, "ProvisionedThroughputExceededException"),
                (400, "ThrottlingException"),
            ]
        )
        op = rng.choice([None, "TransactWriteItems", "BatchGetItem", "PutItem"])
        rules = (
            Rule(
                "dynamodb", op, status=status, error=error, probability=0.2, times=rng.randint(2, 5)
            ),
        )
    elif kind == APPLIED_BUT_FAILED:
        service, op = rng.choice(
            [("dynamodb", "TransactWriteItems"), ("dynamodb", "PutItem"), ("s3", "PutObject")]
        )
        rules = (Rule(service, op, status=500, after=True, times=1),)
    elif kind == KINESIS_THROTTLE:
        rules = (
            Rule(
                "kinesis",
                "GetRecords",
                error="ProvisionedThroughputExceededException",
                probability=0.3,
                times=rng.randint(3, 8),
            ),
        )
    elif kind == KINESIS_EXPIRED_ITERATOR:
        rules = (
            Rule(
                "kinesis",
                "GetRecords",
                error="ExpiredIteratorException",
                probability=0.3,
                times=rng.randint(2, 4),
            ),
        )
    else:
        raise ValueError(f"not a request fault: {kind!r}")
    return Fault(kind, after, rules=rules)


def draw(seed: int, index: int, operator: bool = True) -> Schedule:
    """The schedule `index` of the run seeded `seed` (with an operator action unless
    `operator` is False)."""
    rng = random.Random(f"shardless-faults/{seed}/{index}")
    primary = KILLS[index % len(KILLS)]
    faults = [Fault(primary, rng.randint(0, 2), rng.uniform(0.2, 2.0))]
    if primary == DRIVER_KILL and (index // len(KILLS)) % 2 == 0:
        faults.append(Fault(RESHARD, faults[0].after_batch))  # between the kill and the restart
    if rng.random() < 0.3:
        second = rng.choice([k for k in KILLS if k != primary])
        faults.append(
            Fault(second, faults[0].after_batch + rng.randint(1, 2), rng.uniform(0.2, 2.0))
        )
    for kind in rng.sample(REQUEST_FAULTS, 2):
        faults.append(_request_fault(kind, rng.randint(-1, 2), rng))
    schedule = Schedule(
        index=index,
        seed=seed,
        shards=rng.choice([2, 2, 3]),
        events=rng.randint(1200, 1800),
        more_events=rng.randint(300, 600),
        faults=tuple(sorted(faults, key=lambda f: (f.after_batch, f.kind not in KILLS))),
    )
    return with_operator_action(schedule) if operator else schedule


def _order(faults: list[Fault] | tuple[Fault, ...]) -> tuple[Fault, ...]:
    return tuple(sorted(faults, key=lambda f: (f.after_batch, f.kind not in KILLS)))


def with_operator_action(schedule: Schedule) -> Schedule:
    """`schedule` plus one operator action (cycling over `OPERATOR_ACTIONS` by index) and,
    in 30% of schedules, a `gc_running` besides; drawn apart, so the rest is unchanged.

    A takeover, regroup or rollback comes after batch 1 to 3 (a rollback needs an earlier
    recorded batch to go back to; a run has 4 batches or more) and not on the batch of a
    driver kill (the two would race for the same driver)."""
    rng = random.Random(f"shardless-faults-ops/{schedule.seed}/{schedule.index}")
    kind = OPERATOR_ACTIONS[schedule.index % len(OPERATOR_ACTIONS)]
    kill_batches = {f.after_batch for f in schedule.faults if f.kind == DRIVER_KILL}
    after = rng.choice([b for b in (1, 2, 3) if b not in kill_batches])
    ops = [
        Fault(
            kind,
            after,
            rng.uniform(0.2, 2.0),
            groups=rng.choice([2, 8]) if kind == REGROUP else 0,
            back=rng.randint(1, 2) if kind == ROLLBACK else 0,
        )
    ]
    if kind != GC_RUNNING and rng.random() < 0.3:
        ops.append(Fault(GC_RUNNING, rng.randint(0, 3), rng.uniform(0.2, 2.0)))
    events = schedule.events
    if kind == TAKEOVER:
        # a backlog the first query is still working through when the second one starts
        # (a driver takes 30 to 90 s to start): the takeover then overlaps a running query
        events += rng.randint(2000, 3000)
    return replace(schedule, events=events, faults=_order([*schedule.faults, *ops]))


def with_stall(schedule: Schedule) -> Schedule:
    """`schedule` plus an executor stall (drawn apart: the rest of the plan is unchanged).

    The executor's JVM and its Python processes are stopped (SIGSTOP). The JVM stays
    stopped longer than Spark's network timeout (`job.STALL_ARGS`, 10 s): the driver
    declares the executor lost, runs its tasks again on the other executor and has the
    stalled JVM killed. The Python processes resume (SIGCONT) after 8 to 16 s, around the
    time the new attempts start: a worker that had all of a group's input goes on as a
    zombie and races the new attempt to commit. (Speculative execution cannot make the
    second attempt here: Spark never runs a speculative copy on the host of the original
    attempt, and both executors of `local-cluster` are on one host.)"""
    rng = random.Random(f"shardless-faults-stall/{schedule.seed}/{schedule.index}")
    stall = Fault(
        EXECUTOR_STALL,
        rng.randint(0, 2),
        rng.uniform(0.2, 1.5),
        stall_s=rng.uniform(20, 30),
        worker_stall_s=rng.uniform(8, 16),
    )
    return replace(schedule, faults=_order([*schedule.faults, stall]))
