"""A batch's buffered writes over a slice store, with read-your-own-writes.

Nothing reaches RocksDB until the batch's changes are durable elsewhere; a failed batch
simply drops its transaction, so a retry sees the store exactly as it was.
"""

from __future__ import annotations

from state.store import Change, SliceStore

_DELETED = object()


class Transaction:
    def __init__(self, store: SliceStore) -> None:
        self.store = store
        self._writes: dict[bytes, object] = {}

    def get(self, key: bytes) -> bytes | None:
        found = self._writes.get(key)
        if found is None:
            return self.store.get(key)
        return None if found is _DELETED else found  # type: ignore[return-value]

    def put(self, key: bytes, value: bytes) -> None:
        self._writes[key] = value

    def delete(self, key: bytes) -> None:
        self._writes[key] = _DELETED

    def __len__(self) -> int:
        return len(self._writes)

    def merged_items(self) -> list[tuple[bytes, bytes]]:
        """The store's user entries as they will be after this transaction, in key order."""
        merged = dict(self.store.items())
        for k, v in self._writes.items():
            if v is _DELETED:
                merged.pop(k, None)
            else:
                merged[k] = v  # type: ignore[assignment]
        return sorted(merged.items())

    def changes(self) -> list[Change]:
        """The net changes in key order, deletes as `None`."""
        return [
            (k, None if v is _DELETED else v)  # type: ignore[misc]
            for k, v in sorted(self._writes.items())
        ]
