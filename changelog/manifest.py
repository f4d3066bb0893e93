"""Snapshot manifests: the object naming a checkpoint's SST objects and carrying its small
mutable files (CURRENT, MANIFEST-*, OPTIONS-*) inline; encoded, checked and cached here.

    manifest := b"SHMF" u8:format u32:len msgpack(body) u32:crc32(body)
    body     := {app, slice, version, uid, created_ms, files: [[name, key, size, crc32]],
                 inline: {name: bytes}}

Format 2 lets a file be part of an object: `[name, key, size, crc32, offset]`, the SST
object starting at `offset` in a snapshot pack (`pack`); a manifest without such a file
is written as format 1, which every earlier shardless reads.

Every file name in a manifest must be one RocksDB writes (`FILE_NAMES`, `INLINE_NAMES`):
a forged manifest cannot write outside the directory it is restored into. A manifest of
another app, slice or version, or naming another slice's SST objects, is refused.
"""

from __future__ import annotations

import re
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

import msgpack

from shardless.changelog.errors import CorruptObjectError
from shardless.changelog.layout import AppLocation, SnapRef, pack_prefix, sst_key
from shardless.changelog.objects import get_bytes

MANIFEST_MAGIC = b"SHMF"
FORMATS = (1, 2)  # 2: files at an offset of a pack
_MANIFEST = struct.Struct(">4sBI")


@dataclass(frozen=True)
class SstFile:
    name: str
    key: str
    size: int
    crc32: int
    offset: int = -1  # where its SST object starts in `key` (-1: it is the whole object)

    @property
    def where(self) -> str:
        """Names the file's SST object uniquely (several may share a pack's key)."""
        return self.key if self.offset < 0 else f"{self.key}@{self.offset}"


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
    packed = any(f.offset >= 0 for f in m.files)
    body = msgpack.packb(
        {
            "app": m.app,
            "slice": m.slice,
            "version": m.version,
            "uid": m.uid,
            "created_ms": m.created_ms,
            "files": [
                [f.name, f.key, f.size, f.crc32] + ([f.offset] if f.offset >= 0 else [])
                for f in m.files
            ],
            "inline": m.inline,
        },
        use_bin_type=True,
    )
    return b"".join(
        [
            _MANIFEST.pack(MANIFEST_MAGIC, 2 if packed else 1, len(body)),
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


def _sst_file(row: list, fmt: int) -> SstFile:
    if len(row) == 5 and fmt >= 2:
        name, key, size, crc, offset = row
        if int(offset) < 0:
            raise ValueError(f"file {name!r} at offset {offset}")
        return SstFile(name, key, int(size), int(crc), int(offset))
    name, key, size, crc = row
    return SstFile(name, key, int(size), int(crc))


def decode_manifest(raw: bytes, *, where: str) -> Manifest:
    if len(raw) < _MANIFEST.size + 4:
        raise CorruptObjectError(f"{where}: manifest truncated ({len(raw)} bytes)")
    magic, fmt, length = _MANIFEST.unpack_from(raw)
    if magic != MANIFEST_MAGIC:
        raise CorruptObjectError(f"{where}: not a shardless snapshot manifest (magic {magic!r})")
    if fmt not in FORMATS:
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
            files=tuple(_sst_file(row, fmt) for row in d["files"]),
            inline={k: bytes(v) for k, v in d["inline"].items()},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptObjectError(f"{where}: manifest body unreadable ({exc!r})") from exc
    check_names(m, where)
    return m


class _ManifestCache:
    """Manifests are immutable: keep the recent ones so the next snapshot of a slice knows
    which files are already uploaded without fetching anything. Room for the newest
    snapshot of every slice of a 4,096-slice application twice over: with room for fewer,
    a process that runs all of them would fetch back manifests it wrote itself."""

    def __init__(self, size: int = 8192) -> None:
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


def cached_manifest(ref: SnapRef) -> Manifest | None:
    """The manifest of snapshot `ref` if this process has it already (verified when it
    was read or written)."""
    return manifests.get(cache_key(ref))


def cache_key(ref: SnapRef) -> str:
    """Where a manifest is, as the cache knows it: its object, and its bytes in a pack."""
    return ref.key if ref.at < 0 else f"{ref.key}@{ref.at}+{ref.length}"


def read_manifest(loc: AppLocation, ref: SnapRef, *, slice_id: int) -> Manifest:
    """Fetch and verify the manifest of snapshot `ref` of slice `slice_id` (in its own
    object or in a pack); refuse one that belongs to another slice or version."""
    found = manifests.get(cache_key(ref))
    if found is not None:
        return found
    raw = get_bytes(loc.bucket, ref.key, ref.byte_range)
    return manifest_from(loc, ref, raw, slice_id=slice_id)


def manifest_from(loc: AppLocation, ref: SnapRef, raw: bytes, *, slice_id: int) -> Manifest:
    """Verify and decode the manifest of snapshot `ref`, fetched; refuse one that belongs
    to another slice or version, or that names objects outside the slice's own SST
    objects and the application's packs."""
    key, version = ref.key, ref.version
    where = f"s3://{loc.bucket}/{key}" + (f" bytes {ref.at}+{ref.length}" if ref.at >= 0 else "")
    m = decode_manifest(raw, where=where)
    if (m.app, m.slice, m.version) != (loc.app, slice_id, version):
        raise CorruptObjectError(
            f"{where}: manifest of app {m.app!r} slice {m.slice} version {m.version}, expected "
            f"app {loc.app!r} slice {slice_id} version {version}; refusing a foreign snapshot"
        )
    own = sst_key(loc, slice_id, "", "")[:-1]  # the slice's own SST prefix (no "-")
    packs = pack_prefix(loc)
    foreign = next(
        (
            f.key
            for f in m.files
            if not (f.key.startswith(packs) if f.offset >= 0 else f.key.startswith(own))
        ),
        None,
    )
    if foreign is not None:
        raise CorruptObjectError(
            f"{where}: names the object {foreign!r}, outside the slice's own SST objects "
            f"({own}...) and the application's packs ({packs}...); refusing a forged or "
            "foreign snapshot"
        )
    manifests.put(cache_key(ref), m)
    return m
