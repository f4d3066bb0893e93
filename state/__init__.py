"""Local keyed state: one RocksDB store per hash slice, msgpack values, atomic batch commits.

`state` knows nothing of S3, Spark or Kinesis; `changelog` and `processor` build on it.
"""

from shardless.state.errors import CorruptStoreError, EncodingError, StateError
from shardless.state.slices import DEFAULT_SLICES, slice_bounds, slice_of
from shardless.state.store import SliceStore
from shardless.state.transaction import Transaction

__all__ = [
    "DEFAULT_SLICES",
    "CorruptStoreError",
    "EncodingError",
    "SliceStore",
    "StateError",
    "Transaction",
    "slice_bounds",
    "slice_of",
]
