"""Heads that name a group chain, read and restored against moto server over HTTP: the
state restored equals a plain fold of what the chain committed, at every version; a chain
that lost a link, its genesis or a segment is refused, naming what is missing."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from shardless.changelog import aws
from shardless.changelog.chain import Genesis, Link, SliceRange, genesis_item, link_item
from shardless.changelog.durable import DurableState, SliceCommit
from shardless.changelog.errors import ContinuityError, MissingObjectError
from shardless.changelog.layout import AppLocation, Head, head_item, segment_key
from shardless.changelog.restore import materialize
from shardless.changelog.segment import encode_segment, index_length
from tests.changelog.folds import fold

SLICES = 16
GROUP = 1
WITHIN = SliceRange(8, 8)


def write_chain(
    loc: AppLocation, chain: str, batches: list[dict[int, dict[bytes, bytes | None]]],
    bases: dict[int, int], first_batch: int = 50,
) -> list[Link]:  # fmt: skip
    """Commit `batches` ({slice: {key: value}} each) on a new chain of group GROUP the way
    a writer of chains will: a segment each, then its link; slices start at `bases`."""
    s3, ddb = aws.client("s3"), aws.client("dynamodb")
    ddb.put_item(
        TableName=loc.table, Item=genesis_item(Genesis(chain, "query-2", 2, GROUP, WITHIN, 1))
    )
    versions = dict(bases)
    links = []
    for position, changed in enumerate(batches, start=1):
        batch = first_batch + position
        sections = []
        for s in sorted(changed):
            versions[s] += 1
            sections.append((s, versions[s], list(changed[s].items())))
        body, _ = encode_segment({"app": loc.app, "batch": batch, "group": GROUP}, sections)
        uid = f"{0xC0FFEE:016x}{position:016x}"
        s3.put_object(Bucket=loc.bucket, Key=segment_key(loc, batch, GROUP, uid), Body=body)
        link = Link(
            position, "query-2", batch, uid, index_length(body), len(body), tuple(sorted(changed))
        )
        ddb.put_item(TableName=loc.table, Item=link_item(chain, link, WITHIN))
        links.append(link)
    return links


def hand_over(loc: AppLocation, durable: DurableState, slices: list[int], chain: str) -> None:
    """Point the slices' heads at `chain` from position 1 (a takeover, written directly)."""
    for head in durable.heads(slices).values():
        item = head_item(replace(head, chain=chain, chain_from=1))
        aws.client("dynamodb").put_item(TableName=loc.table, Item=item)


def fold_upto(before: list[dict], batches: list[dict], slice_id: int, upto: int) -> dict:
    return fold([*before, *batches][:upto], slice_id)


def store_items(store) -> dict[bytes, bytes]:  # noqa: ANN001
    return {k[1:]: v for k, v in store.items() if k.startswith(b"d")}


def test_a_head_naming_a_chain_restores_to_the_fold_of_both(location, tmp_path: Path) -> None:
    durable = DurableState(location)
    before = [{8: {b"a": b"1"}, 9: {b"b": b"1"}}, {8: {b"a": b"2"}}]
    for batch, changed in enumerate(before, start=1):
        heads = durable.heads(sorted(changed))
        durable.commit("query-1", batch, GROUP, [
            SliceCommit(s, (heads[s].version if s in heads else 0) + 1, heads.get(s),
                        [(b"d" + k, v) for k, v in kv.items()])
            for s, kv in sorted(changed.items())
        ])  # fmt: skip
    hand_over(location, durable, [8, 9], "c1")
    batches = [
        {8: {b"a": b"3", b"c": b"1"}},
        {9: {b"b": None, b"d": b"4"}, 8: {b"c": None}},
        {9: {b"e": b"5"}},
    ]
    write_chain(location, "c1", [
        {s: {b"d" + k: v for k, v in kv.items()} for s, kv in c.items()} for c in batches
    ], {8: 2, 9: 1})  # fmt: skip
    heads = durable.heads([8, 9])
    assert (heads[8].version, heads[9].version) == (4, 3)
    assert (heads[9].query, heads[9].batch) == ("query-2", 53)
    assert [e.batch for e in heads[8].log] == [1, 2, 51, 52]
    for s, versions in ((8, 4), (9, 3)):
        upto = [i + 1 for i, c in enumerate([*before, *batches]) if s in c]
        for version in range(1, versions + 1):
            store, _ = materialize(durable, heads[s], tmp_path / f"s{s}-{version}", SLICES, version)
            assert store_items(store) == fold_upto(before, batches, s, upto[version - 1])
            store.close()


def test_a_chain_missing_a_link_its_genesis_or_a_segment_is_refused(location, tmp_path) -> None:
    durable = DurableState(location)
    aws.client("dynamodb").put_item(
        TableName=location.table, Item=head_item(Head(10, 0, "", -1, chain="c2", chain_from=1))
    )
    links = write_chain(location, "c2", [{10: {b"dk": b"1"}}, {10: {b"dk": b"2"}}], {10: 0})
    assert durable.heads([10])[10].version == 2
    ddb, s3 = aws.client("dynamodb"), aws.client("s3")
    key = segment_key(location, links[1].batch, GROUP, links[1].uid)
    body = s3.get_object(Bucket=location.bucket, Key=key)["Body"].read()
    s3.delete_object(Bucket=location.bucket, Key=key)
    with pytest.raises(MissingObjectError, match=f"{key} .chain c2 position 2."):
        durable.heads([10])
    s3.put_object(Bucket=location.bucket, Key=key, Body=body)
    ddb.delete_item(
        TableName=location.table, Key={"pk": {"S": "chain#c2"}, "sk": {"S": "000000000001"}}
    )
    with pytest.raises(ContinuityError, match="slice 10: chain c2: position 2 .* should hold "
                       "version 1, its segment has version 2"):  # fmt: skip
        durable.heads([10])
    ddb.delete_item(TableName=location.table, Key={"pk": {"S": "chain#c2"}, "sk": {"S": "genesis"}})
    with pytest.raises(ContinuityError, match="chain c2 has no genesis item"):
        durable.heads([10])


def test_a_commit_on_a_head_read_through_its_chain_keeps_every_version(location, tmp_path) -> None:
    """Today's per-slice commit on top of a chain: the new head holds the chain's versions
    in its own log and names no chain, so nothing is counted twice."""
    durable = DurableState(location)
    aws.client("dynamodb").put_item(
        TableName=location.table, Item=head_item(Head(11, 0, "", -1, chain="c3", chain_from=1))
    )
    write_chain(location, "c3", [{11: {b"dk": b"1"}}, {11: {b"dj": b"2"}}], {11: 0})
    head = durable.heads([11])[11]
    durable.commit("query-2", 60, GROUP, [SliceCommit(11, 3, head, [(b"dk", None)])])
    again = durable.heads([11])[11]
    assert (again.version, again.chain, [e.version for e in again.log]) == (3, "", [1, 2, 3])
    store, _ = materialize(durable, again, tmp_path / "s", SLICES)
    assert store_items(store) == {b"j": b"2"}
    store.close()
