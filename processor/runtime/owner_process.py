"""A group's owner process (`shardless.processor.runtime.owner`): it answers its group's
batches at its socket, one at a time, keeping the runner it unpickled and so the group's
open stores from batch to batch.

`python -m shardless.processor.runtime.owner_process zygote NAME WATCH IDLE` runs the zygote
owners are forked from (`shardless.processor.runtime.zygote`): it imports the group runner
and everything a batch needs before its first fork, so an owner starts without imports."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
import time
import traceback
from typing import Any

from shardless.processor.runtime import zygote
from shardless.processor.runtime.owner import (
    OwnerError,
    check_peer,
    recv_message,
    send_message,
)
from shardless.processor.runtime.process import (
    accepted,
    listening,
    no_cycle_collection,
    profiled,
)

log = logging.getLogger(__name__)

_RUNNERS_KEPT = 8


def _reply_error(exc: BaseException) -> tuple[str, Any, str]:
    text = "".join(traceback.format_exception(exc))
    try:
        pickle.loads(pickle.dumps(exc, protocol=5))  # an exception that cannot cross goes as text
    except Exception:  # noqa: BLE001
        return ("error", None, f"{type(exc).__name__}: {exc}\n{text}")
    return ("error", exc, text)


def _serve(conn: socket.socket, runners: dict[bytes, Any]) -> bool:
    """Answer one call; False once asked to stop."""

    try:
        kind, payload = recv_message(conn)
    except (EOFError, OSError):
        raise
    except Exception as exc:  # noqa: BLE001 - a request this owner cannot read
        log.warning("a request could not be read: %s", exc)
        send_message(conn, _reply_error(OwnerError(f"the owner could not read the request: {exc}")))
        return True
    if kind in ("pid", "stop"):
        send_message(conn, ("ok", os.getpid(), ""))
        return kind != "stop"
    digest, blob, bc, sent_at = payload
    send_message(conn, ("accepted", os.getpid(), ""))
    waited = time.time() - sent_at
    runner = runners.get(digest)
    try:
        if runner is None:
            runner = pickle.loads(blob)
            runners[digest] = runner
            while len(runners) > _RUNNERS_KEPT:
                runners.pop(next(iter(runners)))
        timings = {**bc.timings, "owner_request": waited}
        with profiled(bc.group, bc.batch), no_cycle_collection():
            value = runner.run(
                bc.group, bc.query, bc.batch, bc.pdf, bc.pending, bc.now_ms, bc.watermark_ms,
                timings,
            )  # fmt: skip
        reply: tuple[str, Any, str] = ("ok", value, "")
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the worker
        log.exception("group %s batch %s failed", bc.group, bc.batch)
        reply = _reply_error(exc)
    try:
        send_message(conn, reply)
    except OSError as exc:  # the worker is gone: its task fails and Spark runs it again
        log.warning(
            "group %s batch %s: the worker left before the result: %s", bc.group, bc.batch, exc
        )
    return True


def serve(name: str, watch: int, idle_seconds: float) -> int:
    """Answer calls at `name` until idle for `idle_seconds` or `watch` is gone."""
    listener = listening(name, "owner")
    if listener is None:
        return 0
    log.info("owner %s (pid %s) watching pid %s", name, os.getpid(), watch)
    runners: dict[bytes, Any] = {}
    with listener:
        for conn in accepted(listener, watch, idle_seconds):
            conn.settimeout(None)
            try:
                check_peer(conn, name)
            except OwnerError as exc:
                log.warning("a connection refused: %s", exc)
                continue
            try:
                if not _serve(conn, runners):
                    log.info("asked to stop: exiting")
                    return 0
            except (EOFError, OSError) as exc:
                log.warning("a call broke off: %s", exc)
    return 0


def _preload() -> None:
    """What an owner's first batch imports: the group runner and, through it, pandas,
    pyarrow, boto3, the changelog and the handler API; cloudpickle, which unpickles the
    runner; and the S3 and DynamoDB models its clients are made from."""
    import pyarrow  # noqa: F401 - imported here so that no fork imports it again
    from pyspark import cloudpickle  # noqa: F401

    from shardless.changelog import aws
    from shardless.processor.runtime import group_runner  # noqa: F401

    aws.warm()


def main(argv: list[str] | None = None) -> int:
    """An owner (NAME WATCH IDLE), or with `zygote` first, the zygote owners fork from."""
    args = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"
    )
    if args[:1] == ["zygote"]:
        name, watch, idle = args[1:]
        return zygote.serve(name, int(watch), float(idle), _preload, main)
    name, watch, idle = args
    return serve(name, int(watch), float(idle))


if __name__ == "__main__":
    sys.exit(main())
