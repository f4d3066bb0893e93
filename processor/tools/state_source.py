"""`shardless_state`: an application's state as a Spark DataFrame, for ad-hoc analysis.

    spark.read.format("shardless_state").option("app", "clicks").load()

one row per value and per map entry: `slice int, key string, sub string, value string,
version long`, `value` as JSON text (`F.from_json` or `get_json_object` to dig in). The
driver reads every slice's head once, so the DataFrame is one consistent cut of what was
committed when it was planned; each Spark partition then materialises its slices from S3
in a scratch directory on an executor, in parallel.

Options:
  app                   the application (required)
  bucket, table, prefix where its state lives (default: shardless-APP, APP)
  slices                which slices: 3, 0-15 or 1,4,9-12 (default: all)
  batch, query          every slice as it stood after this batch of this query (default:
                        the newest committed state)
  slicesPerPartition    slices each Spark partition reads (default 8)
  allowPickle           "true" to decode pickled values (default: refused; unpickling runs
                        code, so only for buckets whose every writer you trust)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

from shardless.changelog import resources
from shardless.changelog.durable import DurableState
from shardless.changelog.inspect import entries, jsonable, opened
from shardless.changelog.layout import AppLocation, Head
from shardless.processor.tools.selection import parse_slices, targets

SCHEMA = "slice int, key string, sub string, value string, version long"


class _Slices(InputPartition):
    def __init__(self, index: int, work: list[tuple[int, Head | None, int]]) -> None:
        super().__init__(index)
        self.work = work  # (slice, head, version)


def location(options: dict[str, str]) -> AppLocation:
    app = options.get("app")
    if not app:
        raise ValueError("shardless_state: option 'app' is required (the application's name)")
    return AppLocation.of(app, options.get("bucket"), options.get("prefix"), options.get("table"))


class StateReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.loc = location(options)
        self.slices = resources.app_slices(self.loc)
        wanted = parse_slices(options.get("slices"), self.slices)
        heads = DurableState(self.loc).heads(wanted)
        batch = options.get("batch")
        versions = targets(
            heads,
            wanted,
            batch=int(batch) if batch is not None else None,
            query=options.get("query"),
            loc=self.loc,
        )
        self.work = [(s, heads.get(s), versions[s]) for s in wanted if versions[s] > 0]
        self.per_partition = max(1, int(options.get("slicesPerPartition", "8")))
        self.allow_pickle = options.get("allowPickle", "false").strip().lower() == "true"

    def partitions(self) -> list[InputPartition]:
        step = self.per_partition
        return [
            _Slices(i, self.work[lo : lo + step])
            for i, lo in enumerate(range(0, len(self.work), step))
        ] or [_Slices(0, [])]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        import json

        assert isinstance(partition, _Slices)
        durable = DurableState(self.loc)
        for s, head, version in partition.work:
            with opened(durable, head, self.slices, version) as store:
                for e in entries(store, s, allow_pickle=self.allow_pickle):
                    yield (e.slice, e.key, e.sub, json.dumps(jsonable(e.value)), e.version)


class StateDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "shardless_state"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return StateReader(dict(self.options))


def read_state(spark: SparkSession, app: str, **options: str | int) -> DataFrame:
    """The state of `app` as a DataFrame (see the module's options)."""
    spark.dataSource.register(StateDataSource)
    reader = spark.read.format("shardless_state").option("app", app)
    for k, v in options.items():
        reader = reader.option(k, str(v))
    return reader.load()
