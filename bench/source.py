"""Kinesis source throughput against a plain boto3 GetRecords loop: `python -m bench.source`.

One kinesalite (and moto for the source's batch ends in DynamoDB), one stream, one run:

- **plain loop**: a stock boto3 client reading every shard from TRIM_HORIZON, one shard
  after the other, GetRecords with Limit=10000 until the shard's tip. What a hand-written
  consumer does, and the baseline of the goal.
- **plain loop, source client**: the same loop with the source's own client
  (`processor.kinesis.client`: its cheap timestamp parser), to tell what the source gains
  from the client apart from what it costs.
- **source**: `format("shardless_kinesis")` in an availableNow query on Spark (`local[2]`),
  every record counted in `foreachBatch`; with the source's default batch bounds
  (`maxRecordsPerShard` 10,000) and with larger ones.

The kinds run interleaved, `--reps` times each, on the same records. Throughput of the
source is its records over the time Spark spent in its batches (`triggerExecution`, which
holds planning, the reads, Arrow conversion, the offset log and the batch-end records); the
query's start-up (about 1-3 s) is reported apart (`*_wall_*`). The headline ratio is the
median over reps of source / plain loop, each rep's pair measured back to back.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import boto3

from processor import local_aws

GOAL = 0.8
STREAM = "bench-source"


def produce(kinesis: Any, stream: str, records: int, record_bytes: int, keys: int) -> float:
    """Put `records` records of `record_bytes` bytes over `keys` partition keys; seconds."""
    payload = os.urandom(record_bytes)
    started = time.perf_counter()
    for lo in range(0, records, 500):
        batch = [
            {"PartitionKey": f"user-{i % keys}", "Data": payload}
            for i in range(lo, min(records, lo + 500))
        ]
        out = kinesis.put_records(StreamName=stream, Records=batch)
        if out["FailedRecordCount"]:
            raise RuntimeError(f"{out['FailedRecordCount']} records were refused")
    return time.perf_counter() - started


def plain_loop(kinesis: Any, stream: str) -> dict[str, float]:
    """Every record of every shard, one GetRecords loop per shard, one shard at a time."""
    started = time.perf_counter()
    count = calls = 0
    for shard in kinesis.list_shards(StreamName=stream)["Shards"]:
        iterator = kinesis.get_shard_iterator(
            StreamName=stream, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        while iterator:
            out = kinesis.get_records(ShardIterator=iterator, Limit=10_000)
            calls += 1
            count += len(out["Records"])
            if not out["Records"] and out.get("MillisBehindLatest", 0) == 0:
                break
            iterator = out.get("NextShardIterator")
    seconds = time.perf_counter() - started
    return {"records": count, "seconds": seconds, "records_per_s": count / seconds, "calls": calls}


def source_run(
    spark: Any, stream: str, table: str, checkpoint: str, max_records: int
) -> dict[str, Any]:
    """Count the stream through the source in an availableNow query."""
    from processor import progress
    from processor.kinesis.batch_log import BatchLog

    counts: list[int] = []

    def count(df: Any, batch_id: int) -> None:
        counts.append(df.count())

    started = time.perf_counter()
    query = (
        spark.readStream.format("shardless_kinesis")
        .options(
            streams=stream,
            table=table,
            maxRecordsPerShard=str(max_records),
            maxBytesPerShard=str(1 << 30),
        )
        .load()
        .writeStream.foreachBatch(count)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    wall = time.perf_counter() - started
    if query.exception() is not None:
        raise RuntimeError(f"the source query failed: {query.exception()}")
    batches = [p for p in query.recentProgress if "addBatch" in p["durationMs"]]
    batch_s = sum(p["durationMs"].get("triggerExecution", 0) for p in batches) / 1000
    records = sum(counts)
    # What the executors spent inside the shard reads (GetRecords, parsing, DynamoDB end
    # records), from the batch log, against the batches' time.
    log = BatchLog(table)
    read_ms = calls = 0
    phases: dict[str, float] = {}
    for p in batches:
        for name, ms in p["durationMs"].items():
            phases[name] = phases.get(name, 0) + ms / 1000
        offset = progress.checkpoint_offset(spark, checkpoint, p["batchId"])
        for end in log.ends(offset["run"], int(offset["n"])).values():
            read_ms += end.get("read_ms", 0)
            calls += end.get("calls", 0)
    return {
        "records": records,
        "batches": len(batches),
        "batch_seconds": batch_s,
        "wall_seconds": wall,
        "records_per_s": records / batch_s,
        "wall_records_per_s": records / wall,
        "shard_read_seconds": read_ms / 1000,
        "get_records_calls": calls,
        "phases_seconds": {k: round(v, 3) for k, v in sorted(phases.items())},
    }


def _median(runs: list[dict[str, Any]], name: str) -> float:
    return statistics.median(r[name] for r in runs)


def bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from changelog import resources
    from changelog.layout import AppLocation
    from processor.kinesis.client import kinesis_client
    from processor.spark import session

    stock = boto3.client("kinesis")
    stock.create_stream(StreamName=STREAM, ShardCount=args.shards)
    stock.get_waiter("stream_exists").wait(
        StreamName=STREAM, WaiterConfig={"Delay": 0.1, "MaxAttempts": 200}
    )
    produce_s = produce(stock, STREAM, args.records, args.record_bytes, args.keys)
    log(f"produced {args.records:,} records in {produce_s:.1f} s")
    loc = AppLocation.default(f"bench-source-{uuid.uuid4().hex[:6]}")
    resources.ensure(loc, 256)
    spark = session(args.master, groups=4, app_name="shardless-bench-source")
    # Warm up: the Python workers, the source's process, the JVM's code paths.
    source_run(spark, STREAM, loc.table, str(work / "ck-warm"), args.records)

    kinds: dict[str, Callable[[], dict[str, Any]]] = {
        "plain": lambda: plain_loop(stock, STREAM),
        "plain_source_client": lambda: plain_loop(kinesis_client(), STREAM),
        "source": lambda: source_run(
            spark, STREAM, loc.table, str(work / f"ck-{uuid.uuid4().hex}"), args.max_records
        ),
        "source_large": lambda: source_run(
            spark,
            STREAM,
            loc.table,
            str(work / f"ck-{uuid.uuid4().hex}"),
            args.large_max_records,
        ),
    }
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for rep in range(args.reps):
        for name, run in kinds.items():
            result = run()
            if result["records"] != args.records:
                raise RuntimeError(f"{name} read {result['records']} of {args.records} records")
            runs[name].append(result)
            log(f"rep {rep + 1} {name}: {result['records_per_s']:,.0f} records/s")
    spark.stop()

    def ratios(name: str, base: str) -> list[float]:
        return [
            round(a["records_per_s"] / b["records_per_s"], 3)
            for a, b in zip(runs[name], runs[base], strict=True)
        ]

    out: dict[str, Any] = {
        "source_records_per_s": round(_median(runs["source"], "records_per_s")),
        "plain_loop_records_per_s": round(_median(runs["plain"], "records_per_s")),
        "source_vs_plain_loop": statistics.median(ratios("source", "plain")),
        "source_vs_plain_loop_runs": ratios("source", "plain"),
        "source_wall_records_per_s": round(_median(runs["source"], "wall_records_per_s")),
        "source_wall_vs_plain_loop": statistics.median(
            round(a["wall_records_per_s"] / b["records_per_s"], 3)
            for a, b in zip(runs["source"], runs["plain"], strict=True)
        ),
        "plain_loop_source_client_records_per_s": round(
            _median(runs["plain_source_client"], "records_per_s")
        ),
        "source_vs_plain_loop_source_client": statistics.median(
            ratios("source", "plain_source_client")
        ),
        "source_large_batches_records_per_s": round(_median(runs["source_large"], "records_per_s")),
        "source_large_batches_vs_plain_loop": statistics.median(ratios("source_large", "plain")),
        "goal": {"source_vs_plain_loop": GOAL},
    }
    out["goal"]["met"] = out["source_vs_plain_loop"] >= GOAL
    out["runs"] = runs
    out["config"] = {
        "records": args.records,
        "shards": args.shards,
        "record_bytes": args.record_bytes,
        "partition_keys": args.keys,
        "max_records_per_shard": args.max_records,
        "large_max_records_per_shard": args.large_max_records,
        "reps": args.reps,
        "master": args.master,
        "emulator": "kinesalite " + _npm_version("kinesalite"),
        "produce_seconds": round(produce_s, 1),
        "python": sys.version.split()[0],
        "pyspark": version("pyspark"),
        "boto3": version("boto3"),
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    return out


def _npm_version(package: str) -> str:
    try:
        found = local_aws.tools_dir() / "node_modules" / package / "package.json"
        return json.loads(found.read_text())["version"]
    except (OSError, ValueError, KeyError):
        return "?"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="60,000 records, 2 reps")
    parser.add_argument("--records", type=int, help="records in the stream (default 200,000)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--record-bytes", type=int, default=100)
    parser.add_argument("--keys", type=int, default=10_000, help="distinct partition keys")
    parser.add_argument("--reps", type=int, help="runs of each kind (default 3, quick 2)")
    parser.add_argument(
        "--max-records", type=int, default=10_000, help="the source's maxRecordsPerShard"
    )
    parser.add_argument(
        "--large-max-records", type=int, default=100_000, help="maxRecordsPerShard, large run"
    )
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args(argv)
    args.records = args.records or (60_000 if args.quick else 200_000)
    args.reps = args.reps or (2 if args.quick else 3)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the emulators on a kill

    with tempfile.TemporaryDirectory(prefix="shardless-bench-source-") as tmp:
        emulators = local_aws.start("kinesalite", log_dir=Path(tmp, "local-aws"))
        try:
            emulators.apply_env()
            out = bench(args, Path(tmp))
        finally:
            emulators.stop()
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for name, value in out.items():
        if name not in ("runs", "config"):
            print(f"{name}: {value}")


if __name__ == "__main__":
    main()
