"""S3 transfers in a helper process: a restore's SST downloads, so that its store opens do
not stall them, and snapshot uploads, so that they do not stall the slices' handlers.

rocksdict holds Python's GIL while RocksDB opens a store, so another thread of the process
barely moves meanwhile. A restore opens one store per slice while the transfers of later
slices go on, so in one process the opens and the transfer threads take turns; with the
transfers in another process they do not (figures in docs/benchmarks.md, "Restore speed").

So a restore with many bytes of snapshots to fetch (`DurableState.transfer_process_bytes`,
`TRANSFER_PROCESS_BYTES` by default, the `transfer_process_mb` setting) hands its transfers
to a helper process, `python -m shardless.changelog.transfer_process`, started once per
worker process and kept while the worker lives. The helper streams each SST object
into its file with the checks of `sst.download_sst` (header, size, CRC-32) and answers
with the bytes written, or fetches a small object (a manifest, a changelog section) and
answers with its bytes, which this process verifies as it would its own. A refusal comes
back as the same error, with the same message.

A batch's snapshot pack (`pack`, `upload_pack` there) can go to the helper too
(`--snapshot-uploads helper`): an upload's Python (reading the files, the manifests,
botocore's signing and HTTP) then runs outside the process that runs the next slices'
handlers and does not take the GIL from them. On the whole job that was not a gain
(`shardless_uploads_in_helper` in docs/benchmarks.md), so packs are uploaded on threads
of the group's process by default.

The helper takes a few tenths of a second to start (Python, boto3): transfers asked for
before it says it is ready run in this process, so its start overlaps the restore's first
transfers instead of delaying them.

A restore never fails because of the helper: when it cannot be started, or dies, its
unfinished transfers run in this process instead (logged); one that dies before it is
ready is not started again. The helper exits when this process closes its end of the
pipe, which happens when this process ends however it ends.

Protocol over the helper's stdin and stdout, frames of u32 length + msgpack:

    request  := [id, "sst", bucket, key, name, size, crc32, dest, offset]
                                                                      (`download_sst`)
              | [id, "get", bucket, key, byte range or nil]           (`get_bytes`)
              | [id, "pack", bucket, nil, app, prefix, table, [due]]  (`upload_pack`)
    due      := [slice, version, checkpoint dir, previous snapshot or nil]
    response := [id, "ok", bytes written | the object's bytes | [snapshot]]
              | [id, kind, message]
    snapshot := [slice, version, key, bytes, files, at, length, bytes sent]
    kind     := "missing" | "corrupt" | "error"
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

from shardless.changelog import aws
from shardless.changelog.download import IN_PROCESS
from shardless.changelog.errors import ChangelogError, CorruptObjectError, MissingObjectError
from shardless.changelog.layout import AppLocation, SnapRef
from shardless.changelog.manifest import SstFile
from shardless.changelog.objects import FILE_THREADS, OnBytes, get_bytes
from shardless.changelog.pack import Due, upload_pack
from shardless.changelog.snapshot import snapshot_pool
from shardless.changelog.sst import download_sst

log = logging.getLogger(__name__)

TRANSFER_PROCESS_BYTES = 64 << 20  # a restore fetching this many bytes of snapshots uses it
_LENGTH = struct.Struct(">I")
_F_SETPIPE_SZ = 1031  # Linux
_PIPE_BYTES = 1 << 20


class TransferError(ChangelogError):
    """The helper process could not transfer an object, for a reason other than the object
    itself (an S3 error that outlived the retries, a local disk error)."""


def _write_frame(out: BinaryIO, body: bytes) -> None:
    out.write(_LENGTH.pack(len(body)) + body)
    out.flush()


def _read_frame(src: BinaryIO) -> bytes | None:
    """The next frame, or None at the end of the stream (a frame cut short counts as the end)."""
    head = src.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (n,) = _LENGTH.unpack(head)
    body = src.read(n)
    return body if len(body) == n else None


_ERRORS: dict[str, type[ChangelogError]] = {
    "missing": MissingObjectError,
    "corrupt": CorruptObjectError,
    "error": TransferError,
}


@dataclass
class _Request:
    future: Future
    body: list  # the request frame but its id
    here: Callable[[], Future]  # the same transfer started in this process
    on_bytes: OnBytes | None = None
    proc: subprocess.Popen | None = None
    decode: Callable[[Any], Any] | None = None  # the reply's value to the future's result


class TransferProcess:
    """Runs `download_sst`, `get_bytes` and `upload_pack` in the helper process; a
    drop-in for `download.IN_PROCESS` (`download.Transfers`) in restores."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._pending: dict[int, _Request] = {}
        self._ids = itertools.count()
        self._ready: subprocess.Popen | None = None  # the helper that said it is ready
        self._broken = False  # a helper died before it was ready: none is started again
        self.starts = 0  # helper processes started
        self.sent = 0  # transfers handed to a helper
        self.ran_here = 0  # transfers that ran in this process instead

    @property
    def helper_pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> bool:
        """Start the helper now unless it is running (a restore starts it before it has
        anything to send, so the helper's start-up overlaps the manifests' transfers)."""
        with self._lock:
            return self._running() is not None

    @property
    def ready(self) -> bool:
        proc = self._ready
        return proc is not None and proc is self._proc and proc.poll() is None

    @property
    def broken(self) -> bool:
        return self._broken

    def wait_ready(self, timeout: float) -> bool:
        """Start the helper if need be and wait until it serves (or `timeout` passes)."""
        deadline = time.monotonic() + timeout
        self.start()
        while not self.ready and not self._broken and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.ready

    def submit(self, bucket: str, f: SstFile, dest: Path, on_bytes: OnBytes) -> Future[int]:
        """`download_sst(bucket, f, dest)` in the helper; `on_bytes` once it is done."""
        dest = Path(dest).absolute()
        body = ["sst", bucket, f.key, f.name, f.size, f.crc32, str(dest), f.offset]
        here = partial(IN_PROCESS.submit, bucket, f, dest, on_bytes)
        return self._send(_Request(Future(), body, here, on_bytes))

    def fetch(self, bucket: str, key: str, byte_range: str | None = None) -> Future[bytes]:
        """`get_bytes(bucket, key, byte_range)` in the helper."""
        here = partial(IN_PROCESS.fetch, bucket, key, byte_range)
        return self._send(_Request(Future(), ["get", bucket, key, byte_range], here))

    def pack(self, loc: AppLocation, due: list[Due]) -> Future[dict[int, tuple[SnapRef, int]]]:
        """`upload_pack(loc, due)` in the helper (in this process's `snapshot_pool` until
        the helper is ready, or once it is gone)."""
        due = [replace(d, checkpoint=Path(d.checkpoint).absolute()) for d in due]
        rows = [[d.slice, d.version, str(d.checkpoint), _ref_row(d.previous)] for d in due]
        body = ["pack", loc.bucket, None, loc.app, loc.prefix, loc.table, rows]
        here = partial(snapshot_pool().submit, upload_pack, loc, due)
        return self._send(_Request(Future(), body, here, decode=_pack_refs))

    def _send(self, req: _Request) -> Future:
        req.future.set_running_or_notify_cancel()  # like a started transfer: not cancellable
        with self._lock:
            proc = self._running()
            if proc is not None and proc is self._ready:  # until then, transfers run here
                rid = next(self._ids)
                req.proc = proc
                self._pending[rid] = req
                try:
                    _write_frame(proc.stdin, msgpack.packb([rid, *req.body]))  # type: ignore[arg-type]
                    self.sent += 1
                    req.future.in_helper = True  # type: ignore[attr-defined]
                    return req.future
                except (OSError, ValueError):  # the helper is gone: its reader requeues
                    self._pending.pop(rid, None)
        self._run_here(req)
        return req.future

    def stop(self, timeout: float = 10.0) -> None:
        """Close the helper's input and wait for it to finish what it has (for tests and
        for benchmarks that measure a new worker's restore)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _running(self) -> subprocess.Popen | None:
        """The live helper, started if need be (None when it cannot be); under the lock."""
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._broken:
            return None
        env = dict(os.environ)
        # the helper imports shardless from wherever this process did (Spark ships code
        # through sys.path entries the environment does not name)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "shardless.changelog.transfer_process"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                close_fds=True,
            )
        except OSError as exc:
            log.warning("no transfer process (%s): downloading in this process", exc)
            self._proc = None
            return None
        for pipe in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):  # room for replies while this process is busy
                fcntl.fcntl(pipe.fileno(), _F_SETPIPE_SZ, _PIPE_BYTES)  # type: ignore[union-attr]
        self._proc = proc
        self.starts += 1
        threading.Thread(
            target=self._read, args=(proc,), name="shardless-transfer-replies", daemon=True
        ).start()
        return proc

    def _read(self, proc: subprocess.Popen) -> None:
        """Resolve the futures of `proc`'s replies; when it ends, rerun what it left here."""
        try:
            while (frame := _read_frame(proc.stdout)) is not None:  # type: ignore[arg-type]
                rid, kind, value = msgpack.unpackb(frame)
                if kind == "ready":
                    with self._lock:
                        self._ready = proc
                    continue
                with self._lock:
                    req = self._pending.pop(rid, None)
                if req is None:
                    continue
                if kind == "ok":
                    if req.on_bytes is not None:
                        req.on_bytes(value)
                    req.future.set_result(value if req.decode is None else req.decode(value))
                else:
                    req.future.set_exception(_ERRORS.get(kind, TransferError)(value))
        finally:
            code = proc.wait()
            with self._lock:
                if self._proc is proc:
                    self._proc = None
                if self._ready is not proc:
                    self._broken = True
                    log.warning(
                        "transfer process %s exited with code %s before it was ready; "
                        "restores download in this process from now on",
                        proc.pid,
                        code,
                    )
                left = [rid for rid, r in self._pending.items() if r.proc is proc]
                orphans = [self._pending.pop(rid) for rid in left]
            if orphans:
                log.warning(
                    "transfer process %s exited with code %s; its %d unfinished download(s) "
                    "run in this process",
                    proc.pid,
                    code,
                    len(orphans),
                )
            for req in orphans:
                self._run_here(req)

    def _run_here(self, req: _Request) -> None:
        self.ran_here += 1
        inner = req.here()

        def copy(done: Future) -> None:
            exc = done.exception()
            if exc is None:
                req.future.set_result(done.result())
            else:
                req.future.set_exception(exc)

        inner.add_done_callback(copy)


def _ref_row(ref: SnapRef | None) -> list | None:
    return None if ref is None else [ref.version, ref.key, ref.bytes, ref.files, ref.at, ref.length]


def _ref(row: list | None) -> SnapRef | None:
    if row is None:
        return None
    version, key, size, files, at, length = row
    return SnapRef(version, key, size, files, at=at, length=length)


def _pack_refs(value: list) -> dict[int, tuple[SnapRef, int]]:
    out = {}
    for slice_id, version, key, size, files, at, length, sent in value:
        out[slice_id] = (SnapRef(version, key, size, files, at=at, length=length), sent)
    return out


def in_helper(future: Future) -> bool:
    """Whether `future`'s transfer was handed to a helper process (a transfer it left
    unfinished, and then ran here, counts too)."""
    return getattr(future, "in_helper", False)


_lock = threading.Lock()
_instance: TransferProcess | None = None


def transfer_process() -> TransferProcess:
    """This process's helper (a forked worker gets its own, not its parent's)."""
    global _instance
    with _lock:
        if _instance is None or _instance.pid != os.getpid():
            _instance = TransferProcess()
        return _instance


def _serve(src: BinaryIO, out: BinaryIO) -> None:
    """The helper: download what `src` asks for, `FILE_THREADS` at a time, replying on `out`."""
    lock = threading.Lock()

    def run(request: list) -> None:
        rid, op, bucket, key, *rest = request
        what = f"s3://{bucket}/{key}"
        if op == "pack":
            what = f"snapshot pack of slices {[row[0] for row in rest[3]]} to s3://{bucket}"
        try:
            if op == "sst":
                name, size, crc, dest, offset = rest
                f = SstFile(name, key, size, crc, offset)
                done: Any = download_sst(bucket, f, Path(dest))
            elif op == "pack":
                app, prefix, table, rows = rest
                loc = AppLocation(app=app, bucket=bucket, prefix=prefix, table=table)
                due = [Due(s, v, Path(ck), _ref(prev)) for s, v, ck, prev in rows]
                done = [
                    [s, ref.version, ref.key, ref.bytes, ref.files, ref.at, ref.length, sent]
                    for s, (ref, sent) in upload_pack(loc, due).items()
                ]
            else:
                done = get_bytes(bucket, key, rest[0])
            reply = [rid, "ok", done]
        except MissingObjectError as exc:
            reply = [rid, "missing", str(exc)]
        except CorruptObjectError as exc:
            reply = [rid, "corrupt", str(exc)]
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the restore
            reply = [rid, "error", f"{what}: {type(exc).__name__}: {exc}"]
        try:
            with lock:
                _write_frame(out, msgpack.packb(reply))
        except (OSError, ValueError):
            pass  # the restoring process is gone

    pool = ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="shardless-io")
    try:
        while (frame := _read_frame(src)) is not None:
            pool.submit(run, msgpack.unpackb(frame))
    finally:
        # the restoring process is done with us (or gone): what has not started, never will
        pool.shutdown(wait=True, cancel_futures=True)


def main() -> None:
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies may reach the protocol stream
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    aws.client("s3")  # ready means able to serve at once
    _write_frame(out, msgpack.packb([-1, "ready", os.getpid()]))
    _serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    main()
