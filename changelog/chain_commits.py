"""Commits through group chains: a group's batch as one link, and the takeover that makes a
chain commit a slice (docs/design/group-commits.md).

One link per group and batch, in one transaction with the query's fence check and the
check that gc has not marked the chain dead, whatever the group's slice count: 2 write
units for the link (under 1 KB) and 2 read units for each check. A slice's head is written
only when a chain takes it over.
"""

from __future__ import annotations

import time
from dataclasses import replace

from shardless.changelog.chain import (
    DEAD,
    GENESIS_SK,
    Link,
    chain_pk,
    link_item,
    link_snapshot,
    position_sk,
)
from shardless.changelog.chain_writes import ChainTip, read_link
from shardless.changelog.durable import CommitResult, DurableState, SliceCommit
from shardless.changelog.layout import Head, encode_log, head_condition, head_item, new_uid
from shardless.changelog.segment import index_length
from shardless.changelog.transactions import Guard, GuardFailedError, HeadConflictError


class PositionTakenError(HeadConflictError):
    """A group's link lost its chain position to another writer; `found` is what is there
    (another attempt's link, or a seal)."""

    def __init__(self, message: str, slices: list[int], found: Link | None) -> None:
        super().__init__(message, slices)
        self.found = found


def commit_link(
    durable: DurableState,
    query: str,
    batch: int,
    tip: ChainTip,
    commits: list[SliceCommit],
    uploads_since: float | None = None,
) -> CommitResult:
    """Persist the changes of a group's slices as one link at the next position of the
    group's chain: one S3 segment, then one transaction of the link (on that position
    being free, the chain alive) and the query's fence check, whatever the slice count. The heads
    returned are the slices' heads as read through the chain after the link (nothing
    is written to them). Raises PositionTakenError naming what holds the position.
    `uploads_since` as in `commit`."""
    if not commits:
        return CommitResult("", 0, 0, tip=tip)
    commits = sorted(commits, key=lambda c: c.slice)
    up = durable.upload(query, batch, tip.genesis.group, commits, uploads_since)
    slices = [c.slice for c in commits]
    link = Link(
        tip.position + 1, query, batch, up.uid, index_length(up.body), len(up.body),
        tuple(slices), tuple(c.slice for c in commits if c.timers != (None, None)),
        tuple(link_snapshot(c.snapshot, c.slice) for c in commits if c.snapshot),
        at_ms=int(time.time() * 1000),
    )  # fmt: skip
    item = {"Put": {"TableName": durable.loc.table,
                    "Item": link_item(tip.chain, link, tip.genesis.range),
                    "ConditionExpression": "attribute_not_exists(pk)"}}  # fmt: skip
    what = f"batch {batch}: link {link.position} of chain {tip.chain} for slices"
    try:
        durable.send(
            [item], [slices[0]], what, f"{up.uid}-0", query, up.deadline, up.since_ms,
            (alive(durable.loc.table, tip),),
        )  # fmt: skip
    except HeadConflictError as exc:
        found = read_link(durable.loc, tip.genesis, link.position)
        taken = "a seal" if found and found.sealed else (
            f"batch {found.batch} of query {found.query}" if found else
            "nothing, and gc deleted the chain" if isinstance(exc, GuardFailedError) else
            "nothing now"
        )  # fmt: skip
        raise PositionTakenError(
            f"{what} {slices}: the position holds {taken}", slices, found
        ) from exc
    heads = {  # as a read through the chain gives them: the link's time
        c.slice: durable.next_head(c, ref, query, batch, tip.genesis.group, up.uid, link.at_ms)
        for c, ref in zip(commits, up.refs, strict=True)
    }  # fmt: skip
    return CommitResult(up.uid, len(up.body), 1, heads, up.took(), tip.after(link))


def take_over(
    durable: DurableState,
    heads: dict[int, Head | None],
    tip: ChainTip,
    owner: str,
    query: str,
    settled: frozenset[str] = frozenset(),
) -> dict[int, Head]:
    """Make `tip`'s chain commit the slices of `heads` (read through their chains) from
    its next position: seal every other chain they name, read them again (a link may
    have landed before the seal), and write each head whole with its versions in its
    own log, conditional on the head read, with the query's fence check. Returns the
    heads as written. Raises HeadConflictError when another writer changed one.

    Heads naming a `settled` chain, one the caller sealed right after the tip they were
    read at, are final already and are not read again: each one's write is still
    conditional on its item being as read."""
    unsettled = {s: h for s, h in heads.items() if h is None or h.chain not in settled}
    heads = {**heads, **durable.sealed_again(unsettled, owner, keep=tip.chain)}
    now = int(time.time() * 1000)
    taken: dict[int, Head] = {}
    items = []
    for s, head in sorted(heads.items()):
        old = head or Head(s, 0, "", -1)
        new = replace(
            old, epoch=old.epoch + 1, owner=owner, claimed_ms=now, chain=tip.chain,
            chain_from=tip.position + 1,
            log_bytes=encode_log(old.log) if old.log or old.log_bytes is not None else None,
        )  # fmt: skip
        taken[s] = new
        items.append(
            {"Put": {"TableName": durable.loc.table, "Item": head_item(new),
                     **head_condition(head)}}
        )  # fmt: skip
    if items:
        guards = (free_after(durable.loc.table, tip), alive(durable.loc.table, tip))
        durable.transact(
            items, sorted(taken), "takeover of slices", new_uid(), query, guards=guards
        )
    return taken


def free_after(table: str, tip: ChainTip) -> Guard:
    """A check that nothing follows `tip` in its chain yet: a takeover into a chain that was
    sealed since (by a newer owner, or by gc, which then deletes it) names no slice."""
    key = {"pk": {"S": chain_pk(tip.chain)}, "sk": {"S": position_sk(tip.position + 1)}}
    return Guard(
        {"ConditionCheck": {"TableName": table, "Key": key,
                            "ConditionExpression": "attribute_not_exists(pk)"}},
        f"chain {tip.chain} moved past position {tip.position} (sealed, or another attempt "
        "committed there): nothing is taken over",
    )  # fmt: skip


def alive(table: str, tip: ChainTip) -> Guard:
    """A check that `tip`'s chain is still there and not marked dead: gc marks a sealed
    chain no head names before deleting it, and once its seal is deleted the position
    after an old tip is free again, so `free_after` alone no longer stops a writer that
    remembers that tip."""
    key = {"pk": {"S": chain_pk(tip.chain)}, "sk": {"S": GENESIS_SK}}
    return Guard(
        {"ConditionCheck": {"TableName": table, "Key": key,
                            "ConditionExpression": "attribute_exists(pk) AND "
                                                   "attribute_not_exists(#dead)",
                            "ExpressionAttributeNames": {"#dead": DEAD}}},
        f"chain {tip.chain} was deleted by gc (no head named it): nothing lands in it",
    )  # fmt: skip
