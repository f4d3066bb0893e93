"""Properties of a slice head's restore history (log + retained snapshots): bounded, and
always able to rebuild the committed version, the one before it (which a re-run of the
same batch starts from) and every version back to the oldest retained snapshot."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardless.changelog.history import (
    log_bytes_after,
    next_history,
    plan_restore,
    snapshot_due,
)
from shardless.changelog.layout import (
    Head,
    LogEntry,
    SnapRef,
    decode_log,
    decode_snaps,
    encode_log,
    encode_snaps,
    new_uid,
    slice_of_pk,
    slice_pk,
)

KEEP = 3


def entry(version: int, length: int = 10) -> LogEntry:
    return LogEntry(version, version, 0, f"{version:032x}", 0, length, 1)


def snap(version: int, size: int = 25) -> SnapRef:
    return SnapRef(version, f"snap-{version}", size, 1)


# A history: each step commits the next version or re-runs the last one, with or without a
# snapshot of the version it starts from.
steps = st.lists(st.tuples(st.sampled_from(["commit", "rerun"]), st.booleans()), max_size=80)


def replay(history: list[tuple[str, bool]]) -> tuple[Head, int]:
    log: tuple[LogEntry, ...] = ()
    snaps: tuple[SnapRef, ...] = ()
    version = 0
    for kind, with_snapshot in history:
        if not (kind == "rerun" and version > 0):
            version += 1
        base = version - 1
        taken = snap(base) if with_snapshot and base > 0 else None
        log, snaps = next_history(log, snaps, entry(version), taken, KEEP)
    return Head(0, version, "q", version, log, snaps), version


def versions_after(head: Head, local: int | None, target: int) -> list[int]:
    """Apply a restore plan symbolically: the versions a store passes through."""
    plan = plan_restore(head, local, target)
    if plan.snapshot is not None:
        seen = list(range(plan.snapshot.version + 1))
    elif plan.fresh or local is None:
        seen = [0]
    else:
        seen = list(range(local + 1))
    for e in plan.entries:
        assert seen[-1] == e.version - 1
        seen.append(e.version)
    return seen


@settings(max_examples=300)
@given(steps)
def test_history_rebuilds_the_head_and_every_version_back_to_the_oldest_snapshot(history):
    head, version = replay(history)
    floor = head.snaps[0].version if head.snaps else 0
    for target in range(max(floor, 0), version + 1):
        assert versions_after(head, None, target)[-1] == target


@settings(max_examples=300)
@given(steps, st.data())
def test_a_stale_store_catches_up_without_gaps(history, data):
    head, version = replay(history)
    local = data.draw(st.integers(0, version))
    assert versions_after(head, local, version) == list(range(version + 1))


@given(steps)
def test_history_is_bounded_and_ordered(history):
    head, version = replay(history)
    assert len(head.snaps) <= KEEP
    assert [s.version for s in head.snaps] == sorted({s.version for s in head.snaps})
    assert all(s.version < version for s in head.snaps)
    floor = head.snaps[0].version if head.snaps else 0
    assert [e.version for e in head.log] == list(range(floor + 1, version + 1))


def test_restore_prefers_the_snapshot_when_it_is_less_to_fetch():
    log = tuple(entry(v, length=100) for v in range(1, 41))
    head = Head(0, 40, "q", 40, log, (snap(32, size=500),))
    plan = plan_restore(head, None, 40)
    assert plan.snapshot == snap(32, 500) and [e.version for e in plan.entries] == list(
        range(33, 41)
    )
    stale = plan_restore(head, 38, 40)  # two entries beat a snapshot
    assert (
        stale.snapshot is None
        and not stale.fresh
        and [e.version for e in stale.entries] == [39, 40]
    )


def test_a_gap_is_refused():
    head = Head(0, 3, "q", 3, (entry(1), entry(3)))
    with pytest.raises(ValueError, match="cannot bring version 0 to 3"):
        plan_restore(head, 0, 3)


def test_rerun_replaces_the_last_entry_and_drops_snapshots_at_or_after_it():
    log, snaps = next_history(*next_history((), (), entry(1)), entry(2), snap(1))
    log, snaps = next_history(log, snaps, LogEntry(2, 2, 1, "f" * 32, 5, 6, 7), None)
    assert [e.version for e in log] == [2] and log[-1].group == 1 and snaps == (snap(1),)


def test_snapshots_are_due_every_n_versions_staggered_by_slice():
    head = Head(5, 0, "q", 0)
    due = [v for v in range(1, 80) if snapshot_due(head, v, 5, 32, 1 << 30)]
    assert due[0] == 32 - 5
    later = Head(5, 40, "q", 40, (entry(40),), (snap(27),))
    assert not snapshot_due(later, 40, 5, 32, 1 << 30)
    assert snapshot_due(later, 59, 5, 32, 1 << 30)
    assert snapshot_due(later, 40, 5, 32, 10)  # the log since the snapshot is big enough


@given(st.lists(st.integers(1, 10**9), max_size=40))
def test_history_encoding_round_trips(versions):
    log = tuple(entry(v) for v in versions)
    snaps = tuple(snap(v) for v in versions)
    assert decode_log(encode_log(log)) == log
    assert decode_snaps(encode_snaps(snaps)) == snaps


@given(st.lists(st.tuples(st.integers(1, 10**9), st.booleans(), st.integers(0, 2**40))))
def test_snapshot_lists_keep_the_range_of_a_packed_manifest(rows):
    snaps = tuple(
        replace(snap(v), at=at, length=100 + v % 1000) if packed else snap(v)
        for v, packed, at in rows
    )
    assert decode_snaps(encode_snaps(snaps)) == snaps
    for s in snaps:
        assert s.byte_range == (f"bytes={s.at}-{s.at + s.length - 1}" if s.at >= 0 else None)


uids = st.one_of(
    st.builds(new_uid),
    st.binary(min_size=16, max_size=16).map(bytes.hex),
    st.text(max_size=40),  # anything else is kept as text
)
entries = st.builds(
    LogEntry,
    version=st.integers(0, 2**40),
    batch=st.integers(-1, 2**40),
    group=st.integers(0, 2**31),
    uid=uids,
    offset=st.integers(0, 2**40),
    length=st.integers(0, 2**32),
    records=st.integers(0, 2**32),
    query=st.sampled_from(["", "a1b2c3d4", "ffff0000"]),
)


@given(st.lists(entries, max_size=30))
def test_any_log_round_trips_through_the_compact_form(log):
    assert decode_log(encode_log(log)) == tuple(log)


@given(st.lists(entries, max_size=30))
def test_logs_written_before_the_compact_form_still_decode(log):
    rows = [
        [e.version, e.batch, e.group, e.uid, e.offset, e.length, e.records, e.query] for e in log
    ]
    assert decode_log(msgpack.packb(rows)) == tuple(log)


def test_a_long_log_of_one_writer_takes_about_15_bytes_an_entry():
    """96 entries (3 snapshots 32 versions apart): what a head holds in steady state."""
    log = tuple(
        LogEntry(v, 1000 + v, 3, new_uid(), 250_000 + 9_000 * v, 9_000 + v, 400, "a1b2c3d4")
        for v in range(1, 97)
    )
    assert decode_log(encode_log(log)) == log
    old = msgpack.packb([[*e.__dict__.values()] for e in log])
    assert len(encode_log(log)) < 15 * len(log) and 4 * len(encode_log(log)) < len(old)


@given(st.integers(0, 99_999))
def test_a_head_items_partition_key_names_its_slice(slice_id: int) -> None:
    assert slice_of_pk(slice_pk(slice_id)) == slice_id


def reference_next_history(log, snaps, new, snapshot, keep):  # noqa: ANN001, ANN201
    """`next_history` as a filter over the whole log (how it was written before it looked
    at the log's ends only)."""
    kept = [s for s in snaps if s.version < new.version]
    if snapshot is not None and snapshot.version < new.version:
        kept = sorted([s for s in kept if s.version != snapshot.version] + [snapshot],
                      key=lambda s: s.version)  # fmt: skip
    kept = kept[-keep:] if keep > 0 else []
    floor = kept[0].version if kept else 0
    return tuple(e for e in log if floor < e.version < new.version) + (new,), tuple(kept)


ordered_logs = st.lists(
    st.tuples(st.integers(1, 3), st.integers(0, 50)), max_size=60
).map(lambda steps: tuple(  # versions rising by 1-3, each entry with its length
    entry(sum(d for d, _ in steps[: i + 1]), length) for i, (_, length) in enumerate(steps)
))  # fmt: skip
snap_lists = st.lists(st.integers(0, 200), max_size=5, unique=True).map(
    lambda vs: tuple(snap(v) for v in sorted(vs))
)


@settings(max_examples=500)
@given(
    ordered_logs, snap_lists, st.integers(1, 200), st.one_of(st.none(), st.integers(0, 200)),
    st.integers(0, 4),
)  # fmt: skip
def test_next_history_keeps_what_the_whole_log_filter_keeps(log, snaps, version, taken, keep):
    new = LogEntry(version, version, 1, "e" * 32, 0, 5, 1)
    snapshot = None if taken is None else snap(taken)
    assert next_history(log, snaps, new, snapshot, keep) == reference_next_history(
        log, snaps, new, snapshot, keep
    )


@settings(max_examples=500)
@given(ordered_logs, st.integers(-5, 200))
def test_the_bytes_after_a_version_are_those_the_whole_log_sums(log, version):
    assert log_bytes_after(log, version) == sum(e.length for e in log if e.version > version)
