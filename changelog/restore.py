"""Bring a local slice store to a committed version from its head's log.

Restore always has an explicit end point, the version recorded in the slice's head; it
never reads "until it looks finished".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from changelog.durable import DurableState
from changelog.errors import ContinuityError
from changelog.layout import Head, restore_path
from state.store import SliceStore


class StoreAheadError(Exception):
    """The local store holds versions that are not (or no longer) committed."""


class RebuildRequired(Exception):
    """The store must be emptied first: the log starts from a base past its version."""


@dataclass
class RestoreStats:
    slice: int
    from_version: int
    to_version: int
    segments: int = 0
    records: int = 0
    bytes: int = 0
    seconds: float = 0.0


def catch_up(store: SliceStore, durable: DurableState, head: Head, target: int) -> RestoreStats:
    """Replay `head.log` into `store` up to version `target`, one atomic write per entry."""
    start = time.perf_counter()
    local = store.version
    stats = RestoreStats(head.slice, local, target)
    if local > target:
        raise StoreAheadError(
            f"slice {head.slice}: local store at version {local} is ahead of committed {target}"
        )
    try:
        fresh, path = restore_path(head.log, local, target)
    except ValueError as exc:
        raise ContinuityError(
            f"slice {head.slice}: {exc} (table {durable.loc.table}); refusing to restore a "
            "state with a gap"
        ) from exc
    if fresh and local != 0:
        raise RebuildRequired(
            f"slice {head.slice}: restore starts from a base at v{path[0].version}"
        )
    for entry in path:
        changes = durable.read_changes(head.slice, entry)
        store.commit(changes, entry.version)
        stats.segments += 1
        stats.records += len(changes)
        stats.bytes += entry.length
    stats.seconds = time.perf_counter() - start
    return stats
