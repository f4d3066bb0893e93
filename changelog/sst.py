"""SST objects: a checkpoint's table files as the bucket holds them, each behind a header
with its size and CRC-32; uploaded, streamed into a file with both checked on the way, or
read through without writing (`scan_sst`, for `verify`).

    sst := b"SHST" u8:format u32:crc32(file) u64:size file

An SST object is a whole S3 object, or a range of a snapshot pack (`SstFile.offset`).

The CRC-32 of a local file is computed once per process (`local_crcs`), so a snapshot can
tell a file it shares from another of the same name and size without reading it again.
"""

from __future__ import annotations

import re
import struct
import threading
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from shardless.changelog import aws
from shardless.changelog.errors import CorruptObjectError
from shardless.changelog.layout import AppLocation
from shardless.changelog.manifest import Manifest, SstFile
from shardless.changelog.objects import OnBytes, is_missing, missing, no_progress

SST_MAGIC = b"SHST"
FORMAT = 1
_SST = struct.Struct(">4sBIQ")
_CHUNK = 1 << 20


def _file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


class _CrcCache:
    """CRC-32s of local files this process has read, written or checksummed, by device,
    inode, size and modification time: an SST file never changes once written, and a
    checkpoint's hard link to it has the same inode."""

    def __init__(self, size: int = 1 << 16) -> None:
        self.size = size
        self._items: OrderedDict[tuple[int, int, int, int], int] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(path: Path) -> tuple[int, int, int, int]:
        st = path.stat()
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def put(self, path: Path, crc: int) -> None:
        key = self._key(path)
        with self._lock:
            self._items[key] = crc
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def crc(self, path: Path) -> int:
        """The file's CRC-32, read from disk only the first time."""
        key = self._key(path)
        with self._lock:
            found = self._items.get(key)
        if found is None:
            found = _file_crc(path)
            self.put(path, found)
        return found


local_crcs = _CrcCache()


def sst_object(path: Path, size: int) -> tuple[bytes, int]:
    """The SST object of the local file at `path` (`size` bytes), and its CRC-32."""
    data = path.read_bytes()
    if len(data) != size:
        raise CorruptObjectError(f"{path}: {len(data)} bytes, expected {size}")
    crc = zlib.crc32(data)
    local_crcs.put(path, crc)
    return _SST.pack(SST_MAGIC, FORMAT, crc, size) + data, crc


def object_size(size: int) -> int:
    """The bytes of the SST object of a file of `size` bytes."""
    return _SST.size + size


def upload_sst(loc: AppLocation, key: str, path: Path, size: int) -> int:
    body, crc = sst_object(path, size)
    aws.client("s3").put_object(Bucket=loc.bucket, Key=key, Body=body)
    return crc


def _check_header(header: bytes, f: SstFile, where: str) -> None:
    """Refuse an SST object whose header is not ours or disagrees with the manifest."""
    if len(header) < _SST.size:
        raise CorruptObjectError(f"{where}: SST object truncated")
    magic, fmt, crc, size = _SST.unpack(header)
    if magic != SST_MAGIC:
        raise CorruptObjectError(f"{where}: not a shardless SST object (magic {magic!r})")
    if fmt != FORMAT:
        raise CorruptObjectError(f"{where}: unsupported SST object format {fmt}; upgrade shardless")
    if (size, crc) != (f.size, f.crc32):
        raise CorruptObjectError(
            f"{where}: header says {size} bytes crc {crc:08x}, the manifest {f.size} bytes crc "
            f"{f.crc32:08x}; refusing to load"
        )


def _open_sst(bucket: str, f: SstFile) -> tuple[Any, str]:
    """The body of an SST object (the whole object, or its range of a pack), streaming,
    and where it is (MissingObjectError if gone)."""
    where = sst_where(bucket, f)
    extra: dict[str, str] = {}
    if f.offset >= 0:
        extra["Range"] = f"bytes={f.offset}-{f.offset + object_size(f.size) - 1}"
    try:
        return aws.client("s3").get_object(Bucket=bucket, Key=f.key, **extra)["Body"], where
    except ClientError as exc:
        if is_missing(exc):
            raise missing(where) from exc
        raise


def _check_content(f: SstFile, where: str, size: int, crc: int) -> None:
    """Refuse an SST object whose content is not the size and CRC-32 its manifest says."""
    if size != f.size or crc != f.crc32:
        raise CorruptObjectError(
            f"{where}: content does not match its checksum ({size} bytes, crc {crc:08x}; "
            f"expected {f.size} bytes, crc {f.crc32:08x}); refusing to load"
        )


def download_sst(bucket: str, f: SstFile, dest: Path, on_bytes: OnBytes = no_progress) -> int:
    """Stream one SST object into `dest`, verifying its header and the CRC-32 of its content
    on the way (zlib and file writes release the GIL on chunks this size)."""
    body, where = _open_sst(bucket, f)
    try:
        _check_header(body.read(_SST.size), f, where)
        got, written = 0, 0
        dest.mkdir(parents=True, exist_ok=True)
        with open(dest / f.name, "wb", buffering=0) as out:
            while chunk := body.read(_CHUNK):
                got = zlib.crc32(chunk, got)
                out.write(chunk)
                written += len(chunk)
                on_bytes(len(chunk))
    finally:
        body.close()
    _check_content(f, where, written, got)
    local_crcs.put(dest / f.name, got)  # the restored store's next snapshot shares it
    return written


def sst_where(bucket: str, f: SstFile) -> str:
    """How errors name an SST object: its object, and its bytes when it is in a pack."""
    where = f"s3://{bucket}/{f.key}"
    return where if f.offset < 0 else f"{where} bytes {f.offset}+{object_size(f.size)}"


def write_sst(
    bucket: str, data: bytes, f: SstFile, dest: Path, on_bytes: OnBytes = no_progress
) -> int:
    """Write an SST object already fetched (cut from a span of its pack) into `dest`, with
    `download_sst`'s checks made before the file is written."""
    where = sst_where(bucket, f)
    _check_header(data[: _SST.size], f, where)
    content = memoryview(data)[_SST.size :]
    crc = zlib.crc32(content)
    _check_content(f, where, len(content), crc)
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / f.name, "wb", buffering=0) as out:
        out.write(content)
    on_bytes(len(content))
    local_crcs.put(dest / f.name, crc)
    return len(content)


_SESSION = re.compile(rb"session\.identity([0-9A-Z]{20})")  # rocksdb.db.session.id
_TAIL = 64 << 10  # an SST file's table properties are in its last few KB


def _session_lower(tail: bytes) -> int | None:
    """The low 64 bits of the RocksDB session id that wrote an SST file (from the table
    properties at its end: 20 base-36 digits, the low 62 bits in the last 12 and the top
    two in the first 8), or None when not found."""
    found = _SESSION.findall(tail)
    if not found:
        return None
    sid = found[-1].decode()
    return ((int(sid[:8], 36) & 3) << 62) | int(sid[8:], 36)


def scan_sst(bucket: str, f: SstFile) -> int | None:
    """Read an SST object through, checking its header and CRC-32 against `f` as a
    restore would (without writing it); return the low half of the session id that wrote
    the file (None: not found), for `foreign_files`."""
    body, where = _open_sst(bucket, f)
    tail = b""
    try:
        _check_header(body.read(_SST.size), f, where)
        got, size = 0, 0
        while chunk := body.read(_CHUNK):
            got = zlib.crc32(chunk, got)
            size += len(chunk)
            tail = (tail + chunk)[-_TAIL:]
    finally:
        body.close()
    _check_content(f, where, size, got)
    return _session_lower(tail)


def foreign_files(m: Manifest, sessions: dict[str, int | None]) -> list[str]:
    """The SST files of `m` (by name, with the session lows `scan_sst` found, by
    `SstFile.where`) that another store wrote: the snapshot's MANIFEST records each table file's
    unique id, whose first 8 bytes (custom field 12, 16 bytes) are the low half of the
    writing session's id, so a file whose session is not there will not open with it."""
    recorded = b"".join(v for k, v in m.inline.items() if k.startswith("MANIFEST-"))
    return [
        f.name
        for f in m.files
        if (low := sessions.get(f.where)) is not None
        and b"\x0c\x10" + struct.pack("<Q", low) not in recorded
    ]
