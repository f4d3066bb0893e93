"""The application `bench.latency` runs, and its sink that records when outputs arrive.

Each record is `{"id": n, "put_ms": <producer's wall clock at the put>}`; the handler
counts records per key in state and emits `[id, put_ms, count]` (the count makes lost or
doubled state visible). `deliver`, given to `shardless run --foreach-batch
bench.latency_app:deliver`, runs on the driver once the batch's state is committed: it
collects the outputs, takes the time, and appends one line per call to
`$BENCH_LATENCY_OUT/deliveries.jsonl`. On its first call in a driver process it also
registers a listener that appends each of Spark's progress reports (batch durations) to
`progress.jsonl` there.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

OUT_VARIABLE = "BENCH_LATENCY_OUT"  # not SHARDLESS_*: `shardless run` reads those as flags
DELIVERIES = "deliveries.jsonl"
PROGRESS = "progress.jsonl"

_listening: list[Any] = []  # the listener of this driver process, once registered


def process(event: Any, ctx: Any) -> None:
    body = event.json()
    n = ctx.state.get(0) + 1
    ctx.state.set(n)
    ctx.emit([body["id"], body["put_ms"], n])


def out_dir() -> Path:
    """Where the sink writes: `$BENCH_LATENCY_OUT`."""
    where = os.environ.get(OUT_VARIABLE)
    if not where:
        raise RuntimeError(f"set {OUT_VARIABLE} to the folder bench.latency reads")
    return Path(where)


def deliver(df: Any, batch: Any) -> None:
    """The batch's outputs delivered: one line with the batch identity, the time after the
    outputs reached the driver, and the outputs' keys and values (JSON text)."""
    if not _listening:
        _listen()
    rows = df.select("key", "value").collect()
    now = time.time()
    line = {
        "query": batch.query_id,
        "batch": batch.batch_id,
        "t": now,
        "keys": [r.key for r in rows],
        "values": [r.value for r in rows],
    }
    with (out_dir() / DELIVERIES).open("a") as f:
        f.write(json.dumps(line, separators=(",", ":")) + "\n")


def progress_line(progress: dict[str, Any]) -> dict[str, Any]:
    """What the harness keeps of one StreamingQueryProgress (Spark's JSON of it)."""
    return {
        "batch": progress["batchId"],
        "timestamp": progress["timestamp"],
        "input_rows": progress["numInputRows"],
        "duration_ms": progress["durationMs"],
    }


def _listen() -> None:
    """Spark's progress reports to `progress.jsonl`. The listener goes on the process's
    own session, which started the query: `df.sparkSession` in a batch is a clone whose
    listeners hear only queries the clone started. It reads each report as JSON
    (`ProgressJsonListener`): PySpark's conversion costs about 100 ms of the driver a report
    (`bench.listener`), which the job would pay for the benchmark."""
    from pyspark.sql import SparkSession

    from shardless.processor.driver.progress_listener import ProgressJsonListener

    path = out_dir() / PROGRESS

    class ProgressFile(ProgressJsonListener):
        def on_progress(self, progress: dict[str, Any]) -> None:
            with path.open("a") as f:
                f.write(json.dumps(progress_line(progress)) + "\n")

    listener = ProgressFile()
    SparkSession.builder.getOrCreate().streams.addListener(listener)
    _listening.append(listener)
