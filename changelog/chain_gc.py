"""Garbage collection of group chains: the DynamoDB items of chains no head names.

A chain stops being named when its slices move to another chain (a roll-over, a new query
or group layout, a tool): each of those seals it first, so a chain that was ever named
and is named no more is sealed, and nothing can be appended to it or taken over into it
again (a takeover checks the position after its tip is free). A chain that was never
named (its group's attempt failed between creating it and taking its slices over) is
sealed by gc once it has gone unnamed for the grace period; a later collection deletes it.

Deleted: a chain that was sealed before gc read the heads, that no head named then, and
that an earlier collection already found unnamed at least `grace_s` ago (a reader that
resolved a head through it before it moved has that long to finish). Its genesis is first
marked dead: a seal stops a writer only while it is there, and a writer that remembers an
old tip would find the position after it free again once the links are gone, so every link
and takeover also checks the genesis alive (`chain_commits.alive`). Then its links go,
its genesis last, so a collection cut short lists it again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from botocore.exceptions import ClientError

from shardless.changelog import aws
from shardless.changelog.chain import DEAD, GENESIS_SK, chain_pk
from shardless.changelog.chain_reads import all_chains
from shardless.changelog.chain_writes import find_tip, seal
from shardless.changelog.errors import ChangelogError
from shardless.changelog.layout import AppLocation

PENDING_PREFIX = "chain#"  # chains wait in gc's pending list under this prefix
_DELETES_PER_CALL = 25  # BatchWriteItem's limit
_UNPROCESSED_ATTEMPTS = 8


@dataclass
class ChainVerdicts:
    """What one collection does with the chains no head names."""

    listed: int = 0
    delete: list[str] = field(default_factory=list)  # sealed, unnamed for the grace period
    seal: list[str] = field(default_factory=list)  # never sealed, unnamed for the grace period
    waiting: dict[str, int] = field(default_factory=dict)  # `chain#<id>` -> first seen unnamed


def sealed_chains(loc: AppLocation) -> dict[str, bool]:
    """Every chain of the application and whether it is sealed (or marked dead by a
    collection cut short); read before the heads."""
    return {g.chain: g.dead or find_tip(loc, g).sealed for g in all_chains(loc)}


def judge(
    listed: dict[str, bool], named: set[str], pending: dict[str, int], now: int, grace_ms: int
) -> ChainVerdicts:
    """Which chains to delete, which to seal, and which wait (pure: `listed` read before the
    heads, `named` by the heads, `pending` from earlier collections, by its `chain#` keys)."""
    out = ChainVerdicts(len(listed))
    for chain, sealed in sorted(listed.items()):
        if chain in named:
            continue
        first = pending.get(PENDING_PREFIX + chain, now)
        if first > now - grace_ms:
            out.waiting[PENDING_PREFIX + chain] = first
        elif sealed:
            out.delete.append(chain)
        else:
            out.seal.append(chain)
            out.waiting[PENDING_PREFIX + chain] = first
    return out


def seal_unnamed(loc: AppLocation, chains: list[str]) -> None:
    """Seal chains that were never named: from then on no takeover names them."""
    for chain in chains:
        seal(loc, chain, "gc")


def delete_chain(loc: AppLocation, chain: str) -> int:
    """Delete every item of `chain`: its genesis marked dead first, then its links, then
    the genesis; returns how many items went."""
    ddb = aws.client("dynamodb")
    try:
        ddb.update_item(
            TableName=loc.table,
            Key={"pk": {"S": chain_pk(chain)}, "sk": {"S": GENESIS_SK}},
            UpdateExpression="SET #dead = :now",
            ConditionExpression="attribute_exists(pk)",
            ExpressionAttributeNames={"#dead": DEAD},
            ExpressionAttributeValues={":now": {"N": str(int(time.time() * 1000))}},
        )
    except ClientError as exc:
        if exc.response["Error"]["Code"] != "ConditionalCheckFailedException":
            raise
        return 0  # gone already: its genesis goes last
    keys: list[dict] = []
    request = {
        "TableName": loc.table,
        "KeyConditionExpression": "pk = :pk",
        "ExpressionAttributeValues": {":pk": {"S": chain_pk(chain)}},
        "ProjectionExpression": "pk, sk",
    }
    while True:
        page = ddb.query(**request)
        keys += page["Items"]
        if "LastEvaluatedKey" not in page:
            break
        request["ExclusiveStartKey"] = page["LastEvaluatedKey"]
    keys.sort(key=lambda k: k["sk"]["S"] == "genesis")  # the genesis last
    for i in range(0, len(keys), _DELETES_PER_CALL):
        todo = {loc.table: [{"DeleteRequest": {"Key": k}} for k in keys[i : i + _DELETES_PER_CALL]]}
        for _ in range(_UNPROCESSED_ATTEMPTS):
            todo = ddb.batch_write_item(RequestItems=todo).get("UnprocessedItems") or {}
            if not todo:
                break
        else:
            raise ChangelogError(
                f"chain {chain}: DynamoDB table {loc.table} ({aws.where('dynamodb')}) left "
                f"deletions unprocessed {_UNPROCESSED_ATTEMPTS} times (throttled); run gc again"
            )
    return len(keys)
