"""Group keys land on the Spark partitions we intend, and groups are contiguous runs of slices."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardless.processor.runtime.grouping import (
    SPARK_SEED,
    group_keys,
    group_of,
    group_slices,
    murmur3_int,
    spark_partition,
)

# Spark 4.3: SELECT hash(cast(id AS int)) FROM range(8)
SPARK_HASH_OF_INT = [
    933211791,
    -559580957,
    1765031574,
    -1823081949,
    -397064898,
    1023896466,
    -331964951,
    1079293707,
]


@pytest.mark.parametrize(("value", "expected"), list(enumerate(SPARK_HASH_OF_INT)))
def test_murmur3_int_matches_sparks_hash_of_an_int_column(value: int, expected: int) -> None:
    assert murmur3_int(value) == expected
    assert murmur3_int(value, SPARK_SEED) == expected


def test_murmur3_int_uses_the_seed() -> None:
    assert murmur3_int(0, seed=0) != murmur3_int(0)


@given(st.integers(min_value=-(2**31), max_value=2**31 - 1))
def test_murmur3_int_is_a_signed_32_bit_value(value: int) -> None:
    h = murmur3_int(value)
    assert -(2**31) <= h < 2**31


@given(st.integers(min_value=0, max_value=2**31 - 1), st.integers(min_value=1, max_value=4096))
def test_spark_partition_is_the_non_negative_modulo_of_the_hash(value: int, p: int) -> None:
    part = spark_partition(value, p)
    assert 0 <= part < p
    assert (murmur3_int(value) - part) % p == 0


@pytest.mark.parametrize("p", range(1, 65))
def test_group_keys_send_group_g_to_spark_partition_g(p: int) -> None:
    keys = group_keys(p)
    assert len(keys) == p
    assert len(set(keys)) == p
    assert all(isinstance(k, int) and k >= 0 for k in keys)
    for g, key in enumerate(keys):
        assert spark_partition(key, p) == g
        # The smallest such key: no smaller non-negative int lands on g.
        assert all(spark_partition(c, p) != g for c in range(key))


def test_group_keys_for_one_partition_is_zero() -> None:
    assert group_keys(1) == [0]


@given(st.integers(min_value=1, max_value=4096), st.integers(min_value=1, max_value=512))
def test_group_of_and_group_slices_are_inverse(slices: int, groups: int) -> None:
    seen: list[int] = []
    for g in range(groups):
        r = group_slices(g, slices, groups)
        assert r.step == 1
        # Contiguous: each group starts where the previous one stopped.
        assert r.start == len(seen)
        for s in r:
            assert group_of(s, slices, groups) == g
        seen.extend(r)
    # Every slice in exactly one group, in order.
    assert seen == list(range(slices))
    for s in range(0, slices, max(1, slices // 64)):
        assert s in group_slices(group_of(s, slices, groups), slices, groups)


@given(st.integers(min_value=1, max_value=4096), st.integers(min_value=1, max_value=512))
def test_groups_are_balanced_to_within_one_slice(slices: int, groups: int) -> None:
    sizes = [len(group_slices(g, slices, groups)) for g in range(groups)]
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == slices


def test_group_of_known_layout() -> None:
    # 256 slices in 8 groups: 32 consecutive slices each.
    assert [group_of(s, 256, 8) for s in (0, 31, 32, 255)] == [0, 0, 1, 7]
    assert group_slices(1, 256, 8) == range(32, 64)
