"""What a restore is asked for and what it reports: a slice's `RestoreJob`, its
`RestoreOutcome` and `RestoreStats`, the `Progress` logged across slices, and `RestoreWork`, a
job on its way through `restore_many`. Progress lines go to the restore's logger, as
they always have.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shardless.changelog.history import RestorePlan
from shardless.changelog.layout import Head
from shardless.changelog.manifest import Manifest
from shardless.state.store import SliceStore

log = logging.getLogger("shardless.changelog.restore")


@dataclass
class RestoreStats:
    slice: int
    from_version: int
    to_version: int
    snapshot_version: int | None = None
    snapshot_bytes: int = 0
    segments: int = 0
    records: int = 0
    bytes: int = 0
    seconds: float = 0.0
    rolled_back: bool = False
    transfer_process: bool = False  # its snapshot's SST files came through the helper process
    skipped_snapshots: list[int] = field(default_factory=list)  # versions found unusable

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "mb_per_s": round(self.mb_per_s, 2)}


class Progress:
    """Bytes restored across threads, logged with rate and time left every few seconds."""

    def __init__(self, total_bytes: int, slices: int, every_s: float = 2.0) -> None:
        self.total = total_bytes
        self.slices = slices
        self.every_s = every_s
        self.done = 0
        self.slices_done = 0
        self.started = time.monotonic()
        self._last = self.started
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._last < self.every_s:
                return
            self._last = now
        log.info("%s", self.line())

    def slice_done(self) -> None:
        with self._lock:
            self.slices_done += 1

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.done / elapsed
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        return (
            f"restoring {self.slices} slices: {self.slices_done} done, "
            f"{self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB, {rate / 1e6:.1f} MB/s, "
            f"~{left:.0f}s left"
        )


@dataclass
class RestoreJob:
    """One slice to bring to exactly version `target` of `head`, in the directory `path`;
    `store` is the store open there, if any."""

    path: Path
    identity: dict[str, object]
    head: Head | None
    target: int
    store: SliceStore | None = None

    @property
    def slice(self) -> int:
        return int(self.identity["slice"])  # type: ignore[call-overload]


@dataclass
class RestoreOutcome:
    """A job's result: its store at the target version and what it cost, or why it
    failed (its store then closed and its directory removed)."""

    job: RestoreJob
    store: SliceStore | None = None
    stats: RestoreStats | None = None
    error: Exception | None = None


@dataclass(eq=False)
class RestoreWork:
    """A job on its way through `restore_many`."""

    job: RestoreJob
    stats: RestoreStats
    plan: RestorePlan | None = None
    manifest: Future[bytes] | Future[Manifest] | None = None
    files: list[Future[int]] = field(default_factory=list)
    error: Exception | None = None
    done: bool = False
    queued: bool = False  # its snapshot's files are on the transfer pool
    snapshot_open: bool = False  # its snapshot opened as the version it claims
    head: Head | None = None  # the head restored from: the job's, less unusable snapshots

    def __post_init__(self) -> None:
        self.head = self.job.head

    @property
    def where(self) -> str:
        return self.plan.snapshot.key if self.plan and self.plan.snapshot else ""
