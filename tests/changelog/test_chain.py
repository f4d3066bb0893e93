"""Chain items: bitmaps, links and genesis round-trip; versions are counted as a plain
fold counts them; a link stays under 1 KB (2 transactional write units) at 512 slices."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardless.changelog.chain import (
    Genesis,
    Link,
    LinkSnapshot,
    SliceRange,
    bitmap,
    genesis_from_item,
    genesis_item,
    link_from_item,
    link_item,
    link_snapshot,
    members,
    needed_segments,
    resolve,
    versions,
)
from shardless.changelog.errors import ContinuityError, CorruptObjectError
from shardless.changelog.layout import (
    TIMERS_UNKNOWN,
    AppLocation,
    Head,
    SnapRef,
    head_from_item,
    head_item,
    manifest_key,
    pack_key,
)
from shardless.changelog.segment import encode_segment, index_length

LOC = AppLocation.default("chains")


@st.composite
def range_and_slices(draw: st.DrawFn) -> tuple[SliceRange, tuple[int, ...]]:
    within = SliceRange(draw(st.integers(0, 4096)), draw(st.integers(1, 600)))
    picked = draw(st.sets(st.integers(within.first, within.first + within.count - 1)))
    return within, tuple(sorted(picked))


@given(range_and_slices())
def test_a_bitmap_names_exactly_its_slices(case: tuple[SliceRange, tuple[int, ...]]) -> None:
    within, slices = case
    bits = bitmap(slices, within)
    assert len(bits) == (within.count + 7) // 8
    assert members(bits, within) == slices


def test_a_slice_outside_the_range_is_refused_both_ways() -> None:
    within = SliceRange(32, 32)
    with pytest.raises(ValueError, match="slice 64 is outside the chain's range 32-63"):
        bitmap([33, 64], within)
    with pytest.raises(ValueError, match="bit 5 is past the chain's 5 slices"):
        members(bytes([0b100000]), SliceRange(0, 5))


@st.composite
def links(draw: st.DrawFn, within: SliceRange) -> Link:
    if draw(st.booleans()) and draw(st.booleans()):
        return Link(draw(st.integers(1, 10**9)), sealed_by=draw(st.text(min_size=1, max_size=20)))
    slices = tuple(
        sorted(draw(st.sets(st.integers(within.first, within.first + within.count - 1))))
    )
    snapped = tuple(sorted(draw(st.sets(st.sampled_from(slices))))) if slices else ()
    snapshots = tuple(
        LinkSnapshot(s, draw(st.binary(min_size=16, max_size=16)).hex(),
                     draw(st.integers(0, 2**40)), draw(st.integers(0, 10**4)),
                     *draw(st.sampled_from([(), (draw(st.integers(0, 2**40)),
                                                 draw(st.integers(1, 2**20)))])))
        for s in snapped
    )  # fmt: skip
    return Link(
        position=draw(st.integers(1, 10**9)),
        query=draw(st.text(min_size=1, max_size=36)),
        batch=draw(st.integers(0, 2**40)),
        uid=draw(st.text(min_size=1, max_size=32)),
        index_length=draw(st.integers(0, 2**20)),
        length=draw(st.integers(0, 2**32)),
        slices=slices,
        timers=tuple(sorted(draw(st.sets(st.sampled_from(slices))))) if slices else (),
        snapshots=snapshots,
        at_ms=draw(st.integers(0, 2**45)),
    )


@given(st.data())
def test_a_link_reads_back_as_written(data: st.DataObject) -> None:
    within = SliceRange(data.draw(st.integers(0, 4000)), data.draw(st.integers(1, 520)))
    link = data.draw(links(within))
    item = link_item("c1", link, within)
    assert item["pk"] == {"S": "chain#c1"}
    assert link_from_item(item, within) == link


def test_timers_of_slices_the_link_does_not_change_are_refused() -> None:
    with pytest.raises(ValueError, match=r"timers \(3,\) name slices the link does not"):
        link_item("c", Link(1, "q", 0, "u", slices=(1, 2), timers=(3,)), SliceRange(0, 8))


def test_a_damaged_link_is_refused_naming_the_item() -> None:
    within = SliceRange(0, 8)
    item = link_item("c9", Link(7, "q", 3, "u", 10, 20, (1,)), within)
    del item["u"]
    with pytest.raises(CorruptObjectError, match="chain item 'chain#c9'/'000000000007'"):
        link_from_item(item, within)


def test_genesis_reads_back_and_a_damaged_one_is_refused() -> None:
    g = Genesis("c2", "query-1", 8, 3, SliceRange(96, 32), 1_700_000_000_000)
    assert genesis_from_item(genesis_item(g)) == g
    item = genesis_item(g)
    item["count"] = {"N": "many"}
    with pytest.raises(CorruptObjectError, match="chain item 'chain#c2'/genesis"):
        genesis_from_item(item)


def test_a_link_of_every_slice_of_a_4096_slice_group_fits_in_one_kilobyte() -> None:
    """512 slices a group (4,096 slices, 8 groups), all changed, all with timers, and the
    16 snapshots due (every 32 versions): the item bills 2 transactional write units."""
    within = SliceRange(3584, 512)
    every = tuple(range(3584, 4096))
    link = Link(
        position=10**6,
        query="3f1c2a9e-7d44-4b8e-9c1a-5e6f7a8b9c0d",
        batch=10**9,
        uid="0123456789abcdef0123456789abcdef",
        index_length=9000,
        length=2**30,
        slices=every,
        timers=every,
        snapshots=tuple(LinkSnapshot(s, "fedcba9876543210" * 2, 2**33, 400) for s in every[:16]),
    )
    item = link_item("0123456789abcdef0123456789abcdef", link, within)
    size = sum(len(name) + len(next(iter(v.values()))) for name, v in item.items())
    assert size < 1024


@given(st.data())
def test_versions_count_as_a_plain_fold_counts(data: st.DataObject) -> None:
    within = SliceRange(0, 6)
    n = data.draw(st.integers(0, 30))
    chain, fold = [], {s: [] for s in range(6)}
    sealed = False
    for position in range(1, n + 1):
        if data.draw(st.integers(0, 9)) == 0:
            chain.append(Link(position, sealed_by="tool"))
            sealed = True
            continue
        slices = tuple(sorted(data.draw(st.sets(st.integers(0, 5)))))
        link = Link(position, "q", position, f"u{position}", slices=slices)
        chain.append(link)
        if not sealed:
            for s in slices:
                fold[s].append(link)
    base = data.draw(st.integers(0, 100))
    for s in range(within.count):
        got = versions(base, chain, s)
        assert [v for v, _ in got] == list(range(base + 1, base + 1 + len(fold[s])))
        assert [link for _, link in got] == fold[s]


def test_versions_refuse_a_chain_with_a_gap_and_start_where_asked() -> None:
    a, b, c = (Link(p, "q", p, f"u{p}", slices=(0,)) for p in (1, 2, 4))
    with pytest.raises(ValueError, match="chain positions jump from 2 to 4"):
        versions(0, [a, b, c], 0)
    assert [v for v, _ in versions(5, [a, b], 0, start=2)] == [6]


def _chain_of(batches: list[dict[int, list]], within: SliceRange, group: int = 2):
    """Links and segment indexes of `batches` ({slice: changes} each) committed on a chain
    whose slices start at version 0."""
    counts: dict[int, int] = {}
    links, indexes = [], {}
    for position, changed in enumerate(batches, start=1):
        sections = []
        for s in sorted(changed):
            counts[s] = counts.get(s, 0) + 1
            sections.append((s, counts[s], changed[s]))
        raw, refs = encode_segment({"batch": position}, sections)
        uid = f"{position:032x}"
        indexes[uid] = refs
        links.append(
            Link(position, "query-2", 100 + position, uid, index_length(raw), len(raw),
                 tuple(sorted(changed)), timers=tuple(s for s in sorted(changed) if s % 2))
        )  # fmt: skip
    return Genesis("c7", "query-2", 4, group, within, 0), links, indexes


def test_resolve_extends_a_head_with_its_slices_versions_from_the_chain() -> None:
    within = SliceRange(8, 4)
    genesis, links, indexes = _chain_of(
        [{8: [(b"a", b"1")], 9: [(b"b", b"2")]}, {9: [(b"b", None)]}, {8: [(b"c", b"3")]}],
        within,
    )
    head = Head(9, 0, "query-1", 40, chain="c7", chain_from=1)
    got = resolve(head, genesis, links, indexes, LOC)
    assert [(e.version, e.batch, e.group, e.uid, e.query) for e in got.log] == [
        (1, 101, 2, links[0].uid, "query-2"),
        (2, 102, 2, links[1].uid, "query-2"),
    ]
    assert (got.version, got.query, got.batch) == (2, "query-2", 102)
    assert (got.chain, got.chain_from) == ("c7", 1)
    assert got.next_timer == TIMERS_UNKNOWN  # slice 9 is odd: the helper gave it timers
    for entry in got.log:
        ref = next(r for r in indexes[entry.uid] if r.slice == 9)
        assert (entry.offset, entry.length, entry.records) == (ref.offset, ref.length, 1)
    eight = resolve(Head(8, 0, "", -1, chain="c7", chain_from=1), genesis, links, indexes, LOC)
    assert [e.version for e in eight.log] == [1, 2] and eight.next_timer is None
    # counted from position 2, slice 8's first version there would be 1: its section says 2
    with pytest.raises(ContinuityError, match="position 3 .* should hold version 1, its"):
        resolve(Head(8, 0, "", -1, chain="c7", chain_from=2), genesis, links, indexes, LOC)
    # and a head that claims a version the chain does not follow from is refused the same
    with pytest.raises(ContinuityError, match="slice 9: chain c7: position 1 .* version 6"):
        resolve(replace(head, version=5), genesis, links, indexes, LOC)


def test_resolve_leaves_a_head_without_a_chain_or_new_links_alone() -> None:
    within = SliceRange(0, 4)
    genesis, links, indexes = _chain_of([{1: [(b"a", b"1")]}], within)
    plain = Head(1, 3, "q", 7)
    assert resolve(plain, genesis, links, indexes, LOC) is plain
    later = Head(1, 0, "q", 7, chain="c7", chain_from=2)
    assert resolve(later, genesis, links, indexes, LOC) is later


def test_resolve_refuses_a_lost_link_a_missing_section_and_a_foreign_chain() -> None:
    within = SliceRange(0, 4)
    genesis, links, indexes = _chain_of([{1: [(b"a", b"1")]}, {1: [(b"b", b"2")]}], within)
    head = Head(1, 0, "", -1, chain="c7", chain_from=1)
    with pytest.raises(ContinuityError, match="slice 1: chain c7: chain positions jump"):
        resolve(head, genesis, [links[0], replace(links[1], position=3)], indexes, LOC)
    with pytest.raises(ContinuityError, match="should hold version 1, its segment has no sec"):
        resolve(head, genesis, links, {links[1].uid: indexes[links[1].uid]}, LOC)
    with pytest.raises(ContinuityError, match="the chain read is c8 over slices 0-3"):
        resolve(head, replace(genesis, chain="c8"), links, indexes, LOC)
    with pytest.raises(ContinuityError, match="over slices 4-7"):
        resolve(head, replace(genesis, range=SliceRange(4, 4)), links, indexes, LOC)


def test_a_head_naming_its_chain_round_trips_through_its_item() -> None:
    head = Head(17, 4, "q", 9, epoch=2, owner="h:1", chain="c9", chain_from=12)
    again = head_from_item(head_item(head))
    assert again == head
    assert head_from_item(head_item(replace(head, chain="", chain_from=0))).chain == ""


def test_snapshots_in_links_become_the_heads_snapshots_trimmed_as_commits_trim_them() -> None:
    within = SliceRange(0, 2)
    genesis, links, indexes = _chain_of([{0: [(b"k", bytes([i]))]} for i in range(6)], within)
    uids = [f"{i:032x}" for i in range(6)]
    # the batches at positions 3, 4 and 6 snapshotted slice 0 (at versions 2, 3 and 5)
    taken = {3: 0, 4: 1, 6: 2}
    links = [
        replace(link, snapshots=(LinkSnapshot(0, uids[taken[link.position]], 100, 2),))
        if link.position in taken else link
        for link in links
    ]  # fmt: skip
    genesis = replace(genesis, keep_snapshots=2)
    got = resolve(Head(0, 0, "", -1, chain="c7", chain_from=1), genesis, links, indexes, LOC)
    assert [(s.version, s.key, s.batch) for s in got.snaps] == [
        (3, manifest_key(LOC, 0, 3, uids[1]), 103),
        (5, manifest_key(LOC, 0, 5, uids[2]), 105),
    ]
    assert [e.version for e in got.log] == [4, 5, 6]  # only after the oldest kept snapshot
    # the segments of versions 1-3 are not needed (garbage collection may delete them)
    head = Head(0, 0, "", -1, chain="c7", chain_from=1)
    needed = needed_segments(head, genesis, links, LOC)
    assert needed == {links[i].uid for i in (3, 4, 5)}
    assert resolve(head, genesis, links, {u: indexes[u] for u in needed}, LOC) == got


def test_link_snapshot_keeps_the_uid_of_a_manifest_key() -> None:
    ref = SnapRef(7, manifest_key(LOC, 3, 7, "ab" * 16), 10, 2)
    assert link_snapshot(ref, 3) == LinkSnapshot(3, "ab" * 16, 10, 2)
    with pytest.raises(ValueError, match="does not end in -<uid>.manifest"):
        link_snapshot(SnapRef(7, "elsewhere/x.manifest", 10, 2), 3)


def test_link_snapshot_keeps_the_uid_and_range_of_a_packed_manifest() -> None:
    ref = SnapRef(7, pack_key(LOC, "cd" * 16), 10, 2, at=300, length=120)
    short = link_snapshot(ref, 3)
    assert short == LinkSnapshot(3, "cd" * 16, 10, 2, 300, 120)
    assert short.key(LOC, 7) == ref.key
    with pytest.raises(ValueError, match="does not end in /<uid>.pack"):
        link_snapshot(SnapRef(7, "elsewhere/x", 10, 2, at=1, length=2), 3)
