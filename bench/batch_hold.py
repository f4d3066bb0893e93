"""What a batch's trip to the sink costs: `python -m bench.batch_hold --json`.

Each batch the job hands its outputs to the sink and reads its metrics rows
(`shardless.processor.driver.batch_reads.deliver`): in the sink's one read for a sink
marked `reads_once` (Parquet, Kinesis), else (the console, a foreach_batch function) by caching
the outputs, collecting the metrics rows and handing the cache on. This runs those steps
on a frame shaped like a batch's outputs (`OUTPUT_SCHEMA`: `--rows` rows of keys and JSON
values, one metrics row per group, behind a shuffle into `--groups` partitions as the
groups' output comes), in one `local[2]` session, with a sink that reads every output row
(Spark's `noop` writer). Four arms alternate, `--reps` rounds after one unmeasured:

- `one_pass`: `deliver` with the sink marked `reads_once`, as Parquet and Kinesis are;
- `held`: `deliver` with an unmarked sink: the cache, its columns uncompressed (`held`);
- `compressed`: the cache with Spark's default, compressed columns, as before `held`;
- `one_read`: the plan read once by the sink, without the metrics rows (no arm can cost
  less).

Per arm: the median seconds, and the bytes cached while the sink reads, from Spark's
storage report. The benchmark refuses a run where an arm did not see one metrics row per
group, `held` cached no more than `compressed` (the setting did not take), or `one_pass`
cached anything. Ratios are against `compressed`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from shardless.processor.driver.batch_reads import deliver, reads_once
from shardless.processor.driver.spark import session

ARMS = ("one_pass", "held", "compressed", "one_read")


def outputs(spark: SparkSession, rows: int, groups: int) -> DataFrame:
    """A batch's outputs: `rows` output rows of 100,000 distinct keys, one metrics row per
    group, shuffled into `groups` partitions."""
    return (
        spark.range(0, rows, 1, groups)
        .selectExpr(
            f"case when id < {groups} then 'metrics' else 'out' end as kind",
            "cast(id % 256 as int) as slice",
            "7L as batch_id",
            "cast(id as int) as seq",
            "concat('user-', cast(id * 7919 % 100000 as string)) as key",
            """concat('{"count": ', cast(id % 97 as string), ', "at": ', """
            """cast(1700000000000 + id as string), '}') as value""",
        )
        .repartition(groups, "slice")
    )


def cached_bytes(spark: SparkSession) -> int:
    """The bytes Spark's storage report holds for the session's cached RDDs."""
    return sum(
        int(i.memSize()) + int(i.diskSize())
        for i in spark.sparkContext._jsc.sc().getRDDStorageInfo()
    )


def one_batch(spark: SparkSession, df: DataFrame, arm: str, groups: int) -> tuple[float, int]:
    """The job's steps for one batch with `arm`; the seconds and the bytes cached while
    the sink read."""
    cached: list[int] = []

    def sink(out: DataFrame, batch_id: int) -> None:
        out.write.format("noop").mode("overwrite").save()
        cached.append(cached_bytes(spark))

    started = time.perf_counter()
    metrics: list[str] | None
    if arm in ("one_pass", "held"):
        metrics = deliver(df, 7, reads_once(sink) if arm == "one_pass" else sink)
    elif arm == "compressed":
        kept = df.persist()
        try:
            metrics = [r.value for r in kept.where("kind = 'metrics'").select("value").collect()]
            sink(kept.where("kind = 'out'").drop("kind"), 7)
        finally:
            kept.unpersist()
    else:  # the sink's read alone: no metrics rows, what every other arm adds
        sink(df, 7)
        metrics = None
    seconds = time.perf_counter() - started
    if metrics is not None and len(metrics) != groups:
        raise RuntimeError(f"{arm}: {len(metrics)} metrics rows read, not {groups}")
    return seconds, cached[0]


def measure(spark: SparkSession, rows: int, groups: int, reps: int) -> dict[str, Any]:
    df = outputs(spark, rows, groups)
    runs: dict[str, list[tuple[float, int]]] = {arm: [] for arm in ARMS}
    for i in range(reps + 1):
        for arm in ARMS if i % 2 == 0 else reversed(ARMS):
            found = one_batch(spark, df, arm, groups)
            if i:
                runs[arm].append(found)
    arms = {
        arm: {
            "seconds": round(statistics.median(s for s, _ in rs), 4),
            "cached_bytes": int(statistics.median(b for _, b in rs)),
            "runs": [round(s, 4) for s, _ in rs],
        }
        for arm, rs in runs.items()
    }
    if not arms["held"]["cached_bytes"] > arms["compressed"]["cached_bytes"] > 0:
        raise RuntimeError(f"held did not cache uncompressed: {arms}")
    if arms["one_pass"]["cached_bytes"]:
        raise RuntimeError(f"one_pass cached the batch: {arms}")
    base = arms["compressed"]["seconds"]
    return {
        "rows": rows,
        "groups": groups,
        "arms": arms,
        "one_pass_over_compressed": round(arms["one_pass"]["seconds"] / base, 3),
        "one_pass_over_held": round(arms["one_pass"]["seconds"] / arms["held"]["seconds"], 3),
        "held_over_compressed": round(arms["held"]["seconds"] / base, 3),
        "held_saves_s": round(base - arms["held"]["seconds"], 4),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the JSON summary only")
    p.add_argument("--rows", type=int, default=100_000, help="output rows of the batch")
    p.add_argument("--groups", type=int, default=2, help="partitions of the outputs")
    p.add_argument("--reps", type=int, default=40)
    args = p.parse_args(argv)
    spark = session("local[2]", groups=args.groups, ui=False)
    try:
        out = measure(spark, args.rows, args.groups, args.reps)
    finally:
        spark.stop()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for arm, f in out["arms"].items():
            print(f"{arm:10s} {f['seconds'] * 1000:8.1f} ms  cached {f['cached_bytes']:>10,} bytes")
        print(f"one_pass / held: {out['one_pass_over_held']}")
        print(f"held / compressed: {out['held_over_compressed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
