"""A group touches only its own slices: a restart whose session asks for another
`spark.sql.shuffle.partitions` keeps the checkpoint's layout, and a group given a slice
outside its range, or one another group already committed in the batch, fails the batch
instead of taking the other group's commit for a re-run of its own."""

from __future__ import annotations

import pytest

from shardless.processor.driver import recorder
from shardless.processor.errors import ProcessorError
from shardless.processor.runtime.grouping import group_keys, group_of, slices_of_key
from shardless.processor.runtime.routing import route
from tests.processor.runtime.test_runtime import SLICES, durable_counts, frame, runner


def keys_of_slice(s: int, n: int = 3) -> list[str]:
    found = [k for k in (f"user-{i}" for i in range(10_000)) if route(k, None, SLICES) == s]
    return found[:n]


def test_a_slice_committed_by_another_group_in_this_batch_is_not_a_rerun(location, tmp_path):
    """Group 0 committed slice 5 in batch 1; group 1 then runs slice 5 in batch 1 too (a
    layout that changed under the checkpoint). Taking group 0's commit for its own re-run
    would replace it; the batch fails instead, and the state keeps group 0's commit."""
    keys = keys_of_slice(5)
    r = runner(location, tmp_path)
    r.run(0, "q", 0, frame(keys))
    r.run(0, "q", 1, frame(keys, 100))
    with pytest.raises(ProcessorError, match="group 0 already committed it in batch 1"):
        r.run(1, "q", 1, frame(keys[:1], 200))
    assert durable_counts(location) == {k: 2 for k in keys}


def test_a_group_refuses_slices_outside_its_range(location, tmp_path):
    partitions = 4
    keys = group_keys(partitions)
    mine = slices_of_key(keys[1], SLICES, partitions)
    assert list(mine) == [s for s in range(SLICES) if group_of(s, SLICES, partitions) == 1]
    r = runner(location, tmp_path, partitions=partitions)
    r.run(keys[1], "q", 0, frame(keys_of_slice(mine[0])))  # its own: fine
    stray = keys_of_slice(mine.stop)
    with pytest.raises(ProcessorError, match=r"outside its range 4-7 of 16 slices"):
        r.run(keys[1], "q", 1, frame(stray, 100))
    assert set(durable_counts(location)) == set(keys_of_slice(mine[0]))


def test_slices_of_key_inverts_the_layout():
    for partitions in (1, 3, 4, 7, 16):
        keys = group_keys(partitions)
        covered = [s for k in keys for s in slices_of_key(k, 64, partitions)]
        assert covered == list(range(64))
    assert slices_of_key(10**6, 64, 4) == range(0)


@pytest.mark.slow
def test_the_checkpoint_fixes_the_partitions_a_restart_lays_groups_out_for(spark, tmp_path):
    """Spark keeps a stateful query's shuffle partitions in its checkpoint and uses them
    on restart whatever the session says; `checkpoint_layout` reads them back, with the
    number of sources the query reads."""
    checkpoint = str(tmp_path / "ck")
    assert recorder.checkpoint_layout(spark, checkpoint) is None
    saved = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", "3")
    try:
        query = (
            spark.readStream.format("rate").option("rowsPerSecond", 5).load()
            .groupBy("value").count()
            .writeStream.format("noop").outputMode("update")
            .option("checkpointLocation", checkpoint)
            .trigger(once=True).start()
        )  # fmt: skip
        query.awaitTermination()
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", saved)
    assert recorder.checkpoint_layout(spark, checkpoint) == (3, 1)
