"""Layout of keys inside a slice's RocksDB store.

    d <key> 00 00                 the value of a record key
    d <key> 00 00 m <sub>         an entry of the key's map state
    d <key> 00 00 t <kind> <ts>   the key's timers (an index for listing and deleting)
    t <kind> <ts> <key> 00 00     all timers in firing order
    x <kind> <ts> <store key>     expiries (TTL) in time order
    00 m/...                      engine metadata (version, identity, undo)

Record keys are UTF-8 with NUL escaped as NUL FF and end with NUL NUL, so the encoding is
order-preserving and prefix-free: a key's entries are contiguous, and no two keys share a
prefix. Timestamps are 8-byte big-endian milliseconds, so byte order is time order.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

USER_START = b"\x01"
DATA = b"d"
DATA_END = b"e"
TIMERS = b"t"
EXPIRIES = b"x"
META = b"\x00m/"
VERSION_KEY = META + b"version"
IDENTITY_KEY = META + b"identity"
UNDO_KEY = META + b"undo"
TAG_KEY = META + b"tag"  # which commit of `version` the store holds (its segment's uid)

MAP = b"m"
KEY_TIMERS = b"t"
PROCESSING = b"p"
EVENT = b"e"

_TERMINATOR = b"\x00\x00"
_TS = struct.Struct(">Q")


def escape(key: str) -> bytes:
    """UTF-8 with NUL escaped as NUL 0xFF, so the terminator NUL NUL cannot occur inside."""
    return key.encode("utf-8").replace(b"\x00", b"\x00\xff")


def unescape(raw: bytes) -> str:
    return raw.replace(b"\x00\xff", b"\x00").decode("utf-8")


def data_key(key: str) -> bytes:
    """The store key of a record key's value; every entry of the key starts with it."""
    raw = key.encode("utf-8")
    if b"\x00" in raw:
        raw = raw.replace(b"\x00", b"\x00\xff")
    return DATA + raw + _TERMINATOR


def data_keys(record_keys: Iterable[str]) -> dict[str, bytes]:
    """`data_key` of each distinct key, in first-seen order: one pass over the whole batch
    looks for NULs, so keys without one skip the per-key check and call."""
    distinct = dict.fromkeys(record_keys)
    if "\x00" in "".join(distinct):
        return {k: data_key(k) for k in distinct}
    return {k: DATA + k.encode("utf-8") + _TERMINATOR for k in distinct}


def record_key(db_key: bytes) -> str:
    """The record key of any entry under `DATA` (its value, map entries, timer index)."""
    end = db_key.find(_TERMINATOR, len(DATA))
    if not db_key.startswith(DATA) or end < 0:
        raise ValueError(f"not a data key: {db_key!r}")
    return unescape(db_key[len(DATA) : end])


def is_data_key(db_key: bytes) -> bool:
    return db_key.startswith(DATA)


def is_value_key(db_key: bytes) -> bool:
    """True for a record key's own value (not its map entries or timer index)."""
    return db_key.startswith(DATA) and db_key.find(_TERMINATOR, len(DATA)) == len(db_key) - 2


def prefix_end(prefix: bytes) -> bytes:
    """The smallest byte string greater than every string starting with `prefix`."""
    trimmed = prefix.rstrip(b"\xff")
    if not trimmed:
        raise ValueError("a prefix of only 0xFF bytes has no upper bound")
    return trimmed[:-1] + bytes([trimmed[-1] + 1])


def key_range(prefix: str) -> tuple[bytes, bytes]:
    """Store keys of every record key starting with the text `prefix`."""
    lo = DATA + escape(prefix)
    return lo, prefix_end(lo)


def map_key(key: str, sub: str) -> bytes:
    return data_key(key) + MAP + escape(sub)


def map_range(key: str) -> tuple[bytes, bytes]:
    base = data_key(key) + MAP
    return base, prefix_end(base)


def map_sub(db_key: bytes, key: str) -> str:
    return unescape(db_key[len(data_key(key)) + len(MAP) :])


def timer_key(kind: bytes, ts: int, key: str) -> bytes:
    return TIMERS + kind + _TS.pack(ts) + escape(key) + _TERMINATOR


def parse_timer_key(db_key: bytes) -> tuple[bytes, int, str]:
    kind = db_key[1:2]
    (ts,) = _TS.unpack_from(db_key, 2)
    return kind, ts, unescape(db_key[10:-2])


def timers_due(kind: bytes, upto: int) -> tuple[bytes, bytes]:
    """The range of timers of `kind` with timestamps <= `upto`."""
    return TIMERS + kind, TIMERS + kind + _TS.pack(upto + 1)


def key_timer_key(key: str, kind: bytes, ts: int) -> bytes:
    return data_key(key) + KEY_TIMERS + kind + _TS.pack(ts)


def key_timers_range(key: str) -> tuple[bytes, bytes]:
    base = data_key(key) + KEY_TIMERS
    return base, prefix_end(base)


def parse_key_timer(db_key: bytes, key: str) -> tuple[bytes, int]:
    rest = db_key[len(data_key(key)) + len(KEY_TIMERS) :]
    return rest[:1], _TS.unpack(rest[1:])[0]


def expiry_key(kind: bytes, ts: int, db_key: bytes) -> bytes:
    return EXPIRIES + kind + _TS.pack(ts) + db_key


def expiries_due(kind: bytes, upto: int) -> tuple[bytes, bytes]:
    return EXPIRIES + kind, EXPIRIES + kind + _TS.pack(upto + 1)


def owner(db_key: bytes) -> str | None:
    """The record key an entry of the store belongs to (None for engine metadata): its
    value, map entries and timer index, its timers, and the expiries of any of them."""
    if db_key.startswith(DATA):
        return record_key(db_key)
    if db_key.startswith(TIMERS):
        return parse_timer_key(db_key)[2]
    if db_key.startswith(EXPIRIES):
        return owner(db_key[10:])
    return None


def parse_expiry_key(db_key: bytes) -> tuple[bytes, int, bytes]:
    return db_key[1:2], _TS.unpack_from(db_key, 2)[0], db_key[10:]
