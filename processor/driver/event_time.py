"""An app's named event time in the job's plan: read from each record before the shuffle,
so that Spark's watermark follows it (`shardless.processor.api.event_time`).

One `mapInArrow` step in Python reads it for a field path and a function alike (the same
`EventTimeChoice.of` the `TestDriver` calls), and adds three columns: `event_time` (the
timestamp the watermark follows; 1970-01-01 for a record without one and for a timer
wake-up row, which never moves the watermark), `event_time_ms` (what the handler sees as
`event.event_time_ms`) and `event_time_error` (why a record has none). A job that names no
event time has none of this: its watermark follows the arrival time, at no cost per record.

Each group's metrics row counts its late records (`late_records`, summed from
`run_slice`'s results by the attempt).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

from shardless.processor.api.context import Event
from shardless.processor.api.event_time import EventTimeChoice
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.driver.keys import Arrivals
from shardless.processor.runtime.config import RuntimeConfig

__all__ = ["EVENT_TIME_COLUMNS", "EventTimeStep", "chosen", "timed"]

# The columns that cross into Python: the handler's `event_time_ms` and why there is none,
# and `event_time` because Spark gives the group function a watermark only when its input
# holds the column the watermark follows.
EVENT_TIME_COLUMNS = ("event_time", "event_time_ms", "event_time_error")
_TIMESTAMP = pa.timestamp("us", tz="UTC")


def chosen(event_time_field: str | None, handlers: HandlerFactory) -> EventTimeChoice | None:
    """The job's event time: `--event-time-field` when given, else the app's
    `event_time`, else None (the arrival time)."""
    if event_time_field:
        return EventTimeChoice(field=event_time_field)
    return getattr(handlers, "event_time", None)


def timed(records: DataFrame, choice: EventTimeChoice) -> DataFrame:
    """`records` with the event time `choice` names: `event_time`, `event_time_ms`,
    `event_time_error`."""
    schema = StructType(
        [
            *records.schema.fields,
            StructField("event_time", TimestampType()),
            StructField("event_time_ms", LongType()),
            StructField("event_time_error", StringType()),
        ]
    )
    return records.mapInArrow(EventTimeStep(choice), schema)


class EventTimeStep:
    """The `mapInArrow` function that reads each record's event time (for a function: an
    `Event` whose `key` is its partition key)."""

    def __init__(self, choice: EventTimeChoice) -> None:
        self.choice = choice

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        of = self.choice.of
        for batch in batches:
            cols = {
                name: batch.column(name).to_pylist()
                for name in ("stream", "shard", "sequence_number", "subsequence", "partition_key")
            }
            arrivals = Arrivals(batch.column("arrival"))
            found: list[int] = []
            errors: list[str | None] = []
            for i, raw in enumerate(batch.column("data").to_pylist()):
                if raw is None:  # a timer wake-up row, not a record
                    found.append(0)
                    errors.append(None)
                    continue
                event = Event(
                    cols["stream"][i], cols["shard"][i], cols["sequence_number"][i],
                    cols["subsequence"][i], cols["partition_key"][i], arrivals, raw, i,
                )  # fmt: skip
                at, why = of(event)
                found.append(0 if at is None else at)
                errors.append(why)
            ms = pa.array(found, pa.int64())
            stamps = pc.multiply(ms, 1000).cast(_TIMESTAMP)
            yield pa.RecordBatch.from_arrays(
                [*batch.columns, stamps, ms, pa.array(errors, pa.string())],
                names=[*batch.schema.names, *EVENT_TIME_COLUMNS],
            )


def event_time_config(config: RuntimeConfig, on_late: str) -> RuntimeConfig:
    """`config` for a job whose records carry an event time: late records are judged."""
    policy = dataclasses.replace(config.policy, event_time=True, on_late=on_late)
    return dataclasses.replace(config, policy=policy)
