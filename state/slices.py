"""The fixed partition of the 128-bit hash space into N equal, contiguous slices.

A slice is the unit of state, ownership and restore. `slice_of` is the whole routing
rule; everything else (shards, Spark partitions, executors) is irrelevant to it.
"""

import hashlib

HASH_SPACE = 1 << 128
DEFAULT_SLICES = 256


def check_slices(n: int) -> int:
    """Validate a slice count: a positive integer no larger than 65536."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 65536:
        raise ValueError(f"slice count must be an integer in [1, 65536], got {n!r}")
    return n


def key_hash(partition_key: str) -> int:
    """The MD5 of a partition key as a 128-bit big-endian integer, as Kinesis hashes it."""
    return int.from_bytes(hashlib.md5(partition_key.encode("utf-8")).digest(), "big")


def slice_of(hash_key: int, n: int) -> int:
    """The slice holding `hash_key`: `(h * n) >> 128`."""
    if not 0 <= hash_key < HASH_SPACE:
        raise ValueError(f"hash key must be in [0, 2**128), got {hash_key}")
    return (hash_key * n) >> 128


def slice_bounds(s: int, n: int) -> tuple[int, int]:
    """The hash keys of slice `s` as a half-open range `[lo, hi)`.

    `slice_of(h, n) == s` exactly when `lo <= h < hi`: lo is the smallest h with
    `h * n >= s * 2**128`, i.e. the ceiling of `s * 2**128 / n`.
    """
    if not 0 <= s < n:
        raise ValueError(f"slice must be in [0, {n}), got {s}")
    return -((-s * HASH_SPACE) // n), -((-(s + 1) * HASH_SPACE) // n)


def slices_overlapping(start_hash: int, end_hash: int, n: int) -> range:
    """The slices that an inclusive hash range `[start_hash, end_hash]` touches, in order."""
    if start_hash > end_hash:
        raise ValueError(f"empty hash range [{start_hash}, {end_hash}]")
    return range(slice_of(start_hash, n), slice_of(end_hash, n) + 1)
