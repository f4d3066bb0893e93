"""What holding a batch's outputs for their two reads costs: `python -m bench.batch_hold --json`.

Each batch the job caches its outputs, reads the metrics rows (a collect), hands the rest
to the sink, and drops the cache (`shardless.processor.driver.job.start`). This runs those
steps on a frame shaped like a batch's outputs (`OUTPUT_SCHEMA`: `--rows` rows of keys and
JSON values, one metrics row per group, behind a shuffle into `--groups` partitions as the
groups' output comes), in one `local[2]` session, with a sink that reads every output row
(Spark's `noop` writer). Three arms alternate, `--reps` rounds after one unmeasured:

- `held`: the job's `held` (the cache's columns uncompressed), as it is;
- `compressed`: `persist()` with Spark's default, compressed columns, as before;
- `one_read`: the plan read once, no cache (what the two reads cannot cost less than).

Per arm: the median seconds of the steps, and the bytes cached, read from Spark's storage
report while the cache is held (a `held` cache no larger than a `compressed` one means the
setting did not take: the benchmark refuses the run). Ratios are against `compressed`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from shardless.processor.driver.batch_reads import held
from shardless.processor.driver.spark import session

ARMS = ("held", "compressed", "one_read")


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
    return sum(
        int(i.memSize()) + int(i.diskSize())
        for i in spark.sparkContext._jsc.sc().getRDDStorageInfo()
    )


def one_batch(spark: SparkSession, df: DataFrame, arm: str) -> tuple[float, int]:
    """The job's steps for one batch with `arm`; the seconds and the bytes it cached."""
    started = time.perf_counter()
    kept = held(df) if arm == "held" else df.persist() if arm == "compressed" else df
    try:
        metrics = kept.where("kind = 'metrics'").select("value").collect()
        if arm != "one_read":
            kept.where("kind = 'out'").drop("kind").write.format("noop").mode("overwrite").save()
        seconds = time.perf_counter() - started
        size = cached_bytes(spark)
    finally:
        if arm != "one_read":
            kept.unpersist(blocking=True)
    if not metrics:
        raise RuntimeError(f"{arm}: no metrics row read")
    return seconds, size


def measure(spark: SparkSession, rows: int, groups: int, reps: int) -> dict[str, Any]:
    df = outputs(spark, rows, groups)
    runs: dict[str, list[tuple[float, int]]] = {arm: [] for arm in ARMS}
    for i in range(reps + 1):
        for arm in ARMS if i % 2 == 0 else reversed(ARMS):
            found = one_batch(spark, df, arm)
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
    base = arms["compressed"]["seconds"]
    return {
        "rows": rows,
        "groups": groups,
        "arms": arms,
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
        print(f"held / compressed: {out['held_over_compressed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
