"""Durable commits and restore against moto server over HTTP."""

from __future__ import annotations

import threading

import boto3
import pytest

from changelog import resources
from changelog.durable import DurableState, SliceCommit
from changelog.errors import CommitConflictError, ConfigurationError, CorruptObjectError
from changelog.restore import catch_up
from state.store import SliceStore


def kv(i: int) -> tuple[bytes, bytes]:
    return (b"d" + f"k{i:04d}".encode(), f"v{i}".encode())


def commit(durable: DurableState, slice_id: int, version: int, changes, batch: int, base=False):
    head = durable.heads([slice_id]).get(slice_id)
    durable.commit("q", batch, 0, [SliceCommit(slice_id, version, head, changes, base)])


def test_commit_then_restore_into_an_empty_store(location, tmp_path):
    durable = DurableState(location)
    commit(durable, 3, 1, [kv(1), kv(2)], batch=0)
    commit(durable, 3, 2, [(kv(1)[0], None), kv(3)], batch=1)
    head = durable.heads([3])[3]
    assert (head.version, head.batch, len(head.log)) == (2, 1, 2)
    store = SliceStore(tmp_path / "s3", {"slice": 3})
    stats = catch_up(store, durable, head, head.version)
    assert dict(store.items()) == dict([kv(2), kv(3)])
    assert (store.version, stats.segments, stats.records) == (2, 2, 4)


def test_stale_store_replays_only_missing_versions(location, tmp_path):
    durable = DurableState(location)
    store = SliceStore(tmp_path / "s", {"slice": 1})
    commit(durable, 1, 1, [kv(1)], batch=0)
    catch_up(store, durable, durable.heads([1])[1], 1)
    for v in (2, 3):
        commit(durable, 1, v, [kv(v)], batch=v)
    stats = catch_up(store, durable, durable.heads([1])[1], 3)
    assert (stats.from_version, stats.segments) == (1, 2)
    assert dict(store.items()) == dict([kv(1), kv(2), kv(3)])


def test_base_bounds_the_log_and_restores_the_same_state(location, tmp_path):
    durable = DurableState(location)
    commit(durable, 2, 1, [kv(1)], batch=0)
    commit(durable, 2, 2, [kv(1), kv(2)], batch=1, base=True)
    commit(durable, 2, 3, [kv(3)], batch=2)
    commit(durable, 2, 4, [kv(4)], batch=3)
    head = durable.heads([2])[2]
    assert [e.version for e in head.log] == [2, 3, 4]
    store = SliceStore(tmp_path / "s", {"slice": 2})
    catch_up(store, durable, head, 4)
    assert dict(store.items()) == dict([kv(1), kv(2), kv(3), kv(4)])


def test_one_of_two_racing_writers_commits(location):
    """Two attempts start from the same head; exactly one wins and its data is what is read."""
    durable = DurableState(location)
    commit(durable, 5, 1, [kv(0)], batch=0)
    head = durable.heads([5])[5]
    results: dict[str, str] = {}
    barrier = threading.Barrier(2)

    def attempt(name: str) -> None:
        barrier.wait()
        try:
            durable.commit(name, 1, 0, [SliceCommit(5, 2, head, [(b"dwinner", name.encode())])])
            results[name] = "won"
        except CommitConflictError:
            results[name] = "lost"

    threads = [threading.Thread(target=attempt, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results.values()) == ["lost", "won"]
    winner = next(n for n, r in results.items() if r == "won")
    final = durable.heads([5])[5]
    assert (final.version, final.query) == (2, winner)
    assert durable.read_changes(5, final.log[-1]) == [(b"dwinner", winner.encode())]


def test_commit_from_a_stale_head_is_refused(location):
    durable = DurableState(location)
    commit(durable, 7, 1, [kv(1)], batch=0)
    stale = durable.heads([7])[7]
    commit(durable, 7, 2, [kv(2)], batch=1)
    with pytest.raises(CommitConflictError, match=r"slices \[7\] lost"):
        durable.commit("q", 2, 0, [SliceCommit(7, 2, stale, [kv(9)])])
    assert durable.heads([7])[7].version == 2


def test_corrupt_segment_is_refused_with_its_key(location, tmp_path):
    durable = DurableState(location)
    commit(durable, 4, 1, [kv(1)], batch=0)
    head = durable.heads([4])[4]
    key = head.log[0].key(location)
    s3 = boto3.client("s3")
    body = bytearray(s3.get_object(Bucket=location.bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    s3.put_object(Bucket=location.bucket, Key=key, Body=bytes(body))
    store = SliceStore(tmp_path / "s", {"slice": 4})
    with pytest.raises(CorruptObjectError, match=key):
        catch_up(store, durable, head, 1)
    assert store.version == 0 and list(store.items()) == []


def test_idle_commit_costs_nothing(location):
    assert DurableState(location).commit("q", 0, 0, []) == 0
    listed = boto3.client("s3").list_objects_v2(Bucket=location.bucket)
    assert listed.get("KeyCount", 0) == 0


def test_existing_state_with_another_slice_count_is_refused(location):
    with pytest.raises(ConfigurationError, match="keeps its state in 16 slices.*--slices 16"):
        resources.ensure(location, 32)


def test_unreachable_endpoint_fails_fast_with_what_to_fix(location, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    with pytest.raises(ConfigurationError, match="cannot reach .*AWS_ENDPOINT_URL_S3"):
        resources.ensure(location, 16)
