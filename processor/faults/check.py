"""After a schedule: the job's durable state and outputs against a plain-Python fold.

Three checks, each a list of human-readable problems (empty when all is well):

- state: every slice rebuilt from S3 and DynamoDB alone (`demo.durable_state`) equals the
  reference fold of the stream (`demo.reference_fold`);
- outputs: per user, counts 1..n exactly once ending at the reference state
  (`demo.check_outputs`), read from the Parquet sink's per-batch directories: a retried
  batch overwrote its own directory, so reading them all is the outputs deduplicated by
  batch id;
- order: per user, the output with count k carries the k-th event's timestamp, which
  holds only if the user's events were processed once each and in stream order.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow.dataset as ds

from changelog import aws
from processor import demo
from processor.config import JobConfig
from processor.kinesis.shards import stream_records


class _ParquetReader:
    """The part of a SparkSession that `demo.check_outputs` uses (`spark.read.parquet(p)
    .select("value").collect()`), over pyarrow: the harness starts no Spark of its own."""

    def __init__(self) -> None:
        self.read = self
        self._values: list[str] = []

    def parquet(self, path: str) -> _ParquetReader:
        self._values = output_values(path)
        return self

    def select(self, column: str) -> _ParquetReader:
        assert column == "value", column
        return self

    def collect(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(value=v) for v in self._values]


def output_values(path: str) -> list[str]:
    """Every output row's `value` under the sink's directory (`batch_id=<n>/*.parquet`)."""
    if not Path(path).exists():
        return []
    table = ds.dataset(path, format="parquet", partitioning="hive").to_table(columns=["value"])
    return table.column("value").to_pylist()


def stream_timestamps(kinesis: Any, stream: str) -> dict[str, list[int]]:
    """Per user, the `ts` of every event in the stream, sorted (= stream order, by design)."""
    found: dict[str, list[int]] = defaultdict(list)
    for r in stream_records(kinesis, stream):
        found[r["PartitionKey"]].append(json.loads(r["Data"])["ts"])
    return {user: sorted(ts) for user, ts in found.items()}


def order_problems(values: list[str], timestamps: dict[str, list[int]]) -> list[str]:
    by_user: dict[str, dict[int, int]] = defaultdict(dict)
    problems = []
    for v in map(json.loads, values):
        seen = by_user[v["user"]]
        if v["count"] in seen:
            problems.append(f"{v['user']}: two outputs for count {v['count']}")
        seen[v["count"]] = v["last_seen"]
    for user, counts in by_user.items():
        want = timestamps.get(user, [])
        for k, last_seen in sorted(counts.items()):
            if not 1 <= k <= len(want) or want[k - 1] != last_seen:
                expected = want[k - 1] if 1 <= k <= len(want) else None
                problems.append(
                    f"{user}: output {k} says last_seen={last_seen}, the stream's event {k} "
                    f"has ts={expected}: processed out of order or more than once"
                )
                break
    return problems


def verify(
    kinesis: Any, cfg: JobConfig, stream: str, out_dir: str, processed: int
) -> tuple[list[str], int]:
    """Problems found, and the number of events in the stream. `processed` is the sum of
    the job's batch reports' records, one report per batch id."""
    expected, total = demo.reference_fold(kinesis, stream)
    problems = []
    with tempfile.TemporaryDirectory(prefix="shardless-faults-verify-") as scratch:
        rebuilt, _ = demo.durable_state(cfg, Path(scratch))
    if rebuilt != expected:
        wrong = sorted(
            u for u in expected.keys() | rebuilt.keys() if rebuilt.get(u) != expected.get(u)
        )
        problems.append(
            f"durable state differs from the reference fold for {len(wrong)} users, e.g. "
            + "; ".join(
                f"{u}: state {rebuilt.get(u)} expected {expected.get(u)}" for u in wrong[:3]
            )
        )
    problems += [f"outputs: {p}" for p in demo.check_outputs(_ParquetReader(), out_dir, expected)]
    problems += [
        f"order: {p}"
        for p in order_problems(output_values(out_dir), stream_timestamps(kinesis, stream))
    ]
    if processed != total:
        problems.append(
            f"the job's batch reports count {processed} records, the stream holds {total}"
        )
    return problems, total


_SEGMENT = re.compile(r"changelog/(\d+)/g(\d+)-[^/]+\.seg$")


def commit_attempts(cfg: JobConfig) -> dict[str, int]:
    """How many changelog segments the job wrote, and for how many (batch, group) pairs
    more than one: every attempt that reaches its commit writes its segment before the
    DynamoDB transaction, so several segments of one pair are several attempts of that
    group's batch that reached the commit (a task retried after a late failure, a
    zombie, a re-run after a restart); at most one of them is referenced by the heads."""
    loc = cfg.location
    found: Counter[tuple[int, int]] = Counter()
    pages = aws.client("s3").get_paginator("list_objects_v2")
    for page in pages.paginate(Bucket=loc.bucket, Prefix=loc.key("changelog/")):
        for obj in page.get("Contents", []):
            if m := _SEGMENT.search(obj["Key"]):
                found[(int(m.group(1)), int(m.group(2)))] += 1
    return {
        "segments": sum(found.values()),
        "batch_groups_committed_more_than_once": sum(1 for n in found.values() if n > 1),
    }
