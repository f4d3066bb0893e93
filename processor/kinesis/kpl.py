"""De-aggregation of KPL aggregated records, decoded by hand.

The Kinesis Producer Library packs many user records into one Kinesis record:

    F3 89 9A C2 | protobuf AggregatedRecord | MD5 of the protobuf bytes (16 bytes)

    message AggregatedRecord {
      repeated string partition_key_table     = 1;
      repeated string explicit_hash_key_table = 2;
      repeated Record records                 = 3;
    }
    message Record {
      required uint64 partition_key_index     = 1;
      optional uint64 explicit_hash_key_index = 2;
      required bytes  data                    = 3;
      repeated Tag    tags                    = 4;   // ignored
    }

A user record's sub-sequence number is its index in `records`. The format is small enough
that a protobuf runtime would be a dependency for 60 lines of varint reading.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

MAGIC = b"\xf3\x89\x9a\xc2"
DIGEST_SIZE = 16

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


class CorruptAggregate(ValueError):
    """A record starts with the KPL magic bytes but is not a valid aggregate."""


@dataclass(frozen=True)
class UserRecord:
    partition_key: str
    explicit_hash_key: str | None
    data: bytes


def is_aggregated(data: bytes) -> bool:
    """Whether a record claims to be a KPL aggregate (starts with the magic bytes)."""
    return data[:4] == MAGIC


def deaggregate(data: bytes) -> list[UserRecord]:
    """The user records of an aggregate, in sub-sequence order; CorruptAggregate if invalid."""
    if len(data) < len(MAGIC) + DIGEST_SIZE:
        raise CorruptAggregate(f"aggregate of {len(data)} bytes is shorter than its framing")
    body, digest = data[len(MAGIC) : -DIGEST_SIZE], data[-DIGEST_SIZE:]
    if hashlib.md5(body).digest() != digest:
        raise CorruptAggregate("MD5 of the aggregate does not match its trailer")
    partition_keys: list[str] = []
    hash_keys: list[str] = []
    entries: list[tuple[int, int | None, bytes]] = []
    for field, value in _fields(body):
        if field == 1:  # a surrogate's bytes read as one, routed as `routing.key_text` says
            partition_keys.append(_text(value, "partition key", "surrogatepass"))
        elif field == 2:
            hash_keys.append(_text(value, "explicit hash key"))
        elif field == 3:
            entries.append(_record(_as_bytes(value, "record")))
    out = []
    for i, (pk_index, ehk_index, payload) in enumerate(entries):
        if pk_index >= len(partition_keys):
            raise CorruptAggregate(
                f"user record {i}: partition key index {pk_index} outside a table of "
                f"{len(partition_keys)}"
            )
        if ehk_index is not None and ehk_index >= len(hash_keys):
            raise CorruptAggregate(
                f"user record {i}: explicit hash key index {ehk_index} outside a table of "
                f"{len(hash_keys)}"
            )
        ehk = None if ehk_index is None else _hash_key(hash_keys[ehk_index], i)
        out.append(UserRecord(partition_keys[pk_index], ehk, payload))
    return out


def _hash_key(text: str, i: int) -> str:
    if not (text.isascii() and text.isdigit()) or int(text) >= 2**128:
        raise CorruptAggregate(f"user record {i}: explicit hash key {text!r} is not in [0, 2**128)")
    return text


def _record(buf: bytes) -> tuple[int, int | None, bytes]:
    pk_index: int | None = None
    ehk_index: int | None = None
    payload: bytes | None = None
    for field, value in _fields(buf):
        if field == 1:
            pk_index = _as_int(value, "partition key index")
        elif field == 2:
            ehk_index = _as_int(value, "explicit hash key index")
        elif field == 3:
            payload = _as_bytes(value, "data")
    if pk_index is None or payload is None:
        raise CorruptAggregate("a user record lacks its partition key index or its data")
    return pk_index, ehk_index, payload


def _fields(buf: bytes):  # noqa: ANN202 - yields (field number, int | bytes)
    """(field number, value) pairs of one protobuf message; unknown fields are skipped."""
    i, end = 0, len(buf)
    while i < end:
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, i = _varint(buf, i)
            yield field, value
        elif wire == _BYTES:
            size, i = _varint(buf, i)
            if i + size > end:
                raise CorruptAggregate(f"field {field} runs {i + size - end} bytes past its end")
            yield field, buf[i : i + size]
            i += size
        elif wire in (_FIXED64, _FIXED32):
            i += 8 if wire == _FIXED64 else 4
            if i > end:
                raise CorruptAggregate(f"field {field} runs past the end of the message")
        else:
            raise CorruptAggregate(f"field {field} has unsupported wire type {wire}")


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf):
            raise CorruptAggregate("a varint runs past the end of the message")
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise CorruptAggregate("a varint is longer than 10 bytes")


def _as_int(value: int | bytes, what: str) -> int:
    if not isinstance(value, int):
        raise CorruptAggregate(f"{what} is not a varint")
    return value


def _as_bytes(value: int | bytes, what: str) -> bytes:
    if not isinstance(value, bytes):
        raise CorruptAggregate(f"{what} is not length-delimited")
    return value


def _text(value: int | bytes, what: str, errors: str = "strict") -> str:
    try:
        return _as_bytes(value, what).decode("utf-8", errors)
    except UnicodeDecodeError as exc:
        raise CorruptAggregate(f"{what} is not UTF-8") from exc
