"""`bench.batch_hold`: its storage reading sees each arm's cache, and a `held` that does
not cache uncompressed is refused."""

from __future__ import annotations

import pytest

from bench import batch_hold


def test_each_arm_caches_what_it_says(spark):
    out = batch_hold.measure(spark, rows=20_000, groups=2, reps=1)
    arms = out["arms"]
    assert arms["held"]["cached_bytes"] > arms["compressed"]["cached_bytes"] > 0
    assert arms["one_read"]["cached_bytes"] == 0
    assert all(len(a["runs"]) == 1 and a["seconds"] > 0 for a in arms.values())


def test_a_held_cache_as_small_as_the_compressed_one_is_refused(spark, monkeypatch):
    monkeypatch.setattr(batch_hold, "held", lambda df: df.persist())
    with pytest.raises(RuntimeError, match="did not cache uncompressed"):
        batch_hold.measure(spark, rows=20_000, groups=2, reps=1)
