"""A large restore's transfers and the snapshots' uploads in the helper process
(`shardless.changelog.transfer_process`), against moto server over HTTP: the same stores as
in-process, the same refusals with the same names, and nothing lost when the helper dies
with transfers in flight."""

from __future__ import annotations

import io
import os
import signal

import boto3
import pytest

from shardless.changelog import restore as restore_module
from shardless.changelog.download import IN_PROCESS, download_snapshot
from shardless.changelog.durable import DurableState, section_range
from shardless.changelog.errors import CorruptObjectError, MissingObjectError
from shardless.changelog.manifest import manifests, read_manifest
from shardless.changelog.pack import Due
from shardless.changelog.restore import identity, restore_many
from shardless.changelog.restore_jobs import RestoreJob
from shardless.changelog.sst import object_size
from shardless.changelog.transfer_process import (
    TRANSFER_PROCESS_BYTES,
    TransferError,
    TransferProcess,
    _read_frame,
    _write_frame,
)
from shardless.state.store import SliceStore
from tests.changelog.test_durable import SLICES
from tests.changelog.test_restore_many import build, corrupt


def jobs_for(location, tmp_path, heads, target: int) -> list[RestoreJob]:
    """A restore into an empty directory of each slice of `heads`."""
    return [
        RestoreJob(tmp_path / f"r-{s}", identity(location.app, s, SLICES), h, target)
        for s, h in sorted(heads.items())
    ]


def test_a_large_restore_transfers_in_the_helper_and_builds_the_same_stores(
    location, tmp_path, helper
):
    durable = DurableState(location, transfer_process_bytes=0)
    writers = {s: build(location, tmp_path, s, 3, snapshot_at=2) for s in (1, 2, 3)}
    heads = durable.heads(list(writers))
    manifests._items.clear()
    outcomes = restore_many(jobs_for(location, tmp_path, heads, 3), durable)
    for o in outcomes:
        assert o.error is None and o.store is not None and o.stats is not None
        assert (o.stats.snapshot_version, o.stats.segments) == (2, 1)
        assert dict(o.store.items()) == dict(writers[o.job.slice].items())
        assert o.store.version == 3 and o.store.tag == heads[o.job.slice].log[-1].uid
        o.store.close()
    # per slice: its manifest, its SST object(s) and its changelog section, none here
    assert helper.starts == 1 and helper.ran_here == 0
    assert helper.sent == sum(2 + h.snaps[-1].files for h in heads.values())
    assert all(o.stats.transfer_process for o in outcomes)
    assert helper.helper_pid not in (None, os.getpid())


def test_a_small_restore_does_not_start_the_helper(location, tmp_path, monkeypatch):
    tp = TransferProcess()
    monkeypatch.setattr(restore_module, "transfer_process", lambda: tp)
    durable = DurableState(location)
    writer = build(location, tmp_path, 5, 3, snapshot_at=2)
    heads = durable.heads([5])
    manifests._items.clear()
    (o,) = restore_many(jobs_for(location, tmp_path, heads, 3), durable)
    assert o.error is None and dict(o.store.items()) == dict(writer.items())
    o.store.close()
    assert (tp.starts, tp.sent) == (0, 0) and not o.stats.transfer_process
    limit = durable.transfer_process_bytes
    assert limit == TRANSFER_PROCESS_BYTES
    assert restore_module.transfers_for(durable, limit - 1) is IN_PROCESS
    never = DurableState(location, transfer_process_bytes=None)
    assert restore_module.transfers_for(never, 1 << 40) is IN_PROCESS and tp.starts == 0


def test_the_helper_refuses_a_corrupt_sst_object_naming_it(location, tmp_path, helper):
    durable = DurableState(location, transfer_process_bytes=0)
    for s in (1, 2):
        build(location, tmp_path, s, 3, snapshot_at=2)
    heads = durable.heads([1, 2])
    snap = heads[2].snaps[-1]
    bad = read_manifest(location, snap, slice_id=2).files[0].key
    corrupt(location, bad)
    manifests._items.clear()
    by_slice = {
        o.job.slice: o for o in restore_many(jobs_for(location, tmp_path, heads, 3), durable)
    }
    assert by_slice[1].error is None
    by_slice[1].store.close()
    err = by_slice[2].error
    assert isinstance(err, CorruptObjectError), err
    assert f"s3://{location.bucket}/{bad}" in str(err) and "checksum" in str(err)
    assert by_slice[2].store is None and not (tmp_path / "r-2").exists()
    assert helper.ran_here == 0


def test_objects_missing_from_the_bucket_are_named_as_in_process(location, tmp_path, helper):
    durable = DurableState(location, transfer_process_bytes=0)
    for s in (1, 2):
        build(location, tmp_path, s, 3, snapshot_at=2)
    heads = durable.heads([1, 2])
    s3 = boto3.client("s3")
    gone_manifest = heads[1].snaps[-1].key
    s3.delete_object(Bucket=location.bucket, Key=gone_manifest)
    section = heads[2].log[-1]
    s3.delete_object(Bucket=location.bucket, Key=section.key(location))
    manifests._items.clear()
    by_slice = {
        o.job.slice: o for o in restore_many(jobs_for(location, tmp_path, heads, 3), durable)
    }
    for s, name in ((1, gone_manifest), (2, f"{section.key(location)} (slice 2 v3)")):
        err = by_slice[s].error
        assert isinstance(err, MissingObjectError), err
        assert f"s3://{location.bucket}/{name} is referenced by committed state" in str(err)
    assert helper.sent > 0 and helper.ran_here == 0


def test_transfers_left_by_a_helper_that_dies_run_in_this_process(location, tmp_path):
    durable = DurableState(location)
    build(location, tmp_path, 7, 3, snapshot_at=2)
    head = durable.heads([7])[7]
    entry = head.log[-1]
    key, byte_range = entry.key(location), section_range(entry)
    want = IN_PROCESS.fetch(location.bucket, key, byte_range).result()
    tp = TransferProcess()
    try:
        assert tp.wait_ready(60)
        pid = tp.helper_pid
        os.kill(pid, signal.SIGSTOP)  # it takes the requests and answers none
        futures = [tp.fetch(location.bucket, key, byte_range) for _ in range(5)]
        assert not any(f.done() for f in futures) and tp.sent == 5
        os.kill(pid, signal.SIGKILL)
        assert [f.result(timeout=60) for f in futures] == [want] * 5
        assert tp.ran_here == 5
        assert tp.fetch(location.bucket, key, byte_range).result(timeout=60) == want
        assert tp.starts == 2 and tp.helper_pid not in (None, pid)
    finally:
        tp.stop()


def test_transfers_asked_for_before_the_helper_is_ready_run_here(location, tmp_path):
    key = f"{location.prefix}/scratch/early"
    boto3.client("s3").put_object(Bucket=location.bucket, Key=key, Body=b"early")
    tp = TransferProcess()
    try:
        assert tp.start()
        pid = tp.helper_pid
        os.kill(pid, signal.SIGSTOP)  # still importing: it cannot have said it is ready
        assert tp.fetch(location.bucket, key).result(timeout=60) == b"early"
        assert (tp.sent, tp.ran_here) == (0, 1)
        os.kill(pid, signal.SIGCONT)
        assert tp.wait_ready(60)
        assert tp.fetch(location.bucket, key).result(timeout=60) == b"early"
        assert (tp.sent, tp.ran_here, tp.starts) == (1, 1, 1)
    finally:
        tp.stop()


def test_a_helper_that_dies_before_it_is_ready_is_not_started_again(location):
    key = f"{location.prefix}/scratch/broken"
    boto3.client("s3").put_object(Bucket=location.bucket, Key=key, Body=b"here")
    tp = TransferProcess()
    assert tp.start()
    os.kill(tp.helper_pid, signal.SIGKILL)
    assert not tp.wait_ready(60) and tp.broken
    assert tp.fetch(location.bucket, key).result(timeout=60) == b"here"
    assert (tp.starts, tp.sent, tp.ran_here) == (1, 0, 1) and tp.helper_pid is None
    assert not tp.start()


def test_a_frame_cut_short_ends_the_stream():
    out = io.BytesIO()
    _write_frame(out, b"hello")
    _write_frame(out, b"world")
    whole = out.getvalue()
    src = io.BytesIO(whole[:-2])
    assert _read_frame(src) == b"hello"
    assert _read_frame(src) is None
    assert _read_frame(io.BytesIO(b"")) is None


def _writer(location, tmp_path, slice_id: int, versions: range) -> SliceStore:
    store = SliceStore(tmp_path / f"w-{slice_id}", identity(location.app, slice_id, SLICES))
    for v in versions:
        store.commit([(b"\x01k%05d" % i, b"v%d" % v) for i in range(v * 300, v * 300 + 300)], v)
    return store


def _restored(location, tmp_path, ref, slice_id: int, name: str) -> dict:
    manifests._items.clear()
    m = read_manifest(location, ref, slice_id=slice_id)
    download_snapshot(location, m, tmp_path / name)
    store = SliceStore(tmp_path / name, identity(location.app, slice_id, SLICES))
    try:
        return dict(store.items())
    finally:
        store.close()


def test_a_pack_uploads_in_the_helper_sharing_the_files_of_the_snapshots_before(
    location, tmp_path, helper
):
    writers = {s: _writer(location, tmp_path, s, range(1, 3)) for s in (4, 5)}
    due = [Due(s, 2, w.checkpoint(tmp_path / f"ck-{s}-2")) for s, w in writers.items()]
    first = helper.pack(location, due).result(timeout=60)
    assert sorted(first) == [4, 5] and (helper.sent, helper.ran_here) == (1, 0)
    ref = first[4][0]
    assert ref.version == 2 and ref.at > 0 and ref.key == first[5][0].key  # one object
    assert first[4][1] > ref.bytes * 0.9  # everything is new
    for s, w in writers.items():
        assert _restored(location, tmp_path, first[s][0], s, f"r-{s}-2") == dict(w.items())
    w4 = writers[4]
    for v in range(3, 5):
        w4.commit([(b"\x01n%05d" % v, b"new")], v)
    second = w4.checkpoint(tmp_path / "ck-4-4")
    got = helper.pack(location, [Due(4, 4, second, ref)]).result(timeout=60)
    ref2, sent2 = got[4]
    assert (ref2.version, helper.sent, helper.ran_here) == (4, 2, 0)
    m1 = read_manifest(location, ref, slice_id=4)
    m2 = read_manifest(location, ref2, slice_id=4)
    shared = {f.where for f in m1.files} & {f.where for f in m2.files}
    new = sum(object_size(f.size) for f in m2.files if f.where not in shared)
    assert shared and sent2 == new + ref2.length  # shared files not sent again
    assert _restored(location, tmp_path, ref2, 4, "r-4-4") == dict(w4.items())
    assert second.is_dir()  # removing a checkpoint is the caller's
    for w in writers.values():
        w.close()


def test_a_snapshot_left_by_a_helper_that_dies_is_taken_here(location, tmp_path):
    writer = _writer(location, tmp_path, 6, range(1, 4))
    point = writer.checkpoint(tmp_path / "ck-3")
    tp = TransferProcess()
    try:
        assert tp.wait_ready(60)
        pid = tp.helper_pid
        os.kill(pid, signal.SIGSTOP)  # it takes the request and never answers
        future = tp.pack(location, [Due(6, 3, point)])
        assert not future.done() and tp.sent == 1
        os.kill(pid, signal.SIGKILL)
        ref, _ = future.result(timeout=60)[6]
        assert tp.ran_here == 1 and ref.version == 3
        assert _restored(location, tmp_path, ref, 6, "r-3") == dict(writer.items())
    finally:
        tp.stop()
        writer.close()


def test_a_pack_the_helper_cannot_take_names_its_slices(location, tmp_path, helper):
    future = helper.pack(location, [Due(9, 5, tmp_path / "no-such-checkpoint")])
    with pytest.raises(
        TransferError, match=r"snapshot pack of slices \[9\] to s3://.*FileNotFound"
    ):
        future.result(timeout=60)
    assert helper.ran_here == 0
