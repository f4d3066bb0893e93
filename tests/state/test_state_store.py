"""A slice's RocksDB store and the per-batch transaction over it, on a real rocksdict."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardless.state.errors import CorruptStoreError
from shardless.state.keys import IDENTITY_KEY, VERSION_KEY, data_key
from shardless.state.store import SliceStore
from shardless.state.transaction import Transaction

IDENTITY = {"app": "counts", "slice": 7, "slices": 256}


@pytest.fixture
def store(tmp_path: Path):
    s = SliceStore(tmp_path / "slice-7", IDENTITY)
    yield s
    s.close()


class _RecordingDb:
    """Stands in for the Rdict handle: records every call, holds back writes until released."""

    def __init__(self, db: Any) -> None:
        self._db = db
        self.calls: list[str] = []
        self.batches: list[Any] = []

    def write(self, batch: Any) -> None:
        self.calls.append("write")
        self.batches.append(batch)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._db, name)
        if callable(attr) and name in {"put", "delete", "__setitem__", "__delitem__"}:
            self.calls.append(name)
        return attr

    def release(self) -> None:
        for batch in self.batches:
            self._db.write(batch)


# --- SliceStore -------------------------------------------------------------------------


def test_a_new_store_is_at_version_zero_and_empty(store: SliceStore) -> None:
    assert store.version == 0
    assert store.get(data_key("missing")) is None
    assert store.exists_on_disk()


def test_commit_applies_changes_and_sets_the_version(store: SliceStore) -> None:
    store.commit([(data_key("a"), b"1"), (data_key("b"), b"2")], 1)
    assert store.version == 1
    assert store.get(data_key("a")) == b"1"
    store.commit([(data_key("a"), None), (data_key("b"), b"22"), (data_key("c"), b"3")], 2)
    assert store.version == 2
    assert store.get(data_key("a")) is None
    assert store.get_many([data_key("a"), data_key("b"), data_key("c")]) == [None, b"22", b"3"]
    assert store.get_many([]) == []


def test_commit_writes_changes_and_version_in_one_batch(store: SliceStore) -> None:
    store.commit([(data_key("old"), b"x")], 1)
    recording = _RecordingDb(store._db)
    store._db = recording
    store.commit([(data_key("a"), b"1"), (data_key("old"), None)], 2)
    # Exactly one write call and no single-key puts or deletes beside it.
    assert recording.calls == ["write"]
    store._db = recording._db
    # While the batch is held back, neither the data nor the version has moved.
    assert store.version == 1
    assert store.get(data_key("a")) is None
    assert store.get(data_key("old")) == b"x"
    recording.release()
    assert store.version == 2
    assert store.get(data_key("a")) == b"1"
    assert store.get(data_key("old")) is None


def test_a_reopened_store_keeps_its_data_and_version(tmp_path: Path) -> None:
    path = tmp_path / "slice"
    first = SliceStore(path, IDENTITY)
    first.commit([(data_key("k"), b"v"), (data_key("gone"), b"x")], 5)
    first.commit([(data_key("gone"), None)], 6)
    first.close()

    again = SliceStore(path, dict(IDENTITY))
    try:
        assert again.version == 6
        assert again.get(data_key("k")) == b"v"
        assert again.get(data_key("gone")) is None
    finally:
        again.close()


def test_a_store_keeps_bloom_filters_for_its_misses(store: SliceStore) -> None:
    # What RocksDB recorded it opened the store with: SST files with a Bloom filter and
    # a whole-key filter over the memtable (bench.store_reads: misses 2.6x cheaper).
    (options,) = store.path.glob("OPTIONS-*")
    text = options.read_text()
    assert "filter_policy=bloomfilter" in text
    assert "memtable_whole_key_filtering=true" in text
    assert "memtable_prefix_bloom_size_ratio=0.001000" in text


def test_a_store_written_without_filters_reads_the_same_with_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stores and snapshots written before the filters were added open and read as before.
    from rocksdict import Options

    from shardless.state import store

    def rocksdb_defaults() -> Options:
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        return opts

    path = tmp_path / "slice"
    with monkeypatch.context() as m:
        m.setattr(store, "store_options", rocksdb_defaults)
        old = SliceStore(path, IDENTITY)
        old.commit([(data_key(str(i)), str(i).encode()) for i in range(0, 2000, 2)], 1)
        old.checkpoint(tmp_path / "flushed")  # the values now sit in an SST file too
        old.commit([(data_key("late"), b"x")], 2)
        old.close()
    assert "filter_policy=nullptr" in next(path.glob("OPTIONS-*")).read_text()
    again = SliceStore(path, IDENTITY)
    try:
        wanted = [data_key(str(i)) for i in range(2000)] + [data_key("late")]
        found = again.get_many(wanted)
        assert found[:2000] == [str(i).encode() if i % 2 == 0 else None for i in range(2000)]
        assert found[2000] == b"x"
        assert again.version == 2
    finally:
        again.close()


def test_opening_a_store_with_a_different_identity_raises_corrupt_store_error(
    tmp_path: Path,
) -> None:
    path = tmp_path / "slice"
    SliceStore(path, IDENTITY).close()
    other = {**IDENTITY, "slice": 8}
    with pytest.raises(CorruptStoreError) as info:
        SliceStore(path, other)
    assert str(path) in str(info.value)
    # The refused open released the database: the rightful owner can open it again.
    again = SliceStore(path, IDENTITY)
    again.close()


def test_items_returns_only_user_entries_in_key_order(store: SliceStore) -> None:
    keys = ["b", "a\x00", "a", "", "zz", "\u00e9", "a\x01"]
    store.commit([(data_key(k), k.encode()) for k in keys], 3)
    found = list(store.items())
    db_keys = [k for k, _ in found]
    assert db_keys == sorted(data_key(k) for k in keys)
    assert VERSION_KEY not in db_keys
    assert IDENTITY_KEY not in db_keys
    assert dict(found) == {data_key(k): k.encode() for k in keys}


def test_items_with_bounds_returns_the_half_open_range(store: SliceStore) -> None:
    store.commit([(data_key(k), b"v") for k in "abcde"], 1)
    got = [k for k, _ in store.items(data_key("b"), data_key("d"))]
    assert got == [data_key("b"), data_key("c")]


def test_exists_on_disk_turns_false_when_the_directory_is_removed(tmp_path: Path) -> None:
    path = tmp_path / "slice"
    s = SliceStore(path, IDENTITY)
    s.commit([(data_key("k"), b"v")], 1)
    assert s.exists_on_disk()
    shutil.rmtree(path)
    assert not s.exists_on_disk()
    s.close()  # must not raise
    s.close()  # nor a second time


def test_destroy_removes_the_store_directory(tmp_path: Path) -> None:
    path = tmp_path / "slice"
    s = SliceStore(path, IDENTITY)
    s.close()
    SliceStore.destroy(path)
    assert not path.exists()
    SliceStore.destroy(path)  # already gone: no error


# --- Transaction ------------------------------------------------------------------------


def test_transaction_reads_its_own_puts(store: SliceStore) -> None:
    store.commit([(data_key("a"), b"stored")], 1)
    tx = Transaction(store)
    assert tx.get(data_key("a")) == b"stored"
    tx.put(data_key("a"), b"new")
    tx.put(data_key("b"), b"")
    assert tx.get(data_key("a")) == b"new"
    assert tx.get(data_key("b")) == b""


def test_transaction_delete_then_get_returns_none(store: SliceStore) -> None:
    store.commit([(data_key("a"), b"stored")], 1)
    tx = Transaction(store)
    tx.delete(data_key("a"))
    assert tx.get(data_key("a")) is None
    tx.delete(data_key("never"))
    assert tx.get(data_key("never")) is None
    tx.put(data_key("a"), b"back")
    assert tx.get(data_key("a")) == b"back"


def test_transaction_changes_nothing_in_the_store_before_commit(store: SliceStore) -> None:
    store.commit([(data_key("a"), b"stored")], 1)
    tx = Transaction(store)
    tx.put(data_key("b"), b"new")
    tx.delete(data_key("a"))
    assert store.get(data_key("b")) is None
    assert store.get(data_key("a")) == b"stored"
    assert store.version == 1
    store.commit(tx.changes(), 2)
    assert store.get(data_key("b")) == b"new"
    assert store.get(data_key("a")) is None


def test_transaction_changes_are_sorted_with_deletes_as_none(store: SliceStore) -> None:
    store.commit([(data_key("m"), b"stored")], 1)
    tx = Transaction(store)
    tx.put(data_key("z"), b"1")
    tx.delete(data_key("m"))
    tx.put(data_key("a"), b"2")
    tx.put(data_key("z"), b"3")  # last write wins
    tx.put(data_key("x"), b"4")
    tx.delete(data_key("x"))
    assert len(tx) == 4
    assert tx.changes() == [
        (data_key("a"), b"2"),
        (data_key("m"), None),
        (data_key("x"), None),
        (data_key("z"), b"3"),
    ]


ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "delete", "get"]),
        st.sampled_from(["a", "b", "c", "d", "\x00"]),
        st.binary(max_size=4),
    ),
    max_size=30,
)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c"]), st.binary(max_size=4)), ops)
def test_transaction_behaves_like_a_dict_over_the_store(
    initial: dict[str, bytes], steps: list[tuple[str, str, bytes]]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = SliceStore(Path(tmp) / "slice", IDENTITY)
        try:
            store.commit([(data_key(k), v) for k, v in initial.items()], 1)
            model = dict(initial)
            tx = Transaction(store)
            for op, key, value in steps:
                if op == "put":
                    tx.put(data_key(key), value)
                    model[key] = value
                elif op == "delete":
                    tx.delete(data_key(key))
                    model.pop(key, None)
                else:
                    assert tx.get(data_key(key)) == model.get(key)
            # Untouched by the transaction until commit.
            assert {k: store.get(data_key(k)) for k in initial} == initial
            changes = tx.changes()
            assert [k for k, _ in changes] == sorted(k for k, _ in changes)
            store.commit(changes, 2)
            alphabet = ["a", "b", "c", "d", "\x00"]
            assert {k: store.get(data_key(k)) for k in alphabet} == {
                k: model.get(k) for k in alphabet
            }
            assert store.version == 2
        finally:
            store.close()


_ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "delete"]),
        st.sampled_from([data_key(k) for k in "abcd"] + [b"\x02timer-x", b"\x03exp-y"]),
        st.binary(max_size=3),
    ),
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(before=_ops, failed=_ops, after=_ops, ok=st.booleans())
def test_rollback_to_a_savepoint_leaves_no_trace_of_the_writes_after_it(
    before, failed, after, ok
) -> None:
    """A record whose handler fails is undone exactly: the transaction then equals one in
    which the record never ran, for reads, scans and the changes it commits."""

    def apply(tx: Transaction, ops) -> None:  # noqa: ANN001
        for op, key, value in ops:
            tx.put(key, value) if op == "put" else tx.delete(key)

    d = Path(tempfile.mkdtemp())
    try:
        s = SliceStore(d / "s", IDENTITY)
        s.commit([(data_key("a"), b"A"), (b"\x02timer-x", b"T")], 1)
        tx, ref = Transaction(s), Transaction(s)
        apply(tx, before)
        apply(ref, before)
        mark = tx.savepoint()
        apply(tx, failed)
        if ok:  # the record succeeded: keep its writes
            tx.release(mark)
            apply(ref, failed)
        else:
            tx.rollback_to(mark)
        apply(tx, after)
        apply(ref, after)
        assert tx.changes() == ref.changes()
        for lo, hi in ((b"\x00", b"\xff"), (b"\x02", b"\x03"), (b"\x03", None)):
            assert list(tx.items(lo, hi)) == list(ref.items(lo, hi))
        for _, key, _ in before + failed + after:
            assert tx.get(key) == ref.get(key)
        s.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
