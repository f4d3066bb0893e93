"""A slice log's compact encoding (`layout.encode_log`), carried from one batch to the next.

A host writes its group's heads, logs included, to the group's hint file after every batch
(`shardless.processor.runtime.known_heads`). A log lists the versions since the oldest
snapshot kept, so in a job that has run a while it holds about `keep_snapshots *
snapshot_every` entries, and encoding every log whole each batch grows with it. Yet a batch
changes a log only at its ends: entries added after the last, and, after a snapshot, the
oldest dropped. `LogEncoder` keeps the columns of the log it encoded last; when the next log
continues it (the same entry objects, some dropped from the start, some added at the end)
it cuts and extends them, and encodes any other log whole. The bytes are `encode_log`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import is_

import msgpack

from shardless.changelog.layout import LOG_COMPACT, LogEntry, uid_bytes


class LogEncoder:
    """`encode_log` for the successive logs of one slice."""

    def __init__(self) -> None:
        self._log: tuple[LogEntry, ...] = ()
        self._bytes: bytes | None = None
        self._versions: list[int] = []
        self._batches: list[int] = []  # each the difference from the entry before
        self._groups: list[int] = []
        self._uids: list[bytes | int | str] = []  # as `encode_log` writes them
        self._offsets: list[int] = []
        self._lengths: list[int] = []
        self._records: list[int] = []
        self._queries: list[list] = []  # runs of one query: [tag, count]
        self.whole = 0  # logs encoded whole, not as a continuation of the one before

    def encode(self, log: Sequence[LogEntry]) -> bytes:
        log = tuple(log)
        if log is self._log and self._bytes is not None:
            return self._bytes
        dropped = continues(self._log, log)
        if dropped is None:
            self._clear()
            self.whole += 1
            kept = 0
        else:
            kept = len(self._log) - dropped
            self._drop(dropped, log[0])
        self._extend(log, kept)
        self._log = log
        self._bytes = self._pack()
        return self._bytes

    def _clear(self) -> None:
        for column in self._columns():
            column.clear()
        self._queries.clear()

    def _columns(self) -> tuple[list, ...]:
        return (
            self._versions, self._batches, self._groups, self._uids, self._offsets,
            self._lengths, self._records,
        )  # fmt: skip

    def _drop(self, count: int, first: LogEntry) -> None:
        """The first `count` entries gone; `first` is the entry that now starts the log,
        whose batch and uid `encode_log` writes whole."""
        if not count:
            return
        for column in self._columns():
            del column[:count]
        self._batches[0] = first.batch
        raw = uid_bytes(first.uid)
        self._uids[0] = first.uid if raw is None else raw
        left = count
        while left:
            run = self._queries[0]
            if run[1] > left:
                run[1] -= left
                break
            left -= run[1]
            del self._queries[0]

    def _extend(self, log: tuple[LogEntry, ...], start: int) -> None:
        """Add `log[start:]` after `log[start - 1]`, as `encode_log`'s loop does."""
        last_batch = log[start - 1].batch if start else 0
        last_uid = uid_bytes(log[start - 1].uid) if start else None
        queries = self._queries
        for e in log[start:]:
            self._versions.append(e.version)
            self._batches.append(e.batch - last_batch)
            last_batch = e.batch
            raw = uid_bytes(e.uid)
            if raw is None:
                self._uids.append(e.uid)
            elif last_uid is not None and raw[:8] == last_uid[:8]:
                step = int.from_bytes(raw[8:], "big") - int.from_bytes(last_uid[8:], "big")
                self._uids.append(step if -(1 << 63) <= step < (1 << 63) else raw)
            else:
                self._uids.append(raw)
            last_uid = raw
            self._groups.append(e.group)
            self._offsets.append(e.offset)
            self._lengths.append(e.length)
            self._records.append(e.records)
            if queries and queries[-1][0] == e.query:
                queries[-1][1] += 1
            else:
                queries.append([e.query, 1])

    def _pack(self) -> bytes:
        versions = self._versions
        first = versions[0] if versions else 0
        consecutive = versions == list(range(first, first + len(versions)))
        columns = [
            first if consecutive else versions, self._batches, self._groups, self._uids,
            self._offsets, self._lengths, self._records, self._queries,
        ]  # fmt: skip
        return LOG_COMPACT + msgpack.packb(columns, use_bin_type=True)


def continues(old: tuple[LogEntry, ...], new: tuple[LogEntry, ...]) -> int | None:
    """How many entries `new` drops from the start of `old`, when `new` is `old` less some
    at the start and with some added at the end, entry for entry the same objects; None
    when it is not (an entry equal but not the same object counts as different)."""
    if not old or not new:
        return None
    first = new[0]
    dropped = next((i for i, entry in enumerate(old) if entry is first), None)
    if dropped is None:
        return None
    kept = len(old) - dropped
    if len(new) < kept or not all(map(is_, old[dropped:], new)):
        return None
    return dropped
