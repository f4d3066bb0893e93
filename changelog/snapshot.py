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

    manifest := b"SHMF" u8:format u32:len msgpack(body) u32:crc32(body)
    body     := {app, slice, version, uid, created_ms, files: [[name, key, size, crc32]],
                 inline: {name: bytes}}
    sst      := b"SHST" u8:format u32:crc32(file) u64:size file

Every file name in a manifest must be one RocksDB writes (`FILE_NAMES`, `INLINE_NAMES`):
a forged manifest cannot write outside the directory it is restored into.

Restore fetches the manifest, downloads the SST objects in parallel (verifying each
checksum as it streams to disk), writes the inline files and opens the directory.
"""

from __future__ import annotations

import re
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgpack
from botocore.exceptions import ClientError

from shardless.changelog import aws
from shardless.changelog.errors import CorruptObjectError, MissingObjectError
from shardless.changelog.layout import AppLocation, SnapRef, manifest_key, new_uid, sst_key

MANIFEST_MAGIC = b"SHMF"
SST_MAGIC = b"SHST"
FORMAT = 1
_MANIFEST = struct.Struct(">4sBI")
_SST = struct.Struct(">4sBIQ")
_CHUNK = 1 << 20
FILE_THREADS = 16

OnBytes = Callable[[int], None]


def _ignore(n: int) -> None:
    pass


_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def file_pool() -> ThreadPoolExecutor:
    """The process's pool for object transfers (separate from per-slice restore threads)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="shardless-io")
        return _pool


@dataclass(frozen=True)
class SstFile:
    name: str
    key: str
    size: int
    crc32: int


@dataclass(frozen=True)
class Manifest:
    app: str
    slice: int
    version: int
    uid: str
    created_ms: int
    files: tuple[SstFile, ...]
    inline: dict[str, bytes] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files) + sum(len(v) for v in self.inline.values())


def encode_manifest(m: Manifest) -> bytes:
    body = msgpack.packb(
        {
            "app": m.app,
            "slice": m.slice,
            "version": m.version,
            "uid": m.uid,
            "created_ms": m.created_ms,
            "files": [[f.name, f.key, f.size, f.crc32] for f in m.files],
            "inline": m.inline,
        },
        use_bin_type=True,
    )
    return b"".join(
        [
            _MANIFEST.pack(MANIFEST_MAGIC, FORMAT, len(body)),
            body,
            struct.pack(">I", zlib.crc32(body)),
        ]
    )


# The names RocksDB gives the files of a checkpoint: table files, and the small ones a
# manifest carries inline (rocksdict adds its config file).
FILE_NAMES = re.compile(r"[0-9]{6,}\.sst")
INLINE_NAMES = re.compile(
    r"CURRENT|IDENTITY|MANIFEST-[0-9]{6,}|OPTIONS-[0-9]{6,}|[0-9]{6,}\.log|rocksdict-config\.json"
)


def check_names(m: Manifest, where: str) -> None:
    """Refuse a manifest naming a file RocksDB would not write (such as "../x")."""
    for names, pattern in (([f.name for f in m.files], FILE_NAMES), (m.inline, INLINE_NAMES)):
        for name in names:
            if not isinstance(name, str) or not pattern.fullmatch(name):
                raise CorruptObjectError(
                    f"{where}: manifest names a file {name!r} that is not a RocksDB file "
                    "name; refusing to load"
                )


def decode_manifest(raw: bytes, *, where: str) -> Manifest:
    if len(raw) < _MANIFEST.size + 4:
        raise CorruptObjectError(f"{where}: manifest truncated ({len(raw)} bytes)")
    magic, fmt, length = _MANIFEST.unpack_from(raw)
    if magic != MANIFEST_MAGIC:
        raise CorruptObjectError(f"{where}: not a shardless snapshot manifest (magic {magic!r})")
    if fmt != FORMAT:
        raise CorruptObjectError(f"{where}: unsupported manifest format {fmt}; upgrade shardless")
    body = raw[_MANIFEST.size : _MANIFEST.size + length]
    if len(body) != length or len(raw) != _MANIFEST.size + length + 4:
        raise CorruptObjectError(f"{where}: manifest length does not match its header")
    (crc,) = struct.unpack_from(">I", raw, _MANIFEST.size + length)
    if zlib.crc32(body) != crc:
        raise CorruptObjectError(f"{where}: manifest checksum mismatch; refusing to load")
    try:
        d = msgpack.unpackb(body, raw=False)
        m = Manifest(
            app=d["app"],
            slice=int(d["slice"]),
            version=int(d["version"]),
            uid=d["uid"],
            created_ms=int(d["created_ms"]),
            files=tuple(SstFile(n, k, int(s), int(c)) for n, k, s, c in d["files"]),
            inline={k: bytes(v) for k, v in d["inline"].items()},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptObjectError(f"{where}: manifest body unreadable ({exc!r})") from exc
    check_names(m, where)
    return m


class _ManifestCache:
    """Manifests are immutable: keep the recent ones so the next snapshot of a slice knows
    which files are already uploaded without fetching anything."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._items: OrderedDict[str, Manifest] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Manifest | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key: str, m: Manifest) -> None:
        with self._lock:
            self._items[key] = m
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


manifests = _ManifestCache()


def cached_manifest(key: str) -> Manifest | None:
    """The manifest at `key` if this process has it already (verified when it was read)."""
    return manifests.get(key)


def missing(where: str) -> MissingObjectError:
    return MissingObjectError(
        f"{where} is referenced by committed state but missing from the bucket: it was "
        "deleted outside shardless (or by a garbage collection with too short a grace "
        "period); recover it from S3 versioning, or roll the application back to a "
        "version that does not need it"
    )


def is_missing(exc: ClientError) -> bool:
    return exc.response["Error"]["Code"] in {"NoSuchKey", "404", "NotFound"}


def get_bytes(bucket: str, key: str, byte_range: str | None = None) -> bytes:
    """An object's bytes (`byte_range` as in HTTP: "bytes=0-99"); a missing object raises
    MissingObjectError."""
    extra = {"Range": byte_range} if byte_range else {}
    try:
        return aws.client("s3").get_object(Bucket=bucket, Key=key, **extra)["Body"].read()
    except ClientError as exc:
        if is_missing(exc):
            raise missing(f"s3://{bucket}/{key}") from exc
        raise


def read_manifest(loc: AppLocation, key: str, *, slice_id: int, version: int) -> Manifest:
    """Fetch and verify a manifest; refuse one that belongs to another slice or version."""
    found = manifests.get(key)
    if found is not None:
        return found
    return manifest_from(loc, key, get_bytes(loc.bucket, key), slice_id=slice_id, version=version)


def manifest_from(
    loc: AppLocation, key: str, raw: bytes, *, slice_id: int, version: int
) -> Manifest:
    """Verify and decode the manifest fetched from `key`; refuse one that belongs to
    another slice or version."""
    where = f"s3://{loc.bucket}/{key}"
    m = decode_manifest(raw, where=where)
    if (m.app, m.slice, m.version) != (loc.app, slice_id, version):
        raise CorruptObjectError(
            f"{where}: manifest of app {m.app!r} slice {m.slice} version {m.version}, expected "
            f"app {loc.app!r} slice {slice_id} version {version}; refusing a foreign snapshot"
        )
    own = sst_key(loc, slice_id, "", "")[:-1]  # the slice's own SST prefix (no "-")
    foreign = next((f.key for f in m.files if not f.key.startswith(own)), None)
    if foreign is not None:
        raise CorruptObjectError(
            f"{where}: names the object {foreign!r}, outside the slice's own SST objects "
            f"({own}...); refusing a forged or foreign snapshot"
        )
    manifests.put(key, m)
    return m


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


def _upload_sst(loc: AppLocation, key: str, path: Path, size: int) -> int:
    data = path.read_bytes()
    crc = zlib.crc32(data)
    local_crcs.put(path, crc)
    aws.client("s3").put_object(
        Bucket=loc.bucket, Key=key, Body=_SST.pack(SST_MAGIC, FORMAT, crc, size) + data
    )
    return crc


def _share_or_upload(
    loc: AppLocation, key: str, path: Path, size: int, previous: SstFile | None
) -> tuple[SstFile, int]:
    """The previous snapshot's object for the file at `path` when it holds the same bytes
    (same CRC-32), else a new object; and the bytes uploaded."""
    if previous is not None and local_crcs.crc(path) == previous.crc32:
        return previous, 0
    return SstFile(path.name, key, size, _upload_sst(loc, key, path, size)), size


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
    """The process's pool for whole snapshots (`upload_checkpoint`): separate from
    `file_pool`, whose threads a snapshot waits on for its SST objects."""
    global _snapshot_pool
    with _pool_lock:
        if _snapshot_pool is None:
            _snapshot_pool = ThreadPoolExecutor(
                SNAPSHOT_THREADS, thread_name_prefix="shardless-snapshot"
            )
        return _snapshot_pool


def upload_checkpoint(
    loc: AppLocation, slice_id: int, version: int, checkpoint: Path, previous: SnapRef | None
) -> tuple[SnapRef, int]:
    """Upload the checkpoint of slice `slice_id` taken at `version` as a snapshot sharing
    the SST objects of `previous` (the slice's newest snapshot, None for none) that it still
    contains; return its reference and the bytes sent. The checkpoint is left in place."""
    base = None
    if previous is not None:
        base = read_manifest(loc, previous.key, slice_id=slice_id, version=previous.version)
    ref, _, sent = write_snapshot(loc, slice_id, version, Path(checkpoint), base)
    return ref, sent


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
    """The body of an SST object, streaming, and where it is (MissingObjectError if gone)."""
    where = f"s3://{bucket}/{f.key}"
    try:
        return aws.client("s3").get_object(Bucket=bucket, Key=f.key)["Body"], where
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


def download_sst(bucket: str, f: SstFile, dest: Path, on_bytes: OnBytes = _ignore) -> int:
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
    """The SST files of `m` (by name, with the session lows `scan_sst` found, by object
    key) that another store wrote: the snapshot's MANIFEST records each table file's
    unique id, whose first 8 bytes (custom field 12, 16 bytes) are the low half of the
    writing session's id, so a file whose session is not there will not open with it."""
    recorded = b"".join(v for k, v in m.inline.items() if k.startswith("MANIFEST-"))
    return [
        f.name
        for f in m.files
        if (low := sessions.get(f.key)) is not None
        and b"\x0c\x10" + struct.pack("<Q", low) not in recorded
    ]


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


def fetch_files(
    loc: AppLocation,
    m: Manifest,
    dest: Path,
    on_bytes: OnBytes = _ignore,
    transfers: Transfers = IN_PROCESS,
) -> list[Future[int]]:
    """Start materialising the snapshot into `dest` (created): its SST objects downloaded
    by `transfers` (this process's transfer pool unless told otherwise), its inline files
    written on the transfer pool. Each future gives the bytes written or the reason an
    object was refused. The calling thread makes no system call: a thread that gives up
    Python's GIL waits to get it back while the transfers run."""
    _inline_names(m)
    files = [transfers.submit(loc.bucket, f, dest, on_bytes) for f in m.files]
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


def write_inline(m: Manifest, dest: Path, on_bytes: OnBytes = _ignore) -> int:
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
    loc: AppLocation, m: Manifest, dest: Path, on_bytes: OnBytes = _ignore
) -> int:
    """Materialise the snapshot into the empty directory `dest`; return the bytes fetched."""
    return settle(fetch_files(loc, m, dest, on_bytes))
