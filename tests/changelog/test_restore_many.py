"""Several slices restored as one pipeline (`restore_many`, `StoreCache.acquire_many`)
against moto server over HTTP: every way a slice comes to its committed version at once,
and one failing slice among several."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import boto3
import pytest

from shardless.changelog.download import identity_file
from shardless.changelog.durable import DurableState
from shardless.changelog.errors import CorruptObjectError
from shardless.changelog.manifest import manifests
from shardless.changelog.restore import identity, restore_many
from shardless.changelog.restore_jobs import RestoreJob
from shardless.processor.runtime.stores import StoreCache
from shardless.state.store import SliceStore
from tests.changelog.test_durable import SLICES, commit, kv, snapshot_of


def corrupt(location, key: str) -> None:
    s3 = boto3.client("s3")
    body = bytearray(s3.get_object(Bucket=location.bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    s3.put_object(Bucket=location.bucket, Key=key, Body=bytes(body))


def build(location, tmp_path: Path, slice_id: int, versions: int, snapshot_at: int | None = None):
    """Commit `versions` versions of a slice (version v writes key v, plus a file's worth
    of values at `snapshot_at`, snapshotted there); return the writer's store."""
    durable = DurableState(location)
    writer = SliceStore(tmp_path / f"writer-{slice_id}", identity(location.app, slice_id, SLICES))
    ref = None
    for v in range(1, versions + 1):
        changes = [kv(v)]
        if v == snapshot_at:
            changes += [kv(1000 + i, "x" * 200) for i in range(500)]
        done = commit(durable, slice_id, v, changes, batch=v, snapshot=ref)
        writer.commit(changes, v, undo=[(kv(v)[0], None)], tag=done.uid)
        ref = None
        if v == snapshot_at:
            ref, _, _ = snapshot_of(durable, writer, slice_id, tmp_path / f"ck-{slice_id}")
    return writer


def test_restore_many_restores_the_others_when_one_slice_fails(location, tmp_path):
    durable = DurableState(location)
    writers = {s: build(location, tmp_path, s, 3, snapshot_at=2) for s in (1, 2, 3, 4)}
    heads = durable.heads(list(writers))
    bad = next(e for e in heads[3].log if e.version == 3)
    corrupt(location, bad.key(location))
    manifests._items.clear()
    jobs = [
        RestoreJob(tmp_path / f"r-{s}", identity(location.app, s, SLICES), heads[s], 3)
        for s in writers
    ]
    outcomes = restore_many(jobs, durable)
    assert [o.job.slice for o in outcomes] == [1, 2, 3, 4]
    for o in outcomes:
        if o.job.slice == 3:
            assert isinstance(o.error, CorruptObjectError) and bad.key(location) in str(o.error)
            assert o.store is None and not (tmp_path / "r-3").exists()
            continue
        assert o.error is None and o.stats is not None and o.store is not None
        assert (o.stats.snapshot_version, o.stats.segments) == (2, 1)
        assert dict(o.store.items()) == dict(writers[o.job.slice].items())
        assert o.store.version == 3 and o.store.tag == heads[o.job.slice].log[-1].uid
        o.store.close()


def test_acquire_many_brings_every_kind_of_slice_to_its_version(location, tmp_path):
    durable = DurableState(location)
    writers = {s: build(location, tmp_path, s, 4, snapshot_at=2) for s in range(1, 7)}
    cache = StoreCache(tmp_path / "local", location.app, SLICES)
    heads = durable.heads(list(writers))
    first = cache.acquire_many([(s, heads[s], 3) for s in (1, 2, 3, 4)], durable)
    assert all(st is not None and st.snapshot_version == 2 for _, _, st in first.values())
    first[4][0].commit([kv(4)], 4, undo=[(kv(4)[0], None)], tag="a re-run's, not committed")
    first[3][0].commit([kv(4)], 4, tag="another worker's")  # not the committed v4
    # a dead worker left slice 5 at v4 (its head's)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True, check=True)  # fmt: skip
    gone = tmp_path / "local" / location.app / f"w{int(dead.stdout)}" / "slice-00005"
    writers[5].close()
    gone.parent.mkdir(parents=True)
    os.replace(writers[5].path, gone)
    manifests._items.clear()
    wanted = [(1, heads[1], 3), (2, heads[2], 4), (3, heads[3], 4), (4, heads[4], 3)]
    wanted += [(5, heads[5], 4), (6, heads[6], 4)]
    got = cache.acquire_many(wanted, durable)
    stats = {s: st for s, (_, _, st) in got.items()}
    assert stats[1] is None and stats[5] is None  # open at its version; adopted
    assert (stats[2].from_version, stats[2].segments, stats[2].snapshot_version) == (3, 1, None)
    assert stats[3].from_version == 0 and stats[3].snapshot_version == 2  # rebuilt
    assert stats[4] is None  # rolled back in place
    assert (stats[6].snapshot_version, stats[6].segments) == (2, 2)
    full = dict(writers[6].items())
    for s, v in [(1, 3), (2, 4), (3, 4), (4, 3), (5, 4), (6, 4)]:
        store, head, _ = got[s]
        assert head is heads[s] and store.version == v
        assert store.tag == next(e.uid for e in heads[s].log if e.version == v)
        assert dict(store.items()) == {k: x for k, x in full.items() if v == 4 or k != kv(4)[0]}
    assert not gone.exists() and cache._open[5].path == cache._path(5)


def test_acquire_many_raises_the_first_failure_after_restoring_the_rest(location, tmp_path):
    durable = DurableState(location)
    for s in (1, 2, 3):
        build(location, tmp_path, s, 3, snapshot_at=2)
    heads = durable.heads([1, 2, 3])
    sst = manifests.get(heads[2].snaps[-1].key).files[0].key
    corrupt(location, sst)
    manifests._items.clear()
    cache = StoreCache(tmp_path / "local", location.app, SLICES)
    with pytest.raises(CorruptObjectError, match=sst):
        cache.acquire_many([(s, heads[s], 3) for s in (1, 2, 3)], durable)
    assert sorted(cache._open) == [1, 3]
    assert not cache._path(2).exists()
    assert all(cache._open[s].version == 3 for s in (1, 3))
    # the next run restores only what is missing
    got = cache.acquire_many([(s, heads[s], 3) for s in (1, 3)], durable)
    assert all(st is None for _, _, st in got.values())


def test_a_restored_snapshot_carries_the_identity_rocksdb_would_write(location, tmp_path):
    durable = DurableState(location)
    writer = build(location, tmp_path, 7, 3, snapshot_at=2)
    head = durable.heads([7])[7]
    db_id = (writer.path / "IDENTITY").read_bytes().strip()
    assert identity_file(manifests.get(head.snaps[-1].key)) == db_id  # read from its MANIFEST
    manifests._items.clear()
    (done,) = restore_many(
        [RestoreJob(tmp_path / "r", identity(location.app, 7, SLICES), head, 3)], durable
    )
    assert done.error is None and done.store is not None
    assert (tmp_path / "r" / "IDENTITY").read_bytes().strip() == db_id
    assert dict(done.store.items()) == dict(writer.items())
    done.store.close()


def test_a_restore_leaves_out_the_files_rocksdb_rewrites_on_open(location, tmp_path):
    """The snapshot's OPTIONS and rocksdict config files are in its manifest but not written
    on restore: the open writes its own from the options it is given (two file creations
    fewer per slice), and the store opens with the same contents."""
    durable = DurableState(location)
    writer = build(location, tmp_path, 8, 3, snapshot_at=2)
    head = durable.heads([8])[8]
    m = manifests.get(head.snaps[-1].key)
    old_options = {n for n in m.inline if n.startswith("OPTIONS-")}
    assert old_options and "rocksdict-config.json" in m.inline
    manifests._items.clear()
    (done,) = restore_many(
        [RestoreJob(tmp_path / "r", identity(location.app, 8, SLICES), head, 3)], durable
    )
    assert done.error is None and done.store is not None
    names = {p.name for p in (tmp_path / "r").iterdir()}
    assert not names & old_options, "the snapshot's OPTIONS file was restored"
    assert len([n for n in names if n.startswith("OPTIONS-")]) == 1  # the open's own
    assert dict(done.store.items()) == dict(writer.items())
    assert done.store.version == 3
    done.store.close()
    reopened = SliceStore(tmp_path / "r", identity(location.app, 8, SLICES))
    assert reopened.version == 3 and dict(reopened.items()) == dict(writer.items())
    reopened.close()


def test_a_catch_up_from_the_hosts_segments_runs_in_the_calling_thread(
    location, tmp_path, monkeypatch
):
    """Another worker process of the host moved the slices on: each open store only needs
    segments the host keeps, so restore_many applies them itself, with no transfer or
    finishing thread; a slice whose segment is not on the host still goes through the
    pipeline, and a damaged cached segment is read from S3 instead."""
    from shardless.changelog import objects as objects_module
    from shardless.changelog import restore as restore_module
    from shardless.changelog.durable import SliceCommit

    cached = DurableState(location, segment_cache=tmp_path / "segments")
    stale = {
        s: SliceStore(tmp_path / f"w-{s}", identity(location.app, s, SLICES)) for s in (1, 2, 3)
    }
    writers = {s: SliceStore(tmp_path / f"x-{s}", identity(location.app, s, SLICES)) for s in stale}
    for v in (1, 2, 3):
        heads = cached.heads(list(stale))
        commits = [SliceCommit(s, v, heads.get(s), [kv(10 * s + v)]) for s in stale]
        done = cached.commit("q", v, 0, commits)
        for s in stale:
            writers[s].commit([kv(10 * s + v)], v, tag=done.uid)
            if v == 1:
                stale[s].commit([kv(10 * s + v)], v, tag=done.uid)
    heads = cached.heads(list(stale))
    damaged = tmp_path / "segments" / f"{heads[1].log[1].uid}.seg"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"?")

    threads: list[str] = []
    original = restore_module._finish

    def spy(w, *args):
        threads.append(threading.current_thread().name)
        return original(w, *args)

    monkeypatch.setattr(restore_module, "_finish", spy)

    def no_transfers(*args, **kwargs):
        raise AssertionError(f"a transfer was queued: {args}")

    monkeypatch.setattr(objects_module.file_pool(), "submit", no_transfers)
    jobs = [
        RestoreJob(stale[s].path, identity(location.app, s, SLICES), heads[s], 3, stale[s])
        for s in (1, 2)
    ]
    outcomes = restore_many(jobs, cached)
    assert threads == [threading.current_thread().name] * 2
    for o in outcomes:
        assert o.error is None and o.store is stale[o.job.slice]
        assert (o.stats.from_version, o.stats.segments, o.stats.snapshot_version) == (1, 2, None)
        assert o.stats.seconds > 0
        assert o.store.version == 3 and dict(o.store.items()) == dict(writers[o.job.slice].items())

    monkeypatch.undo()
    monkeypatch.setattr(restore_module, "_finish", spy)
    threads.clear()
    (tmp_path / "segments" / f"{heads[3].log[-1].uid}.seg").unlink()
    assert not cached.cached(heads[3].log[-1])
    job = RestoreJob(stale[3].path, identity(location.app, 3, SLICES), heads[3], 3, stale[3])
    (o,) = restore_many([job], cached)
    assert threads and threads[0].startswith("shardless-open")  # through the pipeline
    assert o.error is None and o.store.version == 3
    assert dict(o.store.items()) == dict(writers[3].items())


def test_materialize_heads_restores_every_head_or_closes_all_and_names_the_failure(
    location, tmp_path
):
    """Every slice at its head's version in one pipeline, in slice order; when one fails,
    the stores already restored are closed (each path opens again) and the error names it."""
    from shardless.changelog.errors import ContinuityError
    from shardless.changelog.restore import materialize_heads

    durable = DurableState(location)
    writers = {s: build(location, tmp_path, s, 3, snapshot_at=2) for s in (4, 1, 2, 3)}
    heads = durable.heads(list(writers))
    done = materialize_heads(durable, heads, tmp_path / "ok", SLICES)
    assert [s for s, _ in done] == [1, 2, 3, 4]
    for s, store in done:
        assert store.version == 3 and dict(store.items()) == dict(writers[s].items())
        store.close()

    corrupt(location, next(e for e in heads[3].log if e.version == 3).key(location))
    manifests._items.clear()
    with pytest.raises(ContinuityError, match=r"slice 3: restore failed: .*1 of 4 slices"):
        materialize_heads(durable, heads, tmp_path / "bad", SLICES)
    for s in (1, 2, 4):  # closed: a store still open here would hold RocksDB's lock
        SliceStore(tmp_path / "bad" / f"slice-{s}", identity(location.app, s, SLICES)).close()
