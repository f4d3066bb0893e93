"""The zygote owners are forked from (`shardless.processor.runtime.zygote`): real processes
over abstract Unix sockets, with a small target in place of an owner."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardless.processor.runtime import process, zygote

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

SCRIPT = """\
import gc, os, sys, threading, time
from shardless.processor.runtime import zygote

def preload():
    import json  # noqa: F401
    if os.environ.get("ZYGOTE_TEST_THREAD"):
        threading.Thread(target=time.sleep, args=(60,), name="left-running", daemon=True).start()

def target(args):
    print("child", os.getpid(), "of", os.getppid(), "args", args, flush=True)
    print("frozen", gc.get_freeze_count(), flush=True)
    time.sleep(float(args[0]))
    return 0

name, watch, idle = sys.argv[1:]
sys.exit(zygote.serve(name, int(watch), float(idle), preload, target))
"""
SPAWN = [sys.executable, "-c", SCRIPT]


def _ppid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no PPid for {pid}")


def _ignored(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigIgn for {pid}")


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def forked():
    """fork() with the test script; every child and zygote is killed afterwards."""
    pids: list[int] = []
    started_before = set(process._detached)

    def fork(log: Path, seconds: float = 30, env: dict | None = None, watch: int | None = None):
        pid = zygote.fork(
            SPAWN, dict(os.environ if env is None else env),
            os.getpid() if watch is None else watch, 30, [str(seconds)], log, timeout=30,
        )  # fmt: skip
        pids.append(pid)
        # a child that exits at once may be reaped before its parent can be read from /proc;
        # the zygotes this process started are killed below in any case
        with contextlib.suppress(FileNotFoundError):
            pids.append(_ppid(pid))
        return pid

    yield fork
    for pid in pids + list(set(process._detached) - started_before):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _log_has(path: Path, text: str, within: float = 10.0) -> str:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = path.read_text() if path.exists() else ""
        if text in found:
            return found
        time.sleep(0.02)
    raise AssertionError(f"{text!r} not in {path}: {found!r}")


def test_children_are_forks_of_one_zygote_each_in_a_session_and_log_of_its_own(forked, tmp_path):
    a, b = forked(tmp_path / "a.log"), forked(tmp_path / "b.log")
    assert a != b and _ppid(a) == _ppid(b) != os.getpid()
    z = _ppid(a)
    assert "zygote.serve" in Path(f"/proc/{z}/cmdline").read_text()
    assert f"child {a} of {z} args ['30']" in _log_has(tmp_path / "a.log", f"child {a}")
    text = _log_has(tmp_path / "b.log", f"child {b}")
    assert os.getsid(a) == a and os.getsid(b) == b  # not the zygote's session
    # the zygote's objects are frozen: a child's collections do not copy their pages
    frozen = _log_has(tmp_path / "b.log", "frozen").split("frozen ")[1].split()[0]
    assert int(frozen) > 1000
    # the zygote ignores SIGCHLD to reap its children; a child waits for its own again
    assert not _ignored(z) & _ignored(a) & (1 << (signal.SIGCHLD - 1))
    assert _ignored(z) & (1 << (signal.SIGCHLD - 1))
    assert f"child {a}" not in text and "zygote" not in text  # the zygote logs to a.log


def test_another_environment_or_watched_process_gets_another_zygote(forked, tmp_path):
    base = forked(tmp_path / "a.log")
    other_env = forked(tmp_path / "b.log", env={**os.environ, "SHARDLESS_TEST_EXTRA": "1"})
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        other_watch = forked(tmp_path / "c.log", watch=watched.pid)
        assert len({_ppid(base), _ppid(other_env), _ppid(other_watch)}) == 3
        assert b"SHARDLESS_TEST_EXTRA=1" in Path(f"/proc/{other_env}/environ").read_bytes()
        z = _ppid(other_watch)
    finally:
        watched.kill()
        watched.wait()
    assert _gone(z), "the zygote outlived the process it watched"


def test_a_child_keeps_none_of_the_zygotes_sockets(forked, tmp_path):
    """With the zygote killed, its name no longer answers although its child runs: the
    child closed the listening socket it inherited. The next fork starts a new zygote."""
    child = forked(tmp_path / "a.log")
    _log_has(tmp_path / "a.log", f"child {child}")  # it runs its target: its setup is done
    z = _ppid(child)
    os.kill(z, signal.SIGKILL)
    assert _gone(z)
    name = zygote.address(SPAWN, dict(os.environ), os.getpid())
    with pytest.raises(ConnectionRefusedError):
        zygote._connect(name)
    assert not _gone(child, within=0.2)
    again = forked(tmp_path / "b.log")
    assert _ppid(again) not in (z, 1) and _ppid(again) != _ppid(child)


def test_children_are_reaped_as_they_exit(forked, tmp_path):
    child = forked(tmp_path / "a.log", seconds=0)
    assert _gone(child)
    assert not Path(f"/proc/{child}").exists(), "a zombie: the zygote did not reap it"


def test_requesters_starting_the_zygote_at_once_share_one(forked, tmp_path):
    pids: list[int] = []
    threads = [
        threading.Thread(target=lambda i=i: pids.append(forked(tmp_path / f"{i}.log")))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(pids) == 4 and len({_ppid(p) for p in pids}) == 1


def test_a_zygote_whose_imports_start_a_thread_refuses_to_fork(tmp_path):
    env = {**os.environ, "ZYGOTE_TEST_THREAD": "1"}
    with pytest.raises(
        zygote.ZygoteError, match=r"(?s)did not start \(exit code 1.*'left-running'"
    ):
        zygote.fork(SPAWN, env, os.getpid(), 30, ["1"], tmp_path / "a.log", timeout=30)


def test_a_requester_that_meets_a_zygote_going_away_waits_and_starts_one(
    forked, tmp_path, monkeypatch
):
    """A zygote that hangs up without forking (it was exiting as the request came) is
    asked again 50 ms later, not answered with a new zygote every few milliseconds; once
    its name is free, one zygote is started and forks."""
    name = zygote.address(SPAWN, dict(os.environ), os.getpid())
    going = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    going.bind("\0" + name)
    going.listen(8)
    going.settimeout(0.02)
    hung_up = []

    def hang_up() -> None:
        end = time.monotonic() + 0.4
        while time.monotonic() < end:
            try:
                conn, _ = going.accept()
            except TimeoutError:
                continue
            conn.close()
            hung_up.append(1)
        going.close()

    spawned = []
    real = zygote._spawn
    monkeypatch.setattr(zygote, "_spawn", lambda *a: spawned.append(a) or real(*a))
    thread = threading.Thread(target=hang_up)
    thread.start()
    child = forked(tmp_path / "a.log")
    thread.join()
    assert 1 <= len(hung_up) <= 12 and len(spawned) == 1  # 23 asked every 5 ms
    assert "zygote.serve" in Path(f"/proc/{_ppid(child)}/cmdline").read_text()
