"""Snapshot packs: the snapshots a group takes in one batch, uploaded as one S3 object, so
a batch pays one snapshot PUT per group whatever the slice count.

    pack   := b"SHPK" u8:format u32:len msgpack(header) u32:crc32(header) member*
    header := {app, uid, created_ms}
    member := an SST object (`sst`) or a manifest (`manifest`, format 2)

A slice's snapshot in a pack is the byte range of its manifest (`SnapRef.at`, `length`),
and the manifest names each SST file by object and offset. A file the slice's previous
snapshot already holds (same name, size and CRC-32, as `snapshot` decides) is named where
it is, in an older pack or SST object, not packed again. A file larger than
`PACK_FILE_LIMIT`, or one that would take the pack past `PACK_LIMIT`, is uploaded alone as
an SST object of its slice, so a pack is built in memory without holding a large state.
The header names the application, which gc reads before it deletes a pack.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import msgpack

from shardless.changelog import aws
from shardless.changelog.errors import CorruptObjectError
from shardless.changelog.framing import frame, unframe
from shardless.changelog.layout import AppLocation, SnapRef, new_uid, pack_key, sst_key
from shardless.changelog.manifest import (
    Manifest,
    SstFile,
    cache_key,
    encode_manifest,
    manifests,
    read_manifest,
)
from shardless.changelog.objects import file_pool
from shardless.changelog.sst import local_crcs, object_size, sst_object, upload_sst

PACK_MAGIC = b"SHPK"
PACK_FORMAT = 1
PACK_FILE_LIMIT = 16 << 20  # a larger SST file goes alone, uploaded on its own thread
PACK_LIMIT = 128 << 20  # and so do the files that would take a pack past this


@dataclass(frozen=True)
class Due:
    """A slice whose snapshot a batch takes: the checkpoint of its store at `version`, and
    its newest snapshot before it (None: none), whose files are shared, not packed again."""

    slice: int
    version: int
    checkpoint: Path
    previous: SnapRef | None = None


def pack_header(app: str, uid: str) -> bytes:
    body = msgpack.packb({"app": app, "uid": uid, "created_ms": int(time.time() * 1000)})
    return frame(PACK_MAGIC, PACK_FORMAT, body)


def decode_pack_header(raw: bytes, *, where: str) -> dict:
    """The header at the start of a pack (`raw` may be its first few KB)."""
    body = unframe(
        raw, where=where, magic=PACK_MAGIC, fmt=PACK_FORMAT, kind="snapshot pack", short="pack"
    )
    try:
        return dict(msgpack.unpackb(body, raw=False))
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CorruptObjectError(f"{where}: pack header unreadable ({exc!r})") from exc


class _Builder:
    """The pack's bytes as they are appended, and the files uploaded alone beside it."""

    def __init__(self, loc: AppLocation, uid: str) -> None:
        self.loc, self.uid, self.key = loc, uid, pack_key(loc, uid)
        self.parts: list[bytes] = [pack_header(loc.app, uid)]
        self.size = len(self.parts[0])

    def append(self, data: bytes) -> int:
        at = self.size
        self.parts.append(data)
        self.size += len(data)
        return at

    def file(self, slice_id: int, path: Path, size: int) -> SstFile | Future[SstFile]:
        """The file packed (its object appended here), or a future of its own upload."""
        if size > PACK_FILE_LIMIT or self.size + object_size(size) > PACK_LIMIT:
            key = sst_key(self.loc, slice_id, self.uid, path.name)
            return file_pool().submit(
                lambda: SstFile(path.name, key, size, upload_sst(self.loc, key, path, size))
            )
        body, crc = sst_object(path, size)
        return SstFile(path.name, self.key, size, crc, self.append(body))


def _snapshot(b: _Builder, due: Due, previous: Manifest | None) -> tuple[Manifest, int]:
    """The manifest of one slice's checkpoint with its new files packed (or uploading
    alone); the bytes it adds."""
    known = {(f.name, f.size): f for f in previous.files} if previous else {}
    inline: dict[str, bytes] = {}
    files: list[SstFile | Future[SstFile]] = []
    sent = 0
    for path in sorted(due.checkpoint.iterdir()):
        size = path.stat().st_size
        if path.suffix == ".sst":
            same = known.get((path.name, size))
            if same is not None and local_crcs.crc(path) == same.crc32:
                files.append(same)
            else:
                files.append(b.file(due.slice, path, size))
                sent += object_size(size)
        elif path.is_file() and not (path.suffix == ".log" and size == 0):
            inline[path.name] = path.read_bytes()
    done = [f.result() if isinstance(f, Future) else f for f in files]
    m = Manifest(
        app=b.loc.app,
        slice=due.slice,
        version=due.version,
        uid=b.uid,
        created_ms=int(time.time() * 1000),
        files=tuple(sorted(done, key=lambda f: f.name)),
        inline=inline,
    )
    return m, sent


def write_pack(
    loc: AppLocation, due: Sequence[Due], previous: dict[int, Manifest | None]
) -> dict[int, tuple[SnapRef, int]]:
    """Upload the snapshots of the `due` checkpoints as one pack (plus any file too large
    for it); each slice's reference and the bytes it sent. `previous` holds each slice's
    newest manifest before these (files it names with the same checksum are shared)."""
    if not due:
        return {}
    b = _Builder(loc, new_uid())
    made = [
        (d, *_snapshot(b, d, previous.get(d.slice))) for d in sorted(due, key=lambda d: d.slice)
    ]
    out: dict[int, tuple[SnapRef, int]] = {}
    for d, m, sent in made:
        body = encode_manifest(m)
        at = b.append(body)
        ref = SnapRef(d.version, b.key, m.bytes, len(m.files), at=at, length=len(body))
        manifests.put(cache_key(ref), m)
        out[d.slice] = (ref, sent + len(body))
    aws.client("s3").put_object(Bucket=loc.bucket, Key=b.key, Body=b"".join(b.parts))
    return out


def upload_pack(loc: AppLocation, due: Sequence[Due]) -> dict[int, tuple[SnapRef, int]]:
    """`write_pack`, with each slice's previous manifest read first (from this process's
    cache when it wrote or read it already)."""
    previous = {
        d.slice: read_manifest(loc, d.previous, slice_id=d.slice) if d.previous else None
        for d in due
    }
    return write_pack(loc, due, previous)
