"""The helpers of `shardless.processor.runtime.process` that start and track the helper
processes (owners and zygotes) a worker starts: real processes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardless.processor.runtime import process

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def _zombie(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return True
        time.sleep(0.02)
    return False


def test_a_started_helper_is_tracked_until_a_later_start_reaps_it(tmp_path):
    first = process.spawn_detached([sys.executable, "-c", ""], {}, tmp_path / "a.log")
    assert process.detached(first.pid) is first
    assert _zombie(first.pid)  # exited, not yet waited for
    second = process.spawn_detached([sys.executable, "-c", ""], {}, tmp_path / "b.log")
    assert process.detached(first.pid) is None and first.returncode == 0
    assert not Path(f"/proc/{first.pid}").exists()  # reaped, no zombie left
    assert process.detached(second.pid) is second
    second.wait()


def test_threads_starting_helpers_at_once_keep_the_record_whole(tmp_path, monkeypatch):
    """Owners and zygotes may be started from several threads at once: each start reaps
    the exited helpers it finds and records its own, and none fails because another
    thread reaped one first (a `ValueError` from the zygote's list did, once in 14 runs).
    Polling an exited, unwaited child waits for it, which lets other threads run; five
    rounds with threads switching as often as they can make a race show."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(5):
            _start_at_once(tmp_path, monkeypatch)
    finally:
        sys.setswitchinterval(switch)


def _start_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exited = [subprocess.Popen(["true"]) for _ in range(150)]
    for p in exited:
        assert _zombie(p.pid)
    monkeypatch.setattr(process, "_detached", {p.pid: p for p in exited})
    ready = threading.Barrier(8)
    failed: list[BaseException] = []
    started: list[subprocess.Popen] = []

    def start(i: int) -> None:
        ready.wait()
        try:
            started.append(process.spawn_detached(["true"], {}, tmp_path / f"{i}.log"))
        except BaseException as exc:  # noqa: BLE001 - the test reports it below
            failed.append(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in started:
        p.wait()
    assert failed == []
    assert len(started) == 8
    assert not set(process._detached) & {p.pid for p in exited}  # every exited one reaped
    assert {p.pid for p in started} >= set(process._detached)
    assert all(p.returncode == 0 for p in exited)
