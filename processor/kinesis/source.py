"""`shardless_kinesis`: a Spark Python streaming data source over Kinesis streams.

Options:
  streams              comma-separated stream names (required)
  table                DynamoDB table where batch ends are recorded (required)
  slices               slice count used to route records (default 256)
  startingPosition     TRIM_HORIZON (default), LATEST, AT_TIMESTAMP:<epoch or ISO time>
  maxRecordsPerShard   per batch (default 10000)
  maxBytesPerShard     per batch (default 10 MiB)
  idlePollMs           with no data, how often to poll again (default 1000)

Planning (`latestOffset`, `partitions`) runs in a driver-side Python process and never
reads records; `read` runs on executors, one partition per readable shard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, SupportsTriggerAvailableNow

from changelog import aws
from processor.errors import ConfigError
from processor.kinesis import positions as pos
from processor.kinesis.batch_log import BatchLog
from processor.kinesis.reader import ShardRead, read_shard
from processor.kinesis.shards import depths, list_shards, readable
from processor.routing import hash_key
from state.slices import check_slices, slice_of

log = logging.getLogger(__name__)

SCHEMA = (
    "stream string, shard string, sequence_number string, subsequence long, "
    "partition_key string, explicit_hash_key string, arrival timestamp, data binary, "
    "slice int, stream_order string"
)


class _Partition(InputPartition):
    def __init__(self, read: ShardRead, slices: int) -> None:
        super().__init__(read.shard_key)
        self.read = read
        self.slices = slices


class KinesisDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "shardless_kinesis"

    def schema(self) -> str:
        return SCHEMA

    def streamReader(self, schema) -> DataSourceStreamReader:  # noqa: ANN001, N802
        return KinesisStreamReader(self.options)


def _int_option(options: dict, name: str, default: int) -> int:
    raw = options.get(name, default)
    try:
        value = int(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"option {name}={raw!r}: expected an integer") from exc
    if value <= 0:
        raise ConfigError(f"option {name}={raw!r}: must be positive")
    return value


class KinesisStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict[str, str]) -> None:
        streams = [s.strip() for s in options.get("streams", "").split(",") if s.strip()]
        if not streams:
            raise ConfigError("the Kinesis source needs option streams=<name>[,<name>...]")
        if not options.get("table"):
            raise ConfigError("the Kinesis source needs option table=<DynamoDB table>")
        self.streams = streams
        self.table = options["table"]
        try:
            self.slices = check_slices(_int_option(options, "slices", 256))
        except ValueError as exc:
            raise ConfigError(f"option slices: {exc}") from exc
        self.starting = options.get("startingPosition", "TRIM_HORIZON")
        pos.initial_position(self.starting)  # validate now, resolve at the first batch
        self.max_records = _int_option(options, "maxRecordsPerShard", 10_000)
        self.max_bytes = _int_option(options, "maxBytesPerShard", 10 * 1024 * 1024)
        self.idle_poll_s = _int_option(options, "idlePollMs", 1000) / 1000
        self._positions: dict[tuple[str, int], pos.Positions] = {}
        self._available_now = False
        self._looked = False
        self._last_probe = 0.0

    # -- driver side ---------------------------------------------------------------------

    def initialOffset(self) -> dict:  # noqa: N802
        return pos.new_offset(pos.initial_position(self.starting))

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802
        self._available_now = True

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:  # noqa: N802
        n = int(start["n"])
        if n == 0:
            self._looked = True
            return pos.next_offset(start)
        ends = BatchLog(self.table).ends(start["run"], n)
        self._positions_after(start)
        unfinished = any(e["done"] or not e["caught_up"] for e in ends.values())
        had_records = any(e["count"] for e in ends.values())
        if unfinished or (had_records and not self._available_now):
            return pos.next_offset(start)
        if self._available_now:
            # A run starts with one look: data may have arrived since the checkpoint's last batch.
            if self._looked:
                return start
            self._looked = True
            return pos.next_offset(start)
        if time.monotonic() - self._last_probe >= self.idle_poll_s:
            self._last_probe = time.monotonic()
            return pos.next_offset(start)
        return start

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        positions = self._positions_after(start)
        done = {k for k, p in positions.items() if p.get("done")}
        kinesis = aws.client("kinesis")
        parts: list[InputPartition] = []
        for stream in self.streams:
            shards = list_shards(kinesis, stream)
            depth = depths(shards)
            for shard in readable(shards, done):
                read = ShardRead(
                    run=end["run"],
                    n=int(end["n"]),
                    stream=stream,
                    shard_id=shard.shard_id,
                    depth=depth[shard.key],
                    start=positions.get(shard.key),
                    initial=end["initial"],
                    max_records=self.max_records,
                    max_bytes=self.max_bytes,
                    closed=shard.closed,
                )
                parts.append(_Partition(read, self.slices))
        return parts

    def commit(self, end: dict) -> None:
        self._positions_after(end)

    def _positions_after(self, offset: dict) -> pos.Positions:
        """Shard positions after the batch that ended at `offset` (cached, then stored)."""
        run, n = offset["run"], int(offset["n"])
        if (run, n) in self._positions:
            return self._positions[(run, n)]
        batch_log = BatchLog(self.table)
        found = {} if n == 0 else batch_log.positions(run, n)
        if found is None:
            before = self._positions_after({**offset, "n": n - 1})
            found = pos.advance(before, batch_log.ends(run, n))
            batch_log.save_positions(run, n, found)
        self._positions = {k: v for k, v in self._positions.items() if k[1] >= n - 1}
        self._positions[(run, n)] = found
        return found

    # -- executor side -------------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[tuple]:
        assert isinstance(partition, _Partition)
        read, slices = partition.read, partition.slices
        records, end = read_shard(aws.client("kinesis"), BatchLog(self.table), read)
        log.info("batch %s shard %s: %s records", read.n, read.shard_key, len(records))
        prefix = f"{read.depth:04d}"
        for r in records:
            pk = r["PartitionKey"]
            seq = r["SequenceNumber"]
            yield (
                read.stream,
                read.shard_id,
                seq,
                0,
                pk,
                None,
                r["ApproximateArrivalTimestamp"],
                r["Data"],
                slice_of(hash_key(pk), slices),
                prefix + pos.sequence_sort_key(seq) + "0000000000",
            )
