"""Bring a local slice store to a committed version by replaying its changelog tail.

Restore always has an explicit end point, the version recorded in the slice's head; it
never reads "until it looks finished".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from changelog.durable import DurableState
from state.store import SliceStore


class StoreAheadError(Exception):
    """The local store holds versions that are not (or no longer) committed."""


@dataclass
class RestoreStats:
    slice: int
    from_version: int
    to_version: int
    segments: int = 0
    records: int = 0
    bytes: int = 0
    seconds: float = 0.0


def catch_up(store: SliceStore, durable: DurableState, slice_id: int, target: int) -> RestoreStats:
    """Replay versions `store.version + 1 .. target` into `store`, one atomic write each."""
    start = time.perf_counter()
    local = store.version
    stats = RestoreStats(slice_id, local, target)
    if local > target:
        raise StoreAheadError(
            f"slice {slice_id}: local store at version {local} is ahead of committed {target}"
        )
    for entry in durable.log(slice_id, local + 1, target):
        changes = durable.read_changes(entry)
        store.commit(changes, entry.version)
        stats.segments += 1
        stats.records += len(changes)
        stats.bytes += entry.length
    stats.seconds = time.perf_counter() - start
    return stats
