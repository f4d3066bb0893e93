"""Shard positions, starting positions and the lineage order in which shards may be read."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardless.processor.errors import ConfigError
from shardless.processor.kinesis.positions import (
    advance,
    initial_position,
    iterator_args,
    sequence_sort_key,
)
from shardless.processor.kinesis.shards import Shard, depths, readable

STREAM = "events"
TOP = str(2**128 - 1)


def shard(shard_id: str, *parents: str, closed: bool = True, stream: str = STREAM) -> Shard:
    return Shard(
        stream=stream,
        shard_id=shard_id,
        parents=tuple(parents),
        starting_hash_key="0",
        ending_hash_key=TOP,
        closed=closed,
    )


def key(shard_id: str, stream: str = STREAM) -> str:
    return f"{stream}/{shard_id}"


def ids(shards: list[Shard]) -> set[str]:
    return {s.shard_id for s in shards}


# --- starting positions -----------------------------------------------------------------


def test_trim_horizon_resolves_to_trim_horizon() -> None:
    assert initial_position("TRIM_HORIZON") == {"type": "TRIM_HORIZON"}
    assert initial_position("  trim_horizon ") == {"type": "TRIM_HORIZON"}


def test_latest_resolves_to_at_timestamp_at_the_given_now() -> None:
    assert initial_position("LATEST", now=1_700_000_000.5) == {
        "type": "AT_TIMESTAMP",
        "ts": 1_700_000_000.5,
    }
    assert initial_position("latest", now=12.0) == {"type": "AT_TIMESTAMP", "ts": 12.0}


def test_latest_without_now_uses_the_current_time() -> None:
    before = time.time()
    got = initial_position("LATEST")
    after = time.time()
    assert got["type"] == "AT_TIMESTAMP"
    assert before <= got["ts"] <= after


@pytest.mark.parametrize(
    ("spec", "ts"),
    [
        ("AT_TIMESTAMP:1700000000", 1_700_000_000.0),
        ("AT_TIMESTAMP:1700000000.25", 1_700_000_000.25),
        ("at_timestamp:0", 0.0),
        ("AT_TIMESTAMP:2023-11-14T22:13:20+00:00", 1_700_000_000.0),
        ("AT_TIMESTAMP:2023-11-14T22:13:20Z", 1_700_000_000.0),
        ("AT_TIMESTAMP:2023-11-15T00:13:20+02:00", 1_700_000_000.0),
    ],
)
def test_at_timestamp_accepts_epoch_seconds_and_iso_8601(spec: str, ts: float) -> None:
    assert initial_position(spec) == {"type": "AT_TIMESTAMP", "ts": ts}


@pytest.mark.parametrize(
    "spec",
    ["EARLIEST", "", "AT_TIMESTAMP", "AT_TIMESTAMP:", "AT_TIMESTAMP:yesterday", "AT_SEQUENCE:1"],
)
def test_a_bad_starting_position_raises_config_error_naming_the_spec(spec: str) -> None:
    with pytest.raises(ConfigError) as info:
        initial_position(spec)
    assert repr(spec.strip()) in str(info.value)


# --- advancing positions ----------------------------------------------------------------


def test_advance_records_each_shards_end() -> None:
    before = {key("a"): {"after": "100", "done": False}}
    ends = {
        key("a"): {"after": "250", "done": False},
        key("b"): {"after": "7", "done": True},
    }
    assert advance(before, ends) == {
        key("a"): {"after": "250", "done": False},
        key("b"): {"after": "7", "done": True},
    }
    assert before == {key("a"): {"after": "100", "done": False}}  # not mutated


def test_advance_keeps_the_previous_position_when_an_end_read_nothing() -> None:
    before = {key("a"): {"after": "100", "done": False}}
    got = advance(before, {key("a"): {"after": None, "done": True}})
    assert got == {key("a"): {"after": "100", "done": True}}


def test_advance_of_a_new_shard_that_read_nothing_starts_from_none() -> None:
    got = advance({}, {key("a"): {"after": None, "done": False}})
    assert got == {key("a"): {"after": None, "done": False}}


def test_advance_leaves_shards_without_an_end_untouched() -> None:
    before = {key("a"): {"after": "1", "done": True}, key("b"): {"after": "2", "done": False}}
    got = advance(before, {key("b"): {"after": "3", "done": False}})
    assert got[key("a")] == {"after": "1", "done": True}
    assert got[key("b")] == {"after": "3", "done": False}


def test_advance_keeps_when_unread_records_began_from_the_end_or_else_from_before() -> None:
    before = {key("a"): {"after": "1", "done": False, "since": 100.0}}
    assert advance(before, {key("a"): {"after": "2", "done": False, "since": 250.5}}) == {
        key("a"): {"after": "2", "done": False, "since": 250.5}
    }
    assert advance(before, {key("a"): {"after": None, "done": False, "since": None}}) == before
    assert advance(before, {key("a"): {"after": "3", "done": False}})[key("a")]["since"] == 100.0


def test_iterator_args_resume_after_the_last_sequence_number() -> None:
    initial = {"type": "AT_TIMESTAMP", "ts": 5.0}
    assert iterator_args({"after": "4900", "done": False}, initial) == {
        "ShardIteratorType": "AFTER_SEQUENCE_NUMBER",
        "StartingSequenceNumber": "4900",
    }


@pytest.mark.parametrize("position", [None, {}, {"after": None, "done": False}])
def test_iterator_args_of_an_unread_shard_use_the_initial_position(position: dict | None) -> None:
    assert iterator_args(position, {"type": "AT_TIMESTAMP", "ts": 5.0}) == {
        "ShardIteratorType": "AT_TIMESTAMP",
        "Timestamp": 5.0,
    }
    assert iterator_args(position, {"type": "TRIM_HORIZON"}) == {
        "ShardIteratorType": "TRIM_HORIZON"
    }


decimal_sequence = st.integers(min_value=0, max_value=10**64 - 1).map(str)


@given(decimal_sequence, decimal_sequence)
def test_sequence_sort_key_orders_like_the_integers(a: str, b: str) -> None:
    assert (sequence_sort_key(a) < sequence_sort_key(b)) == (int(a) < int(b))
    assert (sequence_sort_key(a) == sequence_sort_key(b)) == (int(a) == int(b))


def test_sequence_sort_key_orders_real_kinesis_sequence_numbers() -> None:
    seqs = [
        "49590338271490256608559692540925702759324208523137515618",
        "9",
        "49590338271490256608559692538651455974631303643840217090",
        "100",
    ]
    assert sorted(seqs, key=sequence_sort_key) == sorted(seqs, key=int)


# --- lineage ----------------------------------------------------------------------------


def test_split_children_wait_for_the_parent_to_be_done() -> None:
    shards = [shard("A"), shard("B", "A", closed=False), shard("C", "A", closed=False)]
    assert ids(readable(shards, set())) == {"A"}
    assert ids(readable(shards, {key("A")})) == {"B", "C"}
    assert ids(readable(shards, {key("A"), key("B"), key("C")})) == set()


def test_merge_child_waits_for_both_parents() -> None:
    shards = [shard("B"), shard("C"), shard("D", "B", "C", closed=False)]
    assert ids(readable(shards, set())) == {"B", "C"}
    assert ids(readable(shards, {key("B")})) == {"C"}
    assert ids(readable(shards, {key("C")})) == {"B"}
    assert ids(readable(shards, {key("B"), key("C")})) == {"D"}


def test_a_chain_is_read_one_generation_at_a_time() -> None:
    shards = [shard("A"), shard("B", "A"), shard("C", "B"), shard("D", "C", closed=False)]
    done: set[str] = set()
    order = []
    while True:
        now = readable(shards, done)
        if not now:
            break
        assert len(now) == 1
        order.append(now[0].shard_id)
        done.add(now[0].key)
    assert order == ["A", "B", "C", "D"]


def test_a_parent_missing_from_the_listing_counts_as_done() -> None:
    # A aged out of the listing; its children are readable at once.
    shards = [shard("B", "A"), shard("C", "A"), shard("D", "B", "X")]
    assert ids(readable(shards, set())) == {"B", "C"}
    assert ids(readable(shards, {key("B")})) == {"C", "D"}


def test_parents_are_matched_within_the_same_stream() -> None:
    shards = [shard("A", stream="other"), shard("B", "A")]
    # "events/A" is not listed, so B does not wait for "other/A".
    assert ids(readable(shards, set())) == {"A", "B"}


def test_depths_of_a_split_and_merge() -> None:
    shards = [
        shard("A"),
        shard("B", "A"),
        shard("C", "A"),
        shard("D", "B", "C", closed=False),
    ]
    assert depths(shards) == {key("A"): 0, key("B"): 1, key("C"): 1, key("D"): 2}


def test_depths_take_the_deepest_parent_and_ignore_missing_ones() -> None:
    shards = [shard("B", "gone"), shard("C", "B"), shard("E", "C", "gone2"), shard("F", "B", "E")]
    assert depths(shards) == {key("B"): 0, key("C"): 1, key("E"): 2, key("F"): 3}


@st.composite
def lineages(draw: st.DrawFn) -> tuple[list[Shard], set[str]]:
    """A stream's history of splits and merges, with the oldest shards possibly trimmed."""
    counter = iter(range(10_000))

    def new_id() -> str:
        return f"shardId-{next(counter):012d}"

    open_ids = [new_id() for _ in range(draw(st.integers(min_value=1, max_value=3)))]
    parents: dict[str, tuple[str, ...]] = {s: () for s in open_ids}
    for _ in range(draw(st.integers(min_value=0, max_value=12))):
        if len(open_ids) >= 2 and draw(st.booleans()):
            i = draw(st.integers(min_value=0, max_value=len(open_ids) - 2))
            a, b = open_ids[i], open_ids[i + 1]
            child = new_id()
            parents[child] = (a, b)
            open_ids[i : i + 2] = [child]
        else:
            i = draw(st.integers(min_value=0, max_value=len(open_ids) - 1))
            parent = open_ids[i]
            left, right = new_id(), new_id()
            parents[left] = parents[right] = (parent,)
            open_ids[i : i + 1] = [left, right]
    trimmed = draw(st.sets(st.sampled_from(sorted(parents))))
    trimmed -= set(open_ids)  # retention only drops closed shards
    shards = [
        shard(s, *ps, closed=s not in open_ids) for s, ps in parents.items() if s not in trimmed
    ]
    order = draw(st.permutations(shards))
    return list(order), {key(s) for s in trimmed}


@given(lineages(), st.data())
def test_readable_never_returns_a_child_before_its_listed_parents_are_done(
    lineage: tuple[list[Shard], set[str]], data: st.DataObject
) -> None:
    shards, _ = lineage
    done = data.draw(st.sets(st.sampled_from([s.key for s in shards])))
    listed = {s.key for s in shards}
    got = readable(shards, done)
    for s in got:
        assert s.key not in done
        for p in s.parents:
            assert key(p) in done or key(p) not in listed
    # ...and returns every shard that qualifies.
    for s in shards:
        qualifies = s.key not in done and all(
            key(p) in done or key(p) not in listed for p in s.parents
        )
        assert (s in got) == qualifies


@given(lineages())
def test_reading_readable_shards_reaches_every_shard_parents_first(
    lineage: tuple[list[Shard], set[str]],
) -> None:
    shards, _ = lineage
    done: set[str] = set()
    finished_at: dict[str, int] = {}
    step = 0
    while len(done) < len(shards):
        now = readable(shards, done)
        assert now, "lineage stalled"
        for s in now:
            finished_at[s.key] = step
        done |= {s.key for s in now}
        step += 1
    for s in shards:
        for p in s.parents:
            if key(p) in finished_at:
                assert finished_at[key(p)] < finished_at[s.key]


@given(lineages())
def test_depths_put_parents_before_children(lineage: tuple[list[Shard], set[str]]) -> None:
    shards, _ = lineage
    d = depths(shards)
    assert set(d) == {s.key for s in shards}
    listed = set(d)
    for s in shards:
        known = [key(p) for p in s.parents if key(p) in listed]
        if known:
            assert d[s.key] == 1 + max(d[p] for p in known)
        else:
            assert d[s.key] == 0
