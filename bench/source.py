"""Kinesis source throughput against a plain boto3 GetRecords loop: `python -m bench.source`.

One kinesalite (and moto for the source's batch ends in DynamoDB), one stream, one run
(and a kinesis-local for the fan-out pair):

- **plain loop** (the baseline of the goal): a stock boto3 client reading every shard from
  TRIM_HORIZON, one shard after the other, GetRecords with Limit=10000 until the shard's
  tip. It keeps the limits the source keeps: at most 5 GetRecords calls per second per
  shard, and it stops a shard where the source does (a short page with MillisBehindLatest
  0). What a hand-written consumer does.
- **plain loop, source client**: the same loop with the source's own client
  (`shardless.processor.kinesis.client`: its GetRecords parser), to tell what the source gains from
  its client apart from what Spark and the batch protocol cost.
- **plain loop, parallel**: the stock loop with one thread per shard, all shards at once
  (the source reads shards in parallel too), for reference.
- **source**: `format("shardless_kinesis")` in an availableNow query on Spark (`local[2]`),
  every record counted in `foreachBatch`; with the source's default batch bounds
  (`maxRecordsPerShard` 10,000: one full GetRecords call per shard per batch) and with
  larger ones (`--large-max-records`, 100,000).

- **polling against enhanced fan-out** (`fan_out_pair`): the source on a kinesis-local
  stream (the one emulator with SubscribeToShard), polling and with `consumerName`,
  `--efo-reps` runs each, interleaved: `efo_records_per_s` beside `polling_records_per_s`.

The kinds run interleaved on the same records, `--reps` times: each rep runs the plain loop,
the source and the plain loop again (the headline pair as close in time as possible: other
work on the machine comes and goes), then the other kinds in an order that rotates from rep
to rep. Throughput of the source is its records
over the time Spark spent in its batches (`triggerExecution`, which holds planning, the
reads, the rows' way into the JVM, the offset and commit logs and the batch-end records);
the query's start-up (about 1-3 s) is reported apart (`*_wall_*`). The headline ratio is
the median over reps of the source against the mean of the two plain loops around it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path
from typing import Any

import boto3

from bench import harness
from shardless.processor.kinesis.put import put_records
from shardless.processor.kinesis.reader import MIN_CALL_INTERVAL_S
from shardless.processor.local import emulators as local_aws

GOAL = 0.8
STREAM = "bench-source"
LIMIT = 10_000  # records per GetRecords call, Kinesis' maximum


def produce(kinesis: Any, stream: str, records: int, record_bytes: int, keys: int) -> float:
    """Put `records` records of `record_bytes` bytes over `keys` partition keys; seconds."""
    payload = os.urandom(record_bytes)
    started = time.perf_counter()
    for lo in range(0, records, 500):
        batch = [
            {"PartitionKey": f"user-{i % keys}", "Data": payload}
            for i in range(lo, min(records, lo + 500))
        ]
        put_records(kinesis, stream, batch)
    return time.perf_counter() - started


def plain_loop(kinesis: Any, stream: str) -> dict[str, Any]:
    """Every record of every shard, one GetRecords loop per shard, one shard at a time.

    The loop keeps the limits the source keeps: at most 5 GetRecords calls per second per
    shard (`MIN_CALL_INTERVAL_S` between the starts of two calls), Limit=10000, and it stops
    a shard where the source would (a short page with MillisBehindLatest 0).
    """
    started = time.perf_counter()
    count = calls = paced = 0
    for shard in kinesis.list_shards(StreamName=stream)["Shards"]:
        count_s, calls_s, paced_s = _read_one_shard(kinesis, stream, shard["ShardId"])
        count, calls, paced = count + count_s, calls + calls_s, paced + paced_s
    seconds = time.perf_counter() - started
    return {
        "records": count,
        "seconds": seconds,
        "records_per_s": count / seconds,
        "calls": calls,
        "paced_calls": paced,
    }


def plain_loop_parallel(kinesis: Any, stream: str) -> dict[str, Any]:
    """The same loop with one thread per shard (all shards at once): what a hand-written
    consumer gets from overlapping its calls, for reference."""
    started = time.perf_counter()
    shards = [s["ShardId"] for s in kinesis.list_shards(StreamName=stream)["Shards"]]
    with ThreadPoolExecutor(max_workers=len(shards)) as pool:
        results = list(pool.map(lambda s: _read_one_shard(kinesis, stream, s), shards))
    seconds = time.perf_counter() - started
    count = sum(r[0] for r in results)
    return {
        "records": count,
        "seconds": seconds,
        "records_per_s": count / seconds,
        "calls": sum(r[1] for r in results),
        "paced_calls": sum(r[2] for r in results),
    }


def _read_one_shard(kinesis: Any, stream: str, shard_id: str) -> tuple[int, int, int]:
    """Records, GetRecords calls, and calls that waited for the pacing, of one shard."""
    iterator = kinesis.get_shard_iterator(
        StreamName=stream, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"
    )["ShardIterator"]
    count = calls = paced = 0
    last_call = -MIN_CALL_INTERVAL_S
    while iterator:
        wait = last_call + MIN_CALL_INTERVAL_S - time.monotonic()
        if wait > 0:
            paced += 1
            time.sleep(wait)
        last_call = time.monotonic()
        out = kinesis.get_records(ShardIterator=iterator, Limit=LIMIT)
        calls += 1
        count += len(out["Records"])
        if len(out["Records"]) < LIMIT and out.get("MillisBehindLatest", 0) == 0:
            break  # caught up with the stream
        iterator = out.get("NextShardIterator")
    return count, calls, paced


def source_run(
    spark: Any,
    stream: str,
    table: str,
    checkpoint: str,
    max_records: int,
    options: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Count the stream through the source in an availableNow query (`options`: more source
    options, such as another endpoint or `consumerName`)."""
    from shardless.processor.driver import recorder
    from shardless.processor.kinesis.batch_log import BatchLog

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
            **(options or {}),
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
    read_ms = calls = ends = fan_out_ends = 0
    phases: dict[str, float] = {}
    for p in batches:
        for name, ms in p["durationMs"].items():
            phases[name] = phases.get(name, 0) + ms / 1000
        offset = recorder.checkpoint_offset(spark, checkpoint, p["batchId"])
        for end in log.ends(offset["run"], int(offset["n"])).values():
            read_ms += end.get("read_ms", 0)
            calls += end.get("calls", 0)  # GetRecords calls, or subscriptions with fan-out
            ends += 1
            fan_out_ends += bool(end.get("fan_out"))
    return {
        "records": records,
        "batches": len(batches),
        "batch_seconds": batch_s,
        "wall_seconds": wall,
        "records_per_s": records / batch_s,
        "wall_records_per_s": records / wall,
        "shard_read_seconds": read_ms / 1000,
        "get_records_calls": calls,
        "shard_reads": ends,
        "fan_out_shard_reads": fan_out_ends,
        "phases_seconds": {k: round(v, 3) for k, v in sorted(phases.items())},
    }


def fan_out_pair(
    spark: Any, table: str, work: Path, records: int, shards: int, reps: int, max_records: int
) -> dict[str, Any]:
    """The source polling and over enhanced fan-out (`consumerName`) on one kinesis-local
    stream (kinesalite has no consumers), `reps` runs each, interleaved: records/s of each
    (the median) and their ratio. On kinesis-local a subscription's first event comes about
    a second after it starts and a closed one is held about 3 s, so what fan-out measures
    here is mostly the emulator's pace, not Kinesis' (`docs/design/enhanced-fan-out.md`)."""
    from shardless.processor.kinesis.fan_out import deregister_consumer

    aws = local_aws.start("kinesis-local", log_dir=work / "kinesis-local")
    try:
        kinesis = boto3.client("kinesis", endpoint_url=aws.kinesis_endpoint)
        stream = f"{STREAM}-efo"
        kinesis.create_stream(StreamName=stream, ShardCount=shards)
        kinesis.get_waiter("stream_exists").wait(
            StreamName=stream, WaiterConfig={"Delay": 0.2, "MaxAttempts": 300}
        )
        produce_s = produce(kinesis, stream, records, 100, 1_000)
        log(f"kinesis-local: produced {records:,} records in {produce_s:.1f} s")
        consumer = f"bench-{uuid.uuid4().hex[:8]}"
        kinds = {
            "polling": {"kinesisEndpoint": aws.kinesis_endpoint},
            "efo": {"kinesisEndpoint": aws.kinesis_endpoint, "consumerName": consumer},
        }
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        for rep in range(reps):
            for name in ("polling", "efo") if rep % 2 == 0 else ("efo", "polling"):
                checkpoint = str(work / f"ck-{name}-{uuid.uuid4().hex}")
                result = source_run(spark, stream, table, checkpoint, max_records, kinds[name])
                if result["records"] != records:
                    raise RuntimeError(f"{name} read {result['records']} of {records} records")
                runs[name].append(result)
                log(f"kinesis-local rep {rep + 1} {name}: {result['records_per_s']:,.0f} records/s")
        deregister_consumer(kinesis, stream, consumer)
    finally:
        aws.stop()
    efo = [r["records_per_s"] for r in runs["efo"]]
    polling = [r["records_per_s"] for r in runs["polling"]]
    return {
        "efo_records_per_s": round(statistics.median(efo)),
        "polling_records_per_s": round(statistics.median(polling)),
        "efo_vs_polling": _mid([round(a / b, 3) for a, b in zip(efo, polling, strict=True)]),
        "efo_subscriptions_per_run": statistics.median(r["get_records_calls"] for r in runs["efo"]),
        "runs": runs,
        "config": {
            "emulator": "kinesis-local " + _npm_version("kinesis-local"),
            "records": records,
            "shards": shards,
            "reps": reps,
            "max_records_per_shard": max_records,
            "produce_seconds": round(produce_s, 1),
        },
    }


def _median(runs: list[dict[str, Any]], name: str) -> float:
    return statistics.median(r[name] for r in runs)


def _mid(values: list[float]) -> float:
    """The median, rounded as the ratios are."""
    return round(statistics.median(values), 3)


def bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from shardless.changelog import resources
    from shardless.changelog.layout import AppLocation
    from shardless.processor.driver.spark import session
    from shardless.processor.kinesis.client import kinesis_client

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
        "plain_parallel": lambda: plain_loop_parallel(stock, STREAM),
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
    baseline: list[float] = []  # per rep: the mean of the two plain loops around the source
    load_before = os.getloadavg()[0]
    others = ["plain_source_client", "plain_parallel", "source_large"]
    for rep in range(args.reps):
        # plain, source, plain: the headline pair as close in time as can be (other work on
        # the machine comes and goes); then the other kinds, in an order that rotates.
        turn = rep % len(others)
        plains: list[float] = []
        for name in ["plain", "source", "plain", *others[turn:], *others[:turn]]:
            result = kinds[name]()
            if result["records"] != args.records:
                raise RuntimeError(f"{name} read {result['records']} of {args.records} records")
            runs[name].append(result)
            if name == "plain":
                plains.append(result["records_per_s"])
            log(f"rep {rep + 1} {name}: {result['records_per_s']:,.0f} records/s")
        baseline.append(statistics.mean(plains))
    load_after = os.getloadavg()[0]

    def ratios(name: str, base: str | None = None, field: str = "records_per_s") -> list[float]:
        """Per rep, `name` against the rep's plain-loop baseline (or the rep's `base` run)."""
        bases = baseline if base is None else [r["records_per_s"] for r in runs[base]]
        return [round(a[field] / b, 3) for a, b in zip(runs[name], bases, strict=True)]

    out: dict[str, Any] = {
        "source_records_per_s": round(_median(runs["source"], "records_per_s")),
        "plain_loop_records_per_s": round(_median(runs["plain"], "records_per_s")),
        "source_vs_plain_loop": _mid(ratios("source")),
        "source_vs_plain_loop_runs": ratios("source"),
        "source_wall_records_per_s": round(_median(runs["source"], "wall_records_per_s")),
        "source_wall_vs_plain_loop": _mid(ratios("source", field="wall_records_per_s")),
        "plain_loop_source_client_records_per_s": round(
            _median(runs["plain_source_client"], "records_per_s")
        ),
        "source_vs_plain_loop_source_client": _mid(ratios("source", "plain_source_client")),
        "plain_loop_parallel_records_per_s": round(
            _median(runs["plain_parallel"], "records_per_s")
        ),
        "source_vs_plain_loop_parallel": _mid(ratios("source", "plain_parallel")),
        "source_large_batches_records_per_s": round(_median(runs["source_large"], "records_per_s")),
        "source_large_batches_vs_plain_loop": _mid(ratios("source_large")),
        "goal": {"source_vs_plain_loop": GOAL},
    }
    out["goal"]["met"] = out["source_vs_plain_loop"] >= GOAL
    if args.efo_records:
        pair = fan_out_pair(
            spark, loc.table, work, args.efo_records, args.efo_shards, args.efo_reps,
            args.max_records,
        )  # fmt: skip
        out["efo_records_per_s"] = pair.pop("efo_records_per_s")
        out["polling_records_per_s"] = pair.pop("polling_records_per_s")
        out["efo_vs_polling"] = pair.pop("efo_vs_polling")
        out["fan_out"] = pair
    out["runs"] = runs
    out["config"] = {
        "records": args.records,
        "shards": args.shards,
        "record_bytes": args.record_bytes,
        "partition_keys": args.keys,
        "max_records_per_shard": args.max_records,
        "large_max_records_per_shard": args.large_max_records,
        "reps": args.reps,
        "get_records_limit": LIMIT,
        "min_get_records_interval_s_per_shard": MIN_CALL_INTERVAL_S,
        "master": args.master,
        "emulator": "kinesalite " + _npm_version("kinesalite"),
        "produce_seconds": round(produce_s, 1),
        "python": sys.version.split()[0],
        "pyspark": version("pyspark"),
        "boto3": version("boto3"),
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_1m_before_after": [round(load_before, 2), round(load_after, 2)],
    }
    spark.stop()
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
    parser.add_argument("--reps", type=int, help="runs of each kind (default 5, quick 2)")
    parser.add_argument(
        "--max-records", type=int, default=10_000, help="the source's maxRecordsPerShard"
    )
    parser.add_argument(
        "--large-max-records", type=int, default=100_000, help="maxRecordsPerShard, large run"
    )
    parser.add_argument("--master", default="local[2]")
    parser.add_argument(
        "--efo-records",
        type=int,
        help="records of the polling against fan-out pair on kinesis-local (default 10,000, "
        "quick 3,000; 0: skip it)",
    )
    parser.add_argument("--efo-shards", type=int, default=2)
    parser.add_argument("--efo-reps", type=int, default=3, help="runs of each, interleaved")
    args = parser.parse_args(argv)
    if args.efo_records is None:
        args.efo_records = 3_000 if args.quick else 10_000
    args.records = args.records or (60_000 if args.quick else 200_000)
    args.reps = args.reps or (2 if args.quick else 5)
    harness.quiet()
    with harness.emulated_aws("shardless-bench-source-") as (tmp, _):
        out = bench(args, tmp)
    harness.print_result(out, args.json)


if __name__ == "__main__":
    main()
