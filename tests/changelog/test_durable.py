"""Durable commits, claims, snapshots and restore against moto server over HTTP."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError, ParamValidationError
from hypothesis import given, settings
from hypothesis import strategies as st

from shardless.changelog import aws, resources, segment_cache
from shardless.changelog import durable as durable_module
from shardless.changelog.durable import (
    DurableState,
    HeadConflictError,
    SliceCommit,
    transaction_chunks,
)
from shardless.changelog.errors import (
    CommitConflictError,
    ConfigurationError,
    ContinuityError,
    CorruptObjectError,
    MissingObjectError,
    ThrottledError,
)
from shardless.changelog.layout import AppLocation
from shardless.changelog.manifest import manifests, read_manifest
from shardless.changelog.restore import identity, materialize, restore
from shardless.changelog.snapshot import write_snapshot
from shardless.processor.local.faults.fault_proxy import FaultProxy
from shardless.processor.local.faults.rules import Rule
from shardless.state.store import SliceStore

SLICES = 16


def kv(i: int, v: str | None = None) -> tuple[bytes, bytes]:
    return (b"d" + f"k{i:04d}".encode(), (v or f"v{i}").encode())


def commit(durable: DurableState, slice_id: int, version: int, changes, batch: int, snapshot=None):
    head = durable.heads([slice_id]).get(slice_id)
    return durable.commit("q", batch, 0, [SliceCommit(slice_id, version, head, changes, snapshot)])


def open_store(location, tmp_path: Path, slice_id: int, name: str = "s") -> SliceStore:
    return SliceStore(tmp_path / name, identity(location.app, slice_id, SLICES))


def committed_store(location, tmp_path, slice_id, versions: int) -> tuple[DurableState, SliceStore]:
    """A slice committed `versions` times (version v writes key v), with a local store."""
    durable = DurableState(location)
    store = open_store(location, tmp_path, slice_id, "writer")
    for v in range(1, versions + 1):
        done = commit(durable, slice_id, v, [kv(v)], batch=v)
        store.commit([kv(v)], v, tag=done.uid)
    return durable, store


def snapshot_of(durable, store, slice_id, tmp_path, previous=None):
    point = store.checkpoint(tmp_path / f"ck-{store.version}")
    return write_snapshot(durable.loc, slice_id, store.version, point, previous)


def corrupt(location, key: str, at: int = -1) -> None:
    s3 = boto3.client("s3")
    body = bytearray(s3.get_object(Bucket=location.bucket, Key=key)["Body"].read())
    body[at] ^= 0xFF
    s3.put_object(Bucket=location.bucket, Key=key, Body=bytes(body))


def test_missing_store_is_restored_in_full(location, tmp_path):
    durable = DurableState(location)
    commit(durable, 3, 1, [kv(1), kv(2)], batch=0)
    commit(durable, 3, 2, [(kv(1)[0], None), kv(3)], batch=1)
    head = durable.heads([3])[3]
    assert (head.version, head.batch, len(head.log)) == (2, 1, 2)
    store, stats = materialize(durable, head, tmp_path / "s3", SLICES)
    assert dict(store.items()) == dict([kv(2), kv(3)])
    assert (store.version, stats.segments, stats.records, stats.snapshot_version) == (2, 2, 4, None)
    assert store.tag == head.log[-1].uid


def test_stale_store_replays_only_the_missing_versions(location, tmp_path):
    durable = DurableState(location)
    commit(durable, 1, 1, [kv(1)], batch=0)
    store, _ = materialize(durable, durable.heads([1])[1], tmp_path / "s", SLICES)
    for v in (2, 3):
        commit(durable, 1, v, [kv(v)], batch=v)
    head = durable.heads([1])[1]
    store, stats = restore(store.path, identity(location.app, 1, SLICES), durable, head, 3, store)
    assert (stats.from_version, stats.segments, stats.snapshot_version) == (1, 2, None)
    assert dict(store.items()) == dict([kv(1), kv(2), kv(3)])


def test_store_ahead_of_the_committed_state_is_rolled_back(location, tmp_path):
    durable, writer = committed_store(location, tmp_path, 2, 2)
    writer.commit([kv(3)], 3, undo=[(kv(3)[0], None)], tag="never-committed")
    head = durable.heads([2])[2]
    store, stats = restore(writer.path, identity(location.app, 2, SLICES), durable, head, 2, writer)
    assert stats.rolled_back and store.version == 2 and dict(store.items()) == dict([kv(1), kv(2)])
    assert store.tag == head.log[-1].uid
    # two versions ahead: no undo reaches that far, so the store is rebuilt
    store.commit([kv(3)], 3, tag="x")
    store.commit([kv(4)], 4, tag="y")
    store, stats = restore(store.path, identity(location.app, 2, SLICES), durable, head, 2, store)
    assert not stats.rolled_back and stats.segments == 2
    assert dict(store.items()) == dict([kv(1), kv(2)])


def test_snapshot_plus_tail_restores_and_later_snapshots_upload_only_new_files(location, tmp_path):
    durable, writer = committed_store(location, tmp_path, 6, 3)
    for i in range(2000):  # something worth a file of its own
        writer.commit([kv(1000 + i, "x" * 200)], 3, tag=writer.tag)
    ref, first, sent_first = snapshot_of(durable, writer, 6, tmp_path)
    done = commit(durable, 6, 4, [kv(4)], batch=4, snapshot=ref)
    writer.commit([kv(4)], 4, tag=done.uid)
    ref2, second, sent_second = snapshot_of(durable, writer, 6, tmp_path, previous=first)
    shared = {f.key for f in first.files} & {f.key for f in second.files}
    assert shared and sent_second < sent_first / 4  # the big file is referenced, not re-sent
    done = commit(durable, 6, 5, [kv(5)], batch=5, snapshot=ref2)
    head = durable.heads([6])[6]
    assert [s.version for s in head.snaps] == [3, 4] and [e.version for e in head.log] == [4, 5]
    manifests._items.clear()  # restore as a new process would: fetch the manifest
    store, stats = materialize(durable, head, tmp_path / "fresh", SLICES)
    assert (stats.snapshot_version, stats.segments) == (4, 1)
    assert dict(store.items()) == dict(writer.items()) | dict([kv(5)])
    assert store.version == 5 and store.tag == done.uid
    # an earlier version, for a roll-back: the older snapshot and the log after it
    old, stats = materialize(durable, head, tmp_path / "old", SLICES, version=3)
    assert stats.snapshot_version == 3 and old.version == 3 and kv(4)[0] not in dict(old.items())


def test_corrupt_segment_is_refused_with_its_key(location, tmp_path):
    durable = DurableState(location)
    commit(durable, 4, 1, [kv(1)], batch=0)
    head = durable.heads([4])[4]
    key = head.log[0].key(location)
    corrupt(location, key)
    with pytest.raises(CorruptObjectError, match=key):
        materialize(durable, head, tmp_path / "s", SLICES)
    assert not (tmp_path / "s").exists()  # nothing half-restored left behind


@pytest.mark.parametrize("what", ["manifest", "sst"])
def test_corrupt_snapshot_objects_are_refused_with_their_key(location, tmp_path, what):
    durable, writer = committed_store(location, tmp_path, 8, 2)
    ref, m, _ = snapshot_of(durable, writer, 8, tmp_path)
    commit(durable, 8, 3, [kv(3)], batch=3, snapshot=ref)
    key = ref.key if what == "manifest" else m.files[0].key
    corrupt(location, key, at=40 if what == "manifest" else -3)
    manifests._items.clear()
    with pytest.raises(CorruptObjectError, match=key):
        materialize(durable, durable.heads([8])[8], tmp_path / "s", SLICES, version=2)


def test_snapshot_of_another_slice_is_refused(location, tmp_path):
    durable, writer = committed_store(location, tmp_path, 9, 2)
    ref, _, _ = snapshot_of(durable, writer, 9, tmp_path)
    manifests._items.clear()
    with pytest.raises(CorruptObjectError, match=f"{ref.key}.*expected app .* slice 10"):
        read_manifest(location, ref, slice_id=10)


def test_missing_object_names_the_key_and_what_to_do(location, tmp_path):
    durable = DurableState(location)
    commit(durable, 5, 1, [kv(1)], batch=0)
    head = durable.heads([5])[5]
    boto3.client("s3").delete_object(Bucket=location.bucket, Key=head.log[0].key(location))
    with pytest.raises(MissingObjectError, match=f"{head.log[0].key(location)}.*S3 versioning"):
        materialize(durable, head, tmp_path / "s", SLICES)


def test_a_gap_in_the_history_is_refused(location, tmp_path):
    durable = DurableState(location)
    commit(durable, 7, 1, [kv(1)], batch=0)
    head = durable.heads([7])[7]
    with pytest.raises(ContinuityError, match=f"slice 7.*{location.table}"):
        materialize(durable, head, tmp_path / "s", SLICES, version=2)


def race(durable: DurableState, fns: dict[str, callable]) -> dict[str, str]:
    results: dict[str, str] = {}
    barrier = threading.Barrier(len(fns))

    def attempt(name: str) -> None:
        barrier.wait()
        try:
            fns[name]()
            results[name] = "won"
        except CommitConflictError:
            results[name] = "lost"

    threads = [threading.Thread(target=attempt, args=(n,)) for n in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_one_of_two_racing_committers_wins_and_only_its_segment_is_referenced(location):
    durable = DurableState(location)
    commit(durable, 5, 1, [kv(0)], batch=0)
    head = durable.claim(durable.heads([5]))[5]

    def writer(name: str):
        return lambda: durable.commit(
            name, 1, 0, [SliceCommit(5, 2, head, [(b"dwinner", name.encode())])]
        )

    for _ in range(5):  # several rounds: the outcome must never be both or neither
        results = race(durable, {"a": writer("a"), "b": writer("b")})
        assert sorted(results.values()) == ["lost", "won"]
        winner = next(n for n, r in results.items() if r == "won")
        final = durable.heads([5])[5]
        assert (final.version, final.query) == (2, winner)
        assert durable.read_changes(5, final.log[-1]) == [(b"dwinner", winner.encode())]
        segments = boto3.client("s3").list_objects_v2(Bucket=location.bucket)["Contents"]
        referenced = {e.key(location) for e in final.log}
        assert len([o for o in segments if o["Key"] not in referenced]) >= 1  # the loser's
        durable.commit("reset", 9, 0, [SliceCommit(5, 1, final, [])])  # back to v1
        head = durable.heads([5])[5]
        head = durable.claim({5: head})[5]


def test_a_zombie_owner_cannot_commit_after_a_new_claim(location):
    """A worker stalls after claiming; another claims the slice and commits. The zombie's
    commit, though based on the version it read, loses to the newer epoch."""
    durable = DurableState(location)
    commit(durable, 11, 1, [kv(1)], batch=0)
    zombie = durable.claim(durable.heads([11]), owner="zombie")[11]
    successor = durable.claim({11: zombie}, owner="successor")[11]
    assert successor.epoch == zombie.epoch + 1
    with pytest.raises(CommitConflictError, match=r"slices \[11\] lost"):
        durable.commit("q", 2, 0, [SliceCommit(11, 2, zombie, [kv(2, "zombie")])])
    durable.commit("q", 2, 0, [SliceCommit(11, 2, successor, [kv(2, "successor")])])
    final = durable.heads([11])[11]
    assert (final.version, final.owner, final.epoch) == (2, "successor", successor.epoch)
    with pytest.raises(CommitConflictError, match="claim of slices"):
        durable.claim({11: zombie}, owner="zombie")  # its view of the head is stale


def test_commit_from_a_stale_head_is_refused(location):
    durable = DurableState(location)
    commit(durable, 7, 1, [kv(1)], batch=0)
    stale = durable.heads([7])[7]
    commit(durable, 7, 2, [kv(2)], batch=1)
    with pytest.raises(CommitConflictError, match=r"slices \[7\] lost"):
        durable.commit("q", 2, 0, [SliceCommit(7, 2, stale, [kv(9)])])
    assert durable.heads([7])[7].version == 2


def test_a_rerun_in_place_from_one_head_lands_once(location):
    """Two attempts of one batch that both start from the head of its first commit (a
    re-run on the owning worker and a resumed zombie of it) each commit the same version
    in place: the head is compared whole, so only the first lands."""
    durable = DurableState(location)
    commit(durable, 3, 1, [kv(1)], batch=0)
    durable.commit("q", 1, 0, [SliceCommit(3, 2, durable.heads([3])[3], [kv(2)])], owner="w")
    first = durable.heads([3])[3]
    assert (first.version, first.batch, first.owner) == (2, 1, "w")
    durable.commit("q", 1, 0, [SliceCommit(3, 2, first, [kv(2, "rerun")])], owner="w")
    with pytest.raises(CommitConflictError, match=r"slices \[3\] lost"):
        durable.commit("q", 1, 0, [SliceCommit(3, 2, first, [kv(2, "zombie")])], owner="w")
    final = durable.heads([3])[3]
    assert durable.read_changes(3, final.log[-1]) == [kv(2, "rerun")]


def test_a_commit_by_a_new_owner_takes_the_slice_over_and_fences_the_old_one(location):
    durable = DurableState(location)
    a = durable.commit("q", 0, 0, [SliceCommit(2, 1, None, [kv(1)])], owner="a").heads[2]
    assert (a.epoch, a.owner) == (1, "a") and durable.heads([2])[2] == a
    b = durable.commit("q", 1, 0, [SliceCommit(2, 2, a, [kv(2)])], owner="b").heads[2]
    assert (b.epoch, b.owner, b.version) == (2, "b", 2)
    with pytest.raises(CommitConflictError, match=r"slices \[2\] lost"):
        durable.commit("q", 1, 0, [SliceCommit(2, 2, a, [kv(2, "a")])], owner="a")
    again = durable.commit("q", 2, 0, [SliceCommit(2, 3, b, [kv(3)])], owner="b").heads[2]
    assert (again.epoch, again.owner) == (2, "b")  # the owner's commits keep its epoch
    assert durable.heads([2])[2] == again


def test_a_commit_after_a_claim_by_a_tool_is_refused(location):
    """Claims and roll-backs change a head without a commit; the log alone would not show it."""
    durable = DurableState(location)
    commit(durable, 6, 1, [kv(1)], batch=0)
    read = durable.heads([6])[6]
    durable.claim({6: read}, owner="tool")
    with pytest.raises(CommitConflictError, match=r"slices \[6\] lost"):
        durable.commit("q", 1, 0, [SliceCommit(6, 2, read, [kv(2)])])


def test_changes_are_read_from_the_local_segment_cache_first(location, tmp_path, monkeypatch):

    monkeypatch.setattr(segment_cache, "SEGMENT_CACHE_FILES", 2)
    cached = DurableState(location, segment_cache=tmp_path / "segments")
    for v in (1, 2, 3):
        head = cached.heads([4]).get(4)
        cached.commit("q", v, 0, [SliceCommit(4, v, head, [kv(v)])])
    head = cached.heads([4])[4]
    assert sorted(f.name for f in (tmp_path / "segments").iterdir()) == sorted(
        f"{e.uid}.seg" for e in head.log[1:]
    )  # the newest two
    s3 = boto3.client("s3")
    s3.delete_object(Bucket=location.bucket, Key=head.log[-1].key(location))
    assert cached.read_changes(4, head.log[-1]) == [kv(3)]  # from local disk
    with pytest.raises(MissingObjectError):
        DurableState(location).read_changes(4, head.log[-1])
    local = tmp_path / "segments" / f"{head.log[1].uid}.seg"
    local.write_bytes(local.read_bytes()[:-1] + b"?")  # damaged: S3 has it
    assert cached.read_changes(4, head.log[1]) == [kv(2)]


def test_idle_commit_costs_nothing(location):
    assert DurableState(location).commit("q", 0, 0, []).bytes == 0
    listed = boto3.client("s3").list_objects_v2(Bucket=location.bucket)
    assert listed.get("KeyCount", 0) == 0


def test_existing_state_with_another_slice_count_is_refused(location):
    with pytest.raises(ConfigurationError, match="keeps its state in 16 slices.*--slices 16"):
        resources.ensure(location, 32)


def test_unreachable_endpoint_fails_fast_with_what_to_fix(location, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    with pytest.raises(ConfigurationError, match="cannot reach .*AWS_ENDPOINT_URL_S3"):
        resources.ensure(location, 16)


def test_the_commit_client_leaves_validation_to_the_service_and_the_others_keep_it(location):
    """The per-batch transactions skip botocore's parameter check (their items are built
    here) and go through that client; every other client still refuses a malformed
    request before sending it."""
    bad = {"TableName": location.table, "Key": {"pk": {"S": 7}}}  # a number where a string goes
    with pytest.raises(ParamValidationError):
        aws.client("dynamodb").get_item(**bad)
    with pytest.raises(ClientError):  # sent, and refused by the service
        aws.client("dynamodb", validated=False).get_item(**bad)

    sent: list[bool] = []
    event = "before-call.dynamodb.TransactWriteItems"
    hooks = {v: (lambda v=v, **_: sent.append(v)) for v in (True, False)}
    for validated, hook in hooks.items():
        aws.client("dynamodb", validated=validated).meta.events.register(event, hook)
    try:
        durable = DurableState(location)
        done = commit(durable, 3, 1, [kv(1)], batch=1)
    finally:
        for validated, hook in hooks.items():
            aws.client("dynamodb", validated=validated).meta.events.unregister(event, hook)
    assert sent == [False]  # the commit's one transaction, through the unvalidated client
    assert durable.heads([3])[3].log[-1].uid == done.uid


# -- a commit of more than 99 slices: several transactions, sent together ----------------

WIDE = 250  # slices in one commit: three transactions (99, 99, 52), each with a fence check


@pytest.fixture
def wide(location) -> DurableState:
    """An application of 256 slices, each of the first WIDE committed once (version 1)."""
    loc = AppLocation.default(f"{location.app}-w")
    resources.ensure(loc, 256)
    durable = DurableState(loc)
    done = durable.commit("q", 0, 0, [SliceCommit(s, 1, None, [kv(s)]) for s in range(WIDE)])
    assert done.transactions == 3
    return durable


def commit_all(durable: DurableState, heads: dict, batch: int):
    commits = [SliceCommit(s, heads[s].version + 1, heads[s], [kv(s, "b")]) for s in range(WIDE)]
    return durable.commit("q", batch, 0, commits)


def versions(durable: DurableState) -> dict[int, int]:
    return {s: h.version for s, h in durable.heads(list(range(WIDE))).items()}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 400_000), max_size=450), st.integers(0, 1))
def test_transaction_chunks_cover_the_items_in_order_within_dynamodb_limits(sizes, checks):
    chunks = transaction_chunks(sizes, checks)
    per = 99 - checks  # and the fence check (and a guard): 100 items
    assert [lo for lo, _ in chunks] == [0, *(hi for _, hi in chunks[:-1])]
    assert chunks[-1][1] == len(sizes)
    for lo, hi in chunks:
        assert 1 <= hi - lo <= per or not sizes
        assert sum(sizes[lo:hi]) <= 3_500_000 or hi - lo == 1
    for lo, hi in chunks[:-1]:  # as few as allowed: none could have taken one more
        assert hi - lo == per or sum(sizes[lo : hi + 1]) > 3_500_000


def test_a_wide_commit_sends_its_transactions_at_once(wide):
    """All three transactions are in flight together: each waits at a barrier for the
    other two before it is sent, which one at a time would never pass."""
    barrier = threading.Barrier(3, timeout=20)
    client = aws.client("dynamodb", validated=False)
    event = "before-call.dynamodb.TransactWriteItems"

    def hook(**_):
        barrier.wait()

    client.meta.events.register(event, hook)
    try:
        done = commit_all(wide, wide.heads(list(range(WIDE))), batch=1)
    finally:
        client.meta.events.unregister(event, hook)
    assert done.transactions == 3
    assert versions(wide) == {s: 2 for s in range(WIDE)}
    assert all(h.log[-1].uid == done.uid for h in wide.heads(list(range(WIDE))).values())


def test_one_transaction_losing_does_not_stop_the_others(wide):
    """Slice 5 moved on (another writer), so the first transaction, slices 0-98, is
    cancelled whole; the other two land, each head on its own condition, and the error
    names only the slice that lost."""
    heads = wide.heads(list(range(WIDE)))
    wide.commit("other", 1, 1, [SliceCommit(5, 2, heads[5], [kv(5, "other")])])
    with pytest.raises(HeadConflictError, match=r"slices \[5\] lost .*2 of its 3") as lost:
        commit_all(wide, heads, batch=1)
    assert lost.value.slices == [5]
    after = versions(wide)
    assert {s for s, v in after.items() if v == 1} == set(range(99)) - {5}
    assert all(after[s] == 2 for s in range(99, WIDE)) and after[5] == 2
    assert wide.heads([5])[5].query == "other"


def test_losers_in_several_transactions_are_named_together(wide):
    heads = wide.heads(list(range(WIDE)))
    for s in (7, 180):
        wide.commit("other", 1, 1, [SliceCommit(s, 2, heads[s], [kv(s, "other")])])
    with pytest.raises(HeadConflictError, match=r"slices \[7, 180\] lost .*1 of its 3") as lost:
        commit_all(wide, heads, batch=1)
    assert lost.value.slices == [7, 180]
    assert all(v == 2 for s, v in versions(wide).items() if 198 <= s < WIDE)


def test_with_one_transaction_at_a_time_the_first_loss_stops_the_rest(wide, monkeypatch):
    monkeypatch.setattr(durable_module, "TRANSACTION_THREADS", 1)
    heads = wide.heads(list(range(WIDE)))
    wide.commit("other", 1, 1, [SliceCommit(5, 2, heads[5], [kv(5, "other")])])
    with pytest.raises(HeadConflictError, match=r"slices \[5\] lost"):
        commit_all(wide, heads, batch=1)
    assert {s for s, v in versions(wide).items() if v == 2} == {5}


def test_a_commit_failing_two_ways_raises_the_unexpected_error_and_notes_the_losers():
    from shardless.changelog.transactions import combined_failure

    throttled = ClientError({"Error": {"Code": "ThrottlingException"}}, "TransactWriteItems")
    lost = HeadConflictError("slices [3] lost", [3])
    raised = combined_failure([lost, throttled], 3, "batch 9: commit of slices")
    assert raised is throttled
    assert raised.__notes__ == [
        "batch 9: commit of slices: 1 of its 3 transactions landed; slices [3] lost to "
        "another writer"
    ]
    both = combined_failure([HeadConflictError("x", [120, 4]), lost], 3, "claim of slices")
    assert isinstance(both, HeadConflictError) and both.slices == [3, 4, 120]
    assert str(both).startswith("claim of slices [3, 4, 120] lost to another writer")
    assert str(both).endswith("(1 of its 3 transactions landed)")


def test_a_wide_read_of_heads_sends_its_batch_gets_at_once(wide, monkeypatch):
    """250 heads are three BatchGetItem calls in flight together: each waits at a barrier
    for the other two before it is sent, which one at a time would never pass."""
    monkeypatch.setattr(durable_module, "READ_THREADS", 1)
    one_at_a_time = wide.heads(list(range(WIDE)))
    monkeypatch.undo()
    barrier = threading.Barrier(3, timeout=20)
    client = aws.client("dynamodb")
    event = "before-call.dynamodb.BatchGetItem"

    def hook(**_):
        barrier.wait()

    client.meta.events.register(event, hook)
    try:
        together = wide.heads(list(range(WIDE)))
    finally:
        client.meta.events.unregister(event, hook)
    assert together == one_at_a_time and sorted(together) == list(range(WIDE))
    assert all(h.version == 1 for h in together.values())


@pytest.fixture
def via_proxy(aws, monkeypatch):
    """DynamoDB through a fault proxy; the pauses before asking again are recorded, not
    slept."""
    pauses: list[int] = []
    monkeypatch.setattr(durable_module, "_unprocessed_pause_s", lambda n: pauses.append(n) or 0.0)
    with FaultProxy(aws.dynamodb_endpoint, seed=3) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_DYNAMODB", proxy.url)
        yield proxy, pauses


def test_heads_left_unprocessed_are_asked_for_again(wide, via_proxy):
    """Four answers of a throttled table leave 60 keys each unprocessed: each costs one
    more BatchGetItem for just those keys, after a pause, and every head is read."""
    proxy, pauses = via_proxy
    direct = DurableState(wide.loc)
    expected = {s: (h.version, h.log) for s, h in wide.heads(list(range(WIDE))).items()}
    proxy.reset_counts()
    proxy.add(Rule("dynamodb", "BatchGetItem", unprocessed=60, times=4))
    got = direct.heads(list(range(WIDE)))
    assert {s: (h.version, h.log) for s, h in got.items()} == expected
    assert proxy.counts()[("dynamodb", "BatchGetItem")] == 3 + 4
    assert proxy.injected() == {("dynamodb", "BatchGetItem"): 4}
    assert len(pauses) == 4 and set(pauses) <= {1, 2, 3, 4}


def test_heads_a_throttled_table_keeps_unprocessed_are_named(wide, via_proxy):
    proxy, pauses = via_proxy
    proxy.add(Rule("dynamodb", "BatchGetItem", unprocessed=2))
    with pytest.raises(ThrottledError, match=r"slices \[4, 5\] unprocessed after 10 BatchGetItem"):
        DurableState(wide.loc).heads([3, 4, 5])
    assert proxy.counts()[("dynamodb", "BatchGetItem")] == durable_module.UNPROCESSED_ROUNDS
    assert pauses == list(range(1, durable_module.UNPROCESSED_ROUNDS))


def test_the_pause_before_asking_again_grows_and_is_bounded():
    """Full jitter up to a bound that doubles each round up to 2 s: every pause is within
    its round's bound, and 200 draws reach past half of it (all below: p = 2**-200)."""
    for attempt in range(1, 20):
        bound = min(2.0, durable_module.UNPROCESSED_PAUSE_S * 2 ** (attempt - 1))
        pauses = [durable_module._unprocessed_pause_s(attempt) for _ in range(200)]
        assert all(0 <= p <= bound for p in pauses)
        assert max(pauses) > bound / 2, (attempt, bound, max(pauses))
    assert durable_module.UNPROCESSED_PAUSE_S * 2**9 > 2.0  # the last rounds wait up to 2 s


def test_a_commit_past_its_deadline_refuses_to_reference_its_uploads(location, monkeypatch):
    """A task that stalls between its uploads and its commit must not reference objects
    that gc beside the running job may have deleted meanwhile."""
    from shardless.changelog import gc
    from shardless.changelog.errors import CommitTooLateError

    assert 2 * durable_module.COMMIT_DEADLINE_S <= gc.RUNNING_GRACE_S
    durable = DurableState(location)
    stalled_since = time.monotonic() - durable_module.COMMIT_DEADLINE_S - 1
    with pytest.raises(CommitTooLateError, match="more than 1200 s old"):
        durable.commit(
            "q", 0, 0, [SliceCommit(2, 1, None, [kv(2, "a")])], uploads_since=stalled_since
        )
    assert durable.heads([2]) == {}
    durable.commit("q", 0, 0, [SliceCommit(2, 1, None, [kv(2, "a")])])
    assert durable.heads([2])[2].version == 1


def test_an_application_location_has_one_rule_for_its_defaults():
    """Jobs, tools and the state data source all name a location through AppLocation.of."""
    base = AppLocation.default("clicks")
    assert AppLocation.of("clicks") == base
    assert AppLocation.of("clicks", "", None, "") == base  # empty flags: the defaults
    assert AppLocation.of("clicks", prefix="").root == ""  # an empty prefix is none
    mine = AppLocation.of("clicks", "b", "p", "t")
    assert (mine.bucket, mine.prefix, mine.table) == ("b", "p", "t")
