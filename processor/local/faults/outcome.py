"""What one schedule's run shares and records.

`Env` is what every schedule shares (emulators, the two fault proxies, a folder);
`Checkpoint` one of a schedule's queries; `Outcome` everything that happened in a run,
which the runner fills in and `bench.faults` reports.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardless.processor.driver.config import JobConfig
from shardless.processor.local.faults import check, procs
from shardless.processor.local.faults.driver import Driver
from shardless.processor.local.faults.fault_proxy import FaultProxy
from shardless.processor.local.faults.schedule import Schedule


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
    commit_format: str = "chains"  # JobConfig.commit_format of every query
    chain_length: int = 0  # and its chain_length (0: the default rule)


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


def now(outcome: Outcome) -> float:
    """Seconds since the schedule started."""
    return round(time.monotonic() - outcome.started, 2)
