"""`StoreCache._consistent`, which decides whether a local store holds the committed
version (its tag is the uid the head's log has for it), read from the log's end: the same
answer as a search of the whole log, for any log a head can hold (versions rising, each
once) and any store version and tag."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from shardless.changelog.layout import Head, LogEntry
from shardless.processor.runtime.stores import StoreCache
from shardless.state.store import SliceStore


def reference(version: int, tag: str, head: Head | None) -> bool:
    """The search of the whole log, as it was written first."""
    if version == 0:
        return True
    entry = next((e for e in head.log if e.version == version), None) if head else None
    return entry is not None and tag == entry.uid


def entry(version: int, uid: str) -> LogEntry:
    return LogEntry(version, version - 1, 0, uid, 0, 1, 1)


logs = st.lists(st.integers(1, 40), unique=True, max_size=12).map(sorted)


@settings(max_examples=150, deadline=None)
@given(
    versions=logs,
    uids=st.lists(st.sampled_from(["a", "b", "c"]), min_size=12, max_size=12),
    store_version=st.integers(0, 42),
    tag=st.sampled_from(["a", "b", "c", ""]),
    no_head=st.booleans(),
)
def test_reading_the_log_from_its_end_answers_as_the_whole_search(
    versions, uids, store_version, tag, no_head
):
    log = tuple(entry(v, u) for v, u in zip(versions, uids[: len(versions)], strict=True))
    head = None if no_head else Head(0, max(versions, default=0), "q", 0, log)
    with tempfile.TemporaryDirectory() as tmp:
        store = SliceStore(Path(tmp) / "s", {"slice": 0})
        store.commit([], store_version, tag=tag)
        try:
            assert StoreCache._consistent(store, head) == reference(store_version, tag, head)
        finally:
            store.close()
