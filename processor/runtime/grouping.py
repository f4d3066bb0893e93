"""Placement of slices on Spark partitions.

Several slices share one Spark group, because Spark's per-group cost (1-2 ms) times 256
slices would dominate a batch. Group keys are chosen so that Spark's own hash
partitioning (Murmur3 of the key, seed 42, modulo the partition count) sends group g to
partition g: every partition gets exactly one group and the load is even.
"""

from __future__ import annotations

from functools import lru_cache

_C1 = 0xCC9E2D51
_C2 = 0x1B873593
_MASK = 0xFFFFFFFF
SPARK_SEED = 42


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _MASK


def murmur3_int(value: int, seed: int = SPARK_SEED) -> int:
    """Spark's `Murmur3_x86_32.hashInt`: the hash of an IntegerType column, as a signed int."""
    k1 = (value & _MASK) * _C1 & _MASK
    k1 = _rotl(k1, 15) * _C2 & _MASK
    h1 = (seed & _MASK) ^ k1
    h1 = (_rotl(h1, 13) * 5 + 0xE6546B64) & _MASK
    h1 ^= 4
    h1 ^= h1 >> 16
    h1 = h1 * 0x85EBCA6B & _MASK
    h1 ^= h1 >> 13
    h1 = h1 * 0xC2B2AE35 & _MASK
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


def spark_partition(value: int, partitions: int) -> int:
    """The shuffle partition Spark assigns to an integer group key."""
    return murmur3_int(value) % partitions


@lru_cache(maxsize=16)
def _keys(partitions: int) -> tuple[int, ...]:
    return tuple(group_keys(partitions))


def group_keys(partitions: int) -> list[int]:
    """For each partition p, the smallest non-negative int key that Spark sends to p."""
    keys: list[int | None] = [None] * partitions
    missing, candidate = partitions, 0
    while missing:
        p = spark_partition(candidate, partitions)
        if keys[p] is None:
            keys[p] = candidate
            missing -= 1
        candidate += 1
    return keys  # type: ignore[return-value]


def group_of(slice_id: int, slices: int, groups: int) -> int:
    """Contiguous runs of slices share a group."""
    return slice_id * groups // slices


def group_slices(group: int, slices: int, groups: int) -> range:
    """The slices of a group (inverse of `group_of`)."""
    lo = -((-group * slices) // groups)
    hi = -((-(group + 1) * slices) // groups)
    return range(lo, hi)


def slices_of_key(key: int, slices: int, partitions: int) -> range:
    """The slices whose rows a job laid out for `partitions` sends to group key `key`
    (empty for a key it never uses)."""
    keys = _keys(partitions)
    if key not in keys:
        return range(0)
    return group_slices(keys.index(key), slices, partitions)
