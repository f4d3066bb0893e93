"""A commit with its undo record rolls back to exactly the state before it."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from shardless.state.store import SliceStore
from shardless.state.transaction import Transaction

keys = st.binary(min_size=1, max_size=3).map(lambda b: b"d" + b)
values = st.binary(max_size=4)
ops = st.lists(st.tuples(keys, st.one_of(st.none(), values)), max_size=30)


@settings(max_examples=100, deadline=None)
@given(ops, ops)
def test_roll_back_restores_the_previous_version_exactly(first, second):
    with tempfile.TemporaryDirectory() as d:
        store = SliceStore(Path(d) / "s", {"slice": 0})
        for version, batch in ((1, first), (2, second)):
            tx = Transaction(store)
            for k, v in batch:
                if v is None:
                    tx.delete(k)
                else:
                    tx.put(k, v)
            changes = tx.changes()
            if version == 2:
                before = dict(store.items())
            store.commit(changes, version, tx.undo(changes))
        assert store.roll_back() is True
        assert (store.version, dict(store.items())) == (1, before)
        assert store.roll_back() is False  # only one commit can be undone
        store.close()
