"""Writing group chains: create one, find its tip, seal it, append a link.

Every write takes one position with `attribute_not_exists`, so exactly one writer gets
each: attempts of a group's batch are ordered by DynamoDB, and a seal written at the next
free position ends a chain for every writer that did not get there first
(docs/design/group-commits.md). The commit that appends a link is in `durable`, beside the
per-slice commit it replaces.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from botocore.exceptions import ClientError

from shardless.changelog import aws
from shardless.changelog.chain import (
    Genesis,
    Link,
    SliceRange,
    chain_pk,
    genesis_item,
    link_from_item,
    link_item,
    position_sk,
)
from shardless.changelog.chain_reads import read_genesis
from shardless.changelog.errors import CommitConflictError, ContinuityError
from shardless.changelog.layout import AppLocation, new_uid

_SEAL_ATTEMPTS = 20  # a chain still being appended to while it is sealed: try further on


@dataclass(frozen=True)
class ChainTip:
    """A chain and its newest position (0: no link yet), with the link there."""

    genesis: Genesis
    position: int = 0
    last: Link | None = None

    @property
    def chain(self) -> str:
        return self.genesis.chain

    @property
    def sealed(self) -> bool:
        return self.last is not None and self.last.sealed

    def after(self, link: Link) -> ChainTip:
        return ChainTip(self.genesis, link.position, link)


class ChainSealedError(CommitConflictError):
    """The chain a group commits to was sealed: another writer took its slices over."""


def create_chain(
    loc: AppLocation,
    query: str,
    partitions: int,
    group: int,
    within: SliceRange,
    keep_snapshots: int = 3,
) -> ChainTip:
    """A new chain for `group` of `query` (a fresh id: nobody else can write it yet)."""
    genesis = Genesis(
        new_uid(), query, partitions, group, within, int(time.time() * 1000), keep_snapshots
    )
    aws.client("dynamodb").put_item(
        TableName=loc.table,
        Item=genesis_item(genesis),
        ConditionExpression="attribute_not_exists(pk)",
    )
    return ChainTip(genesis)


def find_tip(loc: AppLocation, genesis: Genesis) -> ChainTip:
    """The chain's newest position: one consistent Query, newest first, limit 1."""
    found = _links(loc, genesis, 1, limit=1, newest_first=True)
    if not found:
        return ChainTip(genesis)
    return ChainTip(genesis, found[0].position, found[0])


def still_tip(loc: AppLocation, tip: ChainTip) -> bool:
    """Whether the chain still ends at `tip`: the link at its position is the one `tip`
    holds (none, for a tip before the first link) and nothing is after it. One consistent
    Query of at most two items."""
    last = tip.last
    if tip.position and (last is None or last.sealed):
        return False
    found = _links(loc, tip.genesis, max(tip.position, 1), limit=2)
    if last is None:
        return not found
    return [(f.position, f.uid, f.sealed) for f in found] == [(tip.position, last.uid, False)]


def _links(
    loc: AppLocation, genesis: Genesis, start: int, limit: int, newest_first: bool = False
) -> list[Link]:
    """Up to `limit` links of the chain from position `start` on: one consistent Query."""
    out = aws.client("dynamodb").query(
        TableName=loc.table,
        KeyConditionExpression="pk = :pk AND sk BETWEEN :lo AND :hi",
        ExpressionAttributeValues={
            ":pk": {"S": chain_pk(genesis.chain)},
            ":lo": {"S": position_sk(start)},
            ":hi": {"S": "9" * len(position_sk(0))},
        },
        ScanIndexForward=not newest_first,
        Limit=limit,
        ConsistentRead=True,
    )
    return [link_from_item(item, genesis.range) for item in out["Items"]]


def read_link(loc: AppLocation, genesis: Genesis, position: int) -> Link | None:
    out = aws.client("dynamodb").get_item(
        TableName=loc.table,
        Key={"pk": {"S": chain_pk(genesis.chain)}, "sk": {"S": position_sk(position)}},
        ConsistentRead=True,
    )
    return link_from_item(out["Item"], genesis.range) if "Item" in out else None


def seal(loc: AppLocation, chain: str, by: str) -> ChainTip:
    """End `chain`: write a seal at its next free position (a link that lands first moves
    the seal one further). Idempotent: a chain sealed already is left as it is. Returns
    the sealed tip: the chain's extent is final."""
    genesis = read_genesis(loc, chain)
    tip = find_tip(loc, genesis)
    for _ in range(_SEAL_ATTEMPTS):
        if tip.sealed:
            return tip
        mark = Link(tip.position + 1, sealed_by=by)
        try:
            aws.client("dynamodb").put_item(
                TableName=loc.table,
                Item=link_item(chain, mark, genesis.range),
                ConditionExpression="attribute_not_exists(pk)",
            )
            return tip.after(mark)
        except ClientError as exc:
            if exc.response["Error"]["Code"] != "ConditionalCheckFailedException":
                raise
        found = read_link(loc, genesis, mark.position)
        tip = tip.after(found) if found is not None else find_tip(loc, genesis)
    raise ContinuityError(
        f"chain {chain} (DynamoDB table {loc.table}) kept growing while it was sealed "
        f"({_SEAL_ATTEMPTS} positions): another writer still appends to it; stop that job "
        "first"
    )
