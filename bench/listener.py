"""What reading one progress report costs a driver's listener: `python -m bench.listener --json`.

A streaming query of small batches runs on `local[2]` with shardless's two observed metrics
(`--observed`, each a Java map more in the report). For every report Spark's listener bus
hands to Python, the callback reads it both ways, in alternating order: as Spark's JSON
(`ProgressJsonListener`, one py4j call for the JSON) and through PySpark's
`QueryProgressEvent.fromJObject` (the baseline: what a plain `StreamingQueryListener` is
handed). The figures are the median milliseconds of each and their ratio. The time is the
listener thread's: the JVM answers PySpark's calls on it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROWS = 50  # records a batch: the report's size does not depend on it


def _files(src: Path, batches: int) -> None:
    src.mkdir(parents=True)
    for n in range(batches):
        rows = (json.dumps({"k": f"k{i}", "v": i}) for i in range(ROWS))
        (src / f"{n:05d}.json").write_text("\n".join(rows))


def run(spark: Any, batches: int, observed: int, work: Path) -> dict[str, Any]:
    """Run `batches` batches with `observed` observed metrics; both ways' times per report."""
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.listener import QueryProgressEvent

    from shardless.processor.driver.progress_listener import ProgressJsonListener, _JsonCallback

    as_json: list[float] = []
    converted: list[float] = []
    heard: list[int] = []  # batch ids that reached `on_progress`

    class Timed(_JsonCallback):
        """shardless's callback, timed, and PySpark's conversion of the same report."""

        def onQueryProgress(self, jevent: Any) -> None:  # noqa: N802 - Spark's name
            first, second = (self.read_json, self.convert)
            if len(as_json) % 2:
                first, second = second, first
            first(jevent)
            second(jevent)

        def read_json(self, jevent: Any) -> None:
            t = time.perf_counter()
            super().onQueryProgress(jevent)  # the report's JSON, to `on_progress`
            as_json.append(time.perf_counter() - t)

        def convert(self, jevent: Any) -> None:
            t = time.perf_counter()
            QueryProgressEvent.fromJObject(jevent)
            converted.append(time.perf_counter() - t)

    class Listener(ProgressJsonListener):
        def on_progress(self, progress: dict[str, Any]) -> None:
            heard.append(progress["batchId"])

        def _callback(self) -> _JsonCallback:
            return Timed(self)

    listener = Listener()
    spark.streams.addListener(listener)
    try:
        _files(work / "in", batches)
        df = spark.readStream.schema("k string, v long").option("maxFilesPerTrigger", 1)
        stream = df.json(str(work / "in"))
        metrics = [F.count(F.lit(1)).alias("rows"), F.max("v").alias("newest")]
        for n in range(observed):
            stream = stream.observe(f"m{n}", *metrics)
        query = (
            stream.writeStream.format("noop")
            .option("checkpointLocation", str(work / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        deadline = time.monotonic() + 30
        while min(len(as_json), len(converted)) < batches and time.monotonic() < deadline:
            time.sleep(0.1)  # the listener bus is asynchronous
    finally:
        spark.streams.removeListener(listener)
    return {"as_json_s": as_json, "converted_s": converted, "batch_ids": heard}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--batches", type=int, default=60, help="batches, one report each")
    parser.add_argument(
        "--observed", type=int, default=2, help="observed metrics a batch (shardless: 2)"
    )
    args = parser.parse_args(argv)
    from pyspark.sql import SparkSession

    work = Path(tempfile.mkdtemp(prefix="bench-listener-"))
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("bench-listener")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        times = run(spark, args.batches, args.observed, work)
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)
    as_json, converted = times["as_json_s"], times["converted_s"]
    if not as_json or len(as_json) != len(converted):
        raise SystemExit(f"heard {len(as_json)} / {len(converted)} reports of {args.batches}")
    fast, slow = statistics.median(as_json), statistics.median(converted)
    out = {
        "reports": len(as_json),
        "as_json_ms_p50": round(fast * 1000, 2),
        "converted_ms_p50": round(slow * 1000, 2),
        "converted_over_as_json": round(slow / fast, 1),
        "config": {"batches": args.batches, "observed": args.observed, "master": "local[2]"},
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(
            f"{out['reports']} reports: JSON {out['as_json_ms_p50']} ms, PySpark's conversion "
            f"{out['converted_ms_p50']} ms ({out['converted_over_as_json']}x)"
        )


if __name__ == "__main__":
    sys.exit(main())
