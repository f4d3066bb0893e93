"""A group Spark did not call for a batch or more (no records, no timer due) comes back to
the host that ran it last: what the host knew is checked against DynamoDB (the chain has
nothing after the tip it knew, every head item is as it was) instead of read again through
the chain, and anything committed in between is still seen."""

from __future__ import annotations

import json
from collections import Counter

import pandas as pd
import pytest

from shardless.changelog import aws
from shardless.changelog.chain import chain_pk, position_sk
from shardless.changelog.chain_writes import ChainTip, read_link, still_tip
from shardless.changelog.durable import DurableState
from shardless.changelog.layout import HEAD_SK, slice_pk
from shardless.processor.runtime import known_heads, stores
from tests.processor.runtime.test_runtime import (
    KEYS,
    SLICES,
    durable_counts,
    frame,
    outputs,
    runner,
)


def metrics_of(out: pd.DataFrame) -> dict:
    return json.loads(out[out.kind == "metrics"].value.iloc[0])


def count_or_peek(event, ctx):
    """Counts a key's records; a record marked `peek` only reads the count (a batch of
    peeks commits nothing)."""
    if json.loads(event.data).get("peek"):
        ctx.emit({"key": event.key, "n": ctx.state.get(0)})
        return
    n = ctx.state.get(0) + 1
    ctx.state.set(n)
    ctx.emit({"key": event.key, "n": n})


def peeks(keys: list[str], first_seq: int) -> pd.DataFrame:
    pdf = frame(keys, first_seq)
    pdf["data"] = [json.dumps({"peek": True}).encode()] * len(pdf)
    return pdf


def chains(location, tmp_path, handler=count_or_peek, **kw):
    return runner(location, tmp_path, handler, commit_format="chains", **kw)


@pytest.fixture
def s3_gets(monkeypatch) -> list[dict]:
    """Every S3 GetObject this process sends (the chain's segment indexes among them)."""
    calls: list[dict] = []
    client = aws.client("s3")
    real = client.get_object

    def counted(**request):  # noqa: ANN003, ANN202
        calls.append(request)
        return real(**request)

    monkeypatch.setattr(client, "get_object", counted)
    return calls


def test_a_group_back_after_idle_batches_checks_what_it_knew_and_reads_no_chain(
    location, tmp_path, s3_gets
):
    r = chains(location, tmp_path)
    r.run(0, "q", 0, frame(KEYS[:100]))
    r.run(0, "q", 1, frame(KEYS[100:200], 100))
    del s3_gets[:]
    back = metrics_of(r.run(0, "q", 4, frame(KEYS[200:300], 200)))  # batches 2, 3: idle
    assert back["heads_read"] == 0 and back["heads_known"] == back["slices"]
    assert back["heads_vouched"] == back["slices"] and back["attempts"] == 1
    assert s3_gets == []  # no segment index read to resolve a head
    after = metrics_of(r.run(0, "q", 5, frame(KEYS[300:], 300)))
    assert after["heads_read"] == 0 and "heads_vouched" not in after
    assert durable_counts(location) == Counter(KEYS)


def test_a_group_run_elsewhere_while_idle_here_is_read_afresh(location, tmp_path):
    a, b = chains(location, tmp_path / "a"), chains(location, tmp_path / "b")
    a.run(0, "q", 0, frame(KEYS[:200]))
    b.run(0, "q", 1, frame(KEYS[200:300], 200))
    back = metrics_of(a.run(0, "q", 3, frame(KEYS[300:], 300)))
    assert "heads_vouched" not in back and back["heads_read"] > 0
    assert back["attempts"] == 1  # found out before processing, not by a lost commit
    assert durable_counts(location) == Counter(KEYS)


def test_a_read_only_batch_after_idle_sees_what_another_worker_committed(location, tmp_path):
    """The batch commits nothing, so no conditional write would catch stale heads: the
    check before it must."""
    a, b = chains(location, tmp_path / "a"), chains(location, tmp_path / "b")
    a.run(0, "q", 0, frame(KEYS[:200]))
    b.run(0, "q", 1, frame(KEYS[200:], 200))
    seen = outputs(a.run(0, "q", 3, peeks(sorted(set(KEYS)), 400)))
    want = Counter(KEYS)
    assert {o["key"]: o["n"] for o in seen} == dict(want)


def test_a_head_a_tool_claimed_while_the_group_was_idle_is_read_afresh(location, tmp_path):
    r = chains(location, tmp_path)
    r.run(0, "q", 0, frame(KEYS[:200]))
    durable = DurableState(location)
    durable.claim(durable.heads(list(range(SLICES))), owner="tool")
    back = metrics_of(r.run(0, "q", 3, peeks(sorted(set(KEYS[:200])), 200)))
    assert "heads_vouched" not in back and back["heads_read"] > 0
    assert durable_counts(location) == Counter(KEYS[:200])


def test_a_group_that_never_ran_here_reads_its_heads(location, tmp_path):
    a, b = chains(location, tmp_path / "a"), chains(location, tmp_path / "b")
    a.run(0, "q", 0, frame(KEYS[:200]))
    first = metrics_of(b.run(0, "q", 3, frame(KEYS[200:], 200)))
    assert "heads_vouched" not in first and first["heads_read"] > 0
    assert durable_counts(location) == Counter(KEYS)


def test_a_head_item_written_past_the_protocol_while_idle_is_read_afresh(location, tmp_path):
    """A head item rewritten without sealing the chain it names (by hand, say): the chain
    still ends where the host left it, but the head is not the one it knew."""
    r = chains(location, tmp_path)
    r.run(0, "q", 0, frame(KEYS[:200]))
    written = sorted(DurableState(location).claims(list(range(SLICES))))
    aws.client("dynamodb").update_item(
        TableName=location.table,
        Key={"pk": {"S": slice_pk(written[0])}, "sk": {"S": HEAD_SK}},
        UpdateExpression="SET #o = :o",
        ExpressionAttributeNames={"#o": "owner"},
        ExpressionAttributeValues={":o": {"S": "by-hand"}},
    )
    back = metrics_of(r.run(0, "q", 3, frame(KEYS[200:], 200)))
    assert "heads_vouched" not in back and back["heads_read"] > 0


def test_a_chain_that_lost_the_link_the_host_knew_is_read_afresh(location, tmp_path):
    """The link at the tip the host knew is gone (a table restored from an older backup):
    nothing is after the tip either, but the chain does not end there."""
    r = chains(location, tmp_path)
    r.run(0, "q", 0, frame(KEYS[:100]))
    r.run(0, "q", 1, frame(KEYS[100:200], 100))
    tip = stores.cache_for(str(tmp_path), location.app, SLICES).known.stale(0, "q", 4)[0]
    assert tip.position == 2
    aws.client("dynamodb").delete_item(
        TableName=location.table,
        Key={"pk": {"S": chain_pk(tip.chain)}, "sk": {"S": position_sk(tip.position)}},
    )
    assert not still_tip(location, tip)
    assert still_tip(location, ChainTip(tip.genesis, 1, read_link(location, tip.genesis, 1)))


def test_a_hint_is_decoded_again_only_when_another_process_rewrote_it(
    location, tmp_path, monkeypatch
):
    """Every batch asks the group's hint file what the host knows; the heads in it are
    decoded only when the file is not the one this process last wrote or read."""
    decoded: list[int] = []
    real = known_heads._hint_head

    def counted(item):  # noqa: ANN001, ANN202
        decoded.append(1)
        return real(item)

    monkeypatch.setattr(known_heads, "_hint_head", counted)
    r = chains(location, tmp_path)
    r.run(0, "q", 0, frame(KEYS[:100]))
    r.run(0, "q", 1, frame(KEYS[100:200], 100))
    assert decoded == []
    cache = stores.cache_for(str(tmp_path), location.app, SLICES)
    other = stores.StoreCache(str(tmp_path), location.app, SLICES)
    try:
        other.remember(0, "q", 2, cache.known.heads(0, "q", 2, range(SLICES)))
    finally:
        other.close()
    known = cache.known.heads(0, "q", 3, range(SLICES))
    assert len(decoded) == len(known) > 0  # the other process's hint, read once
    cache.known.heads(0, "q", 3, range(SLICES))
    assert len(decoded) == len(known)


def test_a_hint_carries_each_log_encoding_from_the_batch_before(location, tmp_path, monkeypatch):
    """Past a group's first batches on its chain, the hint encodes what each batch added to
    a slice's log instead of every log whole, and writes the bytes `encode_log` writes."""
    import msgpack

    from shardless.changelog import log_encoder
    from shardless.changelog.layout import encode_log

    encoded_whole: list[int] = []
    real = log_encoder.continues

    def counted(old, new):  # noqa: ANN001, ANN202
        dropped = real(old, new)
        if dropped is None:
            encoded_whole.append(1)
        return dropped

    monkeypatch.setattr(log_encoder, "continues", counted)
    r = chains(location, tmp_path)
    cache = stores.cache_for(str(tmp_path), location.app, SLICES)

    def whole() -> int:
        return len(encoded_whole)

    for b in range(3):
        r.run(0, "q", b, frame(KEYS[:200], 200 * b))
    settled = whole()
    assert 0 < settled <= 2 * SLICES
    for b in range(3, 8):
        r.run(0, "q", b, frame(KEYS[:200], 200 * b))
    assert whole() == settled
    heads = cache.known.heads(0, "q", 8, range(SLICES))
    raw = (cache.known._hints / "g0.msgpack").read_bytes()
    _query, batch, items, _tip = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    written = {int(s): item for s, item in items.items() if item is not None}
    assert batch == 7 and len(written) == len(heads) > SLICES // 2
    for s, item in written.items():
        assert len(heads[s].log) == 8 and item[1] == encode_log(heads[s].log)


def test_heads_left_on_a_chain_the_group_rolled_over_from_are_read_afresh(location, tmp_path):
    """After a roll-over, slices not changed since still name the sealed chain: the check
    only vouches for heads on the group's own chain, so these are read again (and the
    counts stay exact)."""
    r = chains(location, tmp_path, chain_length=2)
    r.run(0, "q", 0, frame(KEYS[:200]))
    r.run(0, "q", 1, frame(KEYS[200:210], 200))
    r.run(0, "q", 2, frame(KEYS[210:220], 210))  # rolls over: a new chain from here
    back = metrics_of(r.run(0, "q", 5, peeks(sorted(set(KEYS[:220])), 220)))
    assert "heads_vouched" not in back and back["heads_read"] > 0
    assert durable_counts(location) == Counter(KEYS[:220])
