"""Per-key timers kept in the slice's store, so they commit, restore and roll back with it.

Each timer is two entries: one in firing order (`t <kind> <ts> <key>`) and one under its
key (for listing and deleting a key's timers). Both go through the batch's transaction.
"""

from __future__ import annotations

from state.keys import (
    key_timer_key,
    key_timers_range,
    parse_key_timer,
    parse_timer_key,
    timer_key,
    timers_due,
)
from state.transaction import Transaction

_MAX_TS = (1 << 64) - 2


def _check(ts: int) -> int:
    if not isinstance(ts, int) or isinstance(ts, bool) or not 0 <= ts <= _MAX_TS:
        raise ValueError(f"timer time must be an integer of epoch milliseconds >= 0, got {ts!r}")
    return ts


def set_timer(tx: Transaction, key: str, kind: bytes, ts: int) -> None:
    _check(ts)
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
    due = []
    for db_key, _ in tx.items(*timers_due(kind, max(upto, -1))):
        _, ts, key = parse_timer_key(db_key)
        due.append((ts, key))
        if len(due) >= limit:
            break
    for ts, key in due:
        delete_timer(tx, key, kind, ts)
    return due


def next_due(tx: Transaction, kind: bytes) -> int | None:
    """The earliest pending timer of `kind`, if any."""
    for db_key, _ in tx.items(*timers_due(kind, _MAX_TS)):
        return parse_timer_key(db_key)[1]
    return None
