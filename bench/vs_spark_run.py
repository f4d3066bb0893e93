"""One contender's run over one workload in `bench.vs_spark`: the streaming query over the
workload's files, every batch checked against the fold, Spark's per-batch figures and
shardless's group metrics kept, and shardless's state rebuilt from S3 and DynamoDB alone at
the end."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.vs_spark_contenders import FLOORS, SHARDLESS, SLICES, query_for
from bench.vs_spark_workload import SOURCE_SCHEMA, Workload
from shardless.processor.local.faults.procs import cpu_seconds

RUN_TIMEOUT_S = 1800


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
