"""Value encoding: a format byte, an optional expiry, then the payload.

    byte 0       format: 1 msgpack, 2 JSON, 3 raw bytes, 4 pickle; +0x80 if an expiry follows
    bytes 1..9   (with expiry) kind b"p" (processing time) or b"e" (event time), 8-byte ms
    rest         payload

msgpack is the default. Pickle is used only when an application explicitly opts in, and a
store refuses to decode it otherwise: a writable bucket must not become code execution.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Callable
from functools import partial
from typing import Any

import msgpack

from shardless.state.errors import EncodingError

MSGPACK = 0x01
JSON = 0x02
RAW = 0x03
PICKLE = 0x04
FORMATS = {"msgpack": MSGPACK, "json": JSON, "raw": RAW, "pickle": PICKLE}
_TTL_FLAG = 0x80
_EXPIRY = struct.Struct(">cQ")
MAX_VALUE_BYTES = 4 * 1024 * 1024
MSGPACK_BYTE = bytes((MSGPACK,))


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not a shardless value")


# The per-record path's two halves, in C. One Packer: building one per call costs most of a small
# pack; its pack() runs without releasing the GIL, so threads cannot interleave inside it.
# `shardless.processor.api.context.KeyedState` calls them directly to save a Python call per record:
# a value that fails either, or is too large, must then go on to `encode_msgpack`/`decode_msgpack`
# for its error.
pack_msgpack: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=True, datetime=False).pack
unpack_msgpack: Callable[[bytes], Any] = partial(
    msgpack.unpackb, raw=False, strict_map_key=False, ext_hook=_no_ext
)


def format_code(name: str) -> int:
    try:
        return FORMATS[name]
    except KeyError:
        raise EncodingError(f"unknown value format {name!r}: use {sorted(FORMATS)}") from None


def _payload(value: Any, fmt: int, key: str) -> bytes:
    if fmt == MSGPACK:
        return msgpack.packb(value, use_bin_type=True, datetime=False)
    if fmt == JSON:
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
    if fmt == RAW:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError("the raw format stores bytes only")
        return bytes(value)
    if fmt == PICKLE:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    raise EncodingError(f"key {key!r}: unknown value format code {fmt}")


def encode(
    value: Any, *, key: str = "?", fmt: int = MSGPACK, expires: tuple[bytes, int] | None = None
) -> bytes:
    """Encode a value; `expires` is (b"p" or b"e", epoch ms) for a value with a TTL."""
    try:
        payload = _payload(value, fmt, key)
    except (TypeError, ValueError, OverflowError, pickle.PicklingError) as exc:
        name = {v: k for k, v in FORMATS.items()}.get(fmt, fmt)
        raise EncodingError(
            f"key {key!r}: cannot encode a value of type {type(value).__name__} as {name} "
            f"({exc}); store plain dicts, lists, str, bytes, int, float, bool or None"
        ) from exc
    if len(payload) > MAX_VALUE_BYTES:
        raise EncodingError(
            f"key {key!r}: encoded value is {len(payload)} bytes, over the limit of "
            f"{MAX_VALUE_BYTES}; split it into smaller values"
        )
    if expires is None:
        return bytes((fmt,)) + payload
    return bytes((fmt | _TTL_FLAG,)) + _EXPIRY.pack(*expires) + payload


def encode_msgpack(value: Any, key: str) -> bytes:
    """`encode` for the common case (msgpack, no expiry), on the per-record path."""
    try:
        payload = pack_msgpack(value)
    except (TypeError, ValueError, OverflowError):
        return encode(value, key=key)  # raises with the full message
    if len(payload) > MAX_VALUE_BYTES:
        return encode(value, key=key)
    return MSGPACK_BYTE + payload


def decode_msgpack(raw: bytes, key: str) -> Any:
    """`decode` for a value known to start with the msgpack format byte."""
    try:
        return unpack_msgpack(raw[1:])
    except Exception:  # noqa: BLE001 - the general path raises the precise error
        return decode(raw, key=key)


def expiry(raw: bytes) -> tuple[bytes, int] | None:
    """The (kind, epoch ms) expiry of an encoded value, if it has one."""
    if raw and raw[0] & _TTL_FLAG:
        return _EXPIRY.unpack_from(raw, 1)  # type: ignore[return-value]
    return None


def decode(raw: bytes, *, key: str = "?", allow_pickle: bool = False) -> Any:
    if not raw:
        raise EncodingError(f"key {key!r}: empty stored value")
    fmt = raw[0] & ~_TTL_FLAG
    payload = raw[1 + _EXPIRY.size :] if raw[0] & _TTL_FLAG else raw[1:]
    if len(payload) > MAX_VALUE_BYTES:
        raise EncodingError(f"key {key!r}: stored value is {len(raw)} bytes, over the limit")
    try:
        if fmt == MSGPACK:
            # unpackb bounds every container and string by the input's length: no memory bombs.
            return unpack_msgpack(payload)
        if fmt == JSON:
            return json.loads(payload)
        if fmt == RAW:
            return payload
        if fmt == PICKLE:
            if not allow_pickle:
                raise EncodingError(
                    f"key {key!r}: stored value is pickled, and this application does not "
                    "allow pickle (value_format='pickle' opts in; only for trusted stores)"
                )
            return pickle.loads(payload)  # noqa: S301 - explicit opt-in only
    except (ValueError, TypeError, msgpack.UnpackException, pickle.UnpicklingError) as exc:
        name = {v: k for k, v in FORMATS.items()}.get(fmt, fmt)
        raise EncodingError(f"key {key!r}: stored value is not valid {name} ({exc})") from exc
    raise EncodingError(f"key {key!r}: unknown value format byte {raw[0]!r}")
