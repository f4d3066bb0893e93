"""What each contender of `bench.vs_spark` runs over the workload's records: Spark's own
operators, shardless's runtime behind its plan, and the floors (the same plan with a
function that does nothing, or that only keeps the counts in RocksDB).

The module is pickled by value (as `python -m bench.vs_spark`'s own classes were): Spark's
Python workers and the group owner processes need not find `bench` on their path."""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pandas as pd
from pyspark import cloudpickle

from shardless.processor.api.context import Context, Event
from shardless.processor.runtime.group_runner import GroupRunner
from shardless.processor.runtime.records import GroupInput, prepare

CONTENDERS = (
    "shardless",
    "shardless_worker_stores",
    "shardless_few_slices",
    "apply_in_pandas_with_state",
    "transform_with_state_in_pandas",
    "spark_sql_count",
    "python_floor",
    "rocksdb_floor",
    "handler_floor",
)
# run only when named in --contenders: shardless with its snapshots uploaded by the worker's
# helper process (`snapshot_uploads="helper"`), the A/B of the helper's uploads; and with
# commit_format="chains", the A/B of the commit's cost
OPTIONAL = ("shardless_uploads_in_helper", "shardless_heads")
PANDAS = ("apply_in_pandas_with_state", "transform_with_state_in_pandas")
SLICES = 256  # shardless's default
SHARDLESS = ("shardless", "shardless_worker_stores", "shardless_few_slices", *OPTIONAL)
FLOORS = ("python_floor", "rocksdb_floor", "handler_floor")
FEW_SLICES = 32

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def counter(event: Event, ctx: Context) -> None:
    """The shardless contender: one get and one set per record."""
    ctx.state.set(ctx.state.get(0) + 1)


def _count_group(key: tuple, pdfs: Iterator[pd.DataFrame], state: Any) -> Iterator[pd.DataFrame]:
    n = (state.get[0] if state.exists else 0) + sum(len(p) for p in pdfs)
    state.update((n,))
    yield pd.DataFrame({"partition_key": [key[0]], "count": [n]})


def _count_processor() -> Any:
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class CountProcessor(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.count = handle.getValueState("count", "count long")

        def handleInputRows(self, key, rows, timerValues):  # noqa: ANN001, ANN201, N802, N803
            n = (self.count.get()[0] if self.count.exists() else 0) + sum(len(r) for r in rows)
            self.count.update((n,))
            yield pd.DataFrame({"partition_key": [key[0]], "count": [n]})

        def close(self) -> None:
            pass

    return CountProcessor()


def as_records(df: Any, slices: int) -> Any:
    """Rows of any Spark source shaped for shardless's group plan, as if from one stream
    with one shard.

    `df` needs `partition_key` (string), `sequence_number` (a long, increasing in the order
    records must be processed), `arrival` (timestamp) and `data` (binary). Every record gets
    one stream and shard, so its sequence number alone is its `stream_order`: kept a long,
    which sorts like the source's padded strings and crosses into Python without a string
    per row (`docs/benchmarks.md`, "Measurements behind the code"). What is the same for
    every record (stream, shard, sub-sequence 0) or follows from `stream_order` (the
    sequence number, as a string) is not a column: `FileFedRunner` fills it in, rather than
    Spark shuffling and converting four more columns per row.
    """
    from pyspark.sql import functions as F

    from shardless.processor.runtime.routing import slice_column

    return df.select(
        F.col("partition_key"),
        F.col("arrival"),
        F.col("data"),
        slice_column("partition_key", slices).alias("slice"),
        F.col("sequence_number").cast("long").alias("stream_order"),
    )


# What `as_records` leaves out: the same for every record, or (sequence_number) the string
# of `stream_order`.
FIXED = {
    "stream": "bench",
    "shard": "shardId-000000000000",
    "subsequence": 0,
    "sequence_number": None,
}


class FileFedRunner(GroupRunner):
    """shardless's runtime fed by `as_records`: it fills in the columns left out."""

    def events(self, pdf: pd.DataFrame | None) -> GroupInput:
        return prepare(pdf, FIXED)


class FloorRunner:
    """In shardless's plan in place of its runtime: reads a group's input and returns one
    metrics row counting it, so the `python_floor` contender measures what Spark costs to
    carry records to a Python function behind `applyInPandasWithState` and back (the
    shuffle, Arrow, the Python worker, the operator's own state store), with no state."""

    def __init__(self, handlers: Any, config: Any) -> None:
        pass

    def __call__(
        self, key: tuple, pdfs: Iterator[pd.DataFrame], state: Any
    ) -> Iterator[pd.DataFrame]:
        from shardless.processor.runtime.group_runner import _COLUMNS

        called_at, started = time.time(), time.perf_counter()
        n = self.count(pdfs)
        metrics = {
            "records": n,
            "seconds": time.perf_counter() - started,
            "called_at": called_at,
            "floor": True,
        }
        row = ("metrics", -1, 0, 0, "", json.dumps(metrics))
        yield pd.DataFrame([row], columns=_COLUMNS)

    def count(self, pdfs: Iterator[pd.DataFrame]) -> int:
        """The group's records, read (Arrow to pandas) and counted."""
        return sum(len(p) for p in pdfs)


class RocksdbFloorRunner(FloorRunner):
    """The floor plus the least that keeping the counts in RocksDB costs: a group's records
    folded into a dict per (slice, key), then per slice one multi-get of its distinct keys
    and one WriteBatch of their new counts, in one store per slice (shardless's store
    options). No durability, no events, no handler API, no snapshots, no undo records.

    Two Python workers share `local[2]`'s groups, and a RocksDB store opens in one process
    only: each worker keeps stores of its own (`<local_dir>/rocksdb-floor-p<pid>`), every
    slice's opened at the worker's first call (in the warm-up), so that a group handed to
    the other worker opens nothing in a measured batch. The counts are then split between
    the workers' stores."""

    stores = "rocksdb-floor"  # the folder of this process's stores under the local dir

    def __init__(self, handlers: Any, config: Any) -> None:
        self.root = str(config.local_dir)
        self.slices = int(config.slices)

    def count(self, pdfs: Iterator[pd.DataFrame]) -> int:
        """The records counted per key into the stores, with the cycle collector paused
        as in shardless's groups."""
        from shardless.processor.runtime.process import no_cycle_collection

        with no_cycle_collection():
            return self._fold(pdfs)

    def _fold(self, pdfs: Iterator[pd.DataFrame]) -> int:
        from rocksdict import WriteBatch

        n, counts = 0, {}
        for p in pdfs:
            n += len(p)
            get = counts.get
            for pair in zip(p["slice"].tolist(), p["partition_key"].tolist(), strict=True):
                counts[pair] = get(pair, 0) + 1
        by_slice: dict[int, list[tuple[bytes, int]]] = {}
        for (s, k), c in counts.items():
            by_slice.setdefault(s, []).append((k.encode(), c))
        stores = floor_stores(self.root, self.slices, self.stores)
        for s, items in by_slice.items():
            db = stores[s]
            wb = WriteBatch(raw_mode=True)
            for (name, c), old in zip(items, db.get([k for k, _ in items]), strict=True):
                wb.put(name, msgpack.packb(c if old is None else msgpack.unpackb(old) + c))
            db.write(wb)
        return n


class _FloorState:
    """The handler floor's `ctx.state`: the bound key's value in a dict."""

    __slots__ = ("key", "values")

    def __init__(self) -> None:
        self.key = ""
        self.values: dict[str, Any] = {}

    def get(self, default: Any = None) -> Any:
        return self.values.get(self.key, default)

    def set(self, value: Any) -> None:
        self.values[self.key] = value


class _FloorContext:
    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = _FloorState()


class HandlerFloorRunner(RocksdbFloorRunner):
    """The RocksDB floor with the contender's handler in the loop: per slice one multi-get
    of its distinct keys, then `counter` called once per record against their values in a
    dict, then one WriteBatch of the values it set. The least any processor that runs a
    Python handler per record over RocksDB does; shardless adds its events (the handler
    gets the key here, as `counter` reads no event), the handler API, undo records,
    snapshots and durable commits. Its own stores (`<local_dir>/handler-floor-p<pid>`)."""

    stores = "handler-floor"

    def _fold(self, pdfs: Iterator[pd.DataFrame]) -> int:
        import numpy as np
        from rocksdict import WriteBatch

        frames = [p for p in pdfs if len(p)]
        if not frames:
            return 0
        slices = np.concatenate([p["slice"].to_numpy() for p in frames])
        names = np.concatenate([p["partition_key"].to_numpy(dtype=object) for p in frames])
        order = np.argsort(slices, kind="stable")  # each slice's records in the group's order
        slices, names = slices[order], names[order]
        cuts = [0, *(np.flatnonzero(np.diff(slices)) + 1).tolist(), len(slices)]
        stores = floor_stores(self.root, self.slices, self.stores)
        ctx = _FloorContext()
        state = ctx.state
        for lo, hi in itertools.pairwise(cuts):
            records = names[lo:hi].tolist()
            distinct = list(dict.fromkeys(records))
            encoded = [k.encode() for k in distinct]
            db = stores[int(slices[lo])]
            state.values = values = {
                k: msgpack.unpackb(old)
                for k, old in zip(distinct, db.get(encoded), strict=True)
                if old is not None
            }
            for k in records:
                state.key = k
                counter(k, ctx)  # type: ignore[arg-type]
            wb = WriteBatch(raw_mode=True)
            for k, name in zip(distinct, encoded, strict=True):
                wb.put(name, msgpack.packb(values[k]))
            db.write(wb)
        return len(slices)


# Spark's worker unpickles RocksdbFloorRunner by value (`bench` is not on its path), so a
# global of this module would start empty in every task: the open stores live in a module
# of their own, for the worker's life.
_FLOOR_STORES = "_shardless_bench_rocksdb_floor"


def floor_stores(root: str, slices: int, kind: str = RocksdbFloorRunner.stores) -> dict[int, Any]:
    """This process's floor stores of `kind` under `root`, one per slice, opened on first
    use."""
    from rocksdict import Rdict

    from shardless.state.store import store_options

    opened = sys.modules.setdefault(_FLOOR_STORES, types.ModuleType(_FLOOR_STORES)).__dict__
    key = (root, slices, kind)
    if key not in opened:
        where = Path(root) / f"{kind}-p{os.getpid()}"
        where.mkdir(parents=True, exist_ok=True)
        opened[key] = {s: Rdict(str(where / f"s{s:05d}"), store_options()) for s in range(slices)}
    return opened[key]


def stored_counts(root: str, slices: int, kind: str = RocksdbFloorRunner.stores) -> dict[str, int]:
    """Every key's count in this process's floor stores of `kind` under `root`."""
    total: dict[str, int] = {}
    for db in floor_stores(root, slices, kind).values():
        for k, v in db.items():
            name = bytes(k).decode()
            total[name] = total.get(name, 0) + msgpack.unpackb(v)
    return total


def query_for(
    contender: str,
    spark: Any,
    src: Any,
    app: str,
    local_dir: str,
    slices: int = SLICES,
    group_owner: str = "auto",
) -> Any:
    """The streaming DataFrame each contender runs over the source `src`."""
    from pyspark.sql.streaming.state import GroupStateTimeout

    out_schema = "partition_key string, count long"
    if contender == "spark_sql_count":
        return src.groupBy("partition_key").count()
    if contender == "apply_in_pandas_with_state":
        return (
            src.select("partition_key")
            .groupBy("partition_key")
            .applyInPandasWithState(
                _count_group, out_schema, "count long", "Update", GroupStateTimeout.NoTimeout
            )
        )
    if contender == "transform_with_state_in_pandas":
        return (
            src.select("partition_key")
            .groupBy("partition_key")
            .transformWithStateInPandas(_count_processor(), out_schema, "Update", "None")
        )
    from shardless.changelog import resources
    from shardless.processor.api.handlers import HandlerFactory
    from shardless.processor.driver.config import JobConfig
    from shardless.processor.driver.job import (
        RECORD_COLUMNS,
        group_owner_for,
        group_plan,
        partitions_for,
        runtime_config,
    )

    groups = int(spark.conf.get("spark.sql.shuffle.partitions"))
    cfg = JobConfig(
        app=app,
        streams=("bench",),
        checkpoint="",
        slices=slices,
        groups=groups,
        local_dir=local_dir,
        group_owner="worker" if contender == "shardless_worker_stores" else group_owner,
        snapshot_uploads="helper" if contender == "shardless_uploads_in_helper" else "worker",
        commit_format="heads" if contender == "shardless_heads" else "chains",
    )
    resources.ensure(cfg.location, cfg.slices)
    records = as_records(src, slices)
    partitions, _ = partitions_for(spark, cfg)
    # the floor: the same plan, built with FloorRunner where the runtime would be
    runner = {
        "python_floor": FloorRunner,
        "rocksdb_floor": RocksdbFloorRunner,
        "handler_floor": HandlerFloorRunner,
    }.get(contender, FileFedRunner)
    owner = group_owner_for(spark, cfg).owner
    group_function = runner(HandlerFactory(counter), runtime_config(cfg, partitions, owner))
    columns = tuple(c for c in RECORD_COLUMNS if c in records.columns)
    return group_plan(records, cfg, partitions, group_function, columns)
