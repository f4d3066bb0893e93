"""`bench.source`'s polling against enhanced fan-out pair on kinesis-local: each side reads
every record through the source, and the fan-out runs really read over fan-out (every
recorded shard end says so, with its subscriptions counted) while the polling runs do not."""

from __future__ import annotations

import pytest

from bench import source as bench_source

pytestmark = pytest.mark.slow


def test_the_fan_out_pair_reads_every_record_each_way_and_counts_what_it_read(
    spark, location, tmp_path
) -> None:
    out = bench_source.fan_out_pair(
        spark, location.table, tmp_path, records=300, shards=1, reps=1, max_records=150
    )
    efo, polling = out["runs"]["efo"][0], out["runs"]["polling"][0]
    assert efo["records"] == polling["records"] == 300
    assert efo["shard_reads"] >= 2 and efo["fan_out_shard_reads"] == efo["shard_reads"]
    assert polling["shard_reads"] >= 2 and polling["fan_out_shard_reads"] == 0
    assert efo["get_records_calls"] >= efo["batches"] >= 2  # subscriptions that delivered
    assert out["efo_subscriptions_per_run"] == efo["get_records_calls"]
    assert out["efo_records_per_s"] == round(efo["records_per_s"]) > 0
    assert out["polling_records_per_s"] == round(polling["records_per_s"]) > 0
    assert out["efo_vs_polling"] == round(efo["records_per_s"] / polling["records_per_s"], 3)
    assert out["config"]["emulator"].startswith("kinesis-local ")
