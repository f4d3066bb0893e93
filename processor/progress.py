"""Where the application's committed state left the source, recorded after each batch.

After a batch's outputs are written, the driver records where the source stood after that
batch, in the application's table (one TransactWriteItems of two items per batch):

    pk="app"  sk="progress"                     the newest completed batch ("latest")
    pk="app"  sk="progress#<query8>#<batch>"    one per batch, for roll-back

A record is self-contained: besides `query` and `batch` it holds every shard's position
after the batch (`positions`, zlib-compressed JSON with a format version) and the run's
initial position (`initial`: where a shard that is not in the map starts). So it can be
copied to another application (a re-sliced state generation), made the latest again after
a roll-back (`set_latest`), and a new query continues from it (`--starting-position
COMMITTED`) without the batch log of the run that wrote it. `offset` (the source's
`{run, n}`) is kept for reference only.

The latest record also says who may continue from it:

- `started`: queries that began from this point and may have committed state past it
  without completing a batch (each registers at its first batch, before committing).
- `fenced`: queries whose checkpoints are stale (another query took the state over, or it
  was rolled back behind them); they are refused at their first batch.

Crash points of batch b of query Q (state commit by the slices → sink → this record):

- before any slice commits: nothing to undo; a restart re-runs b.
- some or all slices committed b, the record not written (the driver died, the sink or
  DynamoDB failed): restarted from its checkpoint, Q re-runs b and every slice that
  committed b re-commits in place (`processor.runtime`). A NEW query started at COMMITTED
  first rolls back every commit past the latest record (`undo_uncommitted`: Q's batches
  after the recorded one, and every query in `started`), then reads from its positions;
  so state counts each record once. Outputs of b that the sink had written are written
  again by the new query (at-least-once for that one batch: a sink that was never told
  the batch completed cannot know).
- the record written, Spark's commit of b not: a restart re-runs b in place and records
  it again; a new query continues after b.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from typing import Any

from botocore.exceptions import ClientError

from changelog import aws, fence, resources, rollback
from changelog.durable import DurableState
from changelog.layout import APP_PK, AppLocation, query_tag
from processor.errors import ConfigError, ProcessorError
from processor.kinesis import positions as pos
from processor.kinesis.batch_log import BatchLog

log = logging.getLogger(__name__)

LATEST_SK = "progress"
FORMAT = 1
MAX_POSITIONS_BYTES = 300_000  # two copies and the rest must fit DynamoDB's 400 KB item
IDLE_RECORD_S = 600.0  # an idle query refreshes its record (and `since`) this often
Progress = dict[str, Any]


def history_sk(query: str, batch: int) -> str:
    return f"progress#{query_tag(query)}#{batch:012d}"


# -- encoding ------------------------------------------------------------------------------


def _encode_positions(positions: pos.Positions) -> bytes:
    raw = json.dumps(positions, sort_keys=True, separators=(",", ":")).encode()
    blob = zlib.compress(raw, 6)
    if len(blob) > MAX_POSITIONS_BYTES:
        raise ProcessorError(
            f"the source positions of {len(positions)} shards take {len(blob)} bytes "
            f"compressed, over the {MAX_POSITIONS_BYTES} a progress record can hold"
        )
    return blob


def _decode_positions(raw: bytes, where: str) -> pos.Positions:
    try:
        found = json.loads(zlib.decompress(raw))
    except (zlib.error, ValueError) as exc:
        raise ProcessorError(f"progress record {where} is corrupt: {exc}") from exc
    if not isinstance(found, dict):
        raise ProcessorError(f"progress record {where} is corrupt: positions are not a map")
    return found


def _item(sk: str, progress: Progress) -> dict[str, Any]:
    item: dict[str, Any] = {
        "pk": {"S": APP_PK},
        "sk": {"S": sk},
        "v": {"N": str(FORMAT)},
        "query": {"S": progress["query"]},
        "batch": {"N": str(int(progress["batch"]))},
        "positions": {"B": _encode_positions(progress["positions"])},
        "initial": {"S": json.dumps(progress["initial"], sort_keys=True)},
        "at": {"N": str(int(progress.get("at") or time.time() * 1000))},
    }
    if progress.get("offset") is not None:
        item["offset"] = {"S": json.dumps(progress["offset"], sort_keys=True)}
    return item


def _from_item(item: dict[str, Any], where: str) -> Progress:
    """A record as a dict; a placeholder (a first query that has not completed a batch)
    has `batch` None and no positions."""
    version = int(item.get("v", {"N": "0"})["N"])
    if "query" in item and version != FORMAT:
        raise ProcessorError(
            f"progress record {where} has format {version}; this version reads {FORMAT}"
        )
    out: Progress = {
        "query": item["query"]["S"] if "query" in item else None,
        "batch": int(item["batch"]["N"]) if "batch" in item else None,
        "started": sorted(item.get("started", {}).get("SS", [])),
        "fenced": sorted(item.get("fenced", {}).get("SS", [])),
        # why the record was withdrawn (`after_rollback`): the state holds batches, but no
        # recorded source positions match it
        "withdrawn": item["withdrawn"]["S"] if "withdrawn" in item else None,
    }
    if out["batch"] is not None:
        out["positions"] = _decode_positions(item["positions"]["B"], where)
        out["initial"] = json.loads(item["initial"]["S"])
        out["offset"] = json.loads(item["offset"]["S"]) if "offset" in item else None
        out["at"] = int(item["at"]["N"]) if "at" in item else None
    return out


def _key(sk: str) -> dict[str, Any]:
    return {"pk": {"S": APP_PK}, "sk": {"S": sk}}


def _read(table: str, sk: str) -> Progress | None:
    item = (
        aws.client("dynamodb")
        .get_item(TableName=table, Key=_key(sk), ConsistentRead=True)
        .get("Item")
    )
    return None if item is None else _from_item(item, f"{table}/{sk}")


def _completed(found: Progress | None) -> Progress | None:
    return found if found is not None and found["batch"] is not None else None


# -- reading and writing records -----------------------------------------------------------


def latest_in(table: str) -> Progress | None:
    """The newest completed batch's record in `table` (None: no batch completed yet)."""
    return _completed(_read(table, LATEST_SK))


def latest(loc: AppLocation) -> Progress | None:
    """The application's newest record: `query`, `batch`, `positions`, `initial`,
    `offset`, `at`, `started`, `fenced`; None while no batch has completed."""
    return latest_in(loc.table)


def at_batch(loc: AppLocation, query: str, batch: int) -> Progress | None:
    """The record `query` (full id or its first 8 characters) wrote after `batch`."""
    return _read(loc.table, history_sk(query, batch))


def record(loc: AppLocation, progress: Progress) -> None:
    """Record that `progress["query"]` completed `progress["batch"]`, in one request.

    Refused (ProcessorError) when the query was fenced, or never registered from the
    latest record: another query has taken the application's state over.
    """
    query = progress["query"]
    latest_item = _item(LATEST_SK, progress)
    if progress.get("fenced"):
        latest_item["fenced"] = {"SS": sorted(set(progress["fenced"]))}
    try:
        aws.client("dynamodb", validated=False).transact_write_items(
            TransactItems=[
                {
                    "Put": {
                        "TableName": loc.table,
                        "Item": latest_item,
                        "ConditionExpression": "(#q = :me OR contains(#st, :me)) "
                        "AND NOT contains(#f, :me)",
                        "ExpressionAttributeNames": {
                            "#q": "query",
                            "#st": "started",
                            "#f": "fenced",
                        },
                        "ExpressionAttributeValues": {":me": {"S": query}},
                    }
                },
                {
                    "Put": {
                        "TableName": loc.table,
                        "Item": _item(history_sk(query, progress["batch"]), progress),
                    }
                },
                fence.check_item(loc, query),
            ]
        )
    except ClientError as exc:
        if exc.response["Error"]["Code"] != "TransactionCanceledException":
            raise
        now = _read(loc.table, LATEST_SK)
        why = (
            "this query was fenced (a COMMITTED start or a roll-back took the state over)"
            if now is not None and query in now["fenced"] or query in fence.fenced(loc)
            else "another query took the state over"
        )
        raise ProcessorError(
            f"query {query} cannot record batch {progress['batch']} of application "
            f"{loc.app!r}: {why}; the newest progress is {_who(now)}. Stop this query: its "
            "commits of this batch are undone by the next COMMITTED start"
        ) from exc


def _who(found: Progress | None) -> str:
    """The newest progress, in words."""
    if found is None:
        return "none"
    if found["withdrawn"]:
        return f"progress withdrawn: {found['withdrawn']}"
    if found["query"] is None:
        return f"no completed batch, begun by queries {found['started']}"
    return f"query {found['query']}'s batch {found['batch']}"


def set_latest(loc: AppLocation, progress: Progress) -> None:
    """Make `progress` (a record of this or another application) the point a COMMITTED
    start continues from: after a roll-back, or in a re-sliced generation. Every query
    that could have continued from the record replaced is fenced, and so is the record's
    own query: its checkpoint is past the point the state now stands at."""
    old = _read(loc.table, LATEST_SK)
    fenced = {progress["query"], *progress.get("fenced", [])}
    if old is not None:
        fenced |= {*old["fenced"], *old["started"]}
        if old["query"] is not None:
            fenced.add(old["query"])
    fence.fence(loc, fenced)
    item = _item(LATEST_SK, progress)
    item["fenced"] = {"SS": sorted(fenced)}
    aws.client("dynamodb").put_item(TableName=loc.table, Item=item)


# -- a query's start -----------------------------------------------------------------------


def register(
    loc: AppLocation,
    query: str,
    first_batch: int,
    start_from: dict[str, Any] | None,
    recount: bool = False,
    streams: tuple[str, ...] | None = None,
) -> list[str]:
    """At a driver run's first batch, before anything is committed: check that `query`
    may work on the application's state, and record that it began (`started`).

    `start_from` is the record a COMMITTED run continues (`{"query", "batch"}` from its
    offsets), None otherwise. A COMMITTED run fences every other query that could continue
    from that record. A new query at its own starting position on an application that
    already holds state of the streams it reads (`streams`; None: any) is refused (its
    records would count again) unless `recount`; a new query on state of other streams
    only, or allowed to recount, fences the queries before it too. Returns the fenced
    queries, which the query's records carry forward. Raises ProcessorError for a stale
    checkpoint.
    """
    ddb = aws.client("dynamodb")
    if query in fence.fenced(loc):
        raise ProcessorError(
            f"query {query} (this checkpoint) may no longer work on application "
            f"{loc.app!r}: its state was rolled back behind it or taken over by another "
            "query; start a NEW checkpoint with --starting-position COMMITTED"
        )
    for _ in range(5):
        found = _read(loc.table, LATEST_SK)
        if found is None:
            if start_from is not None:
                raise ProcessorError(
                    f"query {query} starts from application {loc.app!r}'s progress after "
                    f"batch {start_from['batch']} of query {start_from['query']}, but the "
                    "application has no progress record any more"
                )
            try:
                fence.join(loc, query)  # before it commits anything
                ddb.put_item(
                    TableName=loc.table,
                    Item={**_key(LATEST_SK), "started": {"SS": [query]}},
                    ConditionExpression="attribute_not_exists(pk)",
                )
                return []
            except ClientError as exc:
                if exc.response["Error"]["Code"] != "ConditionalCheckFailedException":
                    raise
                continue
        if query in found["fenced"]:
            raise ProcessorError(
                f"query {query} (this checkpoint) may no longer work on application "
                f"{loc.app!r}: its state was rolled back behind it or taken over by another "
                f"query (the newest progress is {_who(found)}); start a NEW checkpoint with "
                "--starting-position COMMITTED"
            )
        if found["query"] == query or query in found["started"]:
            return found["fenced"]
        if first_batch > 0:
            raise ProcessorError(
                f"query {query} resumes its checkpoint at batch {first_batch}, but another "
                f"query has continued application {loc.app!r}'s state since (the newest "
                f"progress is {_who(found)}): this checkpoint is stale; start a NEW checkpoint "
                "with --starting-position COMMITTED"
            )
        others: set[str] = set()
        if start_from is not None:
            if (found["query"], found["batch"]) != (start_from["query"], start_from["batch"]):
                raise ProcessorError(
                    f"query {query} started from query {start_from['query']}'s batch "
                    f"{start_from['batch']}, but application {loc.app!r}'s newest progress "
                    f"is now {_who(found)}: is another query running on it? Stop it, and "
                    "start this one again on a new checkpoint"
                )
            others = {q for q in (found["query"], *found["started"]) if q and q != query}
        elif found["batch"] is not None or found["started"] or found["withdrawn"]:
            if not recount and _reads_again(loc, found, streams):
                raise ProcessorError(recount_refused(loc, f"query {query}", _who(found)))
            log.warning(
                "query %s starts on a new checkpoint at its own starting position, but "
                "application %r already holds state (%s): records read again are counted "
                "again, as allowed (recount)",
                query,
                loc.app,
                _who(found),
            )
            others = {q for q in (found["query"], *found["started"]) if q and q != query}
        names = {"#st": "started"}
        values: dict[str, Any] = {":me": {"SS": [query]}}
        update = "ADD #st :me"
        fence.join(loc, query)  # before it commits anything
        if others:
            fence.fence(loc, others)  # before `query` is registered, so before it commits
            update += ", #f :others"
            names["#f"] = "fenced"
            values[":others"] = {"SS": sorted(others)}
        if found["query"] is None:
            condition = "attribute_exists(pk) AND attribute_not_exists(#q)"
        else:
            condition = "#q = :q AND #b = :b"
            values[":q"] = {"S": found["query"]}
            values[":b"] = {"N": str(found["batch"])}
            names["#b"] = "batch"
        names["#q"] = "query"
        try:
            ddb.update_item(
                TableName=loc.table,
                Key=_key(LATEST_SK),
                UpdateExpression=update,
                ConditionExpression=condition,
                ExpressionAttributeNames=names,
                ExpressionAttributeValues=values,
            )
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "ConditionalCheckFailedException":
                raise
            continue  # another query recorded or registered meanwhile: look again
        if others:
            log.info("query %s continues application %r; fenced %s", query, loc.app, others)
        return sorted({*found["fenced"], *others})
    raise ProcessorError(
        f"query {query}: application {loc.app!r}'s progress record kept changing while this "
        "query started; is another query running on it?"
    )


def _reads_again(loc: AppLocation, found: Progress, streams: tuple[str, ...] | None) -> bool:
    """Whether a new query reading `streams` from its own position may read records the
    state already counted: when the recorded positions cover one of them, or when no
    positions say which streams the state holds (a withdrawn record, or queries that
    began but completed no batch and committed some slice)."""
    if found["withdrawn"]:
        return True
    if found["batch"] is None:
        slices = list(range(resources.app_slices(loc)))
        return any(h.committed for h in DurableState(loc).heads(slices).values())
    if streams is None:
        return True
    counted = {key.split("/", 1)[0] for key in found["positions"]}
    return bool(counted & set(streams))


def check_new_start(loc: AppLocation, streams: tuple[str, ...]) -> None:
    """Fail fast, before a new checkpoint at its own starting position starts, where
    `register` would refuse it at its first batch (ConfigError)."""
    found = _read(loc.table, LATEST_SK)
    if found is None or found["query"] is None and not found["started"] and not found["withdrawn"]:
        return
    if _reads_again(loc, found, streams):
        raise ConfigError(recount_refused(loc, "this job", _who(found)))


def recount_refused(loc: AppLocation, who: str, state: str) -> str:
    """Why a new query at its own starting position may not start on `loc`'s state."""
    return (
        f"{who} starts on a new checkpoint at its own starting position, but "
        f"application {loc.app!r} already holds state ({state}): records read again would "
        "count twice. Start with --starting-position COMMITTED to continue where the state "
        "left off, or pass --allow-recount (JobConfig.allow_recount) if counting records "
        "again is what you want"
    )


def after_rollback(loc: AppLocation, query: str, batch: int) -> Progress | None:
    """Make the progress record agree with state rolled back to `query`'s `batch`: that
    batch's record becomes the latest (a COMMITTED start continues from it), or, when it
    has none, the latest record is withdrawn, so that no COMMITTED start continues from
    source positions past the state. Every query that could continue is fenced either way.
    Returns the record now latest (None: withdrawn)."""
    found = at_batch(loc, query, batch)
    if found is not None:
        set_latest(loc, found)
        return found
    old = _read(loc.table, LATEST_SK)
    if old is None:
        return None
    fenced = {query, *old["fenced"], *old["started"]}
    if old["query"] is not None:
        fenced.add(old["query"])
    fence.fence(loc, fenced)
    aws.client("dynamodb").put_item(
        TableName=loc.table,
        Item={
            **_key(LATEST_SK),
            "fenced": {"SS": sorted(fenced)},
            "withdrawn": {"S": f"rolled back to batch {batch} of query {query}"},
        },
    )
    return None


def undo_uncommitted(loc: AppLocation) -> tuple[Progress | None, int]:
    """Roll back every slice commit past the latest record: the recorded query's batches
    after its recorded one, and every commit of a query in `started` (none of them
    completed a batch). Returns the latest record (None if none) and how many slices moved.

    Safe to repeat; run with the application stopped (heads are rewritten conditionally,
    so a running job makes it fail rather than interleave).
    """
    found = _read(loc.table, LATEST_SK)
    if found is None:
        return None, 0
    cuts: list[tuple[str, int]] = []
    if found["batch"] is not None:
        cuts.append((found["query"], found["batch"]))
    cuts += [(q, -1) for q in found["started"] if q != found["query"]]
    moved = 0
    for query, batch in cuts:
        try:
            plan = rollback.plan(loc, query, batch)
        except rollback.RollbackError as exc:
            raise ProcessorError(
                f"cannot undo query {query}'s commits after batch {batch} in application "
                f"{loc.app!r}: {exc}"
            ) from exc
        if plan.moves:
            log.warning(
                "application %r: %d slices committed query %s's batches after %s, which never "
                "completed; rolling them back: %s",
                loc.app,
                len(plan.moves),
                query,
                batch,
                plan.to_dict()["moves"],
            )
            moved += rollback.apply(loc, plan)
    if found["batch"] is None and found["started"]:
        _clear_placeholder(loc, found)
    return _completed(found), moved


def _clear_placeholder(loc: AppLocation, found: Progress) -> None:
    """After the commits of queries that never completed a batch were undone, the state
    is empty again: fence those queries and drop their placeholder, so that a new query
    may start at its own position (unless another query registered meanwhile)."""
    fence.fence(loc, found["started"])
    try:
        aws.client("dynamodb").delete_item(
            TableName=loc.table,
            Key=_key(LATEST_SK),
            ConditionExpression="attribute_not_exists(#q) AND #st = :st",
            ExpressionAttributeNames={"#q": "query", "#st": "started"},
            ExpressionAttributeValues={":st": {"SS": found["started"]}},
        )
    except ClientError as exc:
        if exc.response["Error"]["Code"] != "ConditionalCheckFailedException":
            raise


def committed_start(loc: AppLocation) -> tuple[Progress, pos.Positions]:
    """Prepare a COMMITTED start: undo commits past the latest record, then return it and
    the shard positions it holds. ConfigError if no batch has completed yet."""
    withdrawn = (_read(loc.table, LATEST_SK) or {}).get("withdrawn")
    if withdrawn:  # nothing to fence: the roll-back that withdrew it fenced every query
        raise ConfigError(
            f"--starting-position COMMITTED: application {loc.app!r}'s progress was "
            f"withdrawn ({withdrawn}, which has no recorded source positions); start at an "
            "explicit --starting-position AT_TIMESTAMP with --allow-recount"
        )
    # Fence whatever could still be running first: a query that commits between the undo
    # and the new query's first batch would otherwise keep commits that the new query
    # then reads and counts again.
    latest_now = _read(loc.table, LATEST_SK)
    if latest_now is not None:
        fence.fence(loc, [q for q in (latest_now["query"], *latest_now["started"]) if q])
    found, moved = undo_uncommitted(loc)
    if found is None:
        undone = f" ({moved} slices with commits of unfinished batches were rolled back)"
        raise ConfigError(
            f"--starting-position COMMITTED: application {loc.app!r} has no recorded progress "
            f"(no batch has completed yet{undone if moved else ''}); start with TRIM_HORIZON, "
            "LATEST or AT_TIMESTAMP"
        )
    return found, found["positions"]


# -- the driver's side: Spark's checkpoint and the per-batch record -------------------------


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
    found = json.loads(lines[1]).get("conf", {}).get("spark.sql.shuffle.partitions")
    return (None if found is None else int(found)), len(lines) - 2


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
    emitted nothing is not recorded (unless the last record is `IDLE_RECORD_S` old).
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
        self.fenced = register(
            self.loc, query, batch_id, offset.get("from"), self.recount, self.streams
        )
        self.query = query

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
        record(
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
