"""Fault injection against the real job: `python -m bench.faults --schedules N --seed S --json`.

Runs `examples/user_activity.py` with `shardless run` on a two-executor Spark
(`local-cluster[2,1,1024]`) against local emulators, one seeded fault schedule after
another (`processor/local/faults/schedule.py`): kill -9 of the driver (restarted from its
checkpoint, maybe after a reshard), of an executor (its disk lost too) or of a Python
worker; S3 and DynamoDB 5xx, throttling and writes applied but reported failed; Kinesis
throttling and expired iterators; and operator actions (`--no-operator-actions` leaves
them out): a takeover by a new checkpoint at COMMITTED while the job runs, a new checkpoint
with another group count, `state rollback` then a new checkpoint, `state gc --delete`
while the job runs. After each schedule the durable state and the outputs
are compared with a plain-Python fold of the stream (`processor/local/faults/check.py`).

Prints one JSON object: `schedules`, `faults_by_kind` (faults that happened),
`divergences` (schedules whose state or outputs differ from the fold: must be 0),
`incomplete` (schedules that did not drain the stream in time), `restores` (restore
seconds and bytes from the job's batch metrics: every batch that restored a slice, and the
batches right after an executor kill, whose slices were reassigned), and one entry per
schedule. The summary so far is also kept in `<work>/summary.json` after every schedule.
One schedule takes 1.5 to 4.5 minutes on 2 cores (a driver start alone is 30 to 90 s).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardless.processor.local import emulators as local_aws
from shardless.processor.local.faults import runner
from shardless.processor.local.faults.fault_proxy import FaultProxy
from shardless.processor.local.faults.outcome import Env, Outcome
from shardless.processor.local.faults.schedule import KILLS, KINDS, Schedule, draw, with_stall

# chains roll over every few positions in a schedule, so the roll-over meets the faults
CHAIN_LENGTH = 4


def run_harness(
    aws: local_aws.LocalAws,
    schedules: int,
    seed: int,
    work: Path,
    keep: bool = False,
    stalls: bool = False,
    progress: Callable[[str], None] | None = None,
    first: int = 0,
    plans: list[Schedule] | None = None,
    partial: Path | None = None,
    operator: bool = True,
    commit_format: str = "chains",
    chain_length: int = CHAIN_LENGTH,
) -> dict[str, Any]:
    """Run schedules `first .. first+schedules-1` of `seed` against running emulators, or
    the given `plans` (then `schedules` and `first` are not used). With `partial`, the
    summary so far is written there after every schedule (a long run cut short keeps its
    results)."""
    started = time.monotonic()
    kinesis = aws.kinesis_client()
    outcomes: list[Outcome] = []
    with (
        aws.env_applied(),  # the checks (`check.verify`) use default boto3 clients
        FaultProxy(aws.s3_endpoint, seed=seed) as storage,
        FaultProxy(aws.kinesis_endpoint, seed=seed + 1) as kinesis_proxy,
    ):
        env = Env(
            kinesis, aws.env(), storage, kinesis_proxy, work, keep, stalls, commit_format,
            chain_length,
        )  # fmt: skip
        if plans is None:
            plans = [draw(seed, index, operator) for index in range(first, first + schedules)]
            if stalls:
                plans = [with_stall(p) for p in plans]
        for schedule in plans:
            outcome = runner.run(env, schedule)
            outcomes.append(outcome)
            if progress is not None:
                progress(_line(outcome))
            if partial is not None:
                so_far = summarize(outcomes, seed, time.monotonic() - started, stalls)
                partial.write_text(json.dumps(so_far, indent=2) + "\n")
    return summarize(outcomes, seed, time.monotonic() - started, stalls)


def _line(o: Outcome) -> str:
    verdict = "DIVERGED" if o.problems else f"INCOMPLETE ({o.incomplete})" if o.incomplete else "ok"
    done = ", ".join(f"{k} x{n}" for k, n in sorted(o.happened.items())) or "none"
    return (
        f"schedule {o.schedule.index}: {verdict}; faults: {done}; {o.events} events, "
        f"{len(o.batches)} batches, {len(o.runs)} driver runs, {o.seconds:.0f}s"
    )


def summarize(
    outcomes: list[Outcome], seed: int, seconds: float, stalls: bool = False
) -> dict[str, Any]:
    happened: Counter[str] = Counter()
    broken: Counter[str] = Counter()
    for o in outcomes:
        happened.update(o.happened)
        broken.update(o.requests_broken)
    kills = [f for o in outcomes for f in o.faults if f["kind"] in KILLS and "missed" not in f]
    return {
        "schedules": len(outcomes),
        "seed": seed,
        "stalls": stalls,
        "divergences": sum(1 for o in outcomes if o.problems),
        "incomplete": sum(1 for o in outcomes if o.incomplete),
        "faults_by_kind": {k: happened[k] for k in KINDS},
        "faults_missed": dict(
            Counter(f["kind"] for o in outcomes for f in o.faults if "missed" in f)
        ),
        "kills_mid_batch": sum(1 for f in kills if f.get("mid_batch") is not None),
        "kills": len(kills),
        "requests_broken": dict(sorted(broken.items())),
        "driver_runs": sum(len(o.runs) for o in outcomes),
        "driver_failures_restarted": sum(len(o.failures) for o in outcomes),
        "queries": sum(len(o.checkpoints) for o in outcomes),
        "takeover_refusals": sum(len(o.takeover_refusals) for o in outcomes),
        "old_drivers_fenced": sum(1 for o in outcomes for _, e in o.old if e.get("old_fenced")),
        "old_drivers_stopped": sum(1 for o in outcomes for _, e in o.old if e.get("old_stopped")),
        "commit_conflicts_logged": sum(o.commit_conflicts for o in outcomes),
        "batch_groups_committed_more_than_once": sum(
            o.commit_attempts.get("batch_groups_committed_more_than_once", 0) for o in outcomes
        ),
        "events": sum(o.events for o in outcomes),
        "batches": sum(len(o.batches) for o in outcomes),
        "restores": restore_figures(outcomes),
        "seconds": round(seconds, 1),
        "divergence_details": [
            {"schedule": o.schedule.index, "app": o.app, "problems": o.problems[:10]}
            for o in outcomes
            if o.problems
        ],
        "per_schedule": [
            o.summary() | {"restores_after_executor_kill": _figures(after_executor_kill(o))}
            for o in outcomes
        ],
    }


def restore_figures(outcomes: list[Outcome]) -> dict[str, Any]:
    """Restores from the batch reports: all batches that restored a slice with state, and
    those among the first two batches reported after an executor kill (by the same driver
    or, when the batch failed and the driver was restarted, the next one): the killed
    executor's slices, reassigned to the other executor or to its replacement and rebuilt
    from S3."""
    every = [r for o in outcomes for r in o.reports if r.get("restored_slices")]
    after_kill = [r for o in outcomes for r in after_executor_kill(o)]
    return {"all": _figures(every), "after_executor_kill": _figures(after_kill)}


def after_executor_kill(o: Outcome) -> list[dict]:
    """The batch reports with restores among the first two reported after each executor
    kill of a schedule."""
    reports = o.reports
    near = sorted({i for at in o.kill_marks for i in range(at, min(at + 2, len(reports)))})
    return [reports[i] for i in near if reports[i].get("restored_slices")]


def _figures(reports: list[dict]) -> dict[str, Any]:
    if not reports:
        return {"batches": 0}
    seconds = [r["restore_seconds_max"] for r in reports]
    restored = [r["restored_bytes"] for r in reports]
    return {
        "batches": len(reports),
        "slices": sum(r["restored_slices"] for r in reports),
        "bytes_total": sum(restored),
        "bytes_per_batch_max": max(restored),
        "bytes_per_slice_mean": round(sum(restored) / sum(r["restored_slices"] for r in reports)),
        "slice_seconds_max": round(max(seconds), 3),
        "slice_seconds_p50": round(statistics.median(seconds), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--first", type=int, default=0, help="index of the first schedule")
    parser.add_argument("--json", action="store_true", help="print only the JSON summary")
    parser.add_argument("--work", help="folder for checkpoints, stores, outputs and logs")
    parser.add_argument("--keep", action="store_true", help="keep every schedule's folder")
    parser.add_argument(
        "--stalls",
        action="store_true",
        help="add an executor stall to every schedule: the driver gives the executor up and "
        "runs its tasks again, then the stalled Python workers resume as zombies",
    )
    parser.add_argument(
        "--no-operator-actions",
        dest="operator",
        action="store_false",
        help="leave out the operator actions (takeover, regroup, rollback, gc while running)",
    )
    parser.add_argument(
        "--commit-format",
        choices=("heads", "chains"),
        default="chains",
        help="JobConfig.commit_format of the job under test",
    )
    parser.add_argument(
        "--chain-length",
        type=int,
        default=CHAIN_LENGTH,
        help="JobConfig.chain_length: short, so that chains roll over under the faults",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the emulators on a kill
    work = Path(args.work or tempfile.mkdtemp(prefix="shardless-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"bench.faults: working in {work} (summary so far: summary.json)", file=sys.stderr)
    emulators = local_aws.start("kinesalite", log_dir=work / "local-aws")
    try:
        summary = run_harness(
            emulators,
            args.schedules,
            args.seed,
            work,
            keep=args.keep,
            stalls=args.stalls,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
            first=args.first,
            partial=work / "summary.json",
            operator=args.operator,
            commit_format=args.commit_format,
            chain_length=args.chain_length,
        )
    finally:
        emulators.stop()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(json.dumps({k: v for k, v in summary.items() if k != "per_schedule"}, indent=2))
    return 1 if summary["divergences"] or summary["incomplete"] else 0


if __name__ == "__main__":
    sys.exit(main())
