"""`bench.listener`: every report is timed both ways, and the two ways read the same
report (a callback that missed reports, or timed one way only, fails here)."""

from __future__ import annotations

import pytest

from bench import listener

pytestmark = pytest.mark.slow


def test_each_report_is_timed_both_ways(spark, tmp_path) -> None:
    times = listener.run(spark, batches=4, observed=2, work=tmp_path)
    # 4 batches of records, and the availableNow query may add no empty batch
    assert len(times["as_json_s"]) == len(times["converted_s"]) == 4
    assert all(t > 0 for t in times["as_json_s"] + times["converted_s"])
    # the JSON side is shardless's own callback: each report reached `on_progress`
    assert times["batch_ids"] == [0, 1, 2, 3]
