"""After a schedule: the job's durable state and outputs against a plain-Python fold.

A schedule may run several queries (Spark checkpoints) on its application, one after
another: the first at TRIM_HORIZON, each later one at `--starting-position COMMITTED`
(a takeover, a new group count, after a rollback), continuing from a progress record
`(query, batch)` of an earlier one. Each query writes its outputs to a folder of its own
(`batch_id=<n>` directories: batch ids start at 0 again in a new query).

The **lineage** is what the application stands by: the last query's batches, the
batches up to s of the query whose record (s) it continued from, and so on back to the
first query. Every other output is **superseded**: a batch after the record a later query
continued from (its state was rolled back by `state rollback` or by the COMMITTED start's
undo of commits past the latest record, or never landed because the query was fenced;
the later query reads those records again and emits their outputs again), or a query off
the lineage altogether (a takeover refused at its first batch, a new checkpoint that failed
before it recorded a batch and was replaced by another).

Four checks, each a list of human-readable problems (empty when all is well):

- state: every slice rebuilt from S3 and DynamoDB alone (`demo.durable_state`) equals the
  reference fold of the stream (`demo.reference_fold`);
- outputs: in the lineage, per user, counts 1..n exactly once each, ending at the
  reference state (`demo.check_outputs`); a retried batch overwrote its own directory,
  so reading a query's folder is its outputs deduplicated by (query, batch);
- order: in the lineage, per user, the output with count k carries the k-th event's
  timestamp, which holds only if the user's events were processed once each and in stream
  order; and every superseded output is one of the fold's outputs too (count k with the
  k-th event's timestamp): re-emitted, never made up. So the only duplicates accepted are
  copies of fold outputs in superseded batches; a record counted twice shows up as a
  count whose timestamp is not the stream's (or a count past the fold's);
- the lineage's batch reports (the last one per (query, batch)) count every event of
  the stream once.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow.dataset as ds

from shardless.changelog import aws
from shardless.processor.driver.config import JobConfig
from shardless.processor.kinesis.shards import stream_records
from shardless.processor.local import demo


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


class _Values(_ParquetReader):
    """`_ParquetReader` over values already read."""

    def __init__(self, values: list[str]) -> None:
        super().__init__()
        self._given = values

    def parquet(self, path: str) -> _ParquetReader:
        self._values = self._given
        return self


@dataclass
class QueryRun:
    """One query (checkpoint) of a schedule: its Spark query id, its output folder, the
    record it continued from (`(query, batch)`, None for a query at its own position) and
    its batch reports (the last one per batch id)."""

    query: str
    out_dir: str
    start: tuple[str, int] | None = None
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)


Lineage = dict[str, "int | None"]  # query -> last batch of it in the lineage (None: all)


def lineage(queries: list[QueryRun]) -> Lineage:
    """Back from the last query along the records each continued from."""
    if not queries:
        return {}
    by_id = {q.query: q for q in queries}
    keep: Lineage = {queries[-1].query: None}
    current = queries[-1]
    while current.start is not None:
        query, batch = current.start
        if query in keep:  # a loop cannot happen; stop rather than spin
            break
        keep[query] = batch
        if query not in by_id:
            break
        current = by_id[query]
    return keep


def in_lineage(query: str, batch: int, keep: Lineage) -> bool:
    return query in keep and (keep[query] is None or batch <= keep[query])


def output_rows(path: str) -> list[tuple[int, str]]:
    """Every output row's `(batch_id, value)` under the sink's directory."""
    if not Path(path).exists():
        return []
    dataset = ds.dataset(path, format="parquet", partitioning="hive")
    if "batch_id" not in dataset.schema.names:  # not the Parquet sink's layout: one batch
        return [(0, v) for v in dataset.to_table(columns=["value"]).column("value").to_pylist()]
    table = dataset.to_table(columns=["batch_id", "value"])
    batches, values = table.column("batch_id").to_pylist(), table.column("value").to_pylist()
    return list(zip(batches, values, strict=True))


def output_problems(
    rows: list[tuple[str, int, str]],
    keep: Lineage,
    expected: dict[str, dict],
    timestamps: dict[str, list[int]],
) -> list[str]:
    """The outputs and order checks (module docstring) over every query's `(query, batch,
    value)` rows, `keep` the lineage."""
    kept = [v for q, b, v in rows if in_lineage(q, b, keep)]
    gone = [(q, b, v) for q, b, v in rows if not in_lineage(q, b, keep)]
    problems = [f"outputs: {p}" for p in demo.check_outputs(_Values(kept), "", expected)]
    problems += [f"order: {p}" for p in order_problems(kept, timestamps)]
    for query, batch, value in gone:
        v = json.loads(value)
        want = timestamps.get(v["user"], [])
        k = v["count"]
        if not 1 <= k <= len(want) or want[k - 1] != v["last_seen"]:
            problems.append(
                f"superseded: query {query[:8]} batch {batch} output {v} is not one of the "
                "fold's outputs (counted twice or out of order before it was superseded)"
            )
    return problems


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
    kinesis: Any,
    cfg: JobConfig,
    stream: str,
    queries: list[QueryRun] | str,
    processed: int | None = None,
) -> tuple[list[str], int]:
    """Problems found, and the number of events in the stream. `queries` in order (the
    last is the one that drained the stream); or, for a job of one query, its output
    folder and `processed`, the sum of its batch reports' records (one per batch id)."""
    if not isinstance(queries, list):
        queries = [QueryRun("", str(queries))]
    else:
        processed = None
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
    keep = lineage(queries)
    rows = [(q.query, b, v) for q in queries for b, v in output_rows(q.out_dir)]
    problems += output_problems(rows, keep, expected, stream_timestamps(kinesis, stream))
    if processed is None:
        processed = sum(
            r["records"]
            for q in queries
            for b, r in q.reports.items()
            if in_lineage(q.query, b, keep)
        )
    if processed != total:
        problems.append(
            f"the lineage's batch reports (last per query and batch) count {processed} "
            f"records, the stream holds {total}"
        )
    return problems, total


_SEGMENT = re.compile(r"changelog/(\d+)/g(\d+)-[^/]+\.seg$")


def commit_attempts(cfg: JobConfig) -> dict[str, int]:
    """How many changelog segments the job wrote, and for how many (batch, group) pairs
    more than one: every attempt that reaches its commit writes its segment before the
    DynamoDB transaction, so several segments of one pair are several attempts of that
    group's batch that reached the commit at once (a task retried after a late failure,
    a zombie); at most one of them is referenced by the heads. A re-run that finds its
    batch already committed (after a restart) writes none: it adopts the committed
    changes (`shardless.processor.runtime.group_chain.adopt`)."""
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
