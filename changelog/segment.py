"""The changelog segment format: one S3 object per Spark task and batch, one section per slice.

Each section is self-describing and checksummed, so a restore fetches only its slice's
byte range and verifies it without reading the rest of the object.

    object  := header section*
    header  := b"SHLG" u8:format u32:len msgpack(info) u32:crc32(info)
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
from shardless.state.store import Change

OBJECT_MAGIC = b"SHLG"
SECTION_MAGIC = b"SHSC"
FORMAT = 1
_HEADER = struct.Struct(">4sBI")
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
    """Build a segment from `(slice, version, changes)` triples; return it and the refs."""
    meta = msgpack.packb(info, use_bin_type=True)
    parts = [
        _HEADER.pack(OBJECT_MAGIC, FORMAT, len(meta)),
        meta,
        struct.pack(">I", zlib.crc32(meta)),
    ]
    offset = sum(len(p) for p in parts)
    refs = []
    for slice_id, version, changes in sections:
        payload = msgpack.packb([list(c) for c in changes], use_bin_type=True)
        head = _SECTION.pack(
            SECTION_MAGIC, FORMAT, slice_id, version, len(payload), zlib.crc32(payload)
        )
        parts += [head, payload]
        length = len(head) + len(payload)
        refs.append(SectionRef(slice_id, version, offset, length, len(changes)))
        offset += length
    return b"".join(parts), refs


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
    if len(raw) < _HEADER.size:
        raise CorruptObjectError(f"{where}: object truncated")
    magic, fmt, length = _HEADER.unpack_from(raw)
    if magic != OBJECT_MAGIC:
        raise CorruptObjectError(f"{where}: not a shardless changelog segment (magic {magic!r})")
    if fmt != FORMAT:
        raise CorruptObjectError(f"{where}: unsupported segment format {fmt}; upgrade shardless")
    if len(raw) < _HEADER.size + length + 4:
        raise CorruptObjectError(f"{where}: segment header truncated or its length is corrupt")
    meta = raw[_HEADER.size : _HEADER.size + length]
    (crc,) = struct.unpack_from(">I", raw, _HEADER.size + length)
    if zlib.crc32(meta) != crc:
        raise CorruptObjectError(f"{where}: segment header checksum mismatch")
    return msgpack.unpackb(meta)
