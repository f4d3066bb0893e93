"""Typed outputs on the driver: the app's declared output schema parsed by Spark, and each
batch's outputs turned from JSON text into the schema's columns before the sink sees them.

The values were checked against the schema where they were emitted
(`shardless.processor.api.outputs`), before the batch committed; here they are only read
back, so `from_json` runs in FAILFAST mode as a guard that cannot fire for a checked value.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, StructType

from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.errors import AppError

# The columns an output row has besides the app's fields, in the sink's order.
IDENTITY = ("slice", "batch_id", "seq", "key")


def declared(handlers: HandlerFactory, app: str) -> tuple[HandlerFactory, StructType | None]:
    """The handler with its output schema parsed (a DDL string, by the active Spark
    session) and its check naming `app`, and the schema; `(handlers, None)` when untyped."""
    schema = handlers.output_schema
    if schema is None:
        return handlers, None
    if isinstance(schema, str):
        schema = parse(schema)
    return handlers.with_outputs(schema, app), schema


def parse(ddl: str) -> StructType:
    """A DDL schema ("user STRING, total BIGINT") as a StructType, parsed by the active
    Spark session (AppError if it is not one)."""
    try:
        found = DataType.fromDDL(ddl)
    except Exception as exc:  # noqa: BLE001 - Spark's ParseException, whose text says where
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AppError(f"output_schema {ddl!r} is not a Spark DDL schema: {first}") from exc
    if not isinstance(found, StructType):
        raise AppError(
            f"output_schema {ddl!r} is one type ({found.simpleString()}); declare named fields, "
            "e.g. 'user STRING, total BIGINT'"
        )
    return found


def shaped(outputs: DataFrame, schema: StructType | None) -> DataFrame:
    """A batch's output rows (`slice, batch_id, seq, key, value`) with `value`'s JSON as
    the schema's columns after the identity ones; as they are when untyped."""
    if schema is None:
        return outputs
    fields = F.from_json("value", schema, {"mode": "FAILFAST"}).alias("_fields")
    return outputs.select(*IDENTITY, fields).select(*IDENTITY, "_fields.*")
