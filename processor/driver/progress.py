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
  DynamoDB failed): restarted from its checkpoint, Q re-runs b and every slice that committed b
  re-commits in place (`shardless.processor.runtime.group_runner`). A NEW query started at COMMITTED
  first rolls back every commit past the latest record (`shardless.processor.driver.takeover`: Q's
  batches after the recorded one, and every query in `started`), then reads from its positions; so
  state counts each record once. Outputs of b that the sink had written are written again by the new
  query (at-least-once for that one batch: a sink that was never told the batch completed cannot
  know).
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

from shardless.changelog import aws, fence
from shardless.changelog.layout import APP_PK, AppLocation, query_tag
from shardless.processor.errors import ProcessorError
from shardless.processor.kinesis import positions as pos

log = logging.getLogger(__name__)

LATEST_SK = "progress"
FORMAT = 1
MAX_POSITIONS_BYTES = 300_000  # two copies and the rest must fit DynamoDB's 400 KB item
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


def record_key(sk: str) -> dict[str, Any]:
    return {"pk": {"S": APP_PK}, "sk": {"S": sk}}


def read_record(table: str, sk: str) -> Progress | None:
    item = (
        aws.client("dynamodb")
        .get_item(TableName=table, Key=record_key(sk), ConsistentRead=True)
        .get("Item")
    )
    return None if item is None else _from_item(item, f"{table}/{sk}")


def completed(found: Progress | None) -> Progress | None:
    return found if found is not None and found["batch"] is not None else None


# -- reading and writing records -----------------------------------------------------------


def latest_in(table: str) -> Progress | None:
    """The newest completed batch's record in `table` (None: no batch completed yet)."""
    return completed(read_record(table, LATEST_SK))


def latest(loc: AppLocation) -> Progress | None:
    """The application's newest record: `query`, `batch`, `positions`, `initial`,
    `offset`, `at`, `started`, `fenced`; None while no batch has completed."""
    return latest_in(loc.table)


def at_batch(loc: AppLocation, query: str, batch: int) -> Progress | None:
    """The record `query` (full id or its first 8 characters) wrote after `batch`."""
    return read_record(loc.table, history_sk(query, batch))


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
        now = read_record(loc.table, LATEST_SK)
        why = (
            "this query was fenced (a COMMITTED start or a roll-back took the state over)"
            if now is not None and query in now["fenced"] or query in fence.fenced(loc)
            else "another query took the state over"
        )
        raise ProcessorError(
            f"query {query} cannot record batch {progress['batch']} of application "
            f"{loc.app!r}: {why}; the newest progress is {describe(now)}. Stop this query: its "
            "commits of this batch are undone by the next COMMITTED start"
        ) from exc


def describe(found: Progress | None) -> str:
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
    old = read_record(loc.table, LATEST_SK)
    fenced = {progress["query"], *progress.get("fenced", [])}
    if old is not None:
        fenced |= {*old["fenced"], *old["started"]}
        if old["query"] is not None:
            fenced.add(old["query"])
    fence.fence(loc, fenced)
    item = _item(LATEST_SK, progress)
    item["fenced"] = {"SS": sorted(fenced)}
    aws.client("dynamodb").put_item(TableName=loc.table, Item=item)
