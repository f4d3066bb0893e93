"""Choosing slices and versions for the state tools, and deciding whether an app runs."""

from __future__ import annotations

import pytest

from shardless.changelog.inspect import StateQueryError
from shardless.changelog.layout import Head, LogEntry, SnapRef
from shardless.changelog.lease import Lease, activity
from shardless.processor.tools.selection import latest_query, parse_slices, targets


def entry(version: int, batch: int, query: str = "q1234567") -> LogEntry:
    return LogEntry(version, batch, 0, f"u{version}", 0, 10, 1, query[:8])


def head(slice_id: int, versions: list[tuple[int, int]], snaps=(), at_ms=0, claimed_ms=0):  # noqa: ANN001
    log = tuple(entry(v, b) for v, b in versions)
    return Head(
        slice_id, log[-1].version if log else 0, "q1234567-full", log[-1].batch if log else -1,
        log, tuple(snaps), 1, "w", at_ms, claimed_ms,
    )  # fmt: skip


def test_parse_slices_reads_numbers_ranges_and_lists_and_names_what_is_wrong():
    assert parse_slices("5-7,1", 8) == [1, 5, 6, 7]
    with pytest.raises(StateQueryError, match="8 is outside the application's slices 0..7"):
        parse_slices("8", 8)
    with pytest.raises(StateQueryError, match="like 3, 0-15"):
        parse_slices("x", 8)


def test_a_batch_cut_takes_each_slice_to_its_version_after_that_batch():
    heads = {
        0: head(0, [(1, 0), (2, 1), (3, 3)]),  # committed in batches 0, 1, 3
        1: head(1, [(1, 2), (2, 3)]),  # born in batch 2
        2: head(2, [(1, 0)]),  # untouched after batch 0
    }
    assert targets(heads, [0, 1, 2, 3], batch=1) == {0: 2, 1: 0, 2: 1, 3: 0}
    assert targets(heads, [0, 1, 2], batch=2) == {0: 2, 1: 1, 2: 1}
    assert targets(heads, [0, 1]) == {0: 3, 1: 2}
    assert targets(heads, [1], version=1) == {1: 1}
    with pytest.raises(StateQueryError, match="pass --slice N with it"):
        targets(heads, [0, 1], version=1)


def test_a_cut_before_what_retention_keeps_is_refused():
    snap = SnapRef(3, "k", 10, 1, batch=3, query="q1234567")
    heads = {0: head(0, [(4, 4), (5, 5)], snaps=(snap,))}
    assert targets(heads, [0], batch=4) == {0: 4}
    with pytest.raises(StateQueryError, match="no longer retained"):
        targets(heads, [0], batch=1)


def test_latest_query_is_the_one_that_committed_last():
    a = head(0, [(1, 0)], at_ms=5)
    b = Head(1, 1, "other-query", 0, (entry(1, 0, "other-qu"),), (), 1, "w", 9, 0)
    assert latest_query({0: a, 1: b}) == "other-query"
    with pytest.raises(StateQueryError, match="no committed state"):
        latest_query({})


def test_the_application_looks_running_while_its_lease_is_held_or_slices_commit():
    now = 1_000_000
    quiet = [head(0, [(1, 0)], at_ms=now - 400_000)]
    assert activity(None, quiet, quiet_s=300, now_ms=now) == []
    assert activity(Lease("d", "q", now - 1, now - 60_000), quiet, 300, now) == []  # lapsed
    held = activity(Lease("driver-1", "q", now + 30_000, now), quiet, 300, now)
    assert len(held) == 1 and "driver-1" in held[0] and "30 s more" in held[0]
    busy = activity(None, [head(3, [(1, 0)], claimed_ms=now - 5_000)], 300, now)
    assert len(busy) == 1 and "slice 3" in busy[0] and "5 s ago" in busy[0]
