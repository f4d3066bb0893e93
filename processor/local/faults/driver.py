"""One `shardless run` driver as a subprocess: start it, follow its batch reports, kill it.

The driver logs one line per batch at INFO (`shardless.processor.driver.job: batch {...}`, the
`BatchReport.summary()` JSON). The subprocess gets a session of its own, so a kill -9 of
its process group takes the driver, its JVM and the executor JVMs at once; the pyspark
daemons and their workers (their own groups) are killed by pid from a snapshot of the tree
taken just before.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardless.processor.local.faults import procs

REPO = Path(__file__).resolve().parents[3]
_BATCH_LINE = re.compile(r"shardless\.processor\.driver\.job: batch (\{.*\})\s*$")


@dataclass
class Driver:
    """A running (or finished) driver; `reports` are its batch reports in log order."""

    args: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    reports: list[dict[str, Any]] = field(default_factory=list)
    killed: bool = False
    kill_marks: list[int] = field(default_factory=list)  # reports seen at each executor kill
    query_no: int = 1  # which of the schedule's checkpoints (queries) it runs, from 1
    first_report_at: float | None = None  # time.monotonic() when its first report was read
    # what runs `args` (default `python -m shardless.processor.cli run`; e.g. spark-submit)
    command: list[str] | None = None
    cwd: Path = REPO
    _offset: int = 0
    _partial: str = ""

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    *(self.command or [sys.executable, "-m", "shardless.processor.cli", "run"]),
                    *self.args,
                ],
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def poll(self) -> int | None:
        """Read new batch reports from the log; the exit code once the driver has ended."""
        code = None if self.proc is None else self.proc.poll()
        with self.log_path.open("rb") as log:
            log.seek(self._offset)
            data = log.read()
        self._offset += len(data)
        lines = (self._partial + data.decode(errors="replace")).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if m := _BATCH_LINE.search(line):
                self.reports.append(json.loads(m.group(1)))
                if self.first_report_at is None:
                    self.first_report_at = time.monotonic()
        return code

    def wait_for_batch(self, batch_id: int, timeout_s: float) -> bool:
        """Wait until the driver reports `batch_id` (True) or ends or times out (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.poll()
            if any(r["batch_id"] >= batch_id for r in self.reports):
                return True
            if code is not None:
                return False
            time.sleep(0.1)
        return False

    def wait(self, timeout_s: float) -> int | None:
        """Wait for the driver to end; its exit code, or None on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.poll()
            if code is not None:
                return code
            time.sleep(0.2)
        return None

    def kill(self) -> int:
        """kill -9 the driver and everything under it; returns how many processes died."""
        if self.proc is None or self.proc.poll() is not None:
            return 0
        tree = procs.descendants(self.pid)
        root = procs.read(self.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)  # the session we started: driver, JVMs
        hit = procs.kill9([p for p in [root, *tree] if p is not None])
        self.proc.wait(timeout=30)
        self.killed = True
        self.poll()
        return max(len(hit), 1)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def in_batch(self, checkpoint: str) -> int | None:
        """The batch Spark is running now, from the checkpoint (planned but not committed)."""
        return running_batch(Path(checkpoint))


def running_batch(checkpoint: Path) -> int | None:
    def ids(sub: str) -> list[int]:
        folder = checkpoint / sub
        if not folder.is_dir():
            return []
        return [int(p.name) for p in folder.iterdir() if p.name.isdigit()]

    planned, committed = ids("offsets"), ids("commits")
    if planned and max(planned) > max(committed, default=-1):
        return max(planned)
    return None
