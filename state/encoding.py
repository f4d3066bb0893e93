"""Value encoding: one format byte, then the payload.

msgpack is the only format for now; the leading byte lets later formats coexist with
stored values. Pickle is never used: a writable bucket must not become code execution.
"""

from typing import Any

import msgpack

from state.errors import EncodingError

MSGPACK = 0x01
MAX_VALUE_BYTES = 4 * 1024 * 1024


def encode(value: Any, *, key: str = "?") -> bytes:
    try:
        payload = msgpack.packb(value, use_bin_type=True, datetime=False)
    except (TypeError, ValueError, OverflowError) as exc:
        raise EncodingError(
            f"key {key!r}: cannot encode a value of type {type(value).__name__} with msgpack "
            f"({exc}); store plain dicts, lists, str, bytes, int, float, bool or None"
        ) from exc
    if len(payload) > MAX_VALUE_BYTES:
        raise EncodingError(
            f"key {key!r}: encoded value is {len(payload)} bytes, over the limit of "
            f"{MAX_VALUE_BYTES}; split it into smaller values"
        )
    return bytes((MSGPACK,)) + payload


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not a shardless value")


def decode(raw: bytes, *, key: str = "?") -> Any:
    if not raw or raw[0] != MSGPACK:
        fmt = raw[0] if raw else None
        raise EncodingError(f"key {key!r}: unknown value format byte {fmt!r}")
    if len(raw) > MAX_VALUE_BYTES + 1:
        raise EncodingError(f"key {key!r}: stored value is {len(raw)} bytes, over the limit")
    try:
        # unpackb bounds every container and string by the input's length: no memory bombs.
        return msgpack.unpackb(raw[1:], raw=False, strict_map_key=False, ext_hook=_no_ext)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise EncodingError(f"key {key!r}: stored value is not valid msgpack ({exc})") from exc
