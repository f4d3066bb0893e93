"""shardless against Spark's own stateful operators, on one workload and one session:
`python -m bench.vs_spark`.

Each workload is written once as Parquet files of one micro-batch each, and every contender
reads the same files through Spark's file source (`maxFilesPerTrigger=1`), in the same
SparkSession (local[2], RocksDB state store provider), with the same `foreachBatch` sink:
one small action per batch that also checks the batch's result against a NumPy fold of the
same keys. Sustained rate = records / summed `triggerExecution` over the batches after the
first (warm-up) one; latency = `triggerExecution` per batch. The whole measurement runs
again in batches of `--also-batch` records (200,000; the first run's `--batch` is 100,000).

Contenders, each counting records per key:
  shardless                        the counter handler (one get, one set per record), with
                                   durable commits to moto server (S3, DynamoDB) per batch,
                                   in the default configuration (--group-owner auto: owner
                                   processes, as local[2] runs two tasks at once)
  shardless_worker_stores          the same, groups run by the Python worker Spark hands
                                   them (--group-owner worker)
  shardless_few_slices             the shardless contender with --few-slices (32) slices
                                   instead of the default 256
  apply_in_pandas_with_state       grouped by key, state = the count
  transform_with_state_in_pandas   a ValueState count per key
  spark_sql_count                  groupBy(key).count(), Spark's JVM aggregation
  python_floor                     shardless's plan with a no-op Python function
  rocksdb_floor                    the same plan keeping the counts in a local RocksDB store
                                   per slice: a dict fold, then one multi-get and one
                                   WriteBatch per slice and batch (no durability, no events)
Only when named in --contenders:
  shardless_uploads_in_helper      the shardless contender with its snapshots uploaded by
                                   the worker's helper process (--snapshot-uploads helper)
                                   instead of threads of the group's process
  shardless_heads                  the shardless contender committing every changed
                                   slice's head (--commit-format heads, the format before
                                   chains: docs/design/group-commits.md)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from bench.state_loop import ZIPF_S, key_ids
from shardless.processor.api.context import Context, Event
from shardless.processor.driver import placement
from shardless.processor.local.faults.procs import cpu_seconds
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
)
# run only when named in --contenders: shardless with its snapshots uploaded by the worker's
# helper process (`snapshot_uploads="helper"`), the A/B of the helper's uploads; and with
# commit_format="chains", the A/B of the commit's cost
OPTIONAL = ("shardless_uploads_in_helper", "shardless_heads")
PANDAS = ("apply_in_pandas_with_state", "transform_with_state_in_pandas")
WORKLOADS = {  # name: (distribution, distinct keys)
    "uniform_1m": ("uniform", 1_000_000),
    "zipf_1m": ("zipf", 1_000_000),
    "small_1k": ("uniform", 1_000),
}
SLICES = 256  # shardless's default
SHARDLESS = ("shardless", "shardless_worker_stores", "shardless_few_slices", *OPTIONAL)
FLOORS = ("python_floor", "rocksdb_floor")
FEW_SLICES = 32
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
SOURCE_SCHEMA = "partition_key string, sequence_number long, arrival timestamp, data binary"
PAYLOAD = b'{"v":1}'
START = datetime(2026, 1, 1, tzinfo=UTC)
GOALS = {"vs_faster_pandas": 10.0, "vs_spark_sql_count": 1.0, "vs_python_floor": 0.75}
# Where a workload's bar is higher: skewed keys, where the pandas operators do worst.
GOAL_BY_WORKLOAD = {("zipf_1m", "vs_faster_pandas"): 12.0}
RUN_TIMEOUT_S = 1800
ALSO_BATCH = 200_000  # the other end of the batch sizes (--also-batch)


def counter(event: Event, ctx: Context) -> None:
    """The shardless contender: one get and one set per record."""
    ctx.state.set(ctx.state.get(0) + 1)


# -- the workload ---------------------------------------------------------------------------


@dataclass
class Workload:
    """A workload's files (one per micro-batch) and what each batch must produce."""

    name: str
    root: Path
    files: list[Path]
    sizes: list[int]
    distinct: list[int]  # distinct keys per batch: Spark's operators emit one row each
    totals: list[int]  # the sum of those keys' counts after the batch
    counts: np.ndarray  # every key's count after the last batch

    def prefix(self, batches: int) -> Path:
        """A folder with the first `batches` files (hard links), for the slow contenders."""
        folder = self.root / f"first-{batches}"
        if not folder.exists():
            folder.mkdir()
            for f in self.files[:batches]:
                os.link(f, folder / f.name)
        return folder


def build(
    name: str, dist: str, keys: int, records: int, size: int, seed: int, root: Path
) -> Workload:
    """Write the workload's batches as Parquet files and fold their expected counts."""
    ids = np.asarray(key_ids(dist, records, keys, seed), dtype=np.int64)
    names = np.array([f"user-{i}" for i in range(keys)], dtype=object)
    folder = root / name / "all"
    folder.mkdir(parents=True)
    counts = np.zeros(keys, dtype=np.int64)
    w = Workload(name, root / name, [], [], [], [], counts)
    for b, lo in enumerate(range(0, records, size)):
        chunk = ids[lo : lo + size]
        np.add.at(counts, chunk, 1)
        seen = np.unique(chunk)
        arrival = [START.timestamp() * 1e6 + (lo + i) * 1000 for i in range(len(chunk))]
        table = pa.table(
            {
                "partition_key": pa.array(names[chunk], pa.string()),
                "sequence_number": pa.array(np.arange(lo, lo + len(chunk)), pa.int64()),
                "arrival": pa.array(np.array(arrival, dtype="int64"), pa.timestamp("us", "UTC")),
                "data": pa.array([PAYLOAD] * len(chunk), pa.binary()),
            }
        )
        path = folder / f"batch-{b:05d}.parquet"
        pq.write_table(table, path)
        os.utime(path, (1_700_000_000 + b, 1_700_000_000 + b))  # the file source's order
        w.files.append(path)
        w.sizes.append(len(chunk))
        w.distinct.append(len(seen))
        w.totals.append(int(counts[seen].sum()))
    return w


# -- the contenders -------------------------------------------------------------------------


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
        stores = floor_stores(self.root, self.slices)
        for s, items in by_slice.items():
            db = stores[s]
            wb = WriteBatch(raw_mode=True)
            for (name, c), old in zip(items, db.get([k for k, _ in items]), strict=True):
                wb.put(name, msgpack.packb(c if old is None else msgpack.unpackb(old) + c))
            db.write(wb)
        return n


# Spark's worker unpickles RocksdbFloorRunner by value (`bench` is not on its path), so a
# global of this module would start empty in every task: the open stores live in a module
# of their own, for the worker's life.
_FLOOR_STORES = "_shardless_bench_rocksdb_floor"


def floor_stores(root: str, slices: int) -> dict[int, Any]:
    """This process's RocksDB floor stores under `root`, one per slice, opened on first use."""
    from rocksdict import Rdict

    from shardless.state.store import store_options

    opened = sys.modules.setdefault(_FLOOR_STORES, types.ModuleType(_FLOOR_STORES)).__dict__
    key = (root, slices)
    if key not in opened:
        where = Path(root) / f"rocksdb-floor-p{os.getpid()}"
        where.mkdir(parents=True, exist_ok=True)
        opened[key] = {s: Rdict(str(where / f"s{s:05d}"), store_options()) for s in range(slices)}
    return opened[key]


def stored_counts(root: str, slices: int) -> dict[str, int]:
    """Every key's count in this process's RocksDB floor stores under `root`."""
    total: dict[str, int] = {}
    for db in floor_stores(root, slices).values():
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
    runner = {"python_floor": FloorRunner, "rocksdb_floor": RocksdbFloorRunner}.get(
        contender, FileFedRunner
    )
    owner = group_owner_for(spark, cfg).owner
    group_function = runner(HandlerFactory(counter), runtime_config(cfg, partitions, owner))
    columns = tuple(c for c in RECORD_COLUMNS if c in records.columns)
    return group_plan(records, cfg, partitions, group_function, columns)


def group_end(called_at: float, seconds: float, timings: dict[str, float]) -> float:
    """When a group's call returned its result: `seconds` is the group's run, which starts
    after the worker read its input (`input`) and, with owner processes, after the records
    reached the owner (`owner_request`). Adding only `seconds` to the call's start put a
    shardless group's end 0.03-0.06 s early and that time into Spark's part after it."""
    return called_at + timings.get("input", 0.0) + timings.get("owner_request", 0.0) + seconds


@dataclass
class Run:
    """One contender on one workload: per-batch records and seconds, as Spark reported them."""

    contender: str
    records: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)  # shardless: per batch
    durations: list[dict[str, int]] = field(default_factory=list)  # Spark's, ms per batch
    started: list[datetime] = field(default_factory=list)  # when each batch's trigger began
    wall_seconds: float = 0.0
    emulator_cpu_seconds: float = 0.0

    def steady(self) -> tuple[list[int], list[float]]:
        return self.records[1:], self.seconds[1:]

    def timeline(self) -> list[dict[str, float]]:
        """shardless, per batch: seconds from the trigger's start until the first group was
        called, until the last group returned, and until the trigger ended."""
        out = []
        for start, secs, groups in zip(self.started, self.seconds, self.groups, strict=False):
            begin = start.timestamp()
            calls = groups.get("called_at", [])
            timings = groups.get("timings") or [{}] * len(calls)
            # a group without a call time is left out with its own seconds and timings
            known = [
                (c, g, t) for c, g, t in zip(calls, groups["group_s"], timings, strict=True) if c
            ]
            if not known:
                continue
            called = [c for c, _, _ in known]
            ends = [group_end(c, g, t) for c, g, t in known]
            out.append(
                {
                    "first_call_s": round(min(called) - begin, 3),
                    "last_return_s": round(max(ends) - begin, 3),
                    "trigger_s": round(secs, 3),
                }
            )
        return out

    def summary(self) -> dict[str, Any]:
        n, s = self.steady()
        lat = sorted(s)
        return {
            "records_per_s": round(sum(n) / sum(s)) if s else None,
            "measured_records": sum(n),
            "measured_batches": len(n),
            "warmup_records": self.records[0] if self.records else 0,
            "warmup_s": round(self.seconds[0], 3) if self.seconds else None,
            "p50_batch_s": round(statistics.median(lat), 3) if lat else None,
            "p99_batch_s": round(lat[max(0, -(-99 * len(lat) // 100) - 1)], 3) if lat else None,
            "batch_s": [round(x, 3) for x in self.seconds],
            "wall_s": round(self.wall_seconds, 1),
            "moto_cpu_s_per_batch": round(self.emulator_cpu_seconds / len(self.records), 2)
            if self.records
            else None,
            "errors": self.errors,
            "spark_duration_ms": self.durations,
            **({"handovers": handovers(self.groups[1:])} if self.groups else {}),
            **({"groups": self.groups} if self.groups else {}),
            **({"timeline": self.timeline()} if self.groups else {}),
        }


def handovers(batches: list[dict[str, Any]]) -> int:
    """How many times a group ran in another process than in its previous batch: with stores
    in the Python workers, each such hand-over catches the group's slices up in the new
    worker, so records/s depends on how Spark happened to place the groups."""
    last: dict[Any, Any] = {}
    count = 0
    for batch in batches:
        for group, pid in zip(batch.get("group_ids", []), batch.get("pids", []), strict=True):
            if group in last and last[group] != pid:
                count += 1
            last[group] = pid
    return count


def run(
    contender: str,
    spark: Any,
    w: Workload,
    batches: int,
    tmp: Path,
    moto: int | None,
    slices: int = SLICES,
    group_owner: str = "auto",
) -> Run:
    """Run `contender` over the first `batches` files of `w` and check every batch."""
    from pyspark.sql import functions as F

    folder = w.root / "all" if batches >= len(w.files) else w.prefix(batches)
    src = (
        spark.readStream.schema(SOURCE_SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(folder))
    )
    app = f"bench-{w.name.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
    df = query_for(contender, spark, src, app, str(tmp / "stores"), slices, group_owner)
    result = Run(contender)

    def check(batch: Any, batch_id: int) -> None:
        if contender in FLOORS:
            rows = [json.loads(r.value) for r in batch.where("kind = 'metrics'").collect()]
            got, want = sum(m["records"] for m in rows), w.sizes[batch_id]
            if got != want:
                result.errors.append(f"batch {batch_id}: {got} records seen, not {want}")
            if not all(m.get("floor") for m in rows):
                result.errors.append(f"batch {batch_id}: the floor ran shardless's runtime")
            result.groups.append(
                {
                    "group_s": [round(m["seconds"], 3) for m in rows],
                    "called_at": [m.get("called_at") for m in rows],
                }
            )
            return
        if contender in SHARDLESS:
            metrics = [json.loads(r.value) for r in batch.where("kind = 'metrics'").collect()]
            got = sum(m["records"] for m in metrics)
            result.groups.append(
                {
                    "group_s": [round(m["seconds"], 2) for m in metrics],
                    "restores": sum(len(m["restores"]) for m in metrics),
                    "committed_slices": sum(m["committed_slices"] for m in metrics),
                    "segment_bytes": sum(m["segment_bytes"] for m in metrics),
                    "heads_read": sum(m.get("heads_read", 0) for m in metrics),
                    "transactions": sum(m.get("transactions", 0) for m in metrics),
                    "attempts": [m.get("attempts", 1) for m in metrics],
                    "timings": [m.get("timings", {}) for m in metrics],
                    "called_at": [m.get("called_at") for m in metrics],
                    "pids": [m.get("pid") for m in metrics],
                    "group_ids": [m.get("group") for m in metrics],
                }
            )
            want = w.sizes[batch_id]
            if got != want:
                result.errors.append(f"batch {batch_id}: {got} records processed, not {want}")
            return
        row = batch.agg(F.count(F.lit(1)).alias("rows"), F.sum("count").alias("total")).first()
        want = (w.distinct[batch_id], w.totals[batch_id])
        if (row.rows, row.total) != want:
            result.errors.append(f"batch {batch_id}: (rows, sum of counts) {row} != {want}")

    started, cpu = time.perf_counter(), cpu_seconds(moto)
    query = (
        df.writeStream.outputMode("update")
        .option("checkpointLocation", str(tmp / f"ck-{app}-{contender}"))
        .foreachBatch(check)
        .trigger(availableNow=True)
        .start()
    )
    if not query.awaitTermination(RUN_TIMEOUT_S):
        query.stop()
        result.errors.append(f"stopped after {RUN_TIMEOUT_S} s")
    result.wall_seconds = time.perf_counter() - started
    if contender in SHARDLESS:
        _stop_owners(spark, str(tmp / "stores"), app)
    result.emulator_cpu_seconds = cpu_seconds(moto) - cpu
    for p in query.recentProgress:
        if p.numInputRows:
            result.records.append(int(p.numInputRows))
            result.seconds.append(p.durationMs["triggerExecution"] / 1000)
            result.durations.append(dict(p.durationMs))
            result.started.append(datetime.fromisoformat(p.timestamp.replace("Z", "+00:00")))
    if len(result.records) != batches:
        result.errors.append(f"{len(result.records)} batches with data, expected {batches}")
    if contender in SHARDLESS and not result.errors:
        result.errors += verify_durable(app, w, slices)
    return result


def _stop_owners(spark: Any, local_dir: str, app: str) -> None:
    """Stop the run's group owner processes (if any), so that they use no CPU or memory
    in the runs after it."""
    from shardless.processor.runtime import owner
    from shardless.processor.runtime.grouping import group_keys

    for g in group_keys(int(spark.conf.get("spark.sql.shuffle.partitions"))):
        owner.stop(local_dir, app, g)


def verify_durable(app: str, w: Workload, slices: int) -> list[str]:
    """shardless's state rebuilt from S3 and DynamoDB alone equals the NumPy fold."""
    from shardless.changelog.durable import DurableState
    from shardless.changelog.layout import AppLocation
    from shardless.changelog.restore import materialize
    from shardless.state import encoding
    from shardless.state.keys import is_value_key, record_key

    durable = DurableState(AppLocation.default(app))
    found = np.zeros_like(w.counts)
    with tempfile.TemporaryDirectory(prefix="shardless-verify-") as scratch:
        for s, head in durable.heads(list(range(slices))).items():
            store, _ = materialize(durable, head, Path(scratch) / str(s), slices)
            for k, v in store.items():
                if is_value_key(k):
                    found[int(record_key(k).removeprefix("user-"))] = encoding.decode(v)
            store.close()
    bad = int(np.count_nonzero(found != w.counts))
    return [f"{bad} keys' durable counts differ from the fold"] if bad else []


# -- the run --------------------------------------------------------------------------------


def spark_session(master: str, groups: int) -> Any:
    """One session for every contender: shardless's own, with the RocksDB provider."""
    from shardless.processor.driver.spark import session

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = session(master, groups=groups, app_name="shardless-bench-vs-spark")
    spark.conf.set("spark.sql.streaming.stateStore.providerClass", ROCKSDB)
    spark.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    return spark


def slices_of(contender: str, args: argparse.Namespace) -> int:
    """The slice count a shardless contender runs with."""
    return args.few_slices if contender == "shardless_few_slices" else args.slices


def ratios(rates: dict[str, float | None]) -> dict[str, float | None]:
    ours = rates.get("shardless")
    return {
        f"shardless_vs_{c}": round(ours / r, 2) if ours and r else None
        for c, r in rates.items()
        if c != "shardless"
    }


def goals(workloads: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The issue's goals per 1M-key workload, for shardless with the default slice count
    (`<workload>_<goal>`) and, where it ran, with few slices (`..._few_slices`)."""
    out = {}
    for name in ("uniform_1m", "zipf_1m"):
        rates = workloads.get(name) or {}
        pandas_best = max((rates.get(c) or 0) for c in PANDAS)
        sql = rates.get("spark_sql_count")
        floor = rates.get("python_floor")
        for contender, suffix in (("shardless", ""), ("shardless_few_slices", "_few_slices")):
            ours = rates.get(contender)
            if not ours:
                continue
            values = {
                "vs_faster_pandas": ours / pandas_best if pandas_best else None,
                "vs_spark_sql_count": ours / sql if sql else None,
                "vs_python_floor": ours / floor if floor else None,
            }
            for goal, target in GOALS.items():
                target = GOAL_BY_WORKLOAD.get((name, goal), target)
                if values[goal] is not None:
                    out[f"{name}_{goal}{suffix}"] = {
                        "target": target,
                        "value": round(values[goal], 2),
                        "met": values[goal] >= target,
                    }
    return out


def warm_up(
    spark: Any,
    args: argparse.Namespace,
    contenders: list[str],
    tmp: Path,
    moto: int | None,
) -> dict[str, Any]:
    """Run every contender over `--warmup-batches` batches of a workload of its own (1,000
    uniform keys, another seed) before anything is measured, and discard the rates.

    A new JVM spends its first tens of seconds compiling Spark's hot paths (the C2 JIT
    thread took 15 CPU-seconds of a shardless-only run on 2 cores, competing with the
    batches), so without this whichever contender ran first paid for the compilation the
    later ones profit from. Errors of the warm-up runs are kept: a contender that fails
    here would fail measured too."""
    if args.warmup_batches <= 0:
        return {}
    name = "warm_up"
    records = args.warmup_batches * args.batch
    w = build(name, "uniform", 1_000, records, args.batch, args.seed + 1000, tmp / "warm-up")
    out: dict[str, Any] = {}
    try:
        for contender in contenders:
            print(f"warm-up: {contender}, {args.warmup_batches} batches", file=sys.stderr)
            summary = run(
                contender,
                spark,
                w,
                args.warmup_batches,
                tmp,
                moto,
                slices_of(contender, args),
                args.group_owner,
            ).summary()
            out[contender] = {
                k: summary[k] for k in ("records_per_s", "batch_s", "wall_s", "errors")
            }
    finally:
        shutil.rmtree(tmp / "warm-up", ignore_errors=True)
    return out


def measure(
    master: str,
    args: argparse.Namespace,
    contenders: list[str],
    workloads: list[str],
    tmp: Path,
    moto: int | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every contender on every workload in one session; returns (rates, runs) by workload."""
    total = -(-args.records // args.batch)
    rates_by: dict[str, Any] = {}
    runs_by: dict[str, Any] = {}
    spark = spark_session(master, args.groups)
    try:
        warm = warm_up(spark, args, contenders, tmp, moto)
        if warm:
            runs_by["warm_up"] = warm
        for i, name in enumerate(workloads):
            dist, keys = WORKLOADS[name]
            data = tmp / f"data-{uuid.uuid4().hex[:6]}"
            w = build(name, dist, keys, args.records, args.batch, args.seed + i, data)
            rounds: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
            for r in range(args.rounds):
                for contender in contenders:
                    slow = contender in PANDAS and keys > 10_000
                    batches = min(total, args.slow_batches) if slow else total
                    print(
                        f"{master} {name}: {contender}, {batches} batches (round {r + 1})",
                        file=sys.stderr,
                        flush=True,
                    )
                    summary = run(
                        contender,
                        spark,
                        w,
                        batches,
                        tmp,
                        moto,
                        slices_of(contender, args),
                        args.group_owner,
                    ).summary()
                    rounds[contender].append(summary)
                    print(f"{master} {name}: {contender} {json.dumps(summary)}", file=sys.stderr)
            runs = {c: median_run(found) for c, found in rounds.items()}
            rates = {c: summary["records_per_s"] for c, summary in runs.items()}
            rates_by[name] = rates
            runs_by[name] = {**runs, "ratios": ratios(rates), "keys": keys, "distribution": dist}
            if len(next(iter(rounds.values()), [])) > 1:
                runs_by[name]["rounds"] = {
                    c: [x["records_per_s"] for x in found] for c, found in rounds.items()
                }
            shutil.rmtree(data, ignore_errors=True)
    finally:
        spark.stop()
    return rates_by, runs_by


def median_run(found: list[dict[str, Any]]) -> dict[str, Any]:
    """Of one contender's rounds, the run with the median rate (the lower of the middle
    two for an even count; a run without a rate counts as the slowest)."""
    ordered = sorted(found, key=lambda x: x["records_per_s"] or 0)
    return ordered[(len(ordered) - 1) // 2]


def also_batch(
    args: argparse.Namespace,
    contenders: list[str],
    workloads: list[str],
    tmp: Path,
    moto: int | None,
) -> dict[str, Any]:
    """The whole measurement again, under `--master`, in batches of `--also-batch` records.

    The issue asks for batches of about 100,000-200,000 records and the contenders do not
    scale alike across that range: a batch's fixed costs (Spark's planning, state store and
    offset commits; shardless's per-slice commit) spread over twice the records, and Spark's
    operators work per distinct key of a batch, which grows more slowly than the batch."""
    other = argparse.Namespace(**{**vars(args), "batch": args.also_batch})
    rates, runs = measure(args.master, other, contenders, workloads, tmp, moto)
    return {
        "batch_records": args.also_batch,
        "batches": -(-args.records // args.also_batch),
        "workloads": rates,
        "runs": runs,
        "goals": goals(rates),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--quick", action="store_true", help="300k records, 1+1 slow batches, no --also-batch"
    )
    parser.add_argument("--records", type=int, default=1_000_000, help="per workload")
    parser.add_argument("--batch", type=int, default=100_000, help="records per micro-batch")
    parser.add_argument(
        "--slow-batches", type=int, default=3, help="pandas operators' batches on 1M keys"
    )
    parser.add_argument(
        "--warmup-batches",
        type=int,
        default=3,
        help="batches of a 1,000-key workload every contender runs, unmeasured, before the "
        "first measured run of a session (the JVM's JIT warm-up; 0: none)",
    )
    parser.add_argument(
        "--groups",
        type=int,
        default=0,
        help="spark.sql.shuffle.partitions (0, the product's default: one per task slot)",
    )
    parser.add_argument("--slices", type=int, default=SLICES, help="shardless's slice count")
    parser.add_argument(
        "--few-slices",
        type=int,
        default=FEW_SLICES,
        help="the slice count of the shardless_few_slices contender",
    )
    parser.add_argument("--master", default="local[2]")
    parser.add_argument(
        "--also-master",
        default="local-cluster[2,1,1024]",
        help="rerun shardless and spark_sql_count under this master ('' for none)",
    )
    parser.add_argument(
        "--also-batch",
        type=int,
        default=ALSO_BATCH,
        help="rerun every contender and workload in batches of this many records, the other "
        "end of the issue's 100,000-200,000 (0 for none)",
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every contender this many times per workload, in turns (A B C A B C ...), "
        "and report each one's median run: the host's slow stretches then fall on every "
        "contender alike",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--group-owner",
        choices=("auto", "worker", "process"),
        default="auto",
        help="who runs the shardless contender's groups (the product's default, auto: owner "
        "processes under local[2]; shardless_worker_stores: always the worker)",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="cProfile every shardless group call into DIR "
        "(shardless.processor.runtime.process.PROFILE_ENV)",
    )
    args = parser.parse_args(argv)
    for name in ("records", "batch"):
        if getattr(args, name) <= 0:
            parser.error(
                f"--{name} must be a positive number of records, not {getattr(args, name)}"
            )
    if args.also_batch < 0:
        parser.error(
            f"--also-batch must be a number of records, or 0 for none, not {args.also_batch}"
        )
    if args.rounds < 1:
        parser.error(f"--rounds must be 1 or more, not {args.rounds}")
    if args.profile:
        from shardless.processor.runtime.process import PROFILE_ENV

        os.environ[PROFILE_ENV] = str(Path(args.profile).resolve())  # inherited by workers
    if args.quick:
        args.records, args.slow_batches = min(args.records, 3 * args.batch), 2
        args.also_batch = 0
    contenders = [c for c in CONTENDERS + OPTIONAL if c in args.contenders.split(",")]
    workloads = [w for w in WORKLOADS if w in args.workloads.split(",")]

    from shardless.processor.local import emulators as local_aws

    tmp = Path(tempfile.mkdtemp(prefix="shardless-vs-spark-"))
    aws = local_aws.start("kinesalite", log_dir=tmp / "local-aws")
    aws.apply_env()
    moto = aws.pids[0] if aws.pids else None  # started first: moto server
    out: dict[str, Any] = {}
    try:
        out["workloads"], out["runs"] = measure(args.master, args, contenders, workloads, tmp, moto)
        again = [c for c in ("shardless", "spark_sql_count") if c in contenders]
        if args.also_master and again:
            rates, runs = measure(args.also_master, args, again, workloads, tmp, moto)
            out["also"] = {"master": args.also_master, "workloads": rates, "runs": runs}
        if args.also_batch and args.also_batch != args.batch:
            out["also_batch"] = also_batch(args, contenders, workloads, tmp, moto)
    finally:
        aws.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    out["goals"] = goals(out["workloads"])
    out["config"] = {
        "master": args.master,
        "shuffle_partitions": args.groups or placement.choose_groups(args.master, {}).groups,
        "state_store_provider": ROCKSDB,
        "records_per_workload": args.records,
        "batch_records": args.batch,
        "batches": -(-args.records // args.batch),
        "warmup_batches": 1,
        "session_warmup_batches": args.warmup_batches,
        "slow_batches": args.slow_batches,
        "rounds": args.rounds,
        "slices": args.slices,
        "few_slices": args.few_slices,
        "group_owner": args.group_owner,
        "group_owner_chosen": placement.choose_group_owner(
            args.group_owner, placement.tasks_per_executor(args.master, {})
        ).owner,
        "zipf_s": ZIPF_S,
        "source": "Parquet files, one per micro-batch (maxFilesPerTrigger=1), availableNow",
        "sink": "foreachBatch: one checking action per batch",
        "durable_commits": "moto server (S3, DynamoDB) on loopback, on the same 2 cores",
        "seed": args.seed,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "pyspark": version("pyspark"),
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for name, rates in out["workloads"].items():
        print(name, json.dumps(rates), json.dumps(out["runs"][name]["ratios"]))
    print_goals(out["goals"])
    if "also_batch" in out:
        size = out["also_batch"]["batch_records"]
        for name, rates in out["also_batch"]["workloads"].items():
            print(f"batches of {size}: {name}", json.dumps(rates))
        print_goals(out["also_batch"]["goals"], f"batches of {size}: ")


def print_goals(judged: dict[str, dict[str, Any]], prefix: str = "") -> None:
    for name, goal in judged.items():
        met = "met" if goal["met"] else "NOT met"
        print(f"{prefix}goal {name}: {goal['value']} (target {goal['target']}) {met}")


if __name__ == "__main__":
    main()
