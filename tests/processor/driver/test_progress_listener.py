"""`ProgressJsonListener`: each progress report reaches `on_progress` as Spark's JSON,
observed metrics included, without PySpark's conversion of the report (which looked up
`PythonSQLUtils` through every jar on the classpath for each observed metric)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from pyspark.sql import functions as F
from pyspark.sql.streaming import listener as pyspark_listener

from shardless.processor.driver.progress_listener import ProgressJsonListener

pytestmark = pytest.mark.slow


class Reports(ProgressJsonListener):
    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_progress(self, progress: dict[str, Any]) -> None:
        self.seen.append(progress)


def test_reports_arrive_as_json_with_observed_metrics_and_no_pyspark_conversion(
    spark, tmp_path, monkeypatch
) -> None:
    converted: list[object] = []
    real = pyspark_listener.QueryProgressEvent.fromJObject.__func__

    def counting(cls, jevent):  # noqa: ANN001, ANN202
        converted.append(jevent)
        return real(cls, jevent)

    monkeypatch.setattr(pyspark_listener.QueryProgressEvent, "fromJObject", classmethod(counting))
    src = tmp_path / "in"
    src.mkdir()
    for n in range(3):
        (src / f"{n}.json").write_text("\n".join(json.dumps({"k": f"k{i % 2}"}) for i in range(5)))
    reports, plain = Reports(), _PlainListener()
    spark.streams.addListener(reports)
    spark.streams.addListener(plain)  # PySpark's own path, to show the counter counts
    try:
        stream = (
            spark.readStream.schema("k string").option("maxFilesPerTrigger", 1).json(str(src))
            .observe("seen", F.count(F.lit(1)).alias("rows"))
        )  # fmt: skip
        query = (
            stream.writeStream.format("noop")
            .option("checkpointLocation", str(tmp_path / "ck"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        deadline = time.monotonic() + 30
        while (len(reports.seen) < 3 or len(plain.seen) < 3) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        spark.streams.removeListener(reports)
        spark.streams.removeListener(plain)
    batches = [p for p in reports.seen if p["numInputRows"] > 0]
    assert [p["batchId"] for p in batches] == [0, 1, 2]
    assert all(p["observedMetrics"]["seen"]["rows"] == 5 for p in batches)
    assert all("triggerExecution" in p["durationMs"] for p in batches)
    # PySpark converted the reports for its own listener only: once per report it heard
    assert len(converted) == len(plain.seen) >= 3


class _PlainListener(pyspark_listener.StreamingQueryListener):
    def __init__(self) -> None:
        self.seen: list[object] = []

    def onQueryStarted(self, event: Any) -> None:  # noqa: N802
        pass

    def onQueryProgress(self, event: Any) -> None:  # noqa: N802
        self.seen.append(event.progress)

    def onQueryIdle(self, event: Any) -> None:  # noqa: N802
        pass

    def onQueryTerminated(self, event: Any) -> None:  # noqa: N802
        pass
