"""A batch's buffered writes over a slice store, with read-your-own-writes.

Nothing reaches RocksDB until the batch's changes are durable elsewhere; a failed batch
simply drops its transaction, so a retry sees the store exactly as it was. Values read
from the store are cached for the batch: they serve repeated reads and become the undo
record that lets a re-run batch roll the local store back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from shardless.state.keys import DATA, DATA_END
from shardless.state.store import Change, SliceStore

_DATA_BYTE = DATA[0]

_DELETED = object()
_ABSENT = object()


class Transaction:
    def __init__(self, store: SliceStore) -> None:
        self.store = store
        self._writes: dict[bytes, object] = {}
        self._reads: dict[bytes, bytes | None] = {}
        self._engine: set[bytes] = set()  # written keys outside the values (timers, TTL)
        self._journal: list[tuple[bytes, object]] | None = None  # (key, write it replaced)

    def prefetch(self, keys: Iterable[bytes]) -> None:
        """Read many distinct keys in one multi-get (faster than one get each, and faster
        still in key order)."""
        wanted = sorted(k for k in keys if k not in self._reads)
        self._reads.update(zip(wanted, self.store.get_many(wanted), strict=True))

    def get(self, key: bytes) -> bytes | None:
        found = self._writes.get(key, _ABSENT)
        if found is _ABSENT:
            found = self._reads.get(key, _ABSENT)
            if found is _ABSENT:
                found = self._reads[key] = self.store.get(key)
            return found  # type: ignore[return-value]
        return None if found is _DELETED else found  # type: ignore[return-value]

    def put(self, key: bytes, value: bytes) -> None:
        if self._journal is not None:
            self._journal.append((key, self._writes.get(key, _ABSENT)))
        self._writes[key] = value
        if key[0] != _DATA_BYTE:
            self._engine.add(key)

    def delete(self, key: bytes) -> None:
        if self._journal is not None:
            self._journal.append((key, self._writes.get(key, _ABSENT)))
        self._writes[key] = _DELETED
        if key[0] != _DATA_BYTE:
            self._engine.add(key)

    def savepoint(self) -> int:
        """Mark the writes so far; `rollback_to` undoes every write after the mark (a
        record whose handler failed leaves no trace). Journaling starts with the first
        savepoint, so transactions that never take one pay nothing."""
        if self._journal is None:
            self._journal = []
        return len(self._journal)

    def rollback_to(self, mark: int) -> None:
        assert self._journal is not None, "rollback_to without a savepoint"
        for key, previous in reversed(self._journal[mark:]):
            if previous is _ABSENT:
                del self._writes[key]
                self._engine.discard(key)
            else:
                self._writes[key] = previous
        del self._journal[mark:]

    def release(self, mark: int) -> None:
        """Forget the journal from `mark` on (the record succeeded)."""
        if self._journal is not None:
            del self._journal[mark:]

    def __len__(self) -> int:
        return len(self._writes)

    def items(self, lo: bytes, hi: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        """Entries with `lo <= key < hi` in key order, this batch's writes included."""
        # Timer and expiry scans need not look at the batch's many value writes.
        outside_values = lo >= DATA_END or (hi is not None and hi <= DATA)
        written = self._engine if outside_values else self._writes
        overlay = sorted(
            (k, self._writes[k]) for k in written if lo <= k and (hi is None or k < hi)
        )
        i = 0
        for key, value in self.store.items(lo, hi):
            while i < len(overlay) and overlay[i][0] < key:
                if overlay[i][1] is not _DELETED:
                    yield overlay[i]  # type: ignore[misc]
                i += 1
            if i < len(overlay) and overlay[i][0] == key:
                if overlay[i][1] is not _DELETED:
                    yield overlay[i]  # type: ignore[misc]
                i += 1
            else:
                yield key, value
        for key, value in overlay[i:]:
            if value is not _DELETED:
                yield key, value  # type: ignore[misc]

    def changes(self) -> list[Change]:
        """The net changes in key order, deletes as `None`. The keys are sorted alone:
        sorting (key, value) pairs compares tuples, twice the time for the same order."""
        writes = self._writes
        return [
            (k, None if (v := writes[k]) is _DELETED else v)  # type: ignore[misc]
            for k in sorted(writes)
        ]

    def undo(self, changes: list[Change]) -> list[Change]:
        """The changes that restore the values `changes` overwrite (read if not yet read)."""
        missing = [k for k, _ in changes if k not in self._reads]
        if missing:
            self._reads.update(zip(missing, self.store.get_many(missing), strict=True))
        return [(k, self._reads[k]) for k, _ in changes]
