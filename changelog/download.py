"""Materialising a snapshot into a directory: its SST objects downloaded through a
`Transfers` (this process's transfer pool, or the helper process of `transfer_process`),
its small files written from the manifest, with the IDENTITY file RocksDB would otherwise
write (and fsync) on open while holding Python's GIL.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Protocol

from shardless.changelog.layout import AppLocation
from shardless.changelog.manifest import Manifest, SstFile, check_names
from shardless.changelog.objects import OnBytes, file_pool, get_bytes, no_progress
from shardless.changelog.sst import download_sst


def _inline_names(m: Manifest) -> None:
    check_names(m, f"manifest of slice {m.slice} v{m.version}")


class Transfers(Protocol):
    """Where a restore's object transfers run, each started there with its result a future:
    `submit` as `download_sst`, `fetch` as `get_bytes`."""

    def submit(self, bucket: str, f: SstFile, dest: Path, on_bytes: OnBytes) -> Future[int]: ...

    def fetch(self, bucket: str, key: str, byte_range: str | None = None) -> Future[bytes]: ...


class _InProcess:
    def submit(self, bucket: str, f: SstFile, dest: Path, on_bytes: OnBytes) -> Future[int]:
        return file_pool().submit(download_sst, bucket, f, dest, on_bytes)

    def fetch(self, bucket: str, key: str, byte_range: str | None = None) -> Future[bytes]:
        return file_pool().submit(get_bytes, bucket, key, byte_range)


IN_PROCESS: Transfers = _InProcess()

# The write of an SST file from bytes a restore fetched with others (a future of the bytes
# written), or None: fetch it alone.
Fetched = Callable[[SstFile, Path, OnBytes], "Future[int] | None"]


def fetch_files(
    loc: AppLocation,
    m: Manifest,
    dest: Path,
    on_bytes: OnBytes = no_progress,
    transfers: Transfers = IN_PROCESS,
    fetched: Fetched | None = None,
) -> list[Future[int]]:
    """Start materialising the snapshot into `dest` (created): its SST objects downloaded
    by `transfers` (this process's transfer pool unless told otherwise; or written from
    bytes fetched already, when `fetched` has them), its inline files written on the
    transfer pool. Each future gives the bytes written or the reason an object was refused.
    The calling thread makes no system call: a thread that gives up Python's GIL waits to
    get it back while the transfers run."""
    _inline_names(m)
    files = [
        (fetched(f, dest, on_bytes) if fetched else None)
        or transfers.submit(loc.bucket, f, dest, on_bytes)
        for f in m.files
    ]
    return [*files, file_pool().submit(write_inline, m, dest, on_bytes)]


# A RocksDB MANIFEST records the database's id as a VersionEdit field: tag kDbId (8193,
# varint 0x81 0x40), length 36, the id in UUID form.
_DB_ID = re.compile(rb"\x81\x40\x24([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")


def identity_file(m: Manifest) -> bytes | None:
    """The IDENTITY file RocksDB would write on opening the snapshot (the id its MANIFEST
    records), or None when that is not clear. A checkpoint has no IDENTITY file; RocksDB
    then writes one on open with two fsyncs, holding Python's GIL. One that disagrees with
    the MANIFEST is simply rewritten by RocksDB."""
    if "IDENTITY" in m.inline:
        return None
    found = {
        db_id
        for name, data in m.inline.items()
        if name.startswith("MANIFEST-")
        for db_id in _DB_ID.findall(data)
    }
    return found.pop() if len(found) == 1 else None


def needed_on_open(name: str) -> bool:
    """Whether a checkpoint's small file must exist for its store to open as it was.
    RocksDB writes a new OPTIONS file and rocksdict its config file on every open from the
    options it is given, so restoring the old ones would only cost two file creations."""
    return not (name.startswith("OPTIONS-") or name == "rocksdict-config.json")


def write_inline(m: Manifest, dest: Path, on_bytes: OnBytes = no_progress) -> int:
    """Write the manifest's small files that the open needs (CURRENT, MANIFEST-*; not the
    ones `needed_on_open` leaves out) into `dest`, and the IDENTITY file its MANIFEST
    implies (not counted: it was not fetched)."""
    _inline_names(m)
    dest.mkdir(parents=True, exist_ok=True)
    total = 0
    for name, data in m.inline.items():
        if not needed_on_open(name):
            continue
        (dest / name).write_bytes(data)
        on_bytes(len(data))
        total += len(data)
    db_id = identity_file(m)
    if db_id is not None:
        (dest / "IDENTITY").write_bytes(db_id)
    return total


def settle(futures: list[Future[int]]) -> int:
    """The sum of the futures' results once every one has finished. On the first failure
    the ones not started are cancelled and the running ones waited for, so nothing writes
    into a directory the caller is about to remove; then that failure is raised."""
    try:
        return sum(f.result() for f in futures)
    except BaseException:
        for f in futures:
            f.cancel()
        wait(futures)
        raise


def download_snapshot(
    loc: AppLocation, m: Manifest, dest: Path, on_bytes: OnBytes = no_progress
) -> int:
    """Materialise the snapshot into the empty directory `dest`; return the bytes fetched."""
    return settle(fetch_files(loc, m, dest, on_bytes))
