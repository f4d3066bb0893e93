"""Decoding a record's bytes before the handler sees them (`event.value`).

  raw    the bytes as they are (default; nothing can fail)
  utf8   a str
  json   UTF-8 JSON, any JSON value

What happens to a record the decoder cannot read is the job's `on_decode_error`: `fail`
the batch (naming the record's coordinates), set it aside as a `dead-letter`, or pass it
to the handler `raw` with `event.value` = the bytes and `event.decode_error` = why.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from shardless.processor.errors import ConfigError

DECODERS = ("raw", "utf8", "json")
ON_DECODE_ERROR = ("fail", "dead-letter", "raw")


def _raw(data: bytes) -> bytes:
    return data


def _utf8(data: bytes) -> str:
    return data.decode("utf-8")


def _json(data: bytes) -> Any:
    return json.loads(data)


def decoder(name: str) -> Callable[[bytes], Any]:
    """The decode function called `name`; raises what it cannot read."""
    found = {"raw": _raw, "utf8": _utf8, "json": _json}.get(name)
    if found is None:
        raise ConfigError(f"--decoder {name!r}: use one of {', '.join(DECODERS)}")
    return found


def describe(exc: BaseException, limit: int = 300) -> str:
    """An error as one line: `Type: message`, cut to `limit` characters."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"
