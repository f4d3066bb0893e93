"""The key an app's state is bound to, when it is not the producer's partition key.

An app chooses its key from each record, as a JSON field path (`key = "user.id"` in the app
file, or `shardless run --key-field user.id`) or as a function (`def key(record) -> str`).
Records are then routed by the MD5 of that key, exactly as by a partition key, so the
slice a key lives in is the one `shardless state get --key` and every other tool computes.

A field path is read in the JVM before the shuffle (`shardless.processor.driver.keys`);
`json_key` here is the same rule in Python, for the `TestDriver` and for the error
messages: the data must be UTF-8 JSON as Spark's `parse_json` reads it (no duplicate field
names, no NaN, no lone surrogates), and the
field must hold a string. Data that is not a JSON object (after JSON white space) has no
key whatever follows; an object is read to its closing brace, and what comes after it is
ignored, as Spark does. A record without one has no key: `KeyChoice.of` says why, and
the job's `--on-decode-error` policy decides what happens to it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardless.processor.errors import AppError, ConfigError

__all__ = [
    "JSON_WHITESPACE",
    "NOT_JSON",
    "NOT_OBJECT",
    "KeyChoice",
    "check_path",
    "json_key",
    "variant_path",
]

NOT_JSON = "its data is not UTF-8 JSON"
NOT_OBJECT = "its data is not a JSON object"
JSON_WHITESPACE = " \t\n\r"
_DECODER = json.JSONDecoder(
    object_pairs_hook=lambda pairs: _no_duplicates(pairs),
    parse_constant=lambda name: _refuse(name),
)


def check_path(path: Any) -> tuple[str, ...]:
    """The field names of a dotted path (`"user.id"` → `("user", "id")`), or ConfigError."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"key field {path!r}: expected a dotted path of JSON field names")
    names = tuple(path.split("."))
    for name in names:
        if not name or "'" in name or "\\" in name:
            raise ConfigError(
                f"key field {path!r}: field names must be non-empty and hold no quote or "
                "backslash (a path is field names joined by dots, such as user.id)"
            )
    return names


def variant_path(path: str) -> str:
    """The path as Spark's `variant_get` reads it: `$['user']['id']`."""
    return "$" + "".join(f"['{name}']" for name in check_path(path))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate field name")
    for name, _ in pairs:
        name.encode("utf-8")  # a lone surrogate in a name: not JSON parse_json reads
    return out


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    return "an array"


def json_key(data: bytes | None, path: str) -> tuple[str | None, str | None]:
    """The string at `path` in the record's JSON data, or None and why there is none."""
    try:
        text = data.decode("utf-8")  # type: ignore[union-attr]
    except (AttributeError, UnicodeError):
        return None, NOT_JSON
    start = len(text) - len(text.lstrip(JSON_WHITESPACE))
    if not text.startswith("{", start):
        return None, NOT_OBJECT
    try:
        value, _ = _DECODER.raw_decode(text, start)
        _strings_are_utf8(value)
    except (UnicodeError, ValueError, RecursionError):
        return None, NOT_JSON
    for name in check_path(path):
        if not isinstance(value, dict) or name not in value:
            return None, f"it has no field {path!r}"
        value = value[name]
    if not isinstance(value, str):
        return None, f"its field {path!r} is {_kind(value)}, not a string"
    return value, None


def _strings_are_utf8(value: Any) -> None:
    """Raise UnicodeError for a lone surrogate in any string (Spark refuses the record)."""
    if isinstance(value, str):
        value.encode("utf-8")
    elif isinstance(value, dict):
        for v in value.values():
            _strings_are_utf8(v)
    elif isinstance(value, list):
        for v in value:
            _strings_are_utf8(v)


@dataclass(frozen=True)
class KeyChoice:
    """How an app chooses its key: a JSON field path, or a function of the record (an
    `Event` whose `key` is still the partition key) returning a `str`."""

    field: str | None = None
    function: Callable[[Any], str] | None = None

    def __post_init__(self) -> None:
        if (self.field is None) == (self.function is None):
            raise ConfigError("a key is chosen by a field path or by a function, one of them")
        if self.field is not None:
            check_path(self.field)

    @staticmethod
    def of_app(value: Any, where: str) -> KeyChoice | None:
        """An app file's `key`: a field path (str) or a function; None when not set."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                return KeyChoice(field=value)
            except ConfigError as exc:
                raise AppError(f"{where}: {exc}") from exc
        if callable(value):
            return KeyChoice(function=value)
        raise AppError(
            f"{where}: key must be a JSON field path such as 'user.id' or a function "
            f"key(record) -> str, not {type(value).__name__}"
        )

    def describe(self) -> str:
        """How the key is chosen, as error messages name it."""
        if self.field is not None:
            return f"key field {self.field!r}"
        return f"key function {getattr(self.function, '__name__', 'key')}()"

    def of(self, record: Any) -> tuple[str | None, str | None]:
        """The record's key, or None and why it has none. A key with a lone surrogate is
        given as `routing.key_text` writes it, as it reaches Spark."""
        if self.field is not None:
            return json_key(record.data, self.field)
        try:
            found = self.function(record)  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - the record's problem, under the record policy
            return None, f"{self.describe()} raised {type(exc).__name__}: {exc}"
        if not isinstance(found, str):
            return None, f"{self.describe()} returned {type(found).__name__}, not a str"
        try:
            found.encode("utf-8")
        except UnicodeEncodeError:
            found = found.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
        return found, None
