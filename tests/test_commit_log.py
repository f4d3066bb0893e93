"""Properties of a slice head's restore log: bounded, and always able to rebuild both the
committed version and the one before it (which a re-run of the same batch starts from)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changelog.layout import LogEntry, decode_log, encode_log, next_log, restore_path


def entry(version: int, base: bool = False) -> LogEntry:
    return LogEntry(version, version, 0, f"{version:032x}", 0, 10, 1, base)


# A history: each step commits the next version (maybe as a base), or re-runs the last one.
steps = st.lists(st.tuples(st.sampled_from(["commit", "rerun"]), st.booleans()), max_size=60)


def replay(history: list[tuple[str, bool]]) -> tuple[tuple[LogEntry, ...], int]:
    log: tuple[LogEntry, ...] = ()
    version = 0
    for kind, base in history:
        if kind == "rerun" and version > 0:
            log = next_log(log, entry(version, base))
        else:
            version += 1
            log = next_log(log, entry(version, base))
    return log, version


def versions_from(log: tuple[LogEntry, ...], local: int, target: int) -> list[int]:
    """Apply a restore plan symbolically: the versions a store passes through."""
    fresh, path = restore_path(log, local, target)
    seen = [] if fresh else list(range(local + 1))
    for e in path:
        if e.base:
            seen = list(range(e.version + 1))
        else:
            assert seen[-1] == e.version - 1
            seen.append(e.version)
    return seen


@settings(max_examples=300)
@given(steps)
def test_log_rebuilds_the_head_and_the_version_before_it(history):
    log, version = replay(history)
    if version == 0:
        return
    for target in (version, version - 1):
        assert versions_from(log, 0, target)[-1] == target


@settings(max_examples=300)
@given(steps, st.data())
def test_a_stale_store_catches_up_without_gaps(history, data):
    log, version = replay(history)
    if version == 0:
        return
    local = data.draw(st.integers(0, version))
    assert versions_from(log, local, version) == list(range(version + 1))


@given(steps)
def test_log_is_cut_at_the_newest_base_below_the_head(history):
    log, version = replay(history)
    bases = [e.version for e in log if e.base and e.version <= version - 1]
    if bases:
        assert log[0].base and log[0].version == max(bases)
    assert [e.version for e in log] == sorted({e.version for e in log})


def test_log_with_a_gap_is_refused():
    log = (entry(1), entry(3))
    with pytest.raises(ValueError, match="cannot bring version 0 to 3"):
        restore_path(log, 0, 3)


def test_rerun_replaces_the_last_entry():
    log = next_log(next_log((), entry(1)), entry(2))
    rerun = next_log(log, LogEntry(2, 2, 1, "f" * 32, 5, 6, 7))
    assert [e.version for e in rerun] == [1, 2] and rerun[-1].group == 1


@given(st.lists(st.tuples(st.integers(1, 10**9), st.booleans()), max_size=40))
def test_log_encoding_round_trips(rows):
    log = tuple(entry(v, b) for v, b in rows)
    assert decode_log(encode_log(log)) == log
