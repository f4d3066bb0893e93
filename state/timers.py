"""Per-key timers kept in the slice's store, so they commit, restore and roll back with it.

Each timer is two entries: one in firing order (`t <kind> <ts> <key>`) and one under its
key (for listing and deleting a key's timers). Both go through the batch's transaction.

A per-kind floor records that no timer lies below it: fired timers leave tombstones in
RocksDB, and scans that start at the floor skip them instead of walking over them.
"""

from __future__ import annotations

from shardless.state.keys import (
    META,
    TIMERS,
    key_timer_key,
    key_timers_range,
    parse_key_timer,
    parse_timer_key,
    timer_key,
    timers_due,
)
from shardless.state.transaction import Transaction

_MAX_TS = (1 << 64) - 2
_FLOOR = META + b"timer-floor/"


def _floor(tx: Transaction, kind: bytes) -> int:
    raw = tx.get(_FLOOR + kind)
    return 0 if raw is None else int.from_bytes(raw, "big")


def _due_range(tx: Transaction, kind: bytes, upto: int) -> tuple[bytes, bytes]:
    lo, hi = timers_due(kind, upto)
    floor = _floor(tx, kind)
    return (max(lo, TIMERS + kind + floor.to_bytes(8, "big")) if floor else lo), hi


def _check(ts: int) -> int:
    if not isinstance(ts, int) or isinstance(ts, bool) or not 0 <= ts <= _MAX_TS:
        raise ValueError(f"timer time must be an integer of epoch milliseconds >= 0, got {ts!r}")
    return ts


def set_timer(tx: Transaction, key: str, kind: bytes, ts: int) -> None:
    _check(ts)
    if ts < _floor(tx, kind):
        tx.put(_FLOOR + kind, ts.to_bytes(8, "big"))
    tx.put(timer_key(kind, ts, key), b"")
    tx.put(key_timer_key(key, kind, ts), b"")


def delete_timer(tx: Transaction, key: str, kind: bytes, ts: int) -> None:
    _check(ts)
    tx.delete(timer_key(kind, ts, key))
    tx.delete(key_timer_key(key, kind, ts))


def key_timers(tx: Transaction, key: str) -> list[tuple[bytes, int]]:
    """A key's timers as (kind, ts), by kind then time."""
    return [parse_key_timer(k, key) for k, _ in tx.items(*key_timers_range(key))]


def pop_due(tx: Transaction, kind: bytes, upto: int, limit: int) -> list[tuple[int, str]]:
    """Remove and return up to `limit` timers of `kind` due at `upto`, in (time, key) order."""
    if upto < 0:
        return []
    due = []
    for db_key, _ in tx.items(*_due_range(tx, kind, upto)):
        _, ts, key = parse_timer_key(db_key)
        due.append((ts, key))
        if len(due) >= limit:
            break
    for ts, key in due:
        delete_timer(tx, key, kind, ts)
    # Every timer below the last one popped is gone: later scans may start there. Written
    # only when timers fired, so a slice without timer changes still commits nothing.
    if due:
        # drained: nothing is left at the last time either
        floor = due[-1][0] + (1 if len(due) < limit else 0)
        if floor > _floor(tx, kind):
            tx.put(_FLOOR + kind, floor.to_bytes(8, "big"))
    return due


def next_due(tx: Transaction, kind: bytes) -> int | None:
    """The earliest pending timer of `kind`, if any."""
    for db_key, _ in tx.items(*_due_range(tx, kind, _MAX_TS)):
        return parse_timer_key(db_key)[1]
    return None
