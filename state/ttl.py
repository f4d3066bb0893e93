"""Expiry of values written with a time to live.

An expired value is never returned (readers check its expiry), and a bounded number of
expired entries are deleted per batch through a time-ordered index, so state does not
grow without limit.
"""

from __future__ import annotations

from shardless.state import encoding
from shardless.state.keys import EVENT, PROCESSING, expiries_due, expiry_key, parse_expiry_key
from shardless.state.transaction import Transaction


def is_expired(raw: bytes, now_ms: int, watermark_ms: int) -> bool:
    found = encoding.expiry(raw)
    if found is None:
        return False
    kind, at = found
    return at <= (now_ms if kind == PROCESSING else watermark_ms)


def index(tx: Transaction, db_key: bytes, kind: bytes, at: int) -> None:
    """Record that `db_key` expires at `at`, for the purge."""
    tx.put(expiry_key(kind, at, db_key), b"")


def purge(tx: Transaction, now_ms: int, watermark_ms: int, limit: int) -> int:
    """Delete up to `limit` expired entries; return how many index entries were handled."""
    handled = 0
    for kind, upto in ((PROCESSING, now_ms), (EVENT, watermark_ms)):
        if upto < 0:
            continue
        due = []
        for idx_key, _ in tx.items(*expiries_due(kind, upto)):
            due.append(idx_key)
            if handled + len(due) >= limit:
                break
        for idx_key in due:
            _, at, db_key = parse_expiry_key(idx_key)
            raw = tx.get(db_key)
            if raw is not None and encoding.expiry(raw) == (kind, at):
                tx.delete(db_key)
            tx.delete(idx_key)
        handled += len(due)
        if handled >= limit:
            break
    return handled
