"""Which queries may no longer commit an application's state, and in which order queries
took it over: one small DynamoDB item.

    pk="app"  sk="fence"   fenced: string set of query ids
                           lineage: list of query ids, in the order they began on the state
                           gc_before: epoch ms; garbage collection may delete unreferenced
                                      objects written before it

A query is fenced when another query takes the state over (a COMMITTED start, or a new
checkpoint allowed to count records again) or when the state is rolled back behind it.
Every slice commit carries a ConditionCheck that its query is not in the set, inside the
same transaction as its heads, so a fenced query's commit fails atomically: a query that
was running when it was taken over cannot land one more batch on top of the new query's
state, however its reads and the takeover interleave. The check is one item per
transaction (per group and batch), not per slice; the item stays small (a few query ids).

The same check refuses a commit whose uploads began before `gc_before`: garbage collection
raises it before it reads the heads it judges by, so an attempt that stalled longer than
gc's grace period between its uploads and its commit (a frozen host, a zombie) cannot land
a reference to an object gc deleted, whatever the worker's clock or timers did meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shardless.changelog import aws
from shardless.changelog.errors import ChangelogError, CommitConflictError, CommitTooLateError
from shardless.changelog.layout import APP_PK, AppLocation

FENCE_SK = "fence"
HORIZON = "gc_before"


class QueryFencedError(CommitConflictError):
    """The committing query was fenced: another query took the state over, or it was
    rolled back behind it. Not retried: the query must stop."""


def _key() -> dict[str, Any]:
    return {"pk": {"S": APP_PK}, "sk": {"S": FENCE_SK}}


def _item(loc: AppLocation) -> dict[str, Any] | None:
    return (
        aws.client("dynamodb")
        .get_item(TableName=loc.table, Key=_key(), ConsistentRead=True)
        .get("Item")
    )


def fence(loc: AppLocation, queries: Iterable[str]) -> None:
    """Add `queries` to the application's fenced set (idempotent)."""
    names = sorted({q for q in queries if q})
    if not names:
        return
    aws.client("dynamodb").update_item(
        TableName=loc.table,
        Key=_key(),
        UpdateExpression="ADD #f :q",
        ExpressionAttributeNames={"#f": "fenced"},
        ExpressionAttributeValues={":q": {"SS": names}},
    )


def fenced(loc: AppLocation) -> set[str]:
    """The application's fenced queries."""
    item = _item(loc)
    return set(item.get("fenced", {}).get("SS", [])) if item else set()


def join(loc: AppLocation, query: str) -> None:
    """Append `query` to the application's lineage (once): it begins work on the state, so
    every commit it makes comes after those of the queries before it."""
    _update_unless(  # unless joined already
        loc,
        "SET #l = list_append(if_not_exists(#l, :none), :q)",
        "attribute_not_exists(#l) OR NOT contains(#l, :me)",
        {"#l": "lineage"},
        {":none": {"L": []}, ":q": {"L": [{"S": query}]}, ":me": {"S": query}},
    )


def lineage(loc: AppLocation) -> list[str]:
    """The queries that began on the application's state, oldest first ([] for state
    written before the lineage was kept)."""
    item = _item(loc)
    return [q["S"] for q in item.get("lineage", {}).get("L", [])] if item else []


def check_item(loc: AppLocation, query: str, since_ms: int | None = None) -> dict[str, Any]:
    """A TransactWriteItems ConditionCheck that `query` is not fenced (true while the item
    does not exist) and, with `since_ms`, that gc's horizon is older than the commit's
    first upload."""
    condition = "NOT contains(#f, :me)"
    names = {"#f": "fenced"}
    values: dict[str, Any] = {":me": {"S": query}}
    if since_ms is not None:
        condition += " AND (attribute_not_exists(#h) OR #h < :since)"
        names["#h"] = HORIZON
        values[":since"] = {"N": str(since_ms)}
    return {
        "ConditionCheck": {
            "TableName": loc.table,
            "Key": _key(),
            "ConditionExpression": condition,
            "ExpressionAttributeNames": names,
            "ExpressionAttributeValues": values,
        }
    }


def raise_horizon(loc: AppLocation, before_ms: int) -> None:
    """Refuse from now on every commit whose uploads began before `before_ms` (gc deletes
    unreferenced objects written before it). The horizon only moves forward."""
    _update_unless(  # unless a later horizon is there already
        loc,
        "SET #h = :t",
        "attribute_not_exists(#h) OR #h < :t",
        {"#h": HORIZON},
        {":t": {"N": str(before_ms)}},
    )


def _update_unless(
    loc: AppLocation, update: str, condition: str, names: dict, values: dict
) -> None:
    """Update the fence item when `condition` holds; otherwise leave it as it is."""
    try:
        aws.client("dynamodb").update_item(
            TableName=loc.table,
            Key=_key(),
            UpdateExpression=update,
            ConditionExpression=condition,
            ExpressionAttributeNames=names,
            ExpressionAttributeValues=values,
        )
    except aws.client("dynamodb").exceptions.ConditionalCheckFailedException:
        pass


def horizon(loc: AppLocation) -> int | None:
    """gc's horizon (epoch ms), None before the first collection that deleted."""
    item = _item(loc)
    return int(item[HORIZON]["N"]) if item and HORIZON in item else None


def refusal(loc: AppLocation, query: str, what: str, since_ms: int | None) -> ChangelogError:
    """Why a commit's check on the fence item failed, read from the item once: the query
    is fenced, or gc's horizon passed the time its uploads began."""
    item = _item(loc) or {}
    if query in item.get("fenced", {}).get("SS", []):
        return fenced_error(loc, query, what)
    found = item.get(HORIZON, {}).get("N")
    return CommitTooLateError(
        f"{what}: garbage collection has passed the time its uploads began ({since_ms} ms; "
        f"horizon {found} ms), so it may have removed them (a task stalled longer than gc's "
        "grace period?); nothing is committed and the attempt is retried"
    )


def fenced_error(loc: AppLocation, query: str, what: str) -> QueryFencedError:
    return QueryFencedError(
        f"{what}: query {query} is fenced from application {loc.app!r} (another query took "
        "its state over, or the state was rolled back behind it); nothing of this attempt "
        "was committed. Stop this query; continue with a NEW checkpoint and "
        "--starting-position COMMITTED"
    )
