"""Incremental snapshots of slice stores: RocksDB checkpoints whose SST files are uploaded
once and shared by every later snapshot that still contains them.

A snapshot is a manifest object naming the SST objects of a checkpoint and carrying its
small mutable files (CURRENT, MANIFEST-*, OPTIONS-*) inline. A file the previous snapshot
already uploaded is referenced again rather than uploaded when it is the same file: same
name, size and CRC-32. Name and size are not enough: the previous snapshot may come from
another store of the slice (another worker, a store caught up from the log or restored on
another host), whose 000009.sst is another file of the same name, often of the same size
(RocksDB then refuses the restored store: "Mismatch in unique ID on table file"). The
checksum of a local file is computed once per process and file (kept by device, inode,
size and modification time: a checkpoint hard-links the store's files, and a file this
process uploaded or downloaded is known already), so a snapshot costs the bytes written
since the last one, plus compaction output, and rereads only files it has never seen.

The manifest format is in `manifest`, SST objects in `sst`; restoring a snapshot is
`download`. A batch's snapshots go out as one pack per group (`pack`); a snapshot of its
own object, written here, is what reslice and tools write.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shardless.changelog import aws
from shardless.changelog.layout import AppLocation, SnapRef, manifest_key, new_uid, sst_key
from shardless.changelog.manifest import (
    Manifest,
    SstFile,
    encode_manifest,
    manifests,
)
from shardless.changelog.objects import file_pool, pool_lock
from shardless.changelog.sst import local_crcs, upload_sst


def _share_or_upload(
    loc: AppLocation, key: str, path: Path, size: int, previous: SstFile | None
) -> tuple[SstFile, int]:
    """The previous snapshot's object for the file at `path` when it holds the same bytes
    (same CRC-32), else a new object; and the bytes uploaded."""
    if previous is not None and local_crcs.crc(path) == previous.crc32:
        return previous, 0
    return SstFile(path.name, key, size, upload_sst(loc, key, path, size)), size


def write_snapshot(
    loc: AppLocation,
    slice_id: int,
    version: int,
    checkpoint: Path,
    previous: Manifest | None,
) -> tuple[SnapRef, Manifest, int]:
    """Upload the checkpoint directory of a store at `version`; return its reference, its
    manifest and the bytes uploaded (files of `previous` with the same name, size and
    checksum are shared, not uploaded again)."""
    uid = new_uid()
    known = {(f.name, f.size): f for f in previous.files} if previous else {}
    inline: dict[str, bytes] = {}
    uploads = []
    for path in sorted(checkpoint.iterdir()):
        size = path.stat().st_size
        if path.suffix == ".sst":
            key = sst_key(loc, slice_id, uid, path.name)
            same = known.get((path.name, size))
            uploads.append(file_pool().submit(_share_or_upload, loc, key, path, size, same))
        elif path.is_file() and not (path.suffix == ".log" and size == 0):
            inline[path.name] = path.read_bytes()
    files: list[SstFile] = []
    uploaded = 0
    for future in uploads:
        f, sent = future.result()
        files.append(f)
        uploaded += sent
    m = Manifest(
        app=loc.app,
        slice=slice_id,
        version=version,
        uid=uid,
        created_ms=int(time.time() * 1000),
        files=tuple(sorted(files, key=lambda f: f.name)),
        inline=inline,
    )
    body = encode_manifest(m)
    key = manifest_key(loc, slice_id, version, uid)
    aws.client("s3").put_object(Bucket=loc.bucket, Key=key, Body=body)
    manifests.put(key, m)
    return SnapRef(version, key, m.bytes, len(m.files)), m, uploaded + len(body)


SNAPSHOT_THREADS = 4
_snapshot_pool: ThreadPoolExecutor | None = None


def snapshot_pool() -> ThreadPoolExecutor:
    """The process's pool for whole snapshots (a batch's pack, `pack.upload_pack`): separate from
    `file_pool`, whose threads a snapshot waits on for its SST objects."""
    global _snapshot_pool
    with pool_lock:
        if _snapshot_pool is None:
            _snapshot_pool = ThreadPoolExecutor(
                SNAPSHOT_THREADS, thread_name_prefix="shardless-snapshot"
            )
        return _snapshot_pool
