"""`bench.batch_hold`: its storage reading sees each arm's cache, and a `held` that does
not cache uncompressed, a `one_pass` that caches, or an arm that misses metrics rows is
refused."""

from __future__ import annotations

import pytest

from bench import batch_hold
from shardless.processor.driver import batch_reads


def test_each_arm_caches_what_it_says(spark):
    out = batch_hold.measure(spark, rows=20_000, groups=2, reps=1)
    arms = out["arms"]
    assert arms["held"]["cached_bytes"] > arms["compressed"]["cached_bytes"] > 0
    assert arms["one_read"]["cached_bytes"] == arms["one_pass"]["cached_bytes"] == 0
    assert all(len(a["runs"]) == 1 and a["seconds"] > 0 for a in arms.values())


def test_a_held_cache_as_small_as_the_compressed_one_is_refused(spark, monkeypatch):
    monkeypatch.setattr(batch_reads, "held", lambda df: df.persist())
    with pytest.raises(RuntimeError, match="did not cache uncompressed"):
        batch_hold.measure(spark, rows=20_000, groups=2, reps=1)


def test_a_one_pass_that_caches_is_refused(spark, monkeypatch):
    monkeypatch.setattr(batch_hold, "reads_once", lambda sink: sink)  # the held path
    with pytest.raises(RuntimeError, match="one_pass cached the batch"):
        batch_hold.measure(spark, rows=20_000, groups=2, reps=1)


def test_an_arm_that_misses_metrics_rows_is_refused(spark, monkeypatch):
    monkeypatch.setattr(batch_hold, "deliver", lambda df, batch_id, sink: [])
    with pytest.raises(RuntimeError, match="0 metrics rows read, not 2"):
        batch_hold.measure(spark, rows=20_000, groups=2, reps=1)
