"""Whether an application is running: the driver's lease and the slices' recent commits.

A running job's driver renews one item, `pk="app" sk="lease"`, every few seconds with the
time it holds until (`until`), its owner and its query. The lease is advisory: it does not
stop a second job (slice epochs fence commits), it tells the state tools that someone is
working on the state. Tools that change state refuse while the lease is held or any slice
committed or was claimed recently, unless forced.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shardless.changelog import aws
from shardless.changelog.layout import APP_PK, AppLocation, Head

LEASE_SK = "lease"
DEFAULT_TTL_S = 60.0
DEFAULT_QUIET_S = 300.0  # commits or claims this recent mean "running"


@dataclass(frozen=True)
class Lease:
    owner: str
    query: str
    until_ms: int
    renewed_ms: int

    def held(self, now_ms: int) -> bool:
        return self.until_ms > now_ms


def _now_ms() -> int:
    return int(time.time() * 1000)


def renew(loc: AppLocation, owner: str, query: str, ttl_s: float = DEFAULT_TTL_S) -> Lease:
    """Hold (or extend) the application's lease for `ttl_s` seconds from now."""
    now = _now_ms()
    lease = Lease(owner, query, now + int(ttl_s * 1000), now)
    aws.client("dynamodb").put_item(
        TableName=loc.table,
        Item={
            "pk": {"S": APP_PK},
            "sk": {"S": LEASE_SK},
            "owner": {"S": owner},
            "query": {"S": query},
            "until": {"N": str(lease.until_ms)},
            "renewed": {"N": str(now)},
        },
    )
    return lease


def release(loc: AppLocation, owner: str) -> None:
    """Give the lease up if `owner` still holds it (a stopped job)."""
    try:
        aws.client("dynamodb").delete_item(
            TableName=loc.table,
            Key={"pk": {"S": APP_PK}, "sk": {"S": LEASE_SK}},
            ConditionExpression="#o = :o",
            ExpressionAttributeNames={"#o": "owner"},
            ExpressionAttributeValues={":o": {"S": owner}},
        )
    except aws.client("dynamodb").exceptions.ConditionalCheckFailedException:
        pass


def read(loc: AppLocation) -> Lease | None:
    item = (
        aws.client("dynamodb")
        .get_item(
            TableName=loc.table,
            Key={"pk": {"S": APP_PK}, "sk": {"S": LEASE_SK}},
            ConsistentRead=True,
        )
        .get("Item")
    )
    if item is None:
        return None
    return Lease(
        item["owner"]["S"], item["query"]["S"], int(item["until"]["N"]), int(item["renewed"]["N"])
    )


def activity(
    lease: Lease | None, heads: list[Head], quiet_s: float, now_ms: int | None = None
) -> list[str]:
    """Why the application looks running (empty: it does not)."""
    now = _now_ms() if now_ms is None else now_ms
    reasons = []
    if lease is not None and lease.held(now):
        reasons.append(
            f"the driver {lease.owner} of query {lease.query} holds the application's lease "
            f"for {(lease.until_ms - now) / 1000:.0f} s more"
        )
    horizon = now - int(quiet_s * 1000)
    recent = [h for h in heads if max(h.at_ms, h.claimed_ms) > horizon]
    if recent:
        newest = max(recent, key=lambda h: max(h.at_ms, h.claimed_ms))
        ago = (now - max(newest.at_ms, newest.claimed_ms)) / 1000
        reasons.append(
            f"{len(recent)} slices committed or were claimed in the last {quiet_s:.0f} s "
            f"(slice {newest.slice} by {newest.owner or 'unknown'} {ago:.0f} s ago)"
        )
    return reasons
