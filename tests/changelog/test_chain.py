"""Chain items: bitmaps, links and genesis round-trip; versions are counted as a plain
fold counts them; a link stays under 1 KB (2 transactional write units) at 512 slices."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardless.changelog.chain import (
    Genesis,
    Link,
    PackRef,
    SliceRange,
    bitmap,
    genesis_from_item,
    genesis_item,
    link_from_item,
    link_item,
    members,
    versions,
)
from shardless.changelog.errors import CorruptObjectError


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
    pack = None
    if draw(st.booleans()):
        pack = PackRef(
            draw(st.text(min_size=1, max_size=80)),
            draw(st.integers(0, 2**40)),
            tuple(sorted(draw(st.sets(st.sampled_from(slices))))) if slices else (),
        )
    return Link(
        position=draw(st.integers(1, 10**9)),
        query=draw(st.text(min_size=1, max_size=36)),
        batch=draw(st.integers(0, 2**40)),
        uid=draw(st.text(min_size=1, max_size=32)),
        index_length=draw(st.integers(0, 2**20)),
        length=draw(st.integers(0, 2**32)),
        slices=slices,
        timers=tuple(sorted(draw(st.sets(st.sampled_from(slices))))) if slices else (),
        pack=pack,
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
    """512 slices a group (4,096 slices, 8 groups), all changed, all with timers, and a
    snapshot pack: the item bills 2 transactional write units, whatever the slice count."""
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
        pack=PackRef("app/packs/000001000000/g00007-0123456789abcdef0123456789abcdef", 2**33,
                     every[:32]),
    )  # fmt: skip
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
