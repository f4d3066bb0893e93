"""A model-based test of the whole durability protocol: random, seeded, replayable.

    python -m bench.protocol --seed 1 --runs 200 --json
    python -m bench.protocol --seed 1 --run 17 --replay '[["start", 2], ["run", 0, 0, 1]]'

Each run is a fresh application (`bench.protocol_model.World`: 8 slices, 2-4 groups, a
few dozen keys, a handler whose per-key state lists the record ids it saw and the timers
that fired) and a random sequence of steps (seeded by seed and run) that drive the real
runtime, driver and tools in this process against moto server over HTTP: task attempts
(normal, re-run, crashed after the segment PUT / the DynamoDB commit / the local apply,
speculative twins, zombies that resume later), groups left out of a batch as Spark leaves
out idle ones, read batches that commit nothing, wiped and moved worker directories, the
driver's progress records, new queries with COMMITTED and another group count, rollback
(to a recorded batch, and to one without a record), gc while queries run, and `state
restore` at an accepted batch. After every step the state rebuilt from S3 and DynamoDB
alone is checked against a plain fold of the accepted batches; each run then finishes
with a fresh COMMITTED query and must end at the fold of the whole input, every timer
fired once. A failing run is shrunk (delete one step, replay, keep if the same invariant
still breaks) to a short step list.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.protocol_app import Spec, make_input
from bench.protocol_model import Step, Violation, World

# Step kinds and their weights; `--kinds`/`--without` pick a mix.
WEIGHTS = {
    "run": 40,
    "idle": 8,
    "crash": 10,
    "twin": 4,
    "zombie": 3,
    "resume": 6,
    "record": 22,
    "start": 4,
    "restart": 3,
    "wipe": 2,
    "move": 2,
    "rollback": 3,
    "rollback_unrecorded": 1,
    "gc": 3,
    "restore": 2,
    "reslice": 1,
}
KINDS = tuple(WEIGHTS)
# The CI slice's mix: every kind (rollback, restore and reslice were left out while they
# still found holes). PROTOCOL_KINDS in tests/bench/test_protocol.py overrides it.
CI_KINDS = KINDS
CI_TIMERS = True


@dataclass
class RunResult:
    run: int
    steps: list[Step]
    outcomes: list[str]
    refused: int
    violation: Violation | None = None
    seconds: float = 0.0


@dataclass
class Settings:
    spec: Spec = field(default_factory=Spec)
    max_steps: int = 30
    kinds: tuple[str, ...] = KINDS


log = logging.getLogger(__name__)


def choose(rng: random.Random, world: World, settings: Settings) -> Step:
    """A step that can do something in `world` now (drawn from the allowed kinds)."""
    spec = world.spec
    live = [i for i in range(len(world.queries)) if world.live(i) is not None]
    kinds = [k for k in settings.kinds if k in WEIGHTS]
    if not world.queries or (not live and "start" in kinds):
        return ["start", rng.randint(2, 4)]
    kinds = [k for k in kinds if k != "zombie" or world.zombie is None]
    kinds = [k for k in kinds if k != "resume" or world.zombie is not None]
    if not live:
        kinds = [k for k in kinds if k not in ("run", "idle", "crash", "twin", "zombie", "record")]
    if not kinds:
        return ["start", rng.randint(2, 4)]
    kind = rng.choices(kinds, [WEIGHTS[k] for k in kinds])[0]
    qi = rng.choice(live) if live else 0
    q = world.queries[qi]
    todo = [g for g in range(q.groups) if g not in q.done]
    g = rng.choice(todo) if todo and rng.random() < 0.85 else rng.randrange(q.groups)
    free = [x for x in range(spec.workers) if not world.busy(x)]
    w = rng.choice(free)
    other = rng.choice([x for x in free if x != w] or [w])
    if kind == "idle":
        idle = [x for x in todo if world.idle(q, x)]
        return ["idle", qi, rng.choice(idle)] if idle else ["run", qi, g, w]
    if kind == "run":
        return ["run", qi, g, w]
    if kind == "crash":
        return ["run", qi, g, w, rng.choice(["s3", "ddb", "local"])]
    if kind == "twin":
        return ["twin", qi, g, w, other]
    if kind == "zombie":
        return ["zombie", qi, g, w]
    if kind == "resume":
        return ["resume"]
    if kind == "record":
        ready = [i for i in live if len(world.queries[i].done) >= world.queries[i].groups]
        if ready:
            return ["record", rng.choice(ready)]
        return ["run", qi, g, w]
    if kind == "start":
        return ["start", rng.randint(2, 4)]
    if kind == "restart":
        return ["restart", qi, rng.random() < 0.5]
    if kind == "wipe":
        return ["wipe", w]
    if kind == "move":
        return ["move", w, other]
    if kind == "rollback":
        return ["rollback", rng.randrange(max(1, min(4, len(world.lineage))))]
    if kind == "rollback_unrecorded":
        return ["rollback_unrecorded", rng.randrange(len(world.queries))]
    if kind == "gc":
        return ["gc", True]
    if kind == "reslice":
        return ["reslice", rng.choice([x for x in (4, 8, 16) if x != spec.slices])]
    if kind == "restore":
        return ["restore", rng.randrange(max(1, len(world.lineage))), rng.randrange(spec.slices)]
    raise AssertionError(kind)


def run_once(
    seed: int,
    run: int,
    settings: Settings,
    steps: list[Step] | None = None,
    root: Path | None = None,
) -> RunResult:
    """One run: the given steps (a replay), or random ones; then the clean finish."""
    started = time.perf_counter()
    inputs = make_input(
        random.Random(f"input:{seed}:{run}"), settings.spec, random.Random(f"peeks:{seed}:{run}")
    )
    rng = random.Random(f"steps:{seed}:{run}")
    with tempfile.TemporaryDirectory(prefix="protocol-", dir=root) as tmp:
        world = World(settings.spec, inputs, Path(tmp))
        done: list[Step] = []
        result = RunResult(run, done, world.outcomes, 0)
        try:
            todo = list(steps) if steps is not None else None
            while True:
                if todo is not None:
                    if not todo:
                        break
                    step = todo.pop(0)
                elif len(done) >= settings.max_steps:
                    break
                else:
                    step = choose(rng, world, settings)
                done.append(step)
                said = world.step(step)
                world.outcomes.append(said)
                if said != "skip":
                    world.check()
            world.finish(random.Random(f"finish:{seed}:{run}").randint(2, 4), 0)
        except Violation as v:
            result.violation = v
        except Exception as exc:  # noqa: BLE001 - an unexpected error is a finding too
            result.violation = Violation("unexpected_error", f"{type(exc).__name__}: {exc}"[:500])
            log.debug("run %s: unexpected error", run, exc_info=True)
        finally:
            world.close()
        result.refused = world.refused
    result.seconds = time.perf_counter() - started
    return result


def shrink(
    seed: int, run: int, settings: Settings, failing: RunResult, budget_s: float
) -> list[Step]:
    """The shortest step list found that breaks the same invariant (greedy deletes)."""
    assert failing.violation is not None
    want = failing.violation.invariant
    best = list(failing.steps)
    deadline = time.monotonic() + budget_s
    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        i = len(best) - 1
        while i >= 0 and time.monotonic() < deadline:
            candidate = best[:i] + best[i + 1 :]
            again = run_once(seed, run, settings, candidate)
            if again.violation is not None and again.violation.invariant == want:
                best = again.steps  # a replay stops at the violating step
                changed = True
                i = min(i, len(best))
            i -= 1
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--first-run", type=int, default=0, help="index of the first run")
    parser.add_argument("--run", type=int, help="with --replay: the run index it came from")
    parser.add_argument("--replay", help="a JSON step list (or a `details` entry) to replay")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--slices", type=int, default=8)
    parser.add_argument("--no-timers", action="store_true", help="a handler without timers")
    parser.add_argument(
        "--commit-format",
        choices=("heads", "chains"),
        default="chains",
        help="how the runtime commits (docs/design/group-commits.md)",
    )
    parser.add_argument(
        "--chain-length",
        type=int,
        default=Spec().chain_length,
        help="positions before a chain rolls over (a roll-over reads every head again)",
    )
    parser.add_argument("--kinds", help=f"comma-separated step kinds (default all: {KINDS})")
    parser.add_argument("--without", help="comma-separated step kinds to leave out")
    parser.add_argument("--ci", action="store_true", help="the CI slice's mix (CI_KINDS)")
    parser.add_argument("--budget-s", type=float, default=0, help="stop starting runs after")
    parser.add_argument("--shrink-s", type=float, default=120, help="per violation class")
    parser.add_argument(
        "--jobs", type=int, default=1, help="campaigns in parallel, each with its own moto server"
    )
    parser.add_argument("--stride", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="print each run's steps")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    kinds = tuple(args.kinds.split(",")) if args.kinds else CI_KINDS if args.ci else KINDS
    if args.without:
        kinds = tuple(k for k in kinds if k not in args.without.split(","))
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown step kinds {sorted(unknown)}; known: {KINDS}")
    settings = Settings(
        replace(
            Spec(),
            slices=args.slices,
            timers=not args.no_timers,
            commit_format=args.commit_format,
            chain_length=args.chain_length,
        ),
        args.max_steps,
        kinds,
    )
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.jobs > 1 and args.replay:
        parser.error("--jobs is for campaigns, not --replay")
    emulators = None
    if args.jobs > 1:
        report = parallel(args, argv if argv is not None else sys.argv[1:])
    elif not os.environ.get("AWS_ENDPOINT_URL_S3"):
        from shardless.processor.local import emulators as local_aws

        emulators = local_aws.start("kinesalite")
        emulators.apply_env()
    if args.jobs == 1:
        try:
            report = replay(args, settings) if args.replay else campaign(args, settings)
        finally:
            if emulators is not None:
                emulators.stop()
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"seed {report['seed']}: {report['runs']} runs, {report['steps']} steps, "
            f"{report['violations']} violations, {report['refused']} refused, "
            f"{report['seconds']} s"
        )
        for d in report["details"]:
            print(
                f"  run {d['run']}: {d['invariant']}: {d['message']}\n    {json.dumps(d['steps'])}"
            )
    return 0 if report["violations"] == 0 else 1


def replay(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    given = json.loads(args.replay)
    seed, run = args.seed, args.run or 0
    if isinstance(given, dict):
        seed, run, given = given["seed"], given["run"], given["steps"]
    r = run_once(seed, run, settings, given)
    details = []
    if r.violation is not None:
        details.append(detail(seed, r, r.steps))
    return {
        "seed": seed,
        "runs": 1,
        "steps": len(r.steps),
        "violations": len(details),
        "refused": r.refused,
        "seconds": round(r.seconds, 2),
        "details": details,
        "outcomes": [[s, o] for s, o in zip(r.steps, r.outcomes, strict=False)],
    }


def detail(seed: int, r: RunResult, steps: list[Step]) -> dict[str, Any]:
    assert r.violation is not None
    return {
        "seed": seed,
        "run": r.run,
        "invariant": r.violation.invariant,
        "message": r.violation.message,
        "steps": steps,
    }


def campaign(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    started = time.monotonic()
    runs = steps = refused = violations = 0
    details: list[dict[str, Any]] = []
    shrunk: set[str] = set()
    by_class: dict[str, int] = {}
    for run in range(args.first_run, args.first_run + args.runs, args.stride):
        if args.budget_s and time.monotonic() - started > args.budget_s:
            break
        r = run_once(args.seed, run, settings)
        runs += 1
        steps += len(r.steps)
        refused += r.refused
        if args.verbose:
            print(run, json.dumps(r.steps), r.outcomes, file=sys.stderr)
        print(
            f"run {run}: {len(r.steps)} steps, {r.seconds:.1f} s"
            + (f", {r.violation}" if r.violation else ""),
            file=sys.stderr,
            flush=True,
        )
        if r.violation is None:
            continue
        violations += 1
        name = r.violation.invariant
        by_class[name] = by_class.get(name, 0) + 1
        if name in shrunk:
            continue  # one shortest list per violation class
        shrunk.add(name)
        best = shrink(args.seed, run, settings, r, args.shrink_s) if args.shrink_s else r.steps
        again = run_once(args.seed, run, settings, best)
        details.append(detail(args.seed, again if again.violation else r, best))
        print(f"  shrunk: {json.dumps(details[-1])}", file=sys.stderr, flush=True)
    return {
        "seed": args.seed,
        "runs": runs,
        "steps": steps,
        "violations": violations,
        "refused": refused,
        "by_invariant": by_class,
        "kinds": list(settings.kinds),
        "seconds": round(time.monotonic() - started, 1),
        "details": details,
    }


def parallel(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """`--jobs J`: J campaigns in child processes, each with its own moto server (the
    server, not this process, is the bottleneck), job j taking runs first+j, first+j+J, ...
    The merged report is the one a single campaign over the same runs would give."""
    rest: list[str] = []
    skip = False
    for a in argv:  # drop --jobs/--json/--first-run from the children's arguments
        if skip:
            skip = False
            continue
        if a in ("--jobs", "--first-run"):
            skip = True
            continue
        if a.startswith(("--jobs=", "--first-run=")) or a == "--json":
            continue
        rest.append(a)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    started = time.monotonic()
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.protocol", *rest, "--json"]
            + ["--first-run", str(args.first_run + j), "--stride", str(args.jobs)]
            + ["--runs", str(max(0, args.runs - j))],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for j in range(args.jobs)
    ]
    reports = []
    for child in children:
        out, _ = child.communicate()
        lines = out.strip().splitlines()
        if not lines:
            raise SystemExit(f"a protocol campaign exited {child.returncode} without a report")
        reports.append(json.loads(lines[-1]))
    by_class: dict[str, int] = {}
    for r in reports:
        for name, n in r["by_invariant"].items():
            by_class[name] = by_class.get(name, 0) + n
    return {
        "seed": args.seed,
        "runs": sum(r["runs"] for r in reports),
        "steps": sum(r["steps"] for r in reports),
        "violations": sum(r["violations"] for r in reports),
        "refused": sum(r["refused"] for r in reports),
        "by_invariant": by_class,
        "kinds": reports[0]["kinds"],
        "jobs": args.jobs,
        "seconds": round(time.monotonic() - started, 1),
        "details": [d for r in reports for d in r["details"]],
    }


if __name__ == "__main__":
    sys.exit(main())
