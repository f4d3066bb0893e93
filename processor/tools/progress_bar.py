"""Progress of long state commands on a terminal: done/total, rate and time left.

Drawn on stderr only when it is a terminal and the command is not printing `--json`;
otherwise silent, so scripts get clean output.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def render(
    label: str, done: int, total: int, elapsed: float, unit: str, nbytes: int = 0, width: int = 24
) -> str:
    """One line: `label [####....] done/total unit  rate  MB/s  ETA h:mm:ss`."""
    frac = done / total if total else 1.0
    filled = int(round(frac * width))
    bar = "#" * filled + "." * (width - filled)
    rate = done / elapsed if elapsed > 0 else 0.0
    left = (total - done) / rate if rate > 0 else float("nan")
    parts = [f"{label} [{bar}] {done}/{total} {unit}", f"{rate:.1f} {unit}/s"]
    if nbytes:
        parts.append(f"{nbytes / 1e6 / elapsed if elapsed > 0 else 0.0:.1f} MB/s")
    parts.append(f"ETA {_clock(left)}" if left == left else "ETA ?")
    return "  ".join(parts)


class Bar:
    """A thread-safe progress bar; `enabled=None` means "if the stream is a terminal"."""

    def __init__(
        self,
        label: str,
        total: int,
        unit: str = "slices",
        *,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        every_s: float = 0.2,
    ) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.every_s = every_s
        self.done = 0
        self.bytes = 0
        self.started = time.monotonic()
        self._drawn = 0.0
        self._lock = threading.Lock()

    def update(self, done: int | None = None, nbytes: int = 0) -> None:
        with self._lock:
            self.done = self.done + 1 if done is None else done
            self.bytes += nbytes
            now = time.monotonic()
            if self.enabled and (now - self._drawn >= self.every_s or self.done >= self.total):
                self._drawn = now
                line = render(
                    self.label, self.done, self.total, now - self.started, self.unit, self.bytes
                )
                self.stream.write("\r" + line)
                self.stream.flush()

    def callback(self, done: int, total: int) -> None:
        """For functions that report `(done, total)`."""
        self.total = total
        self.update(done)

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
