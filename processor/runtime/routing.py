"""Routing of Kinesis records to slices, exactly as Kinesis routes them to shards.

A record's hash key is its ExplicitHashKey when set, else the MD5 of its partition key
as a 128-bit big-endian integer. Its slice follows from the hash key and the slice count
alone, so it never changes when shards split or merge.

A partition key is hashed as UTF-8. A lone surrogate (from a JSON "\\ud800" or a Java
string) has no UTF-8: it counts as U+FFFD, as a UTF-8 encoder that does not fail writes
it (kinesalite places such a record by that MD5), and the key a handler sees is that text
too (`key_text`), so a key's records and its state stay in the slice that `route` names.

`slice_column` is the same rule as a Spark column expression, for sources other than Kinesis.
"""

from __future__ import annotations

from typing import Any

from shardless.state.slices import HASH_SPACE, key_hash, slice_of, slices_overlapping

__all__ = ["hash_key", "key_text", "route", "shard_slices", "slice_column", "slice_of"]


def key_text(partition_key: str) -> str:
    """The key as valid Unicode: a surrogate pair joined, each lone surrogate U+FFFD."""
    try:
        partition_key.encode("utf-8")
    except UnicodeEncodeError:
        return partition_key.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return partition_key


def hash_key(partition_key: str, explicit_hash_key: str | None = None) -> int:
    """The 128-bit hash key Kinesis uses to place a record."""
    if explicit_hash_key:
        h = int(explicit_hash_key)
        if not 0 <= h < HASH_SPACE:
            raise ValueError(f"explicit hash key {explicit_hash_key!r} is outside [0, 2**128)")
        return h
    try:
        return key_hash(partition_key)
    except UnicodeEncodeError:
        return key_hash(key_text(partition_key))


def route(partition_key: str, explicit_hash_key: str | None, slices: int) -> int:
    """The slice of a record."""
    return slice_of(hash_key(partition_key, explicit_hash_key), slices)


def shard_slices(starting_hash_key: str, ending_hash_key: str, slices: int) -> range:
    """The slices whose hash ranges a shard's inclusive hash-key range overlaps."""
    return slices_overlapping(int(starting_hash_key), int(ending_hash_key), slices)


def slice_column(partition_key: str, slices: int) -> Any:
    """`shardless.processor.runtime.routing.route(key, None, slices)` for the column
    `partition_key`, in the JVM.

    The slice is `(h * slices) >> 128` for the MD5 `h` of the key's UTF-8 bytes: for a power
    of two `2**k`, the top k bits of `h`, read from its first 8 hex digits. Any other count
    splits `h` into 64-bit halves `hi`, `lo`: `(hi * slices + (lo * slices >> 64)) >> 64`,
    exact in decimal arithmetic but several times slower (`docs/benchmarks.md`,
    "Measurements behind the code").
    """
    from pyspark.sql import functions as F

    digest = f"md5(`{partition_key}`)"
    if slices & (slices - 1) == 0:
        top = f"CAST(conv(substr({digest}, 1, 8), 16, 10) AS BIGINT)"
        return F.expr(f"CAST(shiftright({top}, {32 - slices.bit_length() + 1}) AS INT)")
    hi = f"CAST(conv(substr({digest}, 1, 16), 16, 10) AS DECIMAL(20, 0))"
    lo = f"CAST(conv(substr({digest}, 17, 16), 16, 10) AS DECIMAL(20, 0))"
    two_64 = str(1 << 64)
    return F.expr(f"CAST(({hi} * {slices} + ({lo} * {slices}) div {two_64}) div {two_64} AS INT)")
