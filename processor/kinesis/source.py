"""`shardless_kinesis`: a Spark Python streaming data source over Kinesis streams.

Options:
  streams              comma-separated stream names (required)
  table                DynamoDB table where batch ends are recorded (required)
  slices               slice count used to route records (default 256)
  startingPosition     TRIM_HORIZON (default), LATEST, AT_TIMESTAMP:<epoch or ISO time>, or
                       COMMITTED: the shard positions of the application's latest progress record in
                       `table` (see shardless.processor.driver.progress); a new checkpoint only
  maxRecordsPerShard   per batch (default 10000)
  maxBytesPerShard     per batch (default 10 MiB)
  idlePollMs           with no data, how often to poll again (default 1000)
  onTrimmed            fail (default) or oldest: what to do when the source's position in a
                       shard is older than the stream's retention (see reader)
  onCorruptAggregate   fail (default) or skip: what to do with a KPL aggregate that does not
                       decode (bad MD5, bad protobuf); skipped ones are logged and counted
  kinesisEndpoint      a Kinesis endpoint URL for this source alone (default: boto3's own,
                       e.g. AWS_ENDPOINT_URL_KINESIS)
  batchLogRetain       batches of the run kept in the batch log before the last one Spark
                       committed (default 100, as Spark's minBatchesToRetain; 0 or more)
  batchLogGcEvery      delete the batch log's older batches once per this many batches
                       (default 100)
  consumerName         read with enhanced fan-out through the stream consumer of this name
                       (registered on each stream at the first batch a driver process plans,
                       or reused; see `fan_out_batch`); absent: GetRecords (polling). Each
                       batch subscribes to each shard once, and Kinesis refuses a new
                       subscription within 5 s of the last: use a trigger of at least 5 s per
                       batch. A query's stop leaves the consumer registered (other runs may
                       read through it): `deregister_consumers` removes it.

Planning (`latestOffset`, `partitions`) runs in a driver-side Python process and never
reads records; `read` runs on executors, one partition per readable shard.

Which batch log records can be read again: Spark calls `commit(end)` once the batch that
ended at `end` (source batch c) is in its commit log. From then on Spark plans only later
batches, and a restart re-runs at most the one batch after c, starting from c's end: it
reads the positions after c (`pos#c`), the recorded ends of the batches after c, and, to
decide whether to plan another batch, c's own ends. The driver's progress record of a batch
is written before Spark commits it. So records of batches before c are never read again;
`commit` deletes those before c - batchLogRetain (`_collect`), keeping as many source
batches as Spark keeps batches of its own metadata, so every offset still in the
checkpoint names records that exist.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator

import pyarrow as pa
from botocore.exceptions import BotoCoreError, ClientError
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, SupportsTriggerAvailableNow

from shardless.processor.errors import ConfigError, SourceError
from shardless.processor.kinesis import fan_out, fan_out_batch
from shardless.processor.kinesis import positions as pos
from shardless.processor.kinesis.batch_log import BatchLog
from shardless.processor.kinesis.client import kinesis_client
from shardless.processor.kinesis.reader import CORRUPT_POLICIES, POLICIES, ShardRead, read_shard
from shardless.processor.kinesis.rows import ROWS_PER_BATCH, SCHEMA, SOURCE_SCHEMA, record_batch
from shardless.processor.kinesis.shards import depths, list_shards, readable, vanished
from shardless.state.slices import check_slices

__all__ = [
    "SCHEMA",
    "KinesisDataSource",
    "KinesisStreamReader",
    "deregister_consumers",
    "kinesis_client",
]

log = logging.getLogger(__name__)


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
        return SOURCE_SCHEMA

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


def _count_option(options: dict, name: str, default: int) -> int:
    raw = options.get(name, default)
    try:
        value = int(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"option {name}={raw!r}: expected an integer") from exc
    if value < 0:
        raise ConfigError(f"option {name}={raw!r}: must be 0 or more")
    return value


CONSUMER_NAME = re.compile(r"[a-zA-Z0-9_.-]{1,128}")  # Kinesis' rule for consumer names


def _consumer_option(options: dict) -> str | None:
    raw = options.get("consumerName")
    if raw is None or not str(raw).strip():
        return None
    name = str(raw).strip()
    if not CONSUMER_NAME.fullmatch(name):
        raise ConfigError(
            f"option consumerName={raw!r}: a Kinesis consumer name is 1 to 128 letters, digits, "
            "'_', '.' or '-'"
        )
    return name


def deregister_consumers(
    streams: list[str], consumer_name: str, endpoint: str | None = None
) -> dict[str, bool]:
    """Deregister the enhanced fan-out consumer `consumer_name` of each stream; per stream,
    whether there was one (for a command that retires an application's consumer).

    A query never does this when it stops: the application's next run, or another query of it,
    reads through the same consumer, and deregistering ends every subscription through it.
    """
    kinesis = kinesis_client(endpoint)
    return {s: fan_out.deregister_consumer(kinesis, s, consumer_name) for s in streams}


def _choice_option(options: dict, name: str, choices: tuple[str, ...]) -> str:
    value = str(options.get(name, choices[0])).strip().lower()
    if value not in choices:
        raise ConfigError(f"option {name}={options[name]!r}: expected one of {', '.join(choices)}")
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
        # validated now, resolved at the first batch of a new checkpoint
        self.starting = pos.check_starting(options.get("startingPosition", "TRIM_HORIZON"))
        self.max_records = _int_option(options, "maxRecordsPerShard", 10_000)
        self.max_bytes = _int_option(options, "maxBytesPerShard", 10 * 1024 * 1024)
        self.idle_poll_s = _int_option(options, "idlePollMs", 1000) / 1000
        self.on_trimmed = _choice_option(options, "onTrimmed", POLICIES)
        self.on_corrupt = _choice_option(options, "onCorruptAggregate", CORRUPT_POLICIES)
        self.endpoint = options.get("kinesisEndpoint") or None
        self.retain = _count_option(options, "batchLogRetain", 100)
        self.gc_every = _int_option(options, "batchLogGcEvery", 100)
        self.consumer_name = _consumer_option(options)
        self._consumer_arns: dict[str, str] = {}  # per stream, once registered (driver side)
        self._collected: int | None = None  # `below` of this process's last collection
        self._positions: dict[tuple[str, int], pos.Positions] = {}
        self._known_runs: set[str] = set()  # runs whose batches this table records
        self._available_now = False
        self._looked = False
        self._last_probe = 0.0

    # -- driver side ---------------------------------------------------------------------

    def initialOffset(self) -> dict:  # noqa: N802
        if not pos.is_committed(self.starting):
            return pos.new_offset(pos.initial_position(self.starting))
        return self._committed_offset()

    def _committed_offset(self) -> dict:
        """A run that starts where the application's latest progress record left off: its
        positions become the run's batch 0 in the batch log, and its offsets name the record
        (`from`), so the job can check nothing moved in between."""
        from shardless.processor.driver import progress

        found = progress.latest_in(self.table)
        if found is None:
            raise ConfigError(
                f"startingPosition=COMMITTED: table {self.table} holds no progress record (no "
                "batch of this application has completed); start with TRIM_HORIZON, LATEST or "
                "AT_TIMESTAMP"
            )
        offset = pos.new_offset(found["initial"])
        offset["from"] = {"query": found["query"], "batch": found["batch"]}
        BatchLog(self.table).save_positions(offset["run"], 0, found["positions"])
        log.info(
            "run %s starts at the progress of query %s after batch %s: %d shard positions",
            offset["run"],
            found["query"],
            found["batch"],
            len(found["positions"]),
        )
        return offset

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
        kinesis = kinesis_client(self.endpoint)
        parts: list[InputPartition] = []
        for stream in self.streams:
            shards = list_shards(kinesis, stream)
            done |= self._expired(vanished(shards, stream, positions), positions)
            depth = depths(shards)
            consumer_arn = self._consumer_arn(kinesis, stream)
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
                    on_trimmed=self.on_trimmed,
                    on_corrupt=self.on_corrupt,
                    consumer_arn=consumer_arn,
                )
                parts.append(_Partition(read, self.slices))
        return parts

    def _consumer_arn(self, kinesis, stream: str) -> str | None:  # noqa: ANN001
        """The ARN of the stream's fan-out consumer (None: polling), registered or reused
        once per driver process."""
        if self.consumer_name is None:
            return None
        arn = self._consumer_arns.get(stream)
        if arn is None:
            arn = fan_out.register_consumer(kinesis, stream, self.consumer_name).arn
            log.info("stream %s: reading through consumer %s", stream, arn)
            self._consumer_arns[stream] = arn
        return arn

    def _expired(self, keys: list[str], positions: pos.Positions) -> set[str]:
        """Shards whose rest expired unread: an error, or (onTrimmed=oldest) read as done."""
        if not keys:
            return set()
        where = ", ".join(f"{k} (after sequence number {positions[k]['after']})" for k in keys)
        message = (
            f"Kinesis no longer lists shards the source had not finished: {where}; their "
            "records are past the stream's retention, and those not read yet expired unread"
        )
        if self.on_trimmed == "fail":
            raise SourceError(
                f"{message}. To go on with the shards that remain, set the source option "
                "onTrimmed=oldest"
            )
        log.warning("%s; onTrimmed=oldest: treating them as read to their end", message)
        return set(keys)

    def commit(self, end: dict) -> None:
        self._positions_after(end)
        self._collect(end)

    def _collect(self, end: dict) -> None:
        """Delete the batch log records of the batches before `end`'s less `retain` (see the
        module's docstring), once per `gc_every` batches: the first commit of a driver run,
        then whenever the bound moved `gc_every` on. A failure is logged: the records stay
        for the next collection."""
        below = int(end["n"]) - self.retain
        if below <= 0 or (self._collected is not None and below < self._collected + self.gc_every):
            return
        try:
            deleted = BatchLog(self.table).collect(end["run"], below)
        except (ClientError, BotoCoreError, SourceError) as exc:
            log.warning(
                "run %s: batch log records before batch %s stay: %s", end["run"], below, exc
            )
            return
        self._collected = below
        log.info("run %s: deleted %d batch log records before batch %s", end["run"], deleted, below)

    def _positions_after(self, offset: dict, chained: bool = False) -> pos.Positions:
        """Shard positions after the batch that ended at `offset` (cached, then stored).
        `chained`: asked for by a later batch whose positions are not stored either."""
        run, n = offset["run"], int(offset["n"])
        if (run, n) in self._positions:
            return self._positions[(run, n)]
        batch_log = BatchLog(self.table)
        if n == 0:
            if chained:  # batch 1's positions are being built: unless they were collected
                batch_log.check_not_collected(run, 0)
            found = batch_log.positions(run, 0) if offset.get("from") else {}
            if found is None:
                raise SourceError(
                    f"run {run} started at COMMITTED, but its starting positions (pos#0) are "
                    f"missing from table {self.table}"
                )
        else:
            found = batch_log.positions(run, n)
            if found is None and not chained and run not in self._known_runs:
                self._check_known(batch_log, run, n)
        if found is None:
            if chained:  # two batches in a row without stored positions: collected?
                batch_log.check_not_collected(run, n)
            before = self._positions_after({**offset, "n": n - 1}, chained=True)
            ends = batch_log.ends(run, n)
            for shard_key, end in sorted(ends.items()):
                log.info("batch %s shard %s: %s", n, shard_key, end)
            found = pos.advance(before, ends)
            batch_log.save_positions(run, n, found)
        self._positions = {k: v for k, v in self._positions.items() if k[1] >= n - 1}
        self._positions[(run, n)] = found
        return found

    def _check_known(self, batch_log: BatchLog, run: str, n: int) -> None:
        """Refuse a checkpoint whose run this table has never seen: its offsets name batch
        n of a run whose batches were recorded elsewhere (another application's table), so
        going on would read the streams from the start position again, counting what this
        application's state already holds a second time."""
        if not batch_log.knows(run):
            raise SourceError(
                f"the checkpoint's offsets name batch {n} of source run {run}, but table "
                f"{self.table} holds no record of that run: the checkpoint was written by "
                "another application (or this application's table was replaced). Give this "
                "application its own checkpoint: a NEW checkpoint with "
                "startingPosition=COMMITTED continues its state where it left off"
            )
        self._known_runs.add(run)

    # -- executor side -------------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, _Partition)
        read, slices = partition.read, partition.slices
        read_one = read_shard if read.consumer_arn is None else fan_out_batch.read_shard
        records, end = read_one(kinesis_client(self.endpoint), BatchLog(self.table), read)
        for lo in range(0, len(records), ROWS_PER_BATCH):
            chunk = records[lo : lo + ROWS_PER_BATCH]
            last = lo + ROWS_PER_BATCH >= len(records)
            behind = end.get("behind_ms") if last else None
            unread = end.get("unread_arrival_ms") if last else None
            yield record_batch(
                read.stream, read.shard_id, read.depth, chunk, slices, behind, unread
            )
