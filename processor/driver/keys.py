"""An app's chosen key in the job's plan: read from each record before the shuffle, and the
record's `slice` routed by the key's MD5, in the same shuffle that groups the slices.

A JSON field path is read in the JVM (`parse_json`, `variant_get`), so the routing of such a
job stays in the JVM too; a key function runs in Python on the executors (`mapInArrow`)
before the shuffle, one call per record. Either way the rows gain `key` (null when the
record has none) and `key_error` (why), and a record without a key keeps the slice the
source gave it (its partition key's), so that the record policy can deal with it where the
handler runs (`shardless.processor.runtime.slice_runner`). The producer's explicit hash
keys are not used for records with a chosen key: they belong to the partition key.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType

from shardless.processor.api.context import Event
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.api.keys import (
    JSON_WHITESPACE,
    NOT_JSON,
    NOT_OBJECT,
    KeyChoice,
    variant_path,
)
from shardless.processor.runtime.routing import slice_column

__all__ = ["KeyFunctionStep", "chosen", "keyed"]

KEY_COLUMNS = ("key", "key_error")


def chosen(key_field: str | None, handlers: HandlerFactory) -> KeyChoice | None:
    """The job's key: `--key-field` when given, else the app's `key`, else None (the
    partition key)."""
    return KeyChoice(field=key_field) if key_field else handlers.key


def keyed(records: DataFrame, choice: KeyChoice, slices: int) -> DataFrame:
    """`records` with the chosen key (`key`, `key_error`) and each keyed record's `slice`
    routed by it, as `shardless.processor.runtime.routing.route(key, None, slices)` does."""
    if choice.field is not None:
        with_key = _field_key(records, choice.field)
    else:
        schema = StructType(
            [*records.schema.fields, *(StructField(c, StringType()) for c in KEY_COLUMNS)]
        )
        with_key = records.mapInArrow(KeyFunctionStep(choice), schema)
    routed = F.when(F.col("key").isNotNull(), slice_column("key", slices))
    return with_key.withColumn("slice", routed.otherwise(F.col("slice")))


def _field_key(records: DataFrame, path: str) -> DataFrame:
    """The string at `path` in each record's JSON data, and why there is none (the same
    words as `shardless.processor.api.keys.json_key`). Three projections, so that Spark
    parses each record once rather than once per use."""
    where = variant_path(path)
    text = F.col("data").cast("string")
    utf8 = F.call_function("is_valid_utf8", text)
    an_object = F.ltrim(text, F.lit(JSON_WHITESPACE)).startswith("{")
    parsed = F.when(utf8 & an_object, F.try_parse_json(text))
    found = F.call_function("variant_get", F.col("_key_json"), F.lit(where))
    kind = F.expr("schema_of_variant(_key_found)")
    what = (
        F.when(kind == "VOID", "null")
        .when(kind == "BOOLEAN", "a boolean")
        .when(kind.startswith("OBJECT"), "an object")
        .when(kind.startswith("ARRAY"), "an array")
        .otherwise("a number")
    )
    quoted = repr(path)
    error = (
        F.when(F.col("data").isNull(), F.lit(None))
        .when(~utf8, F.lit(NOT_JSON))
        .when(~an_object, F.lit(NOT_OBJECT))
        .when(F.col("_key_json").isNull(), F.lit(NOT_JSON))
        .when(F.col("_key_found").isNull(), F.lit(f"it has no field {quoted}"))
        .when(
            kind != "STRING",
            F.concat(F.lit(f"its field {quoted} is "), what, F.lit(", not a string")),
        )
    )
    key = F.when(kind == "STRING", F.expr("variant_get(_key_found, '$', 'string')"))
    return (
        records.withColumn("_key_json", parsed)
        .withColumn("_key_found", found)
        .withColumn("key", key)
        .withColumn("key_error", error.cast("string"))
        .drop("_key_json", "_key_found")
    )


class Arrivals:
    """A column of arrival times read one row at a time, when a key or event-time function
    asks."""

    def __init__(self, column: pa.Array) -> None:
        self.column = column

    def __getitem__(self, row: int) -> Any:
        return self.column[row].as_py()


class KeyFunctionStep:
    """The `mapInArrow` function that calls the app's key function once per record (an
    `Event` whose `key` is still the partition key) and adds `key` and `key_error`."""

    def __init__(self, choice: KeyChoice) -> None:
        self.choice = choice

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        of = self.choice.of
        for batch in batches:
            cols = {
                name: batch.column(name).to_pylist()
                for name in ("stream", "shard", "sequence_number", "subsequence")
            }
            keys, data = batch.column("partition_key").to_pylist(), batch.column("data")
            arrivals = Arrivals(batch.column("arrival"))
            found: list[str | None] = []
            errors: list[str | None] = []
            for i, raw in enumerate(data.to_pylist()):
                if raw is None:  # a timer wake-up row, not a record
                    found.append(None)
                    errors.append(None)
                    continue
                event = Event(
                    cols["stream"][i], cols["shard"][i], cols["sequence_number"][i],
                    cols["subsequence"][i], keys[i], arrivals, raw, i,
                )  # fmt: skip
                key, error = of(event)
                found.append(key)
                errors.append(error)
            yield pa.RecordBatch.from_arrays(
                [*batch.columns, pa.array(found, pa.string()), pa.array(errors, pa.string())],
                names=[*batch.schema.names, *KEY_COLUMNS],
            )
