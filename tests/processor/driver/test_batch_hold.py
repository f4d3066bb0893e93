"""A batch's outputs held for their two reads (`shardless.processor.driver.batch_reads.held`)."""

from __future__ import annotations

from bench.batch_hold import cached_bytes, outputs
from shardless.processor.driver.batch_reads import CACHE_COMPRESSED, held


def _cached(spark, persist) -> tuple[int, list]:  # noqa: ANN001
    df = outputs(spark, 20_000, 2)
    kept = persist(df)
    try:
        rows = sorted(kept.collect())  # builds the cache
        return cached_bytes(spark), rows
    finally:
        kept.unpersist(blocking=True)


def test_a_batch_is_held_uncompressed_and_reads_the_same(spark):
    """The held cache is the uncompressed one (larger than Spark's compressed default for
    the same rows), and it holds exactly the batch's rows."""
    held_bytes, held_rows = _cached(spark, held)
    default_bytes, default_rows = _cached(spark, lambda df: df.persist())
    assert held_bytes > default_bytes > 0
    assert held_rows == default_rows == sorted(outputs(spark, 20_000, 2).collect())


def test_the_sessions_own_setting_is_put_back(spark):
    before = spark.conf.get(CACHE_COMPRESSED)
    try:
        for setting in ("true", "false"):
            spark.conf.set(CACHE_COMPRESSED, setting)
            held(spark.range(3)).unpersist(blocking=True)
            assert spark.conf.get(CACHE_COMPRESSED) == setting
    finally:
        spark.conf.set(CACHE_COMPRESSED, before)
