"""A group's chain: the append-only DynamoDB items that commit a group's batches, one item
per batch in which the group changed something (docs/design/group-commits.md).

    pk="chain#<id>"  sk="genesis"          query, partitions, group, first, count, created,
                                           keep (snapshots a head keeps)[, dead (gc's mark)]
    pk="chain#<id>"  sk="<position:012d>"  q, b, u, hl, n, sl, tp[, ss] (a link)
                                           or seal (nothing may follow)

A link names its segment (uid, header-and-index length, byte length) and which slices of
the chain's range it changed, as a bitmap: a slice's version is counted, not stored, so a
link stays under 1 KB whatever the slice count. Positions are taken by conditional writes,
one writer each, which orders every attempt of a group's batch.

Pure records and their items here; the reads and writes are in `durable`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from shardless.changelog.errors import ContinuityError, CorruptObjectError
from shardless.changelog.history import next_history
from shardless.changelog.layout import (
    TIMERS_UNKNOWN,
    AppLocation,
    Head,
    LogEntry,
    SnapRef,
    manifest_key,
    pack_key,
    query_tag,
)
from shardless.changelog.segment import SectionRef

GENESIS_SK = "genesis"
DEAD = "dead"  # gc marks a chain's genesis before it deletes the chain: nothing lands in it
_POSITION_DIGITS = 12


def chain_pk(chain: str) -> str:
    return f"chain#{chain}"


def position_sk(position: int) -> str:
    return f"{position:0{_POSITION_DIGITS}d}"


@dataclass(frozen=True)
class SliceRange:
    """The slices a chain may name: `first` .. `first + count - 1` (one group's range)."""

    first: int
    count: int

    def __contains__(self, slice_id: object) -> bool:
        return isinstance(slice_id, int) and self.first <= slice_id < self.first + self.count


def bitmap(slices: tuple[int, ...] | list[int], within: SliceRange) -> bytes:
    """`slices` as one bit each over `within` (bit i of byte i // 8: slice first + i);
    ValueError for a slice outside it."""
    bits = bytearray((within.count + 7) // 8)
    for s in slices:
        if s not in within:
            raise ValueError(
                f"slice {s} is outside the chain's range {within.first}-"
                f"{within.first + within.count - 1}"
            )
        i = s - within.first
        bits[i // 8] |= 1 << (i % 8)
    return bytes(bits)


def members(bits: bytes, within: SliceRange) -> tuple[int, ...]:
    """The slices a `bitmap` names, in order."""
    out = []
    for byte_index, byte in enumerate(bits):
        while byte:
            low = byte & -byte
            i = byte_index * 8 + low.bit_length() - 1
            if i >= within.count:
                raise ValueError(f"bit {i} is past the chain's {within.count} slices")
            out.append(within.first + i)
            byte ^= low
    return tuple(out)


@dataclass(frozen=True)
class Genesis:
    """Who writes a chain: one query's group under one group layout."""

    chain: str
    query: str
    partitions: int
    group: int
    range: SliceRange
    created_ms: int
    keep_snapshots: int = 3  # how many snapshots a slice's head keeps (`next_history`)
    dead: bool = False  # gc marked it before deleting it (not written with the genesis)


@dataclass(frozen=True)
class LinkSnapshot:
    """A snapshot a link's batch took of one of its slices, at the version the slice had
    before the batch: its manifest is `manifest_key(slice, that version, uid)`, or bytes
    `at` to `at + length` of the pack `pack_key(uid)`."""

    slice: int
    uid: str
    bytes: int
    files: int
    at: int = -1
    length: int = 0

    def key(self, loc: AppLocation, version: int) -> str:
        if self.at >= 0:
            return pack_key(loc, self.uid)
        return manifest_key(loc, self.slice, version, self.uid)


_MANIFEST_UID = re.compile(r"-([0-9a-f]{32})\.manifest$")
_PACK_UID = re.compile(r"/([0-9a-f]{32})\.pack$")


def link_snapshot(ref: SnapRef, slice_id: int) -> LinkSnapshot:
    """The short form of a snapshot reference a link keeps (its key rebuilt from the slice,
    version and uid); ValueError for a key not named by `manifest_key` or `pack_key`."""
    if ref.at >= 0:
        found = _PACK_UID.search(ref.key)
        if found is None:
            raise ValueError(f"snapshot pack key {ref.key!r} does not end in /<uid>.pack")
        return LinkSnapshot(slice_id, found.group(1), ref.bytes, ref.files, ref.at, ref.length)
    found = _MANIFEST_UID.search(ref.key)
    if found is None:
        raise ValueError(f"snapshot manifest key {ref.key!r} does not end in -<uid>.manifest")
    return LinkSnapshot(slice_id, found.group(1), ref.bytes, ref.files)


@dataclass(frozen=True)
class Link:
    """One position of a chain: a committed batch of the group, or a seal."""

    position: int
    query: str = ""
    batch: int = -1
    uid: str = ""
    index_length: int = 0  # bytes of the segment's header and section index
    length: int = 0  # bytes of the whole segment
    slices: tuple[int, ...] = ()  # changed by this batch, in order
    timers: tuple[int, ...] = ()  # of `slices`, those with timers pending after it
    snapshots: tuple[LinkSnapshot, ...] = ()  # of `slices`, taken before the batch
    sealed_by: str = ""  # a seal: who took the chain's slices over
    at_ms: int = 0  # when it was committed (0: not recorded, links before it was)

    @property
    def sealed(self) -> bool:
        return bool(self.sealed_by)


def genesis_item(g: Genesis) -> dict[str, dict[str, Any]]:
    return {
        "pk": {"S": chain_pk(g.chain)},
        "sk": {"S": GENESIS_SK},
        "query": {"S": g.query},
        "partitions": {"N": str(g.partitions)},
        "group": {"N": str(g.group)},
        "first": {"N": str(g.range.first)},
        "count": {"N": str(g.range.count)},
        "created": {"N": str(g.created_ms)},
        "keep": {"N": str(g.keep_snapshots)},
    }


def genesis_from_item(item: dict[str, Any]) -> Genesis:
    where = f"chain item {item.get('pk', {}).get('S')!r}/genesis"
    try:
        return Genesis(
            chain=item["pk"]["S"].removeprefix("chain#"),
            query=item["query"]["S"],
            partitions=int(item["partitions"]["N"]),
            group=int(item["group"]["N"]),
            range=SliceRange(int(item["first"]["N"]), int(item["count"]["N"])),
            created_ms=int(item["created"]["N"]),
            keep_snapshots=int(item["keep"]["N"]),
            dead=DEAD in item,
        )
    except (KeyError, ValueError) as exc:
        raise CorruptObjectError(f"{where}: unreadable ({exc!r})") from exc


def link_item(chain: str, link: Link, within: SliceRange) -> dict[str, dict[str, Any]]:
    """The DynamoDB item of `link` in `chain`, whose slices are `within`."""
    item: dict[str, dict[str, Any]] = {
        "pk": {"S": chain_pk(chain)},
        "sk": {"S": position_sk(link.position)},
    }
    if link.sealed:
        item["seal"] = {"S": link.sealed_by}
        return item
    if not set(link.timers) <= set(link.slices):
        raise ValueError(f"timers {link.timers} name slices the link does not: {link.slices}")
    item |= {
        "q": {"S": link.query},
        "b": {"N": str(link.batch)},
        "u": {"S": link.uid},
        "hl": {"N": str(link.index_length)},
        "n": {"N": str(link.length)},
        "sl": {"B": bitmap(link.slices, within)},
    }
    if link.at_ms:
        item["at"] = {"N": str(link.at_ms)}
    if link.timers:
        item["tp"] = {"B": bitmap(link.timers, within)}
    if link.snapshots:
        if not {s.slice for s in link.snapshots} <= set(link.slices):
            raise ValueError(f"snapshots of slices the link does not change: {link.snapshots}")
        rows = [[s.slice - within.first, bytes.fromhex(s.uid), s.bytes, s.files]
                + ([s.at, s.length] if s.at >= 0 else [])
                for s in link.snapshots]  # fmt: skip
        item["ss"] = {"B": msgpack.packb(rows, use_bin_type=True)}
    return item


def link_from_item(item: dict[str, Any], within: SliceRange) -> Link:
    """A link read back; CorruptObjectError naming the item when it does not decode."""
    where = f"chain item {item.get('pk', {}).get('S')!r}/{item.get('sk', {}).get('S')!r}"
    try:
        position = int(item["sk"]["S"])
        if "seal" in item:
            return Link(position, sealed_by=item["seal"]["S"])
        snapshots = ()
        if "ss" in item:
            snapshots = tuple(
                LinkSnapshot(within.first + s, uid.hex(), n, files, *ranged)
                for s, uid, n, files, *ranged in msgpack.unpackb(bytes(item["ss"]["B"]))
            )
        return Link(
            position=position,
            query=item["q"]["S"],
            batch=int(item["b"]["N"]),
            uid=item["u"]["S"],
            index_length=int(item["hl"]["N"]),
            length=int(item["n"]["N"]),
            slices=members(bytes(item["sl"]["B"]), within),
            timers=members(bytes(item["tp"]["B"]), within) if "tp" in item else (),
            snapshots=snapshots,
            at_ms=int(item["at"]["N"]) if "at" in item else 0,
        )
    except (KeyError, ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CorruptObjectError(f"{where}: unreadable ({exc!r})") from exc


def versions(
    base: int, links: list[Link] | tuple[Link, ...], slice_id: int, start: int = 0
) -> list[tuple[int, Link]]:
    """The versions of `slice_id` that `links` (in position order) commit after `base`,
    counting from position `start`, up to the first seal: each version with its link."""
    out, version, last = [], base, None
    for link in links:
        if last is not None and link.position != last + 1:
            raise ValueError(f"chain positions jump from {last} to {link.position}")
        last = link.position
        if link.position < start:
            continue
        if link.sealed:
            break
        if slice_id in link.slices:
            version += 1
            out.append((version, link))
    return out


def _history(
    head: Head, genesis: Genesis, found: list[tuple[int, Link]], loc: AppLocation
) -> tuple[tuple[LogEntry, ...], tuple[SnapRef, ...]]:
    """The log and snapshots after the chain's versions `found`, trimmed as commits trim
    them; the chain's entries without their place in the segment yet (offset, length and
    records 0): the snapshots a link keeps say what stays, without reading S3."""
    log, snaps = head.log, head.snaps
    for version, link in found:
        entry = LogEntry(version, link.batch, genesis.group, link.uid, 0, 0, 0,
                         query_tag(link.query))  # fmt: skip
        snapshot = next((s for s in link.snapshots if s.slice == head.slice), None)
        snap = None
        if snapshot is not None:
            before = next((e for e in log if e.version == version - 1), None)
            snap = SnapRef(
                version - 1, snapshot.key(loc, version - 1), snapshot.bytes, snapshot.files,
                before.batch if before else -1, before.query if before else "",
                snapshot.at, snapshot.length,
            )  # fmt: skip
        log, snaps = next_history(log, snaps, entry, snap, genesis.keep_snapshots)
    return log, snaps


def _found(head: Head, genesis: Genesis, links: Sequence[Link]) -> list[tuple[int, Link]]:
    where = f"slice {head.slice}: chain {head.chain}"
    if genesis.chain != head.chain or head.slice not in genesis.range:
        raise ContinuityError(
            f"{where}: the chain read is {genesis.chain} over slices {genesis.range.first}-"
            f"{genesis.range.first + genesis.range.count - 1}"
        )
    try:
        return versions(head.version, links, head.slice, head.chain_from)
    except ValueError as exc:
        raise ContinuityError(f"{where}: {exc}") from exc


def needed_segments(
    head: Head, genesis: Genesis, links: Sequence[Link], loc: AppLocation
) -> set[str]:
    """The uids of the segments whose index `resolve` needs for `head`: those of the chain
    versions its trimmed log keeps (older ones garbage collection may have deleted)."""
    if not head.chain:
        return set()
    found = _found(head, genesis, links)
    mine = {link.uid for _, link in found}
    log, _ = _history(head, genesis, found, loc)
    return {e.uid for e in log if e.uid in mine}


def resolve(
    head: Head,
    genesis: Genesis,
    links: Sequence[Link],
    indexes: Mapping[str, Sequence[SectionRef]],
    loc: AppLocation,
) -> Head:
    """`head` as if each of its chain's versions had been committed into it: `version`,
    `query`, `batch`, `log` and `snaps` extended from `links` (the chain from
    `head.chain_from` on, in order) and the segments' section `indexes` (by uid), trimmed as
    a commit trims them (`next_history`, with the chain's retention). Every section the
    trimmed log keeps must hold the slice at the version counted for it: anything else is a
    lost or foreign link, refused as a ContinuityError naming the slice and the chain
    rather than restored wrongly. Timers pending after the last link are marked unknown
    (`TIMERS_UNKNOWN`): a link says whether, not when."""
    if not head.chain:
        return head
    found = _found(head, genesis, links)
    if not found:
        return head
    by_version = {version: link for version, link in found}
    log, snaps = _history(head, genesis, found, loc)
    placed = []
    for e in log:
        link = by_version.get(e.version)
        if link is None or e.uid != link.uid:
            placed.append(e)  # from the head's own log
            continue
        ref = next((r for r in indexes.get(link.uid, ()) if r.slice == head.slice), None)
        if ref is None or ref.version != e.version:
            got = "no section" if ref is None else f"version {ref.version}"
            raise ContinuityError(
                f"slice {head.slice}: chain {head.chain}: position {link.position} (batch "
                f"{link.batch}, segment {link.uid}) should hold version {e.version}, its "
                f"segment has {got}"
            )
        placed.append(replace(e, offset=ref.offset, length=ref.length, records=ref.records))
    last = found[-1][1]
    pending = head.slice in last.timers  # when they are due is in the slice's store
    return replace(
        head, version=found[-1][0], query=last.query, batch=last.batch, log=tuple(placed),
        snaps=snaps, next_timer=TIMERS_UNKNOWN if pending else None, next_event_timer=None,
        at_ms=last.at_ms or head.at_ms,
    )  # fmt: skip
