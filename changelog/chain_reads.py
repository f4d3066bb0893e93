"""Reading group chains from DynamoDB and their segments' indexes from S3, to resolve heads
that name a chain (`shardless.changelog.chain.resolve`).

A chain is read with one consistent `Query` from the first position any of the heads asks
for (paginated); each link that names one of those heads' slices costs one ranged GET of
its segment's header and index, sent together. Heads without a chain cost nothing here.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from shardless.changelog import aws
from shardless.changelog.chain import (
    GENESIS_SK,
    Genesis,
    Link,
    chain_pk,
    genesis_from_item,
    link_from_item,
    needed_segments,
    position_sk,
    resolve,
)
from shardless.changelog.errors import ContinuityError, MissingObjectError
from shardless.changelog.layout import AppLocation, Head, segment_key
from shardless.changelog.objects import get_bytes, missing
from shardless.changelog.segment import SectionRef, decode_index

INDEX_THREADS = 8  # segment indexes fetched together


def read_genesis(loc: AppLocation, chain: str) -> Genesis:
    """Who writes `chain`; ContinuityError when it has no genesis (deleted, never written)."""
    out = aws.client("dynamodb").get_item(
        TableName=loc.table,
        Key={"pk": {"S": chain_pk(chain)}, "sk": {"S": GENESIS_SK}},
        ConsistentRead=True,
    )
    if "Item" not in out:
        raise ContinuityError(
            f"chain {chain} has no genesis item in DynamoDB table {loc.table} "
            f"({aws.where('dynamodb')}): a head names a chain that is gone"
        )
    return genesis_from_item(out["Item"])


def all_chains(loc: AppLocation) -> list[Genesis]:
    """Every chain of the application's table, by its genesis item (a Scan: it reads the
    whole table, for gc and tools, never on a batch's path)."""
    found: list[Genesis] = []
    request = {
        "TableName": loc.table,
        "FilterExpression": "begins_with(pk, :chain) AND sk = :genesis",
        "ExpressionAttributeValues": {":chain": {"S": chain_pk("")}, ":genesis": {"S": GENESIS_SK}},
        "ConsistentRead": True,
    }
    ddb = aws.client("dynamodb")
    while True:
        page = ddb.scan(**request)
        found += [genesis_from_item(item) for item in page["Items"]]
        if "LastEvaluatedKey" not in page:
            return sorted(found, key=lambda g: (g.created_ms, g.chain))
        request["ExclusiveStartKey"] = page["LastEvaluatedKey"]


def read_chain(loc: AppLocation, chain: str, start: int = 1) -> tuple[Genesis, list[Link]]:
    """A chain's genesis and its links from position `start` on, in order.
    ContinuityError when the chain has no genesis (deleted, or never written)."""
    ddb = aws.client("dynamodb")
    genesis = read_genesis(loc, chain)
    links: list[Link] = []
    request = {
        "TableName": loc.table,
        "KeyConditionExpression": "pk = :pk AND sk BETWEEN :lo AND :hi",
        "ExpressionAttributeValues": {
            ":pk": {"S": chain_pk(chain)},
            ":lo": {"S": position_sk(max(start, 0))},
            ":hi": {"S": "9" * len(position_sk(0))},
        },
        "ConsistentRead": True,
    }
    while True:
        page = ddb.query(**request)
        links += [link_from_item(item, genesis.range) for item in page["Items"]]
        if "LastEvaluatedKey" not in page:
            return genesis, links
        request["ExclusiveStartKey"] = page["LastEvaluatedKey"]


def segment_indexes(
    loc: AppLocation, genesis: Genesis, links: Iterable[Link]
) -> dict[str, list[SectionRef]]:
    """Each link's segment index (by uid), from one ranged GET of its first bytes each."""

    def fetch(link: Link) -> tuple[str, list[SectionRef]]:
        key = segment_key(loc, link.batch, genesis.group, link.uid)
        where = f"s3://{loc.bucket}/{key}"
        try:
            raw = get_bytes(loc.bucket, key, f"bytes=0-{link.index_length - 1}")
        except MissingObjectError as exc:
            raise missing(f"{where} (chain {genesis.chain} position {link.position})") from exc
        index = decode_index(raw, where=where)
        if index is None:
            raise ContinuityError(f"{where}: a chain's segment without a section index")
        return link.uid, index

    todo = [link for link in links if not link.sealed]
    if len(todo) <= 1:
        return dict(fetch(link) for link in todo)
    with ThreadPoolExecutor(min(len(todo), INDEX_THREADS), thread_name_prefix="shardless-idx") as p:
        return dict(p.map(fetch, todo))


def resolve_heads(loc: AppLocation, heads: dict[int, Head]) -> dict[int, Head]:
    """`heads` with those that name a chain extended through it; the rest as they are."""
    by_chain: dict[str, list[Head]] = {}
    for head in heads.values():
        if head.chain:
            by_chain.setdefault(head.chain, []).append(head)
    if not by_chain:
        return heads
    out = dict(heads)
    for chain, named in by_chain.items():
        genesis, links = read_chain(loc, chain, min(h.chain_from for h in named))
        needed = set().union(*(needed_segments(h, genesis, links, loc) for h in named))
        indexes = segment_indexes(loc, genesis, (link for link in links if link.uid in needed))
        for head in named:
            out[head.slice] = resolve(head, genesis, links, indexes, loc)
    return out
