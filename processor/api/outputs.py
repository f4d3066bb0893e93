"""Typed outputs: the check an emitted value must pass when an app declares its output
schema.

    output_schema = "user STRING, total BIGINT"      # in the app file (or a StructType)

    ctx.emit({"user": event.key, "total": 3})        # fits
    ctx.emit({"user": event.key})                    # OutputSchemaError: 'total' is missing

The check runs inside `ctx.emit`, on the executor, while the record's handler runs: a value
that does not fit is the handler's error on that record, handled by the record policy
(`--on-handler-error`) before anything of the batch is committed, never a failure later in
Spark. A value that fits is turned into plain JSON that Spark's `from_json` reads back as
exactly the declared types (timestamps as ISO 8601 in UTC, bytes in base64, decimals as
strings), so the sink's typed columns hold what the handler emitted.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Mapping
from datetime import UTC, date, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from pyspark.sql import types as T

from shardless.processor.errors import AppError, ProcessorError

# The columns every output row carries besides the app's fields: no field may take them.
RESERVED = ("slice", "batch_id", "seq", "key", "kind")

_INTS = {
    T.ByteType: 8,
    T.ShortType: 16,
    T.IntegerType: 32,
    T.LongType: 64,
}


class OutputSchemaError(ProcessorError):
    """An emitted value does not fit the app's declared output schema."""


class _Mismatch(Exception):
    def __init__(self, path: str, problem: str) -> None:
        super().__init__(path, problem)
        self.path, self.problem = path, problem


Convert = Callable[[Any, str], Any]


def check_schema(schema: Any) -> T.StructType:
    """`schema` if it can be an output schema: a StructType whose fields do not take the
    output rows' own columns and whose types `from_json` reads (else AppError)."""
    if not isinstance(schema, T.StructType):
        raise AppError(
            f"output_schema must be a Spark DDL string ('user STRING, total BIGINT') or a "
            f"pyspark StructType, not {type(schema).__name__}"
        )
    if not schema.fields:
        raise AppError("output_schema declares no fields")
    taken = [f.name for f in schema.fields if f.name.lower() in RESERVED]
    if taken:
        raise AppError(
            f"output_schema: field(s) {taken} would take the output rows' own columns "
            f"({', '.join(RESERVED)}); rename them"
        )
    _converter(schema, "")  # refuses types it has no conversion for
    return schema


class OutputCheck:
    """Checks one emitted value against the schema and returns it as plain JSON data; raises
    OutputSchemaError naming the app, the key and the field."""

    def __init__(self, schema: T.StructType, app: str | None = None) -> None:
        self.schema = check_schema(schema)
        self.app = app
        self._convert = _converter(schema, "")

    def __call__(self, value: Any, key: str) -> dict[str, Any]:
        try:
            return self._convert(value, "")
        except _Mismatch as m:
            where = f"app {self.app!r}: " if self.app else ""
            field = f"field {m.path!r}" if m.path else "the value"
            raise OutputSchemaError(
                f"{where}output for key {key!r} does not fit the declared output schema: "
                f"{field} {m.problem}"
            ) from None

    def __reduce__(self) -> tuple[Any, ...]:
        return OutputCheck, (self.schema, self.app)


def _found(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _converter(dt: T.DataType, path: str) -> Convert:  # noqa: C901 - one branch per type
    """A function turning a value of type `dt` (at `path`) into JSON data."""
    name = dt.simpleString().upper()

    def wrong(value: Any, at: str) -> _Mismatch:
        return _Mismatch(at, f"must be {name}, got {_found(value)}")

    if isinstance(dt, T.StringType | T.CharType | T.VarcharType):

        def string(v: Any, at: str) -> Any:
            if not isinstance(v, str):
                raise wrong(v, at)
            return v

        return string
    if isinstance(dt, T.BooleanType):

        def boolean(v: Any, at: str) -> Any:
            if not isinstance(v, bool):
                raise wrong(v, at)
            return v

        return boolean
    for cls, bits in _INTS.items():
        if isinstance(dt, cls):
            lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1

            def integer(v: Any, at: str, lo: int = lo, hi: int = hi) -> Any:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise wrong(v, at)
                if not lo <= v <= hi:
                    raise _Mismatch(at, f"is {v}, out of {name}'s range {lo}..{hi}")
                return v

            return integer
    if isinstance(dt, T.FloatType | T.DoubleType):

        def floating(v: Any, at: str) -> Any:
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise wrong(v, at)
            v = float(v)
            if math.isfinite(v):
                return v
            return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")

        return floating
    if isinstance(dt, T.DecimalType):
        step = Decimal(1).scaleb(-dt.scale)
        limit = Decimal(10) ** (dt.precision - dt.scale)

        def decimal(v: Any, at: str) -> Any:
            if isinstance(v, bool) or not isinstance(v, Decimal | int | float):
                raise wrong(v, at)
            try:
                d = Decimal(str(v)) if isinstance(v, float) else Decimal(v)
                q = d.quantize(step)
            except InvalidOperation:
                raise _Mismatch(at, f"is {v!r}, not a finite {name}") from None
            if q != d or abs(q) >= limit:
                raise _Mismatch(at, f"is {v!r}, which {name} cannot hold exactly")
            return str(q)

        return decimal
    if isinstance(dt, T.DateType):

        def day(v: Any, at: str) -> Any:
            if isinstance(v, datetime) or not isinstance(v, date):
                raise wrong(v, at)
            return v.isoformat()

        return day
    if isinstance(dt, T.TimestampNTZType):

        def local_time(v: Any, at: str) -> Any:
            if not isinstance(v, datetime) or v.tzinfo is not None:
                raise _Mismatch(at, f"must be a naive datetime ({name}), got {_found(v)}")
            return v.strftime("%Y-%m-%dT%H:%M:%S.%f")

        return local_time
    if isinstance(dt, T.TimestampType):

        def instant(v: Any, at: str) -> Any:
            if not isinstance(v, datetime):
                raise wrong(v, at)
            utc = v.replace(tzinfo=UTC) if v.tzinfo is None else v.astimezone(UTC)
            return utc.strftime("%Y-%m-%dT%H:%M:%S.%fZ")

        return instant
    if isinstance(dt, T.BinaryType):

        def binary(v: Any, at: str) -> Any:
            if not isinstance(v, bytes | bytearray | memoryview):
                raise wrong(v, at)
            return base64.b64encode(bytes(v)).decode()

        return binary
    if isinstance(dt, T.ArrayType):
        element = _nullable(_converter(dt.elementType, f"{path}[]"), dt.containsNull)

        def array(v: Any, at: str) -> Any:
            if not isinstance(v, list | tuple):
                raise wrong(v, at)
            return [element(x, f"{at}[{i}]") for i, x in enumerate(v)]

        return array
    if isinstance(dt, T.MapType):
        if not isinstance(dt.keyType, T.StringType):
            raise AppError(f"output_schema: {path or 'a'} map's keys must be STRING, not {name}")
        item = _nullable(_converter(dt.valueType, f"{path}[]"), dt.valueContainsNull)

        def mapping(v: Any, at: str) -> Any:
            if not isinstance(v, Mapping):
                raise wrong(v, at)
            out = {}
            for k, x in v.items():
                if not isinstance(k, str):
                    raise _Mismatch(at, f"has a key {_found(k)}; map keys must be str")
                out[k] = item(x, f"{at}[{k!r}]")
            return out

        return mapping
    if isinstance(dt, T.StructType):
        fields = [
            (f.name, _nullable(_converter(f.dataType, _join(path, f.name)), f.nullable))
            for f in dt.fields
        ]
        names = {f.name for f in dt.fields}
        listed = ", ".join(f.name for f in dt.fields)

        def struct(v: Any, at: str) -> Any:
            if not isinstance(v, Mapping):
                raise _Mismatch(at, f"must be a dict with the fields {listed}, got {_found(v)}")
            out = {}
            for field, convert in fields:
                here = _join(at, field)
                if field not in v:
                    raise _Mismatch(here, "is missing")
                out[field] = convert(v[field], here)
            if len(v) != len(out):
                extra = sorted(str(k) for k in v if k not in names)
                raise _Mismatch(_join(at, extra[0]), "is not in the schema")
            return out

        return struct
    raise AppError(f"output_schema: {path or 'the'} type {name} is not supported in outputs")


def _join(path: str, field: str) -> str:
    return f"{path}.{field}" if path else field


def _nullable(convert: Convert, nullable: bool) -> Convert:
    def checked(v: Any, at: str) -> Any:
        if v is None:
            if nullable:
                return None
            raise _Mismatch(at, "is None, but is declared NOT NULL")
        return convert(v, at)

    return checked
