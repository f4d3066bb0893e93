"""Group owner processes: one long-lived process per group and host runs the group's
batches and keeps its slice stores open, whichever Python worker Spark hands the group.

With several Python workers per executor (`local[*]`, `spark.executor.cores` > 1), Spark
gives a task any idle worker, so a group changes worker from batch to batch and each move
costs a catch-up of every slice of the group (or, the first time a worker gets the group,
a rebuild). With `--group-owner process` the worker only carries the group's records to
its owner and the results back: the owner is the same process every batch on that host.

This module is the worker's side: it finds the owner at an abstract Unix socket named for the
local directory, the application and the group (Linux; nothing on disk to go stale). If none
answers, it starts one (`shardless.processor.runtime.owner_process`) as a fork of the zygote
for its own environment and `sys.path` (`shardless.processor.runtime.zygote`), which has the
owner's imports done; when two workers start one at once, the second cannot bind the name and
exits, and both talk to the first. An owner runs one batch at a time, in the order the calls
arrive. It exits after `--owner-idle-seconds` without a call, or within a second of its watched
process (the Python worker's parent: PySpark's daemon, which lives as long as the executor)
going away.

Nothing about correctness depends on it: the owner runs the same `GroupRunner.run` with
the same conditional commits. If it dies during a batch the task fails, Spark runs the
task again, and a new owner adopts the dead one's store directory and catches up; if the
worker dies instead, the owner finishes the batch and its commit is one Spark's re-run
recognises as its own (`shardless.processor.runtime.group_runner`). Each owner logs to
`<local_dir>/<app>/owners/g<group>.log`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardless.processor.errors import ConfigError, ProcessorError
from shardless.processor.runtime import installed_pyspark, zygote
from shardless.processor.runtime.process import (
    detached,
    log_tail,
    peer_uid,
    pid_alive,
    spawn_detached,
)

log = logging.getLogger(__name__)

OWNER_IDLE_SECONDS = 600
STARTUP_SECONDS = 60.0
_HEADER = struct.Struct("!Q")


class OwnerError(ProcessorError):
    """A group's owner process could not be started or did not answer."""


def supported() -> bool:
    """Owner processes need abstract Unix sockets, a Linux feature."""
    return sys.platform.startswith("linux")


def check_supported() -> None:
    if not supported():
        raise ConfigError(
            f"--group-owner process needs Linux (abstract Unix sockets); this is "
            f"{sys.platform}: use --group-owner worker"
        )


def address(local_dir: str, app: str, group: int) -> str:
    """The owner's socket name (without the abstract namespace's leading NUL)."""
    where = f"{Path(local_dir).resolve()}\0{app}".encode()
    return f"shardless-{hashlib.sha1(where).hexdigest()[:24]}-g{group}"


def log_path(local_dir: str, app: str, group: int) -> Path:
    return Path(local_dir) / app / "owners" / f"g{group:05d}.log"


def send_message(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=5)
    sock.sendall(_HEADER.pack(len(data)))
    sock.sendall(data)


def _recv_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def recv_message(sock: socket.socket) -> Any:
    (n,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    return pickle.loads(_recv_exactly(sock, n))


def check_peer(sock: socket.socket, name: str) -> None:
    """Refuse a peer run by another user: an abstract socket has no file permissions, and
    what crosses it is pickled (records one way, code and results the other), so only a
    process of this user may sit at either end."""
    uid = peer_uid(sock)
    if uid != os.getuid():
        raise OwnerError(
            f"the process at the owner socket {name!r} runs as uid {uid}, not as this "
            f"process's uid {os.getuid()}: refused (another user bound the name first?)"
        )


def _connect(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + name)
        check_peer(sock, name)
    except (OSError, OwnerError):
        sock.close()
        raise
    return sock


_OWNER_MODULE = "shardless.processor.runtime.owner_process"
# "0": start each owner as a new interpreter instead of a fork of the zygote (as before
# the zygote; bench.query_start's `spawn` arm measures against it).
ZYGOTE_ENV = "SHARDLESS_OWNER_ZYGOTE"


def start(
    local_dir: str, app: str, group: int, watch: int, idle_seconds: int, timeout: float
) -> int:
    """Start an owner for `group` (it exits at once if another one already answers): a
    fork of this environment's zygote, started first if none answers. The owner's pid."""
    logs = log_path(local_dir, app, group)
    logs.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = installed_pyspark.child_path()  # compiled PySpark, not its zip
    args = [address(local_dir, app, group), str(watch), str(idle_seconds)]
    if os.environ.get(ZYGOTE_ENV, "1") == "0":
        return spawn_detached([sys.executable, "-m", _OWNER_MODULE, *args], env, logs).pid
    spawn = [sys.executable, "-m", _OWNER_MODULE, "zygote"]
    try:
        return zygote.fork(spawn, env, watch, idle_seconds, args, logs, timeout)
    except zygote.ZygoteError as exc:
        raise OwnerError(f"group {group}'s owner process did not start because {exc}") from exc


def _exited(pid: int) -> bool:
    """Whether the owner `pid` has exited (a spawned one is this process's child)."""
    child = detached(pid)
    return child.poll() is not None if child is not None else not pid_alive(pid)


def connect(
    local_dir: str,
    app: str,
    group: int,
    watch: int | None = None,
    idle_seconds: int = OWNER_IDLE_SECONDS,
    timeout: float = STARTUP_SECONDS,
) -> socket.socket:
    """A connection to `group`'s owner on this host, started if none answers. `watch`:
    the process whose end ends the owner (default: this process's parent)."""
    check_supported()
    name = address(local_dir, app, group)
    try:
        return _connect(name)
    except (ConnectionRefusedError, FileNotFoundError):
        pass
    deadline = time.monotonic() + timeout
    child = start(
        local_dir, app, group, os.getppid() if watch is None else watch, idle_seconds, timeout
    )
    while True:
        try:
            return _connect(name)
        except (ConnectionRefusedError, FileNotFoundError):
            pass
        gone = _exited(child)
        if gone or time.monotonic() > deadline:
            try:  # it lost the name to an owner started at once, which answers now
                return _connect(name)
            except (ConnectionRefusedError, FileNotFoundError):
                pass
            if not gone:
                os.kill(child, 9)
            where = log_path(local_dir, app, group)
            why = "it exited" if gone else f"{timeout:.0f} s allowed"
            raise OwnerError(
                f"group {group}'s owner process did not start ({why}); its log, {where}:\n"
                f"{log_tail(where)}"
            )
        time.sleep(0.005)


@dataclass(frozen=True)
class BatchCall:
    """One group's batch for its owner to run: `GroupRunner.run`'s arguments, by name."""

    group: int
    query: str
    batch: int
    pdf: Any  # the group's records (a pandas DataFrame), or None
    pending: dict[int, tuple[int | None, int | None]]
    now_ms: int
    watermark_ms: int
    timings: dict[str, float] = field(default_factory=dict)


def call(
    runner: Any,
    blob: bytes,
    batch_call: BatchCall,
    watch: int | None = None,
) -> Any:
    """Run `batch_call` with `runner` in the owner of its group; `blob` is `runner` pickled
    (the owner keeps the runner it unpickled for later calls with the same blob). Errors
    raised in the owner are raised here."""
    cfg = runner.config
    group, batch = batch_call.group, batch_call.batch
    request = ("run", (hashlib.sha1(blob).digest(), blob, batch_call, time.time()))
    deadline = time.monotonic() + STARTUP_SECONDS
    reruns = 0
    while True:
        sock = connect(cfg.local_dir, cfg.location.app, group, watch, cfg.owner_idle_seconds)
        accepted = None
        try:
            with sock:
                send_message(sock, request)
                accepted = recv_message(sock)[1]  # the owner's pid: it has the batch
                kind, value, text = recv_message(sock)
            break
        except (EOFError, ConnectionError) as exc:
            where = log_path(cfg.local_dir, cfg.location.app, group)
            if accepted is None and time.monotonic() < deadline:
                time.sleep(0.01)  # an owner that was exiting as we connected: start another
                continue
            if accepted is not None and not reruns:
                # It died with the batch. Whatever it committed of it, a re-run recognises as
                # its own, so a new owner may run the batch again here.
                reruns += 1
                log.warning(
                    "group %s batch %s: its owner process %s ended during the batch (%s); "
                    "running it in a new owner. Its log, %s:\n%s",
                    group, batch, accepted, exc, where, log_tail(where),
                )  # fmt: skip
                continue
            raise OwnerError(
                f"group {group}'s owner process ended during batch {batch}"
                f"{' twice' if reruns else ''} ({exc}); Spark runs the task again. Its log, "
                f"{where}:\n{log_tail(where)}"
            ) from exc
    if kind == "ok":
        return value
    if isinstance(value, BaseException):
        raise value
    raise ProcessorError(f"group {group} batch {batch}, in its owner process: {text}")


def _ask(local_dir: str, app: str, group: int, kind: str) -> Any:
    try:
        sock = _connect(address(local_dir, app, group))
    except (ConnectionRefusedError, FileNotFoundError):
        return None
    with sock:
        send_message(sock, (kind, None))
        try:
            return recv_message(sock)[1]
        except (EOFError, ConnectionError):
            return None


def pid(local_dir: str, app: str, group: int) -> int | None:
    """The pid of `group`'s owner on this host, None if none answers."""
    return _ask(local_dir, app, group, "pid")


def stop(local_dir: str, app: str, group: int) -> int | None:
    """Stop `group`'s owner on this host once it is between batches; its pid, None if
    none answered."""
    return _ask(local_dir, app, group, "stop")
