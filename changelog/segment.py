"""The changelog segment format: one S3 object per Spark task and batch, one section per slice.

Each section is self-describing and checksummed, so a restore fetches only its slice's
byte range and verifies it without reading the rest of the object. The index after the
header says where each section is, so a reader that knows only the segment (not each
slice's offset) fetches the header and index first, then the sections it wants.

    object  := header index section*
    header  := b"SHLG" u8:format u32:len msgpack(info) u32:crc32(info)
    index   := b"SHIX" u32:len msgpack([[slice, version, offset, length, records], ...])
               u32:crc32(index)        offsets from the object's start; absent in segments
                                       written before it (a section follows the header)
    section := b"SHSC" u8:format u32:slice u64:version u32:len u32:crc32(payload) payload
    payload := msgpack([[key, value-or-nil], ...])
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack

from shardless.changelog.errors import CorruptObjectError
from shardless.changelog.framing import unframe
from shardless.state.store import Change

OBJECT_MAGIC = b"SHLG"
SECTION_MAGIC = b"SHSC"
INDEX_MAGIC = b"SHIX"
FORMAT = 1
_HEADER = struct.Struct(">4sBI")
_INDEX = struct.Struct(">4sI")
_SECTION = struct.Struct(">4sBIQII")


@dataclass(frozen=True)
class SectionRef:
    """Where one slice's changes for one version live inside a segment object."""

    slice: int
    version: int
    offset: int
    length: int
    records: int


def encode_segment(
    info: dict[str, Any], sections: list[tuple[int, int, list[Change]]]
) -> tuple[bytes, list[SectionRef]]:
    """Build a segment from `(slice, version, changes)` triples; return it and the refs.
    The first ref's offset is the length of the header and index (`index_length`)."""
    meta = msgpack.packb(info, use_bin_type=True)
    header = [
        _HEADER.pack(OBJECT_MAGIC, FORMAT, len(meta)),
        meta,
        struct.pack(">I", zlib.crc32(meta)),
    ]
    bodies, rows, offset = [], [], 0
    for slice_id, version, changes in sections:
        payload = msgpack.packb(changes, use_bin_type=True)  # (key, value) tuples: arrays
        head = _SECTION.pack(
            SECTION_MAGIC, FORMAT, slice_id, version, len(payload), zlib.crc32(payload)
        )
        bodies += [head, payload]
        rows.append([slice_id, version, offset, len(head) + len(payload), len(changes)])
        offset += len(head) + len(payload)
    # the index's own length depends on the offsets it holds: fix the start, then encode
    start = sum(len(p) for p in header)
    index = msgpack.packb(rows)
    while True:
        base = start + _INDEX.size + len(index) + 4
        shifted = msgpack.packb([[s, v, o + base, n, r] for s, v, o, n, r in rows])
        if len(shifted) == len(index):
            index = shifted
            break
        index = shifted
    parts = [*header, _INDEX.pack(INDEX_MAGIC, len(index)), index,
             struct.pack(">I", zlib.crc32(index)), *bodies]  # fmt: skip
    refs = [SectionRef(s, v, o + base, n, r) for s, v, o, n, r in rows]
    return b"".join(parts), refs


def index_length(body: bytes) -> int:
    """How many bytes from a segment's start hold its header and index (what
    `decode_index` needs)."""
    (length,) = struct.unpack_from(">I", body, 5)
    end = _HEADER.size + length + 4
    if body[end : end + 4] == INDEX_MAGIC:
        (size,) = struct.unpack_from(">I", body, end + 4)
        end += _INDEX.size + size + 4
    return end


def decode_index(raw: bytes, *, where: str) -> list[SectionRef] | None:
    """The section index of a segment from its first bytes (at least its header and index);
    None for a segment written before segments had one."""
    decode_info(raw, where=where)
    (length,) = struct.unpack_from(">I", raw, 5)
    at = _HEADER.size + length + 4
    if len(raw) < at + 4:
        raise CorruptObjectError(f"{where}: segment truncated after its header")
    if raw[at : at + 4] == SECTION_MAGIC:
        return None
    if len(raw) < at + _INDEX.size:
        raise CorruptObjectError(f"{where}: segment index truncated")
    magic, size = _INDEX.unpack_from(raw, at)
    if magic != INDEX_MAGIC:
        raise CorruptObjectError(f"{where}: no section index after the header (magic {magic!r})")
    body = raw[at + _INDEX.size : at + _INDEX.size + size]
    if len(body) != size or len(raw) < at + _INDEX.size + size + 4:
        raise CorruptObjectError(f"{where}: segment index truncated")
    (crc,) = struct.unpack_from(">I", raw, at + _INDEX.size + size)
    if zlib.crc32(body) != crc:
        raise CorruptObjectError(f"{where}: segment index checksum mismatch")
    try:
        return [SectionRef(*(int(x) for x in row)) for row in msgpack.unpackb(body)]
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CorruptObjectError(f"{where}: segment index unreadable ({exc})") from exc


def decode_section(raw: bytes, *, slice_id: int, version: int, where: str) -> list[Change]:
    """Verify and decode one section fetched by its ref; refuse anything unexpected."""
    if len(raw) < _SECTION.size:
        raise CorruptObjectError(f"{where}: section truncated ({len(raw)} bytes)")
    magic, fmt, got_slice, got_version, length, crc = _SECTION.unpack_from(raw)
    if magic != SECTION_MAGIC:
        raise CorruptObjectError(f"{where}: not a shardless changelog section (magic {magic!r})")
    if fmt != FORMAT:
        raise CorruptObjectError(f"{where}: unsupported section format {fmt}; upgrade shardless")
    if (got_slice, got_version) != (slice_id, version):
        raise CorruptObjectError(
            f"{where}: section holds slice {got_slice} version {got_version}, "
            f"expected slice {slice_id} version {version}"
        )
    payload = raw[_SECTION.size :]
    if len(payload) != length or zlib.crc32(payload) != crc:
        raise CorruptObjectError(f"{where}: section checksum mismatch; refusing to load")
    try:
        return [(bytes(k), None if v is None else bytes(v)) for k, v in msgpack.unpackb(payload)]
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CorruptObjectError(f"{where}: section payload unreadable ({exc})") from exc


def decode_info(raw: bytes, *, where: str) -> dict[str, Any]:
    """Read a segment's header (used by verification tools)."""
    meta = unframe(
        raw, where=where, magic=OBJECT_MAGIC, fmt=FORMAT, kind="changelog segment", short="segment"
    )
    return msgpack.unpackb(meta)
