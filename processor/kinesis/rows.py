"""The source's rows, as Arrow record batches built column by column.

Spark converts a Python data source's tuples to Arrow itself, one converter call per field
per row; handing it `pyarrow.RecordBatch`es instead skips that (the batches must match the
schema exactly: `ARROW_SCHEMA`, derived the way Spark derives it).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from shardless.processor.kinesis.positions import sequence_sort_key
from shardless.processor.runtime.routing import key_text
from shardless.state.slices import key_hash, slice_of

# The rows every source of the job's records gives (`shardless_timers` too).
SCHEMA = (
    "stream string, shard string, sequence_number string, subsequence long, "
    "partition_key string, explicit_hash_key string, arrival timestamp, data binary, "
    "slice int, stream_order string, behind_ms long"
)
# The Kinesis source's rows: SCHEMA and the lag column that only it has (the job observes
# it, then drops it: `shardless.processor.driver.metrics.observe_shards`).
UNREAD = "unread_arrival_ms"
SOURCE_SCHEMA = f"{SCHEMA}, {UNREAD} long"
STRUCT = StructType(
    [
        StructField("stream", StringType()),
        StructField("shard", StringType()),
        StructField("sequence_number", StringType()),
        StructField("subsequence", LongType()),
        StructField("partition_key", StringType()),
        StructField("explicit_hash_key", StringType()),
        StructField("arrival", TimestampType()),
        StructField("data", BinaryType()),
        StructField("slice", IntegerType()),
        StructField("stream_order", StringType()),
        StructField("behind_ms", LongType()),
    ]
)
ARROW_SCHEMA = to_arrow_schema(STRUCT, timezone="UTC")  # as Spark's data source reader does
SOURCE_ARROW_SCHEMA = to_arrow_schema(
    StructType([*STRUCT.fields, StructField(UNREAD, LongType())]), timezone="UTC"
)
ROWS_PER_BATCH = 10_000


def record_batch(
    stream: str,
    shard_id: str,
    depth: int,
    records: list[dict[str, Any]],
    slices: int,
    behind_ms: int | None = None,
    unread_arrival_ms: int | None = None,
) -> pa.RecordBatch:
    """One Arrow batch (`SOURCE_ARROW_SCHEMA`) of user records (as `reader.read_shard`
    returns them) of one shard.

    `behind_ms` and `unread_arrival_ms` go on the batch's last record (null on the others):
    the shard's MillisBehindLatest after the batch's read, and the arrival time (epoch ms)
    of the oldest record the read left unread (null: none), given with the read's last chunk.

    `slice` is `(h * slices) >> 128` of the record's explicit hash key if it has one, else
    of the MD5 of its partition key; `stream_order` is lineage depth (4 digits), sequence
    number (64) and sub-sequence number (10). A key with a lone surrogate is given and
    routed as `shardless.processor.runtime.routing.key_text` writes it (U+FFFD for the surrogate).
    """
    n = len(records)
    keys = [r["PartitionKey"] for r in records]
    explicit = [r["ExplicitHashKey"] for r in records]
    sequences = [r["SequenceNumber"] for r in records]
    subs = [r["SubSequenceNumber"] for r in records]
    by_key: dict[str, int] = {}  # keys repeat; an MD5 per distinct key is enough
    slice_col = []
    for key, ehk in zip(keys, explicit, strict=True):
        if ehk:
            h = int(ehk)
            slice_col.append(slice_of(h, slices))
            continue
        s = by_key.get(key)
        if s is None:
            try:
                h = key_hash(key)
            except UnicodeEncodeError:  # a lone surrogate
                h = key_hash(key_text(key))
            s = by_key[key] = slice_of(h, slices)
        slice_col.append(s)
    prefix = f"{depth:04d}"
    order = [
        f"{prefix}{sequence_sort_key(seq)}{sub:010d}"
        for seq, sub in zip(sequences, subs, strict=True)
    ]
    try:
        key_col = pa.array(keys, pa.string())
    except UnicodeEncodeError:  # a lone surrogate: Arrow (and Spark) strings are UTF-8
        key_col = pa.array([key_text(k) for k in keys], pa.string())
    columns = [
        pa.array([stream] * n, pa.string()),
        pa.array([shard_id] * n, pa.string()),
        pa.array(sequences, pa.string()),
        pa.array(subs, pa.int64()),
        key_col,
        pa.array(explicit, pa.string()),
        pa.array([r["ApproximateArrivalTimestamp"] for r in records], ARROW_SCHEMA.field(6).type),
        pa.array([r["Data"] for r in records], pa.binary()),
        pa.array(slice_col, pa.int32()),
        pa.array(order, pa.string()),
        pa.array([None] * (n - 1) + [behind_ms] if n else [], pa.int64()),
        pa.array([None] * (n - 1) + [unread_arrival_ms] if n else [], pa.int64()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=SOURCE_ARROW_SCHEMA)
