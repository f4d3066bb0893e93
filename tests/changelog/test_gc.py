"""Retention and garbage collection against moto server: only what no retained snapshot
or log entry needs is deleted, and only after the grace period."""

from __future__ import annotations

import shutil
import time
from collections import Counter

import boto3
import pytest

from shardless.changelog import fence, gc
from shardless.changelog.durable import DurableState
from shardless.changelog.errors import CommitTooLateError, MissingObjectError
from shardless.changelog.restore import materialize
from tests.changelog.test_durable import commit, kv
from tests.processor.runtime.test_runtime import (
    KEYS,
    SLICES,
    durable_counts,
    frame,
    runner,
    wipe_stores,
)

HOUR_MS = 3600 * 1000


def run_batches(location, tmp_path, batches: range, **kw) -> None:
    r = runner(location, tmp_path, snapshot_every=2, keep_snapshots=1, **kw)
    hot = ["user-1", "user-2"] * 3
    for b in batches:
        r.run(0, "q", b, frame(KEYS[(b % 8) * 50 : (b % 8 + 1) * 50] + hot, b * 1000))


def expected(batches: int) -> Counter:
    out: Counter = Counter()
    for b in range(batches):
        out += Counter(KEYS[(b % 8) * 50 : (b % 8 + 1) * 50] + ["user-1", "user-2"] * 3)
    return out


def keys(location) -> set[str]:
    s3 = boto3.client("s3")
    found = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=location.bucket):
        found |= {o["Key"] for o in page.get("Contents", [])}
    return found


def test_gc_deletes_only_unreferenced_objects_after_the_grace_period(location, tmp_path):
    run_batches(location, tmp_path, range(10))
    before = keys(location)
    needed = gc.referenced(location, SLICES)
    assert needed < before  # retention dropped old snapshots and log entries

    dry = gc.collect(location, SLICES, dry_run=True)
    assert (
        dry.unreferenced == len(before - needed) and dry.deleted == [] and keys(location) == before
    )

    now = int(time.time() * 1000)
    first = gc.collect(location, SLICES, dry_run=False, now_ms=now)
    assert first.deleted == [] and first.waiting == first.unreferenced  # seen once: kept
    early = gc.collect(location, SLICES, dry_run=False, now_ms=now + HOUR_MS // 2)
    assert early.deleted == []
    late = gc.collect(location, SLICES, dry_run=False, now_ms=now + HOUR_MS + 1)
    assert set(late.deleted) == before - needed
    assert keys(location) == needed | {gc.pending_key(location)}
    assert durable_counts(location) == expected(10)  # every slice still restores


def test_a_restore_that_read_an_older_head_survives_the_grace_period(location, tmp_path):
    run_batches(location, tmp_path, range(4))
    durable = DurableState(location)
    s = next(s for s, h in durable.heads(list(range(SLICES))).items() if h.snaps)
    old_head = durable.heads([s])[s]
    run_batches(location, tmp_path, range(4, 10))  # old_head's snapshot is dropped
    assert old_head.snaps[0].key not in gc.referenced(location, SLICES)
    now = int(time.time() * 1000)
    gc.collect(location, SLICES, dry_run=False, now_ms=now)
    gc.collect(location, SLICES, dry_run=False, now_ms=now + HOUR_MS - 1)
    store, _ = materialize(durable, old_head, tmp_path / "slow-restore", SLICES)
    assert store.version == old_head.version
    store.close()
    gc.collect(location, SLICES, dry_run=False, now_ms=now + HOUR_MS + 1)
    with pytest.raises(MissingObjectError, match="grace period"):
        materialize(durable, old_head, tmp_path / "too-slow", SLICES)


def test_young_unreferenced_uploads_are_never_deleted(location, tmp_path):
    """A snapshot or segment whose commit is in flight (or lost) is unreferenced but young."""
    run_batches(location, tmp_path, range(3))
    s3 = boto3.client("s3")
    orphan = location.key("sst/slice-00003/inflight-000009.sst")
    s3.put_object(Bucket=location.bucket, Key=orphan, Body=b"x")
    now = int(time.time() * 1000)
    gc.collect(location, SLICES, dry_run=False, now_ms=now - 2 * HOUR_MS)  # seen long ago...
    report = gc.collect(location, SLICES, dry_run=False, now_ms=now)
    assert orphan not in report.deleted and orphan in keys(location)  # ...but written now


def test_wiped_stores_restore_after_gc(location, tmp_path, clock_ahead):
    run_batches(location, tmp_path, range(12))
    now = int(time.time() * 1000)
    gc.collect(location, SLICES, dry_run=False, now_ms=now)
    gc.collect(location, SLICES, dry_run=False, now_ms=clock_ahead(2 * HOUR_MS))
    wipe_stores(tmp_path)
    run_batches(location, tmp_path, range(12, 14))
    assert durable_counts(location) == expected(14)


def test_the_pending_list_is_read_with_s3s_checksum(location, tmp_path):
    """The pending list is the one object shardless reads back without a checksum of its
    own, and shardless's client leaves response checksums to the caller: the read asks S3
    for the object's CRC, which botocore then checks."""
    from shardless.changelog import aws

    run_batches(location, tmp_path, range(3))
    gc.collect(location, SLICES, grace_s=3600, dry_run=False)  # records a pending list
    modes: list[bytes | None] = []

    def seen(request, **_):  # noqa: ANN001
        if request.url.split("?")[0].endswith(gc.pending_key(location)):
            modes.append(request.headers.get("x-amz-checksum-mode"))

    events = aws.client("s3").meta.events
    events.register("before-send.s3.GetObject", seen)
    try:
        assert gc._load_pending(location) is not None
    finally:
        events.unregister("before-send.s3.GetObject", seen)
    assert modes == [b"ENABLED"]


def test_a_commit_whose_uploads_began_before_the_gc_horizon_is_refused(location):
    """gc raises the horizon before it reads the heads; DynamoDB then refuses a commit whose
    uploads began before it, wherever its worker stalled and whatever its clocks say."""
    durable = DurableState(location)
    commit(durable, 0, 1, [kv(1)], batch=0)
    before = int(time.time() * 1000)
    gc.collect(location, SLICES, dry_run=False, now_ms=before + 3 * 3_600_000)
    assert fence.horizon(location) == before + 2 * 3_600_000
    with pytest.raises(CommitTooLateError, match="horizon"):
        commit(durable, 0, 2, [kv(2)], batch=1)  # its uploads began "two hours" ago
    assert durable.heads([0])[0].version == 1
    gc.collect(location, SLICES, dry_run=True, now_ms=before + 9 * 3_600_000)
    assert fence.horizon(location) == before + 2 * 3_600_000  # a dry run deletes nothing
    gc.collect(location, SLICES, dry_run=False, now_ms=before)
    assert fence.horizon(location) == before + 2 * 3_600_000  # it only moves forward


def test_a_pack_is_kept_while_any_slice_needs_part_of_it(location, tmp_path, clock_ahead):
    """Slices 1 and 2 snapshot into one pack; slice 1 moves on to a newer snapshot of its
    own, whose files are new: the pack stays for slice 2. Once slice 2 moves on too, the
    pack goes after the grace period, and both slices still restore."""
    from shardless.changelog.pack import Due, upload_pack
    from tests.changelog.test_durable import open_store

    durable = DurableState(location, keep_snapshots=1)
    stores = {s: open_store(location, tmp_path, s, f"w{s}") for s in (1, 2)}

    def step(s: int, version: int, snapshot=None) -> None:
        change = [kv(version * 10 + s, "x" * 2000)]
        done = commit(durable, s, version, change, batch=version, snapshot=snapshot)
        stores[s].commit(change, version, tag=done.uid)

    for s in (1, 2):
        step(s, 1)
    shared = upload_pack(
        location, [Due(s, 1, stores[s].checkpoint(tmp_path / f"ck{s}-1")) for s in (1, 2)]
    )
    pack = shared[1][0].key
    for s in (1, 2):
        step(s, 2, snapshot=shared[s][0])

    def moves_on(s: int) -> None:
        # the slice's store at version 2 is rebuilt elsewhere, with files of its own: its
        # next snapshot shares nothing with the pack
        stores[s].close()
        stores[s] = open_store(location, tmp_path, s, f"w{s}-again")
        stores[s].commit([kv(100 + s, "y" * 3000)], 2)
        point = stores[s].checkpoint(tmp_path / f"ck{s}-2")
        ref, _ = upload_pack(location, [Due(s, 2, point, shared[s][0])])[s]
        step(s, 3, snapshot=ref)

    moves_on(1)
    assert pack in gc.referenced(location, SLICES)
    gc.collect(location, SLICES, dry_run=False, now_ms=clock_ahead(0))
    gc.collect(location, SLICES, dry_run=False, now_ms=clock_ahead(2 * HOUR_MS))
    assert pack in keys(location)
    moves_on(2)  # committed "2 hours later", after gc's horizon
    assert pack not in gc.referenced(location, SLICES)
    gc.collect(location, SLICES, dry_run=False, now_ms=clock_ahead(4 * HOUR_MS))
    report = gc.collect(location, SLICES, dry_run=False, now_ms=clock_ahead(6 * HOUR_MS))
    assert pack in report.deleted and pack not in keys(location)
    for s in (1, 2):
        shutil.rmtree(tmp_path / f"r{s}", ignore_errors=True)
        store, _ = materialize(durable, durable.heads([s])[s], tmp_path / f"r{s}", SLICES)
        assert dict(store.items()) == dict(stores[s].items())
        store.close()
        stores[s].close()


# ---- group chains ----------------------------------------------------------------------------


def chain_ids(location) -> list[str]:
    from shardless.changelog.chain_reads import all_chains

    return sorted(g.chain for g in all_chains(location))


def test_gc_deletes_the_chains_no_head_names_after_the_grace_period(location, tmp_path):
    """Roll-overs leave sealed chains behind; once no head names one and an earlier
    collection saw that a grace period ago, gc deletes its items; state stays whole."""
    run_batches(location, tmp_path, range(6), commit_format="chains", chain_length=2)
    heads = DurableState(location).heads(list(range(SLICES)))
    live = {h.chain for h in heads.values()}
    assert len(live) == 1 and len(chain_ids(location)) == 3  # every slice changed in batch 4
    now = int(time.time() * 1000)
    first = gc.collect(location, SLICES, dry_run=False, now_ms=now)
    assert (first.chains, first.chains_deleted, first.chain_items_deleted) == (3, [], 0)
    late = gc.collect(location, SLICES, dry_run=False, now_ms=now + HOUR_MS + 1)
    assert len(late.chains_deleted) == 2 and not set(late.chains_deleted) & live
    assert late.chains_sealed == []  # the live chain is named: left alone
    assert late.chain_items_deleted == 2 * (1 + 2 + 1)  # each: genesis, 2 links, seal
    assert chain_ids(location) == sorted(live)
    ddb = boto3.client("dynamodb")
    for chain in late.chains_deleted:
        gone = ddb.query(TableName=location.table, KeyConditionExpression="pk = :pk",
                         ExpressionAttributeValues={":pk": {"S": f"chain#{chain}"}})  # fmt: skip
        assert gone["Items"] == []
    assert durable_counts(location) == expected(6)
    run_batches(location, tmp_path, range(6, 9), commit_format="chains", chain_length=2)
    assert durable_counts(location) == expected(9)


def test_gc_keeps_a_chain_a_head_names_and_seals_a_never_named_one_before_deleting_it(
    location, tmp_path
):
    from shardless.changelog.chain import SliceRange
    from shardless.changelog.chain_commits import commit_link, take_over
    from shardless.changelog.chain_writes import create_chain, find_tip
    from shardless.changelog.errors import CommitConflictError
    from tests.changelog.test_chain_commits import batch_commits, read_state

    durable = DurableState(location)
    fence.join(location, "q1")
    old = create_chain(location, "q1", 1, 0, SliceRange(0, SLICES))
    heads = take_over(durable, {1: None, 2: None}, old, "host:1", "q1")
    commit_link(
        durable, "q1", 0, old, batch_commits(durable, heads, {1: {b"a": b"1"}, 2: {b"b": b"2"}})
    )
    new = create_chain(location, "q1", 1, 0, SliceRange(0, SLICES))
    take_over(durable, durable.heads([1]), new, "host:1", "q1")  # seals `old`; 2 stays there
    orphan = create_chain(location, "q1", 1, 0, SliceRange(0, SLICES))  # its attempt died
    now = int(time.time() * 1000)
    gc.collect(location, SLICES, dry_run=False, now_ms=now)
    second = gc.collect(location, SLICES, dry_run=False, now_ms=now + HOUR_MS + 1)
    assert (second.chains_deleted, second.chains_sealed) == ([], [orphan.chain])
    assert find_tip(location, orphan.genesis).sealed
    with pytest.raises(CommitConflictError, match="moved past position 0"):
        take_over(durable, {3: None}, orphan, "zombie:1", "q1")  # the dead attempt, late
    third = gc.collect(location, SLICES, dry_run=False, now_ms=now + 2 * HOUR_MS + 2)
    assert third.chains_deleted == [orphan.chain] and third.chain_items_deleted == 2
    assert chain_ids(location) == sorted([old.chain, new.chain])  # slice 2 names `old`
    assert read_state(durable, 2, tmp_path / "two") == {b"b": b"2"}
    # the seal is gone with the chain: the position after the dead attempt's tip is free,
    # and only the genesis check still stops it
    with pytest.raises(CommitConflictError, match=f"chain {orphan.chain} was deleted by gc"):
        take_over(durable, {3: None}, orphan, "zombie:1", "q1")
    assert durable.heads([3]) == {}


def test_a_collection_cut_short_after_marking_a_chain_dead_deletes_it_next_time(location):
    """gc marks a chain's genesis dead before deleting its links (seal included); a
    collection that stopped in between finds it dead, not unsealed, and deletes the rest
    instead of sealing it again."""
    from shardless.changelog.chain import SliceRange
    from shardless.changelog.chain_gc import sealed_chains
    from shardless.changelog.chain_writes import create_chain, seal

    orphan = create_chain(location, "q1", 1, 0, SliceRange(0, SLICES))
    seal(location, orphan.chain, "gc")
    ddb = boto3.client("dynamodb")
    key = {"pk": {"S": f"chain#{orphan.chain}"}}
    ddb.update_item(
        TableName=location.table,
        Key={**key, "sk": {"S": "genesis"}},
        UpdateExpression="SET dead = :t",
        ExpressionAttributeValues={":t": {"N": "1"}},
    )
    ddb.delete_item(TableName=location.table, Key={**key, "sk": {"S": f"{1:012d}"}})
    assert sealed_chains(location) == {orphan.chain: True}
    now = int(time.time() * 1000)
    gc.collect(location, SLICES, dry_run=False, now_ms=now)
    late = gc.collect(location, SLICES, dry_run=False, now_ms=now + HOUR_MS + 1)
    assert (late.chains_deleted, late.chains_sealed) == ([orphan.chain], [])
    assert chain_ids(location) == []
