"""The rows of `shardless state import`: keyed values read from JSON lines or Parquet files,
each checked and encoded exactly as a handler's `ctx.state.set` (or `ctx.state.map.set`)
would store it, and routed to the slice its key's records go to.

A row names its key (`key_field`), its value (`value_field`) and, optionally, a sub-key
(`sub_field`): with a sub-key the value is an entry of the key's map state. Every problem
is an `ImportInputError` naming the file, the line (JSON lines) or row (Parquet, counted
from 1 across the file) and what was wrong.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardless.processor.errors import ProcessorError
from shardless.processor.runtime.routing import key_text, route
from shardless.state import encoding, keys
from shardless.state.errors import EncodingError

FORMATS = ("jsonl", "parquet")
_JSONL_SUFFIXES = {".jsonl", ".ndjson", ".json"}
_PARQUET_BATCH = 8192


class ImportInputError(ProcessorError):
    """A row of the input cannot be imported; nothing was written."""


@dataclass(frozen=True)
class Fields:
    """Which fields of a row hold what."""

    key: str = "key"
    value: str = "value"
    sub: str | None = None  # a map entry's sub-key; None: every row is a key's own value
    value_json: bool = False  # the value field holds JSON text (as `state export` writes)


@dataclass(frozen=True)
class Row:
    """One value to import, encoded and routed."""

    slice: int
    key: str
    sub: str | None
    db_key: bytes
    value: bytes
    where: str  # "file:line 3" or "file:row 3", for errors


def input_files(paths: list[str], fmt: str | None) -> list[tuple[Path, str]]:
    """Each input file with its format: directories give their `*.parquet` (or, with
    `fmt="jsonl"`, `*.jsonl`) files in name order; a file's format is `fmt`, else its
    suffix's."""
    found: list[tuple[Path, str]] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            kind = fmt or "parquet"
            files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix == f".{kind}")
            if not files:
                raise ImportInputError(f"{path}: a directory without *.{kind} files")
            found += [(p, kind) for p in files]
        elif path.is_file():
            kind = fmt or _format_of(path)
            found.append((path, kind))
        else:
            raise ImportInputError(f"{path}: no such file or directory")
    if not found:
        raise ImportInputError("no input: give one or more JSON lines or Parquet files")
    return found


def _format_of(path: Path) -> str:
    if path.suffix == ".parquet":
        return "parquet"
    if path.suffix in _JSONL_SUFFIXES:
        return "jsonl"
    raise ImportInputError(
        f"{path}: cannot tell its format from the name; pass --format jsonl or parquet"
    )


def rows(path: Path, fmt: str, fields: Fields, slices: int) -> Iterator[Row]:
    """The rows of one file, checked, encoded and routed, in file order."""
    records = _jsonl(path) if fmt == "jsonl" else _parquet(path, fields)
    for where, record in records:
        yield to_row(record, where, fields, slices)


def _jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            where = f"{path}:line {n}"
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ImportInputError(f"{where}: not a JSON value ({exc})") from None


def _parquet(path: Path, fields: Fields) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise ImportInputError(f"{path}: not a Parquet file ({exc})") from None
    names = pf.schema_arrow.names
    wanted = [f for f in (fields.key, fields.value, fields.sub) if f is not None]
    missing = [f for f in wanted if f not in names]
    if missing:
        raise ImportInputError(
            f"{path}: no column {', '.join(map(repr, missing))} (its columns: "
            f"{', '.join(names)}); name the fields with --key-field/--value-field/--sub-field"
        )
    n = 0
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, columns=wanted):
        for record in batch.to_pylist():
            n += 1
            yield f"{path}:row {n}", record


def to_row(record: Any, where: str, fields: Fields, slices: int) -> Row:
    """One decoded record as the job would store it: the key as the handler sees it
    (`key_text`), the slice its records are routed to (the key's MD5), the value msgpack."""
    if not isinstance(record, dict):
        raise ImportInputError(f"{where}: expected a JSON object, found {type(record).__name__}")
    key = _text(record, fields.key, where, "key")
    sub = None
    if fields.sub is not None and record.get(fields.sub) is not None:
        sub = _text(record, fields.sub, where, "sub-key")
    if fields.value not in record:
        raise ImportInputError(
            f"{where}: no value field {fields.value!r} (fields: {', '.join(record)}); name it "
            "with --value-field"
        )
    value = record[fields.value]
    if fields.value_json:
        if not isinstance(value, str):
            raise ImportInputError(
                f"{where}: --value-json, but field {fields.value!r} is a "
                f"{type(value).__name__}, not JSON text"
            )
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ImportInputError(f"{where}: field {fields.value!r} is not JSON ({exc})") from None
    handler_key = key_text(key)
    db_key = keys.data_key(handler_key) if sub is None else keys.map_key(handler_key, sub)
    name = handler_key if sub is None else f"{handler_key}[{sub}]"
    try:
        encoded = encoding.encode(value, key=name)
    except EncodingError as exc:
        raise ImportInputError(f"{where}: {exc}") from None
    return Row(route(key, None, slices), handler_key, sub, db_key, encoded, where)


def _text(record: dict, field: str, where: str, what: str) -> str:
    if field not in record or record[field] is None:
        raise ImportInputError(
            f"{where}: no {what} field {field!r} (fields: {', '.join(record)}); name it with "
            f"--{'key' if what == 'key' else 'sub'}-field"
        )
    value = record[field]
    if not isinstance(value, str):
        raise ImportInputError(
            f"{where}: the {what} {field!r} is {value!r}, a {type(value).__name__}; keys are "
            "text (a record's partition key)"
        )
    if not value and what == "key":  # Kinesis partition keys have 1 to 256 characters
        raise ImportInputError(f"{where}: the key {field!r} is empty")
    return value
