"""`shardless_timers`: wakes the slices with pending timers in a new checkpoint's first batch.

Which slices have pending timers, and when they are due, lives in Spark's group state,
which belongs to one checkpoint. A new checkpoint (a COMMITTED start, another group count,
after a roll-back or a re-slice) has none, so a slice that gets no more records would never
fire its timers. The slices' heads keep the same index durably (`Head.next_timer`); this
source reads it once, when a new checkpoint plans its first batch, and sends one wake-up
row (no data) per such slice through the same shuffle as records. The runtime then looks
at the slice's timers, fires the due ones, and hands the rest to Spark's group state.

Options: `table` (the application's DynamoDB table), `slices`.

The slices are fixed in the offset (`{"v": 1, "slices": [...]}`), so a re-run of that
batch wakes exactly the same slices; once past it, the source has nothing more to send.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, SupportsTriggerAvailableNow

from shardless.changelog.durable import DurableState
from shardless.changelog.layout import AppLocation
from shardless.processor.errors import ConfigError
from shardless.processor.kinesis.rows import ARROW_SCHEMA, SCHEMA
from shardless.state.slices import check_slices

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)  # never moves the watermark


def wake_rows(slices: list[int]) -> pa.RecordBatch:
    """One row per slice in the record schema, with no data (what marks a wake-up)."""
    n = len(slices)
    empty = [""] * n
    columns = {
        "stream": empty,
        "shard": empty,
        "sequence_number": empty,
        "subsequence": [0] * n,
        "partition_key": empty,
        "explicit_hash_key": [None] * n,
        "arrival": [_EPOCH] * n,
        "data": [None] * n,
        "slice": slices,
        "stream_order": empty,
        "behind_ms": [None] * n,
    }
    arrays = [pa.array(columns[f.name], f.type) for f in ARROW_SCHEMA]
    return pa.RecordBatch.from_arrays(arrays, schema=ARROW_SCHEMA)


def pending_slices(loc: AppLocation, slices: int) -> list[int]:
    """The slices whose heads (read through their chains) say timers may be pending."""
    heads = DurableState(loc).heads(list(range(slices)))
    return sorted(s for s, h in heads.items() if h.timers_pending)


class TimerDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "shardless_timers"

    def schema(self) -> str:
        return SCHEMA

    def streamReader(self, schema) -> DataSourceStreamReader:  # noqa: ANN001, N802
        return TimerStreamReader(self.options)


class _Wake(InputPartition):
    def __init__(self, slices: list[int]) -> None:
        super().__init__(len(slices))
        self.slices = slices


class TimerStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict[str, str]) -> None:
        if not options.get("table") or not options.get("bucket"):
            raise ConfigError(
                "the timer source needs options table=<DynamoDB table> and bucket=<S3 bucket> "
                "(and app, prefix): the application's location"
            )
        self.loc = AppLocation(
            app=options.get("app", ""),
            bucket=options["bucket"],
            prefix=options.get("prefix", ""),
            table=options["table"],
        )
        try:
            self.slices = check_slices(int(options.get("slices", 256)))
        except ValueError as exc:
            raise ConfigError(f"option slices: {exc}") from exc

    def initialOffset(self) -> dict:  # noqa: N802
        return {"v": 0}

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:  # noqa: N802
        if start.get("v", 0) >= 1:
            return start  # woken already: nothing more, ever
        return {"v": 1, "slices": pending_slices(self.loc, self.slices)}

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802
        pass

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        if start.get("v", 0) >= 1 or not end.get("slices"):
            return []
        return [_Wake(list(end["slices"]))]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, _Wake)
        yield wake_rows(partition.slices)

    def commit(self, end: dict) -> None:
        pass
