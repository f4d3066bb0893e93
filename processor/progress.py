"""Where a query's committed batches left the source, recorded after each batch.

After a batch's outputs are written, the driver records the source offset that batch
ended at (read from Spark's checkpoint, `offsets/<batch>`), in the application's table:

    pk="app"  sk="progress"                      the newest: query, batch, run, n
    pk="app"  sk="progress#<query8>#<batch>"     one per batch, for roll-back

One BatchWriteItem per batch. From (run, n) the source's batch log gives every shard's
position after that batch, so a new query can continue the application's state exactly
where it stands (`--starting-position COMMITTED`), and a roll-back can name the positions
its batch implies.
"""

from __future__ import annotations

import json
from typing import Any

from changelog import aws
from changelog.layout import APP_PK, AppLocation, query_tag
from processor.errors import ConfigError
from processor.kinesis import positions as pos
from processor.kinesis.batch_log import BatchLog


def checkpoint_offset(spark: Any, checkpoint: str, batch_id: int) -> dict[str, Any]:
    """The (first) source's end offset of `batch_id`, from Spark's checkpoint, on any
    Hadoop file system (local, s3a, hdfs)."""
    jvm = spark._jvm
    path = jvm.org.apache.hadoop.fs.Path(f"{checkpoint.rstrip('/')}/offsets/{batch_id}")
    fs = path.getFileSystem(spark._jsparkSession.sessionState().newHadoopConf())
    stream = fs.open(path)
    try:
        reader = jvm.java.io.BufferedReader(jvm.java.io.InputStreamReader(stream, "UTF-8"))
        lines = []
        while (line := reader.readLine()) is not None:
            lines.append(line)
    finally:
        stream.close()
    # v1 / metadata / one offset per source
    return json.loads(lines[2])


def _item(sk: str, query: str, batch: int, offset: dict[str, Any]) -> dict[str, Any]:
    return {
        "pk": {"S": APP_PK},
        "sk": {"S": sk},
        "query": {"S": query},
        "batch": {"N": str(batch)},
        "offset": {"S": json.dumps(offset, sort_keys=True)},
    }


def record(loc: AppLocation, query: str, batch: int, offset: dict[str, Any]) -> None:
    """Record that `query` completed `batch`, which ended at source `offset`."""
    history = f"progress#{query_tag(query)}#{batch:012d}"
    aws.client("dynamodb").batch_write_item(
        RequestItems={
            loc.table: [
                {"PutRequest": {"Item": _item("progress", query, batch, offset)}},
                {"PutRequest": {"Item": _item(history, query, batch, offset)}},
            ]
        }
    )


def _read(loc: AppLocation, sk: str) -> dict[str, Any] | None:
    item = (
        aws.client("dynamodb")
        .get_item(
            TableName=loc.table, Key={"pk": {"S": APP_PK}, "sk": {"S": sk}}, ConsistentRead=True
        )
        .get("Item")
    )
    if item is None:
        return None
    return {
        "query": item["query"]["S"],
        "batch": int(item["batch"]["N"]),
        "offset": json.loads(item["offset"]["S"]),
    }


def latest(loc: AppLocation) -> dict[str, Any] | None:
    return _read(loc, "progress")


def at_batch(loc: AppLocation, query: str, batch: int) -> dict[str, Any] | None:
    return _read(loc, f"progress#{query_tag(query)}#{batch:012d}")


def set_latest(loc: AppLocation, progress: dict[str, Any]) -> None:
    """Make `progress` the point a COMMITTED start continues from (after a roll-back)."""
    aws.client("dynamodb").put_item(
        TableName=loc.table,
        Item=_item("progress", progress["query"], progress["batch"], progress["offset"]),
    )


def positions_after(table: str, offset: dict[str, Any]) -> pos.Positions:
    """Every shard's position after the batch that ended at `offset` (run, n), from the
    batch log: saved by the source when it committed the batch, or rebuilt from the
    batch's recorded ends on top of the batch before."""
    log = BatchLog(table)
    run, n = offset["run"], int(offset["n"])
    chain = []
    found = None
    while n > 0:
        found = log.positions(run, n)
        if found is not None:
            break
        chain.append(n)
        n -= 1
    current = found or {}
    for k in reversed(chain):
        current = pos.advance(current, log.ends(run, k))
    return current


def committed_start(loc: AppLocation) -> tuple[dict[str, Any], pos.Positions]:
    """The newest recorded progress and the shard positions it implies."""
    found = latest(loc)
    if found is None:
        raise ConfigError(
            f"--starting-position COMMITTED: application {loc.app!r} has no recorded progress "
            "(no batch has completed yet); start with TRIM_HORIZON, LATEST or AT_TIMESTAMP"
        )
    return found, positions_after(loc.table, found["offset"])
