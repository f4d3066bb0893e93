"""A query's start on an application's state: who may work on it, and what a new query
undoes first.

At its first batch, before anything is committed, a driver run registers its query
(`register`): its own checkpoint resumes; a new checkpoint at COMMITTED continues the
latest progress record and fences every query that could continue from it; a new
checkpoint at its own starting position on state of its streams is refused unless it may
count records again. Every query that begins joins the application's lineage
(`shardless.changelog.fence`), which roll-backs cut by. A COMMITTED start first fences the queries
that could still be running and undoes the commits past the latest record
(`committed_start`); a roll-back leaves the progress record agreeing with the state
(`after_rollback`). The records themselves are `shardless.processor.driver.progress`.
"""

from __future__ import annotations

import logging
from typing import Any

from botocore.exceptions import ClientError

from shardless.changelog import aws, fence, resources, rollback
from shardless.changelog.durable import DurableState
from shardless.changelog.layout import AppLocation
from shardless.processor.driver.imports import check_import_done, installed_by_import
from shardless.processor.driver.progress import (
    LATEST_SK,
    Progress,
    at_batch,
    completed,
    describe,
    read_record,
    record_key,
    set_latest,
)
from shardless.processor.errors import ConfigError, ProcessorError
from shardless.processor.kinesis import positions as pos

log = logging.getLogger(__name__)


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
    try:
        check_import_done(loc)
    except ConfigError as exc:
        raise ProcessorError(str(exc)) from exc
    if query in fence.fenced(loc):
        raise ProcessorError(
            f"query {query} (this checkpoint) may no longer work on application "
            f"{loc.app!r}: its state was rolled back behind it or taken over by another "
            "query; start a NEW checkpoint with --starting-position COMMITTED"
        )
    for _ in range(5):
        found = read_record(loc.table, LATEST_SK)
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
                    Item={**record_key(LATEST_SK), "started": {"SS": [query]}},
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
                f"query (the newest progress is {describe(found)}); start a NEW checkpoint with "
                "--starting-position COMMITTED"
            )
        if found["query"] == query or query in found["started"]:
            return found["fenced"]
        if first_batch > 0:
            raise ProcessorError(
                f"query {query} resumes its checkpoint at batch {first_batch}, but another "
                f"query has continued application {loc.app!r}'s state since (the newest "
                f"progress is {describe(found)}): this checkpoint is stale; start a NEW checkpoint "
                "with --starting-position COMMITTED"
            )
        others: set[str] = set()
        if start_from is not None:
            if (found["query"], found["batch"]) != (start_from["query"], start_from["batch"]):
                raise ProcessorError(
                    f"query {query} started from query {start_from['query']}'s batch "
                    f"{start_from['batch']}, but application {loc.app!r}'s newest progress "
                    f"is now {describe(found)}: is another query running on it? Stop it, and "
                    "start this one again on a new checkpoint"
                )
            others = {q for q in (found["query"], *found["started"]) if q and q != query}
        elif found["batch"] is not None or found["started"] or found["withdrawn"]:
            if not recount and _reads_again(loc, found, streams):
                raise ProcessorError(recount_refused(loc, f"query {query}", describe(found)))
            log.warning(
                "query %s starts on a new checkpoint at its own starting position, but "
                "application %r already holds state (%s): records read again are counted "
                "again, as allowed (recount)",
                query,
                loc.app,
                describe(found),
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
                Key=record_key(LATEST_SK),
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
        heads = DurableState(loc).heads(slices).values()
        return any(h.committed and not installed_by_import(h) for h in heads)
    if streams is None:
        return True
    counted = {key.split("/", 1)[0] for key in found["positions"]}
    return bool(counted & set(streams))


def check_new_start(loc: AppLocation, streams: tuple[str, ...]) -> None:
    """Fail fast, before a new checkpoint at its own starting position starts, where
    `register` would refuse it at its first batch (ConfigError)."""
    found = read_record(loc.table, LATEST_SK)
    if found is None or found["query"] is None and not found["started"] and not found["withdrawn"]:
        return
    if _reads_again(loc, found, streams):
        raise ConfigError(recount_refused(loc, "this job", describe(found)))


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
    old = read_record(loc.table, LATEST_SK)
    if old is None:
        return None
    fenced = {query, *old["fenced"], *old["started"]}
    if old["query"] is not None:
        fenced.add(old["query"])
    fence.fence(loc, fenced)
    aws.client("dynamodb").put_item(
        TableName=loc.table,
        Item={
            **record_key(LATEST_SK),
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
    found = read_record(loc.table, LATEST_SK)
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
    if found["batch"] is None and found["started"] and not found["withdrawn"]:
        _clear_placeholder(loc, found)  # (a withdrawn record stays: the state is not empty)
    return completed(found), moved


def _clear_placeholder(loc: AppLocation, found: Progress) -> None:
    """After the commits of queries that never completed a batch were undone, the state
    is empty again: fence those queries and drop their placeholder, so that a new query
    may start at its own position (unless another query registered meanwhile)."""
    fence.fence(loc, found["started"])
    try:
        aws.client("dynamodb").delete_item(
            TableName=loc.table,
            Key=record_key(LATEST_SK),
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
    # Fence whatever could still be running first: a query that commits between the undo
    # and the new query's first batch would otherwise keep commits that the new query
    # then reads and counts again.
    latest_now = read_record(loc.table, LATEST_SK)
    if latest_now is not None:
        fence.fence(loc, [q for q in (latest_now["query"], *latest_now["started"]) if q])
    found, moved = undo_uncommitted(loc)
    withdrawn = latest_now["withdrawn"] if latest_now is not None else None
    if withdrawn:
        raise ConfigError(
            f"--starting-position COMMITTED: application {loc.app!r}'s progress was "
            f"withdrawn ({withdrawn}, which has no recorded source positions; {moved} slices "
            "with commits of queries started since were rolled back); start at an explicit "
            "--starting-position AT_TIMESTAMP with --allow-recount"
        )
    if found is None:
        undone = f" ({moved} slices with commits of unfinished batches were rolled back)"
        raise ConfigError(
            f"--starting-position COMMITTED: application {loc.app!r} has no recorded progress "
            f"(no batch has completed yet{undone if moved else ''}); start with TRIM_HORIZON, "
            "LATEST or AT_TIMESTAMP"
        )
    return found, found["positions"]
