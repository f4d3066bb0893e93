"""A preloaded parent that forks group owner processes: one per host environment, it has
the owner's modules imported, and each new owner is a fork of it.

An owner started as a new interpreter pays its imports (pandas, boto3, the runtime: about
0.9 s of CPU) on the first batch of every application on every executor, and again where
a group moves. The zygote pays them once per watched process (the executor's PySpark
daemon). It runs no Python thread and makes no clients, so a fork of it is as clean as a
new interpreter. It is named for the interpreter, environment and working directory a worker
would start the owner with, so a child runs exactly where a new interpreter would. Each
child starts a session of its own, closes the zygote's sockets and writes to its own log.
The zygote exits once its watched process is gone, or after the idle time without a
request. Linux only, as owners are (abstract Unix sockets)."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from shardless.processor.errors import ProcessorError
from shardless.processor.runtime.process import (
    accepted,
    listening,
    log_tail,
    peer_uid,
    spawn_detached,
)

log = logging.getLogger(__name__)


class ZygoteError(ProcessorError):
    """The zygote could not be started or did not fork the process asked for."""


def address(spawn: list[str], env: dict[str, str], watch: int) -> str:
    """The zygote's socket name (without the abstract namespace's leading NUL): one per
    user, interpreter, environment, working directory and watched process."""
    where = json.dumps([os.getuid(), spawn, sorted(env.items()), os.getcwd(), watch])
    return f"shardless-zygote-{hashlib.sha1(where.encode()).hexdigest()[:24]}"


def _connect(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + name)
        if peer_uid(sock) != os.getuid():
            raise ZygoteError(
                f"the process at the zygote socket {name!r} runs as uid {peer_uid(sock)}, "
                f"not as this process's uid {os.getuid()}: refused"
            )
    except (OSError, ZygoteError):
        sock.close()
        raise
    return sock


def _spawn(
    spawn: list[str], name: str, env: dict[str, str], watch: int, idle: float, logs: Path
) -> subprocess.Popen:
    return spawn_detached([*spawn, name, str(watch), str(idle)], env, logs)


def fork(
    spawn: list[str],
    env: dict[str, str],
    watch: int,
    idle_seconds: float,
    args: list[str],
    logs: Path,
    timeout: float,
) -> int:
    """Fork a child that runs the zygote's target with `args`, writing to `logs`; its pid.
    The zygote for `spawn` (the command that starts one, given its name, watched pid and
    idle seconds), `env` and `watch` is started first if none answers, logging to `logs`."""
    name = address(spawn, env, watch)
    deadline = time.monotonic() + timeout
    started: subprocess.Popen | None = None
    while True:
        try:
            sock = _connect(name)
        except (ConnectionRefusedError, FileNotFoundError):
            sock = None
        if sock is not None:
            try:
                return _request(sock, {"args": args, "log": str(logs)}, deadline)
            except (OSError, EOFError) as exc:
                # a zygote that was exiting (idle, or its watched process gone) as we
                # connected: start another (unless ours is still starting), until the deadline
                if time.monotonic() > deadline:
                    raise ZygoteError(
                        f"the zygote {name} forked nothing in {timeout:.0f} s ({exc}); its "
                        f"log, {logs}:\n{log_tail(logs)}"
                    ) from exc
                if started is not None and started.poll() is not None:
                    started = None
                time.sleep(0.05)
                continue
        if started is None:
            started = _spawn(spawn, name, env, watch, idle_seconds, logs)
        elif started.poll() not in (None, 0) or time.monotonic() > deadline:
            code = started.poll()
            if code is None:
                started.kill()
            raise ZygoteError(
                f"the zygote did not start (exit code {code}, {timeout:.0f} s allowed); its "
                f"log, {logs}:\n{log_tail(logs)}"
            )
        time.sleep(0.005)


def _request(sock: socket.socket, request: dict, deadline: float) -> int:
    with sock, sock.makefile("rwb") as stream:
        stream.write(json.dumps(request).encode() + b"\n")
        stream.flush()
        sock.settimeout(max(1.0, deadline - time.monotonic()))
        line = stream.readline()
    if not line:
        raise EOFError("the zygote closed the connection without an answer")
    reply = json.loads(line)
    if "pid" not in reply:
        raise ZygoteError(f"the zygote could not fork: {reply}")
    return int(reply["pid"])


# The zygote's side.


def _child(
    closing: list[socket.socket], logs: str, target: Callable[[list[str]], int], args: list[str]
) -> None:
    """In the forked child: a session and stdio of its own, then `target`; never returns."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sock in closing:
            sock.close()
        out = os.open(logs, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        code = target(args)
    except BaseException:  # noqa: BLE001 - whatever happens, the child must not return
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def serve(
    name: str,
    watch: int,
    idle_seconds: float,
    preload: Callable[[], None],
    target: Callable[[list[str]], int],
) -> int:
    """Bind `name`, import what `preload` imports, then fork a child running `target` for
    each request, until idle for `idle_seconds` or `watch` is gone."""
    listener = listening(name, "zygote")  # requests wait in its backlog during the imports
    if listener is None:
        return 0
    preload()
    # A fork keeps only the forking thread: a Python thread started by an import would be
    # lost with whatever it held. (The native pools of OpenBLAS and jemalloc, which numpy
    # and pyarrow start, stop and restart themselves around a fork.)
    if threading.active_count() != 1:
        names = [t.name for t in threading.enumerate()]
        log.error("Python threads %s after the imports: a fork would lose them; exiting", names)
        return 1
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped as they exit
    gc.freeze()  # the children's collections leave the zygote's objects (and pages) alone
    log.info("zygote %s (pid %s) watching pid %s", name, os.getpid(), watch)
    with listener:
        for conn in accepted(listener, watch, idle_seconds):
            _answer(conn, listener, target)
    return 0


def _read_line(sock: socket.socket, limit: int = 1 << 16) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk or len(data) > limit:
            raise ValueError(f"a request of {len(data)} bytes without its end")
        data += chunk
    return data


def _answer(
    conn: socket.socket, listener: socket.socket, target: Callable[[list[str]], int]
) -> None:
    conn.settimeout(10.0)
    try:
        if peer_uid(conn) != os.getuid():
            log.warning("a connection from uid %s refused", peer_uid(conn))
            return
        request = json.loads(_read_line(conn))
        sys.stdout.flush()  # nothing of the zygote's buffered output goes to a child's log
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child([conn, listener], request["log"], target, list(request["args"]))
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("a request broke off: %s", exc)
