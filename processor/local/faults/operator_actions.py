"""The operator's actions in a schedule: `shardless state` tools and new queries.

A takeover, regroup or rollback starts a NEW checkpoint at COMMITTED (`new_query`);
`state gc --delete` runs beside the job (`gc_running`) and, with no grace, after the run
(`gc_after`). The tools talk to the emulators directly, not through the fault proxies.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from shardless.processor.driver import progress
from shardless.processor.local.faults import events
from shardless.processor.local.faults.driver import REPO, Driver, running_batch
from shardless.processor.local.faults.job import USERS, new_checkpoint, start_driver
from shardless.processor.local.faults.outcome import Env, Outcome, now
from shardless.processor.local.faults.schedule import GC_RUNNING, REGROUP, TAKEOVER, Fault

TOOL_TIMEOUT_S = 300


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
        {"args": list(args), "exit": proc.returncode, "at": now(outcome), "output": out[-600:]}
    )
    return proc.returncode, out


def gc_running(env: Env, outcome: Outcome) -> None:
    """`state gc --delete` with the default grace while the driver runs: must succeed."""
    code, out = _tool(env, outcome, "gc", "--app", outcome.app, "--delete", "--json")
    entry: dict[str, Any] = {"kind": GC_RUNNING, "exit": code, "at": now(outcome)}
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


def gc_after(env: Env, outcome: Outcome) -> None:
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


def new_query(
    env: Env, driver: Driver, fault: Fault, produced: int, rng: random.Random, outcome: Outcome
) -> tuple[Driver, int]:
    """A takeover, regroup or rollback: a NEW checkpoint at COMMITTED, started."""
    cp = outcome.current
    entry: dict[str, Any] = {"kind": fault.kind, "from_query": cp.n, "at": now(outcome)}
    if fault.kind == TAKEOVER:
        produced = events.produce(
            env.kinesis, cp.cfg.streams[0], produced, outcome.schedule.more_events, USERS, rng
        )
        new = new_checkpoint(outcome, cp.cfg.groups, TAKEOVER)
        started = start_driver(env, outcome)
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
    new = new_checkpoint(outcome, groups, fault.kind)
    entry["to_query"] = new.n
    outcome.happened[fault.kind] += 1
    outcome.faults.append(entry)
    return start_driver(env, outcome), produced


def _rollback(env: Env, fault: Fault, outcome: Outcome) -> dict[str, Any]:
    """`state rollback --apply` to a batch `fault.back` before the newest recorded one
    (or the nearest earlier one with a progress record). A target older than a slice's
    retained history is refused by the tool, rightly: the next later recorded batch is
    tried, and the newest one always can be."""
    loc = outcome.current.cfg.location
    latest = progress.latest(loc)
    if latest is None:
        return {"rollback": "no progress record yet: nothing to roll back to"}
    query, newest = latest["query"], latest["batch"]
    target = max(newest - fault.back, 0)
    while target > 0 and progress.at_batch(loc, query, target) is None:
        target -= 1
    candidates = [b for b in range(target, newest + 1) if progress.at_batch(loc, query, b)]
    done: dict[str, Any] = {"query": query[:8], "latest": newest, "beyond_retention": []}
    for batch in candidates or [newest]:
        code, out = _tool(
            env, outcome, "rollback", "--app", outcome.app, "--query", query,
            "--batch", str(batch), "--apply", "--force", "--json",
        )  # fmt: skip
        done |= {"to_batch": batch, "exit": code}
        if code == 2 and "no longer retained" in out:
            done["beyond_retention"].append(batch)
            continue
        if code == 0:
            with contextlib.suppress(ValueError, IndexError):
                done["moved"] = json.loads(out.splitlines()[-1]).get("moved")
        else:
            outcome.problems.append(f"rollback to batch {batch} exited {code}: {out[-400:]}")
        return done
    outcome.problems.append(f"rollback: even batch {newest}, the newest, is beyond retention")
    return done
