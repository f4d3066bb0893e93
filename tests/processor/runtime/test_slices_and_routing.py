"""Slices partition the 128-bit hash space; routing puts a key in one slice whatever the shards."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardless.processor.runtime.routing import hash_key, key_text, route, shard_slices
from shardless.state.slices import (
    HASH_SPACE,
    check_slices,
    slice_bounds,
    slice_of,
    slices_overlapping,
)

slice_counts = st.integers(min_value=1, max_value=4096)
hashes = st.integers(min_value=0, max_value=HASH_SPACE - 1)


@st.composite
def count_and_hash(draw: st.DrawFn) -> tuple[int, int]:
    """A slice count and a hash, often sitting right on a slice boundary."""
    n = draw(slice_counts)
    kind = draw(st.sampled_from(["any", "lo", "hi-1"]))
    if kind == "any":
        return n, draw(hashes)
    s = draw(st.integers(min_value=0, max_value=n - 1))
    lo, hi = slice_bounds(s, n)
    return n, lo if kind == "lo" else hi - 1


@given(count_and_hash())
def test_every_hash_lies_in_exactly_one_slice(case: tuple[int, int]) -> None:
    n, h = case
    s = slice_of(h, n)
    assert 0 <= s < n
    lo, hi = slice_bounds(s, n)
    assert lo <= h < hi
    # The neighbours (the only slices that could also claim h, as slices are contiguous)
    # do not contain it.
    if s > 0:
        assert slice_bounds(s - 1, n)[1] <= h
    if s < n - 1:
        assert slice_bounds(s + 1, n)[0] > h


@settings(max_examples=50)
@given(slice_counts)
def test_slice_bounds_partition_the_hash_space(n: int) -> None:
    bounds = [slice_bounds(s, n) for s in range(n)]
    assert bounds[0][0] == 0
    assert bounds[-1][1] == HASH_SPACE
    for (_, hi), (lo, _) in zip(bounds, bounds[1:], strict=False):
        assert hi == lo  # contiguous: no gap, no overlap
    sizes = {hi - lo for lo, hi in bounds}
    assert all(size > 0 for size in sizes)
    assert max(sizes) - min(sizes) <= 1


@settings(max_examples=50)
@given(slice_counts)
def test_slice_bounds_agree_with_slice_of_at_the_edges(n: int) -> None:
    for s in range(n):
        lo, hi = slice_bounds(s, n)
        assert slice_of(lo, n) == s
        assert slice_of(hi - 1, n) == s
        if hi < HASH_SPACE:
            assert slice_of(hi, n) == s + 1


@pytest.mark.parametrize("bits", range(0, 17))
def test_power_of_two_slice_counts_give_exactly_equal_slices(bits: int) -> None:
    n = 1 << bits
    size = HASH_SPACE // n
    for s in {0, 1 % n, n // 2, n - 1}:
        assert slice_bounds(s, n) == (s * size, (s + 1) * size)


@pytest.mark.parametrize("n", [1, 2, 3, 256, 4096])
def test_slice_of_and_slice_bounds_reject_out_of_range_inputs(n: int) -> None:
    with pytest.raises(ValueError):
        slice_of(-1, n)
    with pytest.raises(ValueError):
        slice_of(HASH_SPACE, n)
    with pytest.raises(ValueError):
        slice_bounds(n, n)
    with pytest.raises(ValueError):
        slice_bounds(-1, n)


def test_slices_overlapping_rejects_an_empty_range() -> None:
    with pytest.raises(ValueError):
        slices_overlapping(10, 9, 4)


@st.composite
def shard_layouts(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]]]:
    """A slice count and a partition of the hash space into inclusive shard ranges."""
    n = draw(slice_counts)
    cuts = draw(
        st.lists(
            st.one_of(
                st.integers(min_value=1, max_value=HASH_SPACE - 1),
                # Cut points on slice boundaries and one past them: the tricky cases.
                st.integers(min_value=0, max_value=n - 1).map(
                    lambda s: max(1, slice_bounds(s, n)[0])
                ),
                st.integers(min_value=0, max_value=n - 1).map(lambda s: slice_bounds(s, n)[0] + 1),
            ),
            max_size=40,
            unique=True,
        )
    )
    points = [0, *sorted(cuts), HASH_SPACE]
    shards = [(lo, hi - 1) for lo, hi in zip(points, points[1:], strict=False)]
    return n, shards


@given(shard_layouts(), st.text())
def test_a_keys_slice_is_covered_by_the_shard_that_holds_it(
    layout: tuple[int, list[tuple[int, int]]], key: str
) -> None:
    n, shards = layout
    h = hash_key(key)
    holders = [(lo, hi) for lo, hi in shards if lo <= h <= hi]
    assert len(holders) == 1
    lo, hi = holders[0]
    assert route(key, None, n) in shard_slices(str(lo), str(hi), n)


@given(shard_layouts(), hashes)
def test_an_explicit_hash_keys_slice_is_covered_by_the_shard_that_holds_it(
    layout: tuple[int, list[tuple[int, int]]], h: int
) -> None:
    n, shards = layout
    (lo, hi) = next((lo, hi) for lo, hi in shards if lo <= h <= hi)
    assert route("ignored", str(h), n) in shard_slices(str(lo), str(hi), n)


@given(shard_layouts())
def test_shard_slices_over_all_shards_cover_every_slice(
    layout: tuple[int, list[tuple[int, int]]],
) -> None:
    n, shards = layout
    covered: set[int] = set()
    previous_last = -1
    for lo, hi in shards:
        r = shard_slices(str(lo), str(hi), n)
        assert len(r) >= 1
        # In hash order, a shard starts in the slice where the previous one ended or the next.
        assert r.start in (previous_last, previous_last + 1)
        previous_last = r[-1]
        covered.update(r)
    assert covered == set(range(n))


@given(st.text(), st.integers(min_value=1, max_value=65536))
def test_hash_key_is_the_big_endian_md5_of_the_utf8_partition_key(key: str, n: int) -> None:
    expected = int.from_bytes(hashlib.md5(key.encode("utf-8")).digest(), "big")
    assert hash_key(key) == expected
    assert hash_key(key, None) == expected
    assert route(key, None, n) == (expected * n) >> 128


@given(
    st.text(st.characters(categories=["Cs", "L", "N", "So"]), max_size=12),
    st.integers(min_value=1, max_value=65536),
)
def test_a_key_with_lone_surrogates_routes_as_its_text_with_u_fffd(key: str, n: int) -> None:
    text = key_text(key)
    text.encode("utf-8")  # always valid
    assert key_text(text) == text
    assert route(key, None, n) == route(text, None, n)
    lone = text.count("\ufffd") - key.count("\ufffd")
    assert lone <= sum(0xD800 <= ord(c) <= 0xDFFF for c in key)


@pytest.mark.parametrize(
    ("key", "md5_hex"),
    [
        # RFC 1321 test vectors.
        ("", "d41d8cd98f00b204e9800998ecf8427e"),
        ("abc", "900150983cd24fb0d6963f7d28e17f72"),
        ("message digest", "f96b697d7cb7938d525a2f31aaf161d0"),
    ],
)
def test_hash_key_matches_known_md5_vectors(key: str, md5_hex: str) -> None:
    assert hash_key(key) == int(md5_hex, 16)


def test_route_of_a_known_key_matches_the_top_bits_of_its_md5() -> None:
    # md5("abc") starts with 0x90: the top byte picks the slice out of 256.
    assert route("abc", None, 256) == 0x90
    assert route("", None, 256) == 0xD4
    assert route("abc", None, 1) == 0


@given(st.text(), hashes)
def test_explicit_hash_key_overrides_the_partition_key(key: str, h: int) -> None:
    assert hash_key(key, str(h)) == h
    assert route(key, str(h), 256) == slice_of(h, 256)


def test_explicit_hash_key_at_the_edges_of_the_space_is_accepted() -> None:
    assert hash_key("k", "0") == 0
    assert hash_key("k", str(HASH_SPACE - 1)) == HASH_SPACE - 1
    assert route("k", str(HASH_SPACE - 1), 256) == 255
    assert route("k", "0", 256) == 0


@pytest.mark.parametrize("bad", [str(HASH_SPACE), str(HASH_SPACE + 12345), "-1", str(-HASH_SPACE)])
def test_explicit_hash_key_out_of_range_raises_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match="outside"):
        hash_key("k", bad)
    with pytest.raises(ValueError):
        route("k", bad, 256)


@pytest.mark.parametrize("n", [1, 2, 255, 256, 4096, 65536])
def test_check_slices_accepts_counts_from_1_to_65536(n: int) -> None:
    assert check_slices(n) == n


@pytest.mark.parametrize("bad", [0, -1, 65537, True, False, "256", 256.0, None])
def test_check_slices_rejects_non_integers_and_out_of_range_counts(bad: object) -> None:
    with pytest.raises(ValueError, match="slice count"):
        check_slices(bad)  # type: ignore[arg-type]
