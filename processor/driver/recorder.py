"""The driver's side of the progress records: Spark's checkpoint read through its own
file system, and the per-batch record after the sink (`Recorder`)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from shardless.changelog.layout import AppLocation
from shardless.processor.driver import progress, takeover
from shardless.processor.errors import ProcessorError, SourceError
from shardless.processor.kinesis import positions as pos
from shardless.processor.kinesis.batch_log import BatchLog

log = logging.getLogger(__name__)

IDLE_RECORD_S = 600.0  # an idle query refreshes its record (and `since`) this often


def _hadoop_path(spark: Any, path: str) -> tuple[Any, Any]:
    jvm = spark._jvm
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    return hpath.getFileSystem(spark._jsparkSession.sessionState().newHadoopConf()), hpath


def _read_lines(spark: Any, path: str) -> list[str]:
    fs, hpath = _hadoop_path(spark, path)
    stream = fs.open(hpath)
    try:
        jvm = spark._jvm
        reader = jvm.java.io.BufferedReader(jvm.java.io.InputStreamReader(stream, "UTF-8"))
        lines = []
        while (line := reader.readLine()) is not None:
            lines.append(line)
        return lines
    finally:
        stream.close()


def checkpoint_offset(spark: Any, checkpoint: str, batch_id: int) -> dict[str, Any]:
    """The Kinesis source's end offset of `batch_id` (the one with a `run`), from Spark's
    checkpoint, on any Hadoop file system (local, s3a, hdfs). The offset log holds one line
    per source (`-` for none yet), in an order Spark does not promise."""
    where = f"{checkpoint.rstrip('/')}/offsets/{batch_id}"
    lines = _read_lines(spark, where)  # v1 / batch metadata / one offset per source
    for line in lines[2:]:
        if line.strip() not in ("", "-"):
            offset = json.loads(line)
            if isinstance(offset, dict) and "run" in offset:
                return offset
    raise ProcessorError(f"Spark's offset log {where} holds no Kinesis source offset")


def checkpoint_layout(spark: Any, checkpoint: str) -> tuple[int | None, int] | None:
    """What Spark's checkpoint fixed for its query, from its newest offset log entry: the
    shuffle partitions of its state (Spark keeps them on restart, whatever the session
    says; None if not recorded) and how many sources it reads. None for a new checkpoint."""
    offsets = f"{checkpoint.rstrip('/')}/offsets"
    fs, hpath = _hadoop_path(spark, offsets)
    if not fs.exists(hpath):
        return None
    batches = [int(n) for st in fs.listStatus(hpath) if (n := st.getPath().getName()).isdigit()]
    if not batches:
        return None
    lines = _read_lines(spark, f"{offsets}/{max(batches)}")  # v1 / metadata / one per source
    return _partitions(lines), len(lines) - 2


def _partitions(offset_lines: list[str]) -> int | None:
    """The shuffle partitions an offset log entry's metadata line records, if any."""
    found = json.loads(offset_lines[1]).get("conf", {}).get("spark.sql.shuffle.partitions")
    return None if found is None else int(found)


def local_checkpoint_partitions(checkpoint: str) -> int | None:
    """The shuffle partitions a checkpoint on this machine's disk fixed (`checkpoint_layout`
    without a session: the command sizes its session with it); None for a new checkpoint,
    one that did not record them, or one on a remote file system."""
    if "://" in checkpoint and not checkpoint.startswith("file://"):
        return None
    offsets = Path(checkpoint.removeprefix("file://")) / "offsets"
    batches = [int(p.name) for p in offsets.glob("*") if p.name.isdigit()]
    if not batches:
        return None
    newest = offsets / str(max(batches))
    try:
        return _partitions(newest.read_text().splitlines())
    except (OSError, ValueError, IndexError, AttributeError) as exc:
        # only a hint for sizing the session: the query reads the checkpoint itself
        log.warning("checkpoint offset log %s is unreadable (%s); sizing by --groups", newest, exc)
        return None


def checkpoint_query(spark: Any, checkpoint: str) -> str:
    """The query id Spark keeps in the checkpoint (`metadata`), which the runtime commits
    under (`sql.streaming.queryId`)."""
    return json.loads("".join(_read_lines(spark, f"{checkpoint.rstrip('/')}/metadata")))["id"]


def checkpoint_started(spark: Any | None, checkpoint: str) -> bool:
    """Whether Spark's checkpoint already planned a batch (a restart resumes it, and a
    starting position no longer applies). Without a session only local paths are seen."""
    offsets = f"{checkpoint.rstrip('/')}/offsets"
    if spark is not None:
        fs, hpath = _hadoop_path(spark, offsets)
        return bool(fs.exists(hpath)) and len(fs.listStatus(hpath)) > 0
    from pathlib import Path
    from urllib.parse import urlparse

    parsed = urlparse(offsets)
    if parsed.scheme not in ("", "file"):
        return False
    path = Path(parsed.path if parsed.scheme else offsets)
    return path.is_dir() and any(p.name.isdigit() for p in path.iterdir())


def positions_after(
    table: str, offset: dict[str, Any], known: dict[tuple[str, int], pos.Positions] | None = None
) -> pos.Positions:
    """Every shard's position after the batch that ended at `offset` (run, n): saved by
    the source, or rebuilt from the batch's recorded ends on top of the batch before.
    `known` caches positions by (run, n)."""
    known = {} if known is None else known
    batch_log = BatchLog(table)
    run, n = offset["run"], int(offset["n"])
    chain: list[int] = []
    current: pos.Positions | None = None
    while current is None:
        if (run, n) in known:
            current = known[(run, n)]
            break
        current = batch_log.positions(run, n)
        if current is None:
            if chain:  # two batches in a row without stored positions: collected?
                try:
                    batch_log.check_not_collected(run, n)
                except SourceError as exc:
                    raise ProcessorError(str(exc)) from exc
            if n == 0:
                if offset.get("from"):
                    raise ProcessorError(
                        f"source run {run} started at COMMITTED, but its starting positions "
                        f"(pos#0) are missing from table {table}"
                    )
                current = {}
                break
            chain.append(n)
            n -= 1
    for k in reversed(chain):
        current = pos.advance(current, batch_log.ends(run, k))
        known[(run, k)] = current
    known[(run, int(offset["n"]))] = current
    return current


class Recorder:
    """A query's progress records, written from `foreachBatch` on the driver.

    `begin(batch_id)` runs at the top of every batch (it does its work once per driver
    run: find the query id, `register`); `after_sink(batch_id, ...)` after the sink.
    Costs per batch: reading `offsets/<batch>` from the checkpoint, one DynamoDB query
    for the batch's shard ends, one TransactWriteItems; a batch that read, committed and
    emitted nothing is not recorded (unless the last record is `IDLE_RECORD_S` old). A run
    started at COMMITTED deletes the batch log of the run it continues, once per driver run
    (`_retire_continued`).
    """

    def __init__(
        self,
        spark: Any,
        loc: AppLocation,
        checkpoint: str,
        recount: bool = False,
        streams: tuple[str, ...] | None = None,
    ) -> None:
        self.spark = spark
        self.loc = loc
        self.checkpoint = checkpoint
        self.recount = recount  # a new query may count records the state already holds
        self.streams = streams  # the streams the query reads
        self.query: str | None = None
        self.fenced: list[str] = []
        self._known: dict[tuple[str, int], pos.Positions] = {}
        self._last_recorded: float | None = None

    def begin(self, batch_id: int) -> None:
        if self.query is not None:
            return
        query = checkpoint_query(self.spark, self.checkpoint)
        offset = checkpoint_offset(self.spark, self.checkpoint, batch_id)
        self.fenced = takeover.register(
            self.loc, query, batch_id, offset.get("from"), self.recount, self.streams
        )
        self.query = query
        if offset.get("from"):
            self._retire_continued(offset)

    def _retire_continued(self, offset: dict[str, Any]) -> None:
        """Delete the batch log of the run this COMMITTED run continues (the one that wrote
        the progress record it started from): `register` has fenced that run's query, so
        its checkpoint can never run a batch again, and no COMMITTED start or roll-back
        reads a batch log (progress records hold their own positions). Repeated at each
        driver run of this checkpoint, at the cost of a few requests. A failure is logged:
        the records stay."""
        start = offset["from"]
        try:
            found = progress.at_batch(self.loc, start["query"], int(start["batch"]))
            old = ((found or {}).get("offset") or {}).get("run")
            if old and old != offset["run"]:
                deleted = BatchLog(self.loc.table).retire(old)
                if deleted:
                    log.info("deleted %d batch log records of source run %s", deleted, old)
        except (ClientError, BotoCoreError, ProcessorError) as exc:
            log.warning("the batch log of the run this one continues stays: %s", exc)

    def after_sink(self, batch_id: int, records: int, committed: int, outputs: int) -> bool:
        """Record the batch; False if it was skipped as idle."""
        assert self.query is not None, "begin() first"
        idle = records == 0 and committed == 0 and outputs == 0
        recent = self._last_recorded is not None and (
            time.monotonic() - self._last_recorded < IDLE_RECORD_S
        )
        if idle and recent:
            return False
        offset = checkpoint_offset(self.spark, self.checkpoint, batch_id)
        positions = positions_after(self.loc.table, offset, self._known)
        self._known = {k: v for k, v in self._known.items() if k[1] >= int(offset["n"]) - 1}
        progress.record(
            self.loc,
            {
                "query": self.query,
                "batch": batch_id,
                "positions": positions,
                "initial": offset["initial"],
                "offset": {"run": offset["run"], "n": int(offset["n"])},
                "fenced": self.fenced,
            },
        )
        self._last_recorded = time.monotonic()
        return True
