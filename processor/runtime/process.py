"""The Python process a group's batch runs in: the garbage collector paused for the batch,
optional profiling, whether another process is alive, and the accept loop of the helper
processes that live as long as the process they watch. Used by the group runner in a Spark
Python worker, by a group's owner process and by the zygote owners fork from."""

from __future__ import annotations

import contextlib
import cProfile
import gc
import logging
import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

PROFILE_ENV = "SHARDLESS_PROFILE_DIR"

log = logging.getLogger(__name__)


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def accepted(listener: socket.socket, watch: int, idle_seconds: float) -> Iterator[socket.socket]:
    """Connections to `listener`, one at a time (each closed once the caller has answered
    it), until the process `watch` is gone or none came for `idle_seconds` after the last."""
    listener.settimeout(1.0)
    last = time.monotonic()
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if not pid_alive(watch):
                log.info("pid %s is gone: exiting", watch)
                return
            if time.monotonic() - last > idle_seconds:
                log.info("idle for %.0f s: exiting", idle_seconds)
                return
            continue
        with conn:
            yield conn
        last = time.monotonic()


def listening(name: str, what: str) -> socket.socket | None:
    """A socket listening at the abstract Unix name `name`, or None if another `what`
    already holds it (two started at once: the second exits and both callers use the first)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + name)
    except OSError as exc:
        listener.close()
        log.info("another %s already answers at %s (%s): exiting", what, name, exc)
        return None
    listener.listen(64)
    return listener


_detached: dict[int, subprocess.Popen] = {}  # helpers this process started, by pid
_detached_lock = threading.Lock()  # helpers may be started from several threads at once


def spawn_detached(cmd: list[str], env: dict[str, str], logs: Path) -> subprocess.Popen:
    """Start `cmd` in a session of its own, with stdin closed and its output appended to
    `logs`: a helper process that outlives the Spark task that started it. It is kept for
    `detached` until a later start finds it exited and reaps it."""
    with open(logs, "ab") as out:
        child = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    with _detached_lock:  # polling waits for an exited child, which lets other threads run
        for pid in [pid for pid, c in _detached.items() if c.poll() is not None]:
            del _detached[pid]
        _detached[child.pid] = child
    return child


def detached(pid: int) -> subprocess.Popen | None:
    """The helper `pid` if this process started it (`spawn_detached`) and has not reaped it."""
    return _detached.get(pid)


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    _pid, uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return uid


def log_tail(path: Path, lines: int = 20) -> str:
    """The last `lines` of a helper process's log, for an error message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Python's cyclic garbage collector paused for a group's batch.

    A batch allocates a few objects per record that live until its commit (events, the
    transaction's reads and writes), so the collector would run its full pass, over every
    object of a Python worker holding pandas, Arrow and PySpark, several times a batch
    (`docs/benchmarks.md`, "Measurements behind the code"). Reference counting still frees what the
    batch drops; the cycles it leaves wait for the collector's next pass after the batch.
    The objects alive after the first batch (modules, handler, caches) are frozen out of
    later passes."""
    global _frozen
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        if not _frozen:
            gc.collect()
            gc.freeze()
            _frozen = True


_frozen = False


@contextlib.contextmanager
def profiled(group: int, batch: int) -> Iterator[None]:
    """cProfile the block into `$SHARDLESS_PROFILE_DIR/g<group>-b<batch>-p<pid>.prof` when
    that variable is set (in a Python worker or a group's owner process alike)."""
    profile_dir = os.environ.get(PROFILE_ENV)
    if not profile_dir:
        yield
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(f"{profile_dir}/g{group}-b{batch}-p{os.getpid()}.prof")
