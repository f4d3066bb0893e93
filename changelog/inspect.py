"""Reading an application's state from S3 and DynamoDB alone, at any retained version.

A slice is materialised into a scratch directory (the newest snapshot at or below the
version plus the log after it, verified as a restore is) and read there; nothing running
is touched. Pickled values are decoded only when the caller passes `allow_pickle`: whoever
can write the bucket chooses what unpickling runs.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardless.changelog.durable import DurableState
from shardless.changelog.errors import ChangelogError
from shardless.changelog.layout import Head
from shardless.changelog.restore import materialize
from shardless.state import encoding
from shardless.state.keys import (
    DATA,
    DATA_END,
    MAP,
    data_key,
    is_value_key,
    key_range,
    owner,
    record_key,
)
from shardless.state.store import SliceStore


class StateQueryError(ChangelogError):
    """A state command was asked for something the state cannot answer."""


@dataclass(frozen=True)
class Entry:
    """One decoded value of the state: a key's value, or an entry of its map (`sub`)."""

    slice: int
    key: str
    sub: str | None
    value: Any
    version: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "slice": self.slice,
            "key": self.key,
            "sub": self.sub,
            "value": jsonable(self.value),
            "version": self.version,
        }


def jsonable(value: Any) -> Any:
    """Values as JSON can carry them: bytes as {"base64": ...}."""
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def target_version(head: Head | None, version: int | None) -> int:
    if head is None:
        if version:
            raise StateQueryError(f"version {version}: the slice was never committed")
        return 0
    if version is None:
        return head.version
    floor = head.snaps[0].version if head.snaps else 0
    if not floor <= version <= head.version:
        raise StateQueryError(
            f"slice {head.slice}: version {version} is not retained (restorable: {floor}.."
            f"{head.version}; keep more with --keep-snapshots)"
        )
    return version


@contextlib.contextmanager
def opened(
    durable: DurableState, head: Head | None, slices: int, version: int | None = None
) -> Iterator[SliceStore | None]:
    """The slice at `version` (default: committed) in a scratch store, removed afterwards."""
    target = target_version(head, version)
    if head is None or target == 0:
        yield None
        return
    scratch = Path(tempfile.mkdtemp(prefix=f"shardless-{durable.loc.app}-{head.slice}-"))
    store = None
    try:
        store, _ = materialize(durable, head, scratch / "store", slices, target)
        yield store
    finally:
        if store is not None:
            store.close()
        shutil.rmtree(scratch, ignore_errors=True)


def entries(
    store: SliceStore | None,
    slice_id: int,
    *,
    key: str | None = None,
    prefix: str | None = None,
    start: str | None = None,
    stop: str | None = None,
    allow_pickle: bool = False,
) -> Iterator[Entry]:
    """Decoded values and map entries of one key, a key prefix, or a key range [start, stop).

    A pickled value raises `StateQueryError` unless `allow_pickle` (trusted buckets only)."""
    if store is None:
        return
    if key is not None:
        lo = data_key(key)
        hi = lo[:-2] + b"\x00\x01"  # every entry of exactly this key
    elif prefix is not None:
        lo, hi = key_range(prefix)
    else:
        lo = data_key(start)[:-2] if start is not None else DATA
        hi = data_key(stop)[:-2] if stop is not None else DATA_END
    version = store.version
    for db_key, raw in store.items(lo, hi):
        k = record_key(db_key)
        if is_value_key(db_key):
            yield Entry(slice_id, k, None, _decode(raw, k, slice_id, allow_pickle), version)
            continue
        rest = db_key[len(data_key(k)) :]
        if rest.startswith(MAP):
            sub = rest[len(MAP) :].replace(b"\x00\xff", b"\x00").decode("utf-8")
            yield Entry(slice_id, k, sub, _decode(raw, k, slice_id, allow_pickle), version)


def _decode(raw: bytes, key: str, slice_id: int, allow_pickle: bool) -> Any:
    if not allow_pickle and raw and raw[0] & 0x7F == encoding.PICKLE:
        raise StateQueryError(
            f"slice {slice_id}, key {key!r}: the stored value is pickled, and unpickling runs "
            "whatever code the writer chose; refused. Pass --allow-pickle (the shardless_state "
            "source: option allowPickle=true) only if you trust everyone who can write the "
            "bucket"
        )
    return encoding.decode(raw, key=key, allow_pickle=allow_pickle)


@dataclass
class Digest:
    """An order-independent digest of a set of store entries: their count and the sum of
    their hashes, so the union of slices can be checked against its parts."""

    count: int = 0
    total: int = 0

    def add(self, db_key: bytes, value: bytes) -> None:
        h = hashlib.blake2b(db_key + b"\x00" + value, digest_size=8).digest()
        self.count += 1
        self.total = (self.total + int.from_bytes(h, "big")) % (1 << 64)

    def __add__(self, other: Digest) -> Digest:
        return Digest(self.count + other.count, (self.total + other.total) % (1 << 64))

    def to_dict(self) -> dict[str, int | str]:
        return {"entries": self.count, "digest": f"{self.total:016x}"}


def digest(store: SliceStore | None) -> Digest:
    """The digest of every user entry (values, maps, timers, expiries) of a store."""
    d = Digest()
    if store is not None:
        for k, v in store.user_items():
            d.add(k, v)
    return d


def keys_of(store: SliceStore | None) -> int:
    """How many record keys hold a value."""
    if store is None:
        return 0
    return sum(1 for k, _ in store.items() if is_value_key(k))


__all__ = ["Digest", "Entry", "digest", "entries", "keys_of", "opened", "owner"]
