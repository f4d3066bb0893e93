"""A slice's history in its head: what a commit keeps of the log and snapshots
(`next_history`), when a slice is due a snapshot (`snapshot_due`), and the cheapest way to
bring a store to a version (`plan_restore`). Pure functions of heads.

A log is in version order: every commit keeps the entries below its own version and adds
its entry after them (`next_history`), and a log read back decodes in the order it was
written. The two functions a batch calls for every slice rely on it to look at the log's
ends only.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardless.changelog.layout import Head, LogEntry, SnapRef


def next_history(
    log: tuple[LogEntry, ...],
    snaps: tuple[SnapRef, ...],
    entry: LogEntry,
    snapshot: SnapRef | None = None,
    keep_snapshots: int = 3,
) -> tuple[tuple[LogEntry, ...], tuple[SnapRef, ...]]:
    """The log and snapshots after committing `entry` (with `snapshot`, if one was taken).

    A commit replaces any entries and snapshots at or after its version (a re-run of a
    batch commits in its own place). The newest `keep_snapshots` snapshots below the new
    version are kept, and log entries only after the oldest of them: every version from
    that snapshot to the head stays restorable, so the head stays small and restore stays
    bounded however long the history.
    """
    kept = [s for s in snaps if s.version < entry.version]
    if snapshot is not None and snapshot.version < entry.version:
        kept = [s for s in kept if s.version != snapshot.version] + [snapshot]
        kept.sort(key=lambda s: s.version)
    kept = kept[-keep_snapshots:] if keep_snapshots > 0 else []
    floor = kept[0].version if kept else 0
    if log and log[-1].version < entry.version:  # each batch's commit: the log's start cut
        start = 0
        while start < len(log) and log[start].version <= floor:
            start += 1
        return (*log[start:], entry), tuple(kept)
    new_log = [e for e in log if floor < e.version < entry.version] + [entry]
    return tuple(new_log), tuple(kept)


@dataclass(frozen=True)
class RestorePlan:
    """How to bring a store to a version: optionally a snapshot to start from, then log
    entries to replay in order. `fresh` plans start from an empty store."""

    snapshot: SnapRef | None
    entries: tuple[LogEntry, ...]
    fresh: bool = False  # the local store is discarded first

    @property
    def bytes(self) -> int:
        return (self.snapshot.bytes if self.snapshot else 0) + sum(e.length for e in self.entries)


def _replay(log: tuple[LogEntry, ...], start: int, target: int) -> tuple[LogEntry, ...] | None:
    """The entries for versions `start+1 .. target` if the log holds all of them."""
    path = tuple(e for e in log if start < e.version <= target)
    if [e.version for e in path] == list(range(start + 1, target + 1)):
        return path
    return None


def plan_restore(head: Head, local: int | None, target: int) -> RestorePlan:
    """The cheapest way to bring a store at version `local` (None: no usable store) to
    `target`: replay the log from `local`, or a snapshot and the log after it.

    Raises ValueError when neither reaches `target` (a gap); callers turn that into an
    error naming the slice and table.
    """
    options: list[RestorePlan] = []
    if local is not None and 0 <= local <= target:
        path = _replay(head.log, local, target)
        if path is not None:
            options.append(RestorePlan(None, path, fresh=False))
    if local is None or local > 0:
        path = _replay(head.log, 0, target)
        if path is not None:
            options.append(RestorePlan(None, path, fresh=True))
    for snap in reversed(head.snaps):
        if snap.version <= target:
            path = _replay(head.log, snap.version, target)
            if path is not None:
                options.append(RestorePlan(snap, path, fresh=True))
                break
    if not options:
        raise ValueError(
            f"log holds versions {[e.version for e in head.log]} and snapshots "
            f"{[s.version for s in head.snaps]}, which cannot bring version {local} to {target}"
        )
    # A replay from the local store is preferred unless a snapshot is less to fetch.
    return min(options, key=lambda p: (p.bytes, p.fresh))


def snapshot_due(
    head: Head | None, version: int, slice_id: int, every: int, max_log_bytes: int
) -> bool:
    """Whether to snapshot a slice at `version` (the version a batch starts from).

    Every `every` versions, or sooner once the log since the newest snapshot holds
    `max_log_bytes`. A slice's first snapshot comes `slice_id % every` versions early, so
    the slices of an application that move in step do not all snapshot in one batch.
    """
    if version <= 0 or every <= 0:
        return False
    last = head.snaps[-1].version if head and head.snaps else -(slice_id % every)
    if version <= last:
        return False
    if version - last >= every:
        return True
    return log_bytes_after(head.log if head else (), max(last, 0)) >= max_log_bytes


def log_bytes_after(log: tuple[LogEntry, ...], version: int) -> int:
    """The bytes of the log's entries above `version`: read from the log's end back."""
    total = 0
    for e in reversed(log):
        if e.version <= version:
            break
        total += e.length
    return total
