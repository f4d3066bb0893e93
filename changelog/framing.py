"""The header shardless's S3 objects start with: a magic number, a format, the length of a
msgpack body, the body, and its CRC-32 (`>4sBI body >I`). Segments and snapshot packs
read theirs here, so a damaged or foreign object is refused the same way, by name.
"""

from __future__ import annotations

import struct
import zlib

from shardless.changelog.errors import CorruptObjectError

HEADER = struct.Struct(">4sBI")


def frame(magic: bytes, fmt: int, body: bytes) -> bytes:
    """`body` behind its header and followed by its CRC-32."""
    return HEADER.pack(magic, fmt, len(body)) + body + struct.pack(">I", zlib.crc32(body))


def unframe(raw: bytes, *, where: str, magic: bytes, fmt: int, kind: str, short: str) -> bytes:
    """The checked body of the header at the start of `raw` (which may be only the
    object's first bytes); CorruptObjectError naming `where` and what is wrong. `kind`
    names the object ("changelog segment"), `short` its header ("segment")."""
    if len(raw) < HEADER.size:
        raise CorruptObjectError(f"{where}: {short} truncated ({len(raw)} bytes)")
    got, version, length = HEADER.unpack_from(raw)
    if got != magic:
        raise CorruptObjectError(f"{where}: not a shardless {kind} (magic {got!r})")
    if version != fmt:
        raise CorruptObjectError(
            f"{where}: unsupported {short} format {version}; upgrade shardless"
        )
    if len(raw) < HEADER.size + length + 4:
        raise CorruptObjectError(f"{where}: {short} header truncated or its length is corrupt")
    body = raw[HEADER.size : HEADER.size + length]
    (crc,) = struct.unpack_from(">I", raw, HEADER.size + length)
    if zlib.crc32(body) != crc:
        raise CorruptObjectError(f"{where}: {short} header checksum mismatch")
    return body
