"""Garbage collection of the source's batch log (moto's DynamoDB): `BatchLog.collect`
deletes exactly a run's batches before a bound, the source's `commit` runs it once per
`batchLogGcEvery` batches keeping `batchLogRetain` batches before the committed one, and a
batch asked for after it was collected fails naming it instead of starting over."""

from __future__ import annotations

import uuid

import pytest

from shardless.changelog.layout import AppLocation
from shardless.processor.driver import recorder
from shardless.processor.errors import ConfigError, ProcessorError, SourceError
from shardless.processor.kinesis.batch_log import BatchLog
from shardless.processor.kinesis.source import KinesisStreamReader

SHARDS = [f"s/shardId-{i:012d}" for i in range(6)]
TRIM_HORIZON = {"type": "TRIM_HORIZON"}


def fill(log: BatchLog, run: str, batches: range) -> None:
    """Each batch's end for every shard and its positions, as a run leaves them."""
    for n in batches:
        for shard in SHARDS:
            end = {"after": f"{n}{len(shard)}", "done": False, "caught_up": True, "count": 1}
            log.record_end(run, n, shard, end)
        log.save_positions(run, n, {s: {"after": f"{n}", "done": False} for s in SHARDS})


def kept(log: BatchLog, run: str) -> tuple[list[int], list[int]]:
    """The batches of `run` whose ends (any shard), and whose positions, are still there."""
    ends = sorted({int(sk.split("#")[1]) for sk in log._keys(run, "end#", "end#~")})
    positions = sorted(int(sk.split("#")[1]) for sk in log._keys(run, "pos#", "pos#~"))
    return ends, positions


@pytest.fixture
def log(location: AppLocation) -> BatchLog:
    return BatchLog(location.table)


def test_collect_deletes_the_run_s_batches_before_the_bound_and_nothing_else(log) -> None:
    run, other = uuid.uuid4().hex, uuid.uuid4().hex
    fill(log, run, range(8))
    fill(log, other, range(4))

    # 5 batches of 6 ends and a position map: 35 records, over one BatchWriteItem's 25
    assert log.collect(run, 5) == 5 * (len(SHARDS) + 1)
    assert kept(log, run) == ([5, 6, 7], [5, 6, 7])
    assert set(log.ends(run, 5)) == set(SHARDS) and log.positions(run, 5) is not None
    assert kept(log, other) == ([0, 1, 2, 3], [0, 1, 2, 3])  # another run: untouched
    assert log.collected_below(run) == 5 and log.collected_below(other) == 0

    assert log.collect(run, 3) == 0  # an older bound deletes nothing and moves nothing back
    assert log.collected_below(run) == 5
    assert log.collect(run, 0) == 0 and kept(log, run) == ([5, 6, 7], [5, 6, 7])


def test_a_batch_asked_for_after_it_was_collected_fails_naming_it(log, location) -> None:
    run = uuid.uuid4().hex
    fill(log, run, range(1, 8))
    log.collect(run, 5)
    source = KinesisStreamReader({"streams": "s", "table": location.table})

    # The positions after batch 5 are kept; those after 4 are not, and rebuilding them
    # would need batch 3's: collected, so the source refuses rather than start over.
    five = source._positions_after({"run": run, "n": 5, "initial": TRIM_HORIZON})
    assert five[SHARDS[0]]["after"] == "5"
    with pytest.raises(SourceError, match=rf"batch 3 of source run {run}: .* deleted .* from 5 on"):
        source._positions_after({"run": run, "n": 4, "initial": TRIM_HORIZON})
    with pytest.raises(ProcessorError, match=rf"batch 3 of source run {run}"):
        recorder.positions_after(location.table, {"run": run, "n": 4, "initial": TRIM_HORIZON})

    # A batch after the last stored positions is rebuilt from its ends as before.
    log.record_end(run, 8, SHARDS[0], {"after": "80", "done": False, "count": 1})
    after = source._positions_after({"run": run, "n": 8, "initial": TRIM_HORIZON})
    assert after[SHARDS[0]]["after"] == "80" and after[SHARDS[1]]["after"] == "7"


def test_commit_collects_once_every_gc_every_batches_keeping_retain_before_it(
    log, location
) -> None:
    run = uuid.uuid4().hex
    fill(log, run, range(13))
    source = KinesisStreamReader(
        {"streams": "s", "table": location.table, "batchLogRetain": "2", "batchLogGcEvery": "3"}
    )
    oldest = []
    for n in range(1, 13):
        source.commit({"run": run, "n": n, "initial": TRIM_HORIZON})
        ends, positions = kept(log, run)
        assert ends[0] == positions[0] and ends[-1] == positions[-1] == 12
        oldest.append(ends[0])
    # below = n - 2; the first commit that has something to delete collects, then every 3
    assert oldest == [0, 0, 1, 1, 1, 4, 4, 4, 7, 7, 7, 10]


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("batchLogRetain", "-1", "must be 0 or more"),
        ("batchLogRetain", "many", "expected an integer"),
        ("batchLogGcEvery", "0", "must be positive"),
    ],
)
def test_bad_batch_log_options_are_refused_naming_them(option, value, message) -> None:
    with pytest.raises(ConfigError, match=rf"option {option}='{value}': {message}"):
        KinesisStreamReader({"streams": "s", "table": "t", option: value})


def test_a_retired_run_loses_every_record_and_cannot_plan_any_batch(log, location) -> None:
    run, other = uuid.uuid4().hex, uuid.uuid4().hex
    fill(log, run, range(1, 4))
    fill(log, other, range(1, 4))
    assert log.retire(run) == 3 * (len(SHARDS) + 1)
    assert kept(log, run) == ([], []) and kept(log, other) == ([1, 2, 3], [1, 2, 3])

    source = KinesisStreamReader({"streams": "s", "table": location.table})
    for n in (1, 3):  # batch 1 would otherwise be rebuilt from nothing: every shard anew
        with pytest.raises(SourceError, match=rf"source run {run} was retired"):
            source._positions_after({"run": run, "n": n, "initial": TRIM_HORIZON})
    # A run's first batch is built from its ends as before while nothing was collected.
    fresh = uuid.uuid4().hex
    log.record_end(fresh, 1, SHARDS[0], {"after": "10", "done": False, "count": 1})
    after = source._positions_after({"run": fresh, "n": 1, "initial": TRIM_HORIZON})
    assert after == {SHARDS[0]: {"after": "10", "done": False}}


def test_a_checkpoint_of_another_application_is_refused_not_restarted(log, location) -> None:
    """Offsets naming a run this table never recorded (another application's checkpoint)
    would otherwise rebuild positions from nothing: the streams read again from the start."""
    foreign = uuid.uuid4().hex
    source = KinesisStreamReader({"streams": "s", "table": location.table})
    with pytest.raises(SourceError, match=rf"batch 70 of source run {foreign}, but table "):
        source._positions_after({"run": foreign, "n": 70, "initial": TRIM_HORIZON})
    with pytest.raises(SourceError, match="written by another application"):
        source.latestOffset({"run": foreign, "n": 70, "initial": TRIM_HORIZON}, None)

    # A run of this table is known once; a new run's first batches build on its start.
    run = uuid.uuid4().hex
    log.record_end(run, 1, SHARDS[0], {"after": "10", "done": False, "count": 1})
    assert source._positions_after({"run": run, "n": 1, "initial": TRIM_HORIZON}) == {
        SHARDS[0]: {"after": "10", "done": False}
    }
    assert run in source._known_runs
    assert source._positions_after({"run": run, "n": 0, "initial": TRIM_HORIZON}) == {}
