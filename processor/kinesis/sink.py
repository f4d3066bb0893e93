"""A foreachBatch sink that puts a batch's outputs into a Kinesis stream: at least once,
with keys to deduplicate by.

    query = start(spark, handler, cfg, sink=kinesis_sink("user-activity-out"))

Each output row becomes one record, JSON:

    {"query": "8f0c…", "batch_id": 12, "seq": 73014444033, "key": "user-7",
     "value": {...the emitted value...}}

with the row's `key` as partition key, so one key's outputs go to one shard. With typed
outputs (an app's `output_schema`), `value` is the JSON object of the row's fields. `query` is
Spark's query id (kept in the checkpoint: the same after a restart, new with a new
checkpoint, whose batch ids start at 0 again). `seq` is unique within the batch:
`slice * 2**32 +` the output's position among its slice's outputs. All are fixed by the
batch's input (a retried batch yields the same outputs for a deterministic handler), so
`(query, batch_id, seq)` names an output for good.

The records are written from the executors (one `mapInPandas` pass per Spark partition, in
one DataFrame action: the sink `reads_once`), in PutRecords calls of at most 500 records and
5 MiB. When Kinesis fails some entries of a call (throttling, internal failures), only those
are put again, after a jittered exponential backoff, up to `attempts` calls; then the task
fails with `KinesisSinkError`, naming the stream, the batch and the error codes seen. Spark
retries the task and, if that fails too, the batch: either way records already accepted are
put again. Kinesis offers no conditional put, so this sink is at-least-once: consumers drop
records whose `(query, batch_id, seq)` they have seen. Kinesis does not keep the order of
records within a PutRecords call across retries either; consumers that need a key's outputs
in order sort one query's records by `(batch_id, seq)`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import boto3
import pandas as pd
from botocore.config import Config
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from shardless.changelog import aws
from shardless.processor.driver import batch_reads
from shardless.processor.errors import ConfigError, ProcessorError
from shardless.processor.kinesis import put
from shardless.processor.runtime.routing import key_text

Sink = Callable[[DataFrame, int], None]  # as shardless.processor.driver.job.Sink

MAX_RECORD_BYTES = 1024 * 1024  # data plus partition key
MAX_PARTITION_KEY = 256
COLUMNS = ("slice", "seq", "key", "value")
QUERY_ID_PROPERTY = (
    "sql.streaming.queryId"  # as shardless.processor.runtime.group_runner's, set by Spark
)


class KinesisSinkError(ProcessorError):
    """Outputs could not be put into the sink's stream; the batch fails and is retried."""


@dataclass(frozen=True)
class SinkConfig:
    stream: str
    endpoint_url: str | None = None
    attempts: int = 8
    base_delay_s: float = 0.05
    max_delay_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.stream:
            raise ConfigError("kinesis_sink: give the name of the stream to put outputs into")
        if self.attempts < 1:
            raise ConfigError(f"kinesis_sink: attempts={self.attempts}: must be at least 1")
        if self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise ConfigError(
                f"kinesis_sink: delays base={self.base_delay_s}s max={self.max_delay_s}s: "
                "need 0 <= base <= max"
            )


def kinesis_sink(
    stream: str,
    *,
    endpoint_url: str | None = None,
    attempts: int = 8,
    base_delay_s: float = 0.05,
    max_delay_s: float = 2.0,
    query_id: str | None = None,
) -> Sink:
    """A sink for `shardless.processor.driver.job.start` putting each batch's outputs into `stream`.

    `endpoint_url`: a Kinesis endpoint for the executors (default: boto3's own, e.g.
    AWS_ENDPOINT_URL_KINESIS). `attempts`: PutRecords calls per chunk of records before
    the task fails; backoff between them is uniform in [0, min(max, base * 2**attempt)].
    `query_id`: the records' `query` when the sink is called outside a streaming query
    (inside one, Spark's query id is used).
    """
    cfg = SinkConfig(stream, endpoint_url, attempts, base_delay_s, max_delay_s)

    def write(df: DataFrame, batch_id: int) -> None:
        fields = [c for c in df.columns if c not in ("slice", "batch_id", "seq", "key")]
        if fields and fields != ["value"]:  # typed outputs: the record's value is their JSON
            df = df.withColumn("value", F.to_json(F.struct(*fields)))
        missing = [c for c in COLUMNS if c not in df.columns]
        if missing:
            raise ConfigError(
                f"kinesis_sink({stream!r}): the batch has no column(s) {missing}; it writes a "
                f"shardless job's outputs (columns {list(COLUMNS)}), found {df.columns}"
            )
        query = df.sparkSession.sparkContext.getLocalProperty(QUERY_ID_PROPERTY) or query_id
        if not query:
            raise ConfigError(
                f"kinesis_sink({stream!r}): batch {batch_id} is not run by a streaming query "
                "(no sql.streaming.queryId), so its records could not be told from another "
                "query's batch of the same id: give kinesis_sink(..., query_id=...)"
            )
        puts = df.select(*COLUMNS).mapInPandas(
            partial(put_frames, cfg, query, batch_id), "rows long"
        )
        puts.write.format("noop").mode("overwrite").save()  # a DataFrame action (`reads_once`)

    return batch_reads.reads_once(write)


def record(query: str, batch_id: int, slice_id: int, seq: int, key: str | None, value: str) -> dict:
    """The PutRecords entry for one output row of `query`'s batch `batch_id`."""
    n = (int(slice_id) << 32) | int(seq)
    try:
        parsed: Any = json.loads(value)
    except (TypeError, ValueError):
        parsed = value
    data = json.dumps(
        {"query": query, "batch_id": batch_id, "seq": n, "key": key, "value": parsed},
        separators=(",", ":"),
    ).encode()
    partition_key = key_text(key[:MAX_PARTITION_KEY]) if key else f"{batch_id}:{n}"
    size = len(data) + len(partition_key.encode())
    if size > MAX_RECORD_BYTES:
        raise KinesisSinkError(
            f"output {n} of batch {batch_id} (key {key!r}) is {size} bytes as a Kinesis "
            f"record; the limit is {MAX_RECORD_BYTES}: emit smaller values"
        )
    return {"Data": data, "PartitionKey": partition_key}


def put_frames(
    cfg: SinkConfig, query: str, batch_id: int, frames: Iterable[pd.DataFrame]
) -> Iterator[pd.DataFrame]:
    """Put one Spark partition's output rows, as Arrow gives them (runs on an executor)."""
    rows = 0
    for frame in frames:
        put_rows(cfg, query, batch_id, frame.to_dict("records"))
        rows += len(frame)
    yield pd.DataFrame({"rows": [rows]})


def put_rows(cfg: SinkConfig, query: str, batch_id: int, rows: Iterable[Any]) -> None:
    """Put one Spark partition's output rows (runs on an executor)."""
    kinesis = client(cfg.endpoint_url)
    entries = (record(query, batch_id, r["slice"], r["seq"], r["key"], r["value"]) for r in rows)
    for chunk in put.chunks(entries):
        put_all(kinesis, cfg, batch_id, chunk)


def put_all(
    kinesis: Any,
    cfg: SinkConfig,
    batch_id: int,
    entries: list[dict],
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """PutRecords until every entry is in, retrying only the failed ones (`put.put_chunk`);
    returns the number of calls made. Raises KinesisSinkError after `cfg.attempts` calls."""
    retries = put.Retries(cfg.attempts, cfg.base_delay_s, cfg.max_delay_s)
    try:
        return put.put_chunk(kinesis, cfg.stream, entries, retries, sleep)
    except put.PutRecordsError as exc:
        if exc.final:
            raise KinesisSinkError(
                f"cannot put records of batch {batch_id} into Kinesis stream {cfg.stream!r}: {exc}"
            ) from exc
        codes = ", ".join(f"{code} x{n}" for code, n in exc.codes.most_common())
        raise KinesisSinkError(
            f"{exc.left} of {len(entries)} records of batch {batch_id} could not be put into "
            f"Kinesis stream {cfg.stream!r} after {cfg.attempts} attempts (failures: {codes}); "
            "the batch fails and is retried, which may put records twice: consumers "
            "deduplicate by (query, batch_id, seq)"
        ) from exc


_clients: dict[str, Any] = {}
_lock = threading.Lock()


def client(endpoint_url: str | None = None) -> Any:
    """A Kinesis client per endpoint and process (executors reuse their Python workers)."""
    key = endpoint_url or ""
    with _lock:
        found = _clients.get(key)
        if found is None:
            session = boto3.session.Session()
            found = session.client(
                "kinesis",
                endpoint_url=endpoint_url,
                region_name=aws.region(session),
                config=Config(
                    retries={"max_attempts": 3, "mode": "standard"},
                    connect_timeout=5,
                    read_timeout=30,
                ),
            )
            _clients[key] = found
        return found
