"""Snapshots of one slice taken by different stores (another worker, a store caught up
from the log, one restored on another host): an SST file of the previous snapshot is
reused only when it is the same file, a restore falls back past an unusable snapshot,
`state verify` finds one, and a manifest cannot name files outside the store."""

from __future__ import annotations

import logging
import random
import re
from dataclasses import replace
from pathlib import Path

import boto3
import pytest

from shardless.changelog import snapshot as snapshot_module
from shardless.changelog import sst as sst_module
from shardless.changelog.download import download_snapshot
from shardless.changelog.durable import DurableState
from shardless.changelog.errors import CorruptObjectError, MissingObjectError
from shardless.changelog.layout import SnapRef
from shardless.changelog.manifest import SstFile, encode_manifest, manifests, read_manifest
from shardless.changelog.pack import Due, upload_pack
from shardless.changelog.restore import identity, materialize, restore
from shardless.changelog.snapshot import write_snapshot
from shardless.changelog.verify import verify
from shardless.state.store import SliceStore
from tests.changelog.test_durable import SLICES, commit, kv

SLICE = 5


def values(seed: str, n: int = 200) -> list[tuple[bytes, bytes]]:
    """`n` keys with incompressible values: SST files of equal size whatever the seed."""
    r = random.Random(seed)
    return [(kv(i)[0], r.randbytes(100)) for i in range(n)]


def open_store(location, path: Path) -> SliceStore:
    return SliceStore(path, identity(location.app, SLICE, SLICES))


@pytest.mark.parametrize("b_seed", ["v1", "other"], ids=["same-data", "other-data"])
def test_a_snapshot_of_another_store_does_not_reuse_a_file_of_the_same_name(
    location, tmp_path, b_seed
):
    """Store A snapshots v1; store B (another worker of the slice, its own files: caught
    up from the log, or one that went another way) snapshots v2 on top of A's snapshot.
    Both flushed v1 into 000009.sst of the same size, but they are different files (their
    unique ids differ even with the same data): B's snapshot must not reference A's."""
    durable = DurableState(location)
    a, b = open_store(location, tmp_path / "a"), open_store(location, tmp_path / "b")
    done = commit(durable, SLICE, 1, values("v1"), batch=1)
    a.commit(values("v1"), 1, tag=done.uid)
    b.commit(values(b_seed), 1, tag=done.uid)
    ref_a, m_a, _ = write_snapshot(location, SLICE, 1, a.checkpoint(tmp_path / "ck-a"), None)
    b.checkpoint(tmp_path / "ck-b1")  # B flushed v1 too (its own snapshot, say)
    b.commit([kv(1000)], 2, tag="v2")
    point = b.checkpoint(tmp_path / "ck-b2")
    a_files = {(f.name, f.size) for f in m_a.files}
    assert any((p.name, p.stat().st_size) in a_files for p in point.iterdir()), "no clash"
    ref_b, _ = upload_pack(location, [Due(SLICE, 2, point, ref_a)])[SLICE]  # as the runtime does
    manifests._items.clear()
    m_b = read_manifest(location, ref_b, slice_id=SLICE)
    download_snapshot(location, m_b, tmp_path / "r")
    restored = open_store(location, tmp_path / "r")
    assert dict(restored.items()) == dict(b.items())
    restored.close()


def test_the_same_store_shares_its_files_without_reading_them_again(
    location, tmp_path, monkeypatch
):
    """A store's next snapshot shares the files it still has, and so does the first
    snapshot of a store restored from it: their checksums are known to the process (it
    uploaded or downloaded them), so no file is read again to compare."""
    from shardless.changelog import sst as sst_module

    a = open_store(location, tmp_path / "a")
    a.commit(values("v1"), 1)
    _, first, _ = write_snapshot(location, SLICE, 1, a.checkpoint(tmp_path / "ck1"), None)
    a.commit([kv(1000)], 2)
    reads: list[str] = []
    real = sst_module._file_crc
    monkeypatch.setattr(sst_module, "_file_crc", lambda p: reads.append(p.name) or real(p))
    _, second, sent = write_snapshot(location, SLICE, 2, a.checkpoint(tmp_path / "ck2"), first)
    shared = set(first.files) & set(second.files)
    assert len(shared) == 1 and len(second.files) == 2 and reads == []
    assert sent < sum(f.size for f in second.files)
    download_snapshot(location, second, tmp_path / "r")
    restored = open_store(location, tmp_path / "r")
    restored.commit([kv(1001)], 3)
    point = restored.checkpoint(tmp_path / "ck3")
    _, third, _ = write_snapshot(location, SLICE, 3, point, second)
    assert set(second.files) <= set(third.files) and reads == []
    manifests._items.clear()
    download_snapshot(location, third, tmp_path / "r3")
    again = open_store(location, tmp_path / "r3")
    assert dict(again.items()) == dict(restored.items())
    again.close()
    restored.close()


@pytest.mark.parametrize(
    "where, name",
    [
        ("files", "../../escaped.sst"),
        ("files", "/tmp/x.sst"),
        ("files", "CURRENT"),
        ("inline", "../CURRENT"),
        ("inline", "MANIFEST-000005/../../x"),
        ("inline", ".bashrc"),
        ("inline", ""),
    ],
)
def test_a_manifest_naming_a_file_rocksdb_would_not_write_is_refused(
    location, tmp_path, where, name
):
    """A forged manifest (anyone who can write the bucket) cannot make a restore write
    outside its directory: every name must be one RocksDB gives a checkpoint's files."""
    a = open_store(location, tmp_path / "a")
    a.commit(values("v1"), 1)
    _, m, _ = write_snapshot(location, SLICE, 1, a.checkpoint(tmp_path / "ck"), None)
    if where == "files":
        forged = replace(m, files=(replace(m.files[0], name=name), *m.files[1:]))
    else:
        forged = replace(m, inline={**m.inline, name: b"x"})
    key = f"{location.prefix}/snapshots/slice-{SLICE:05d}/v{1:012d}-forged.manifest"
    boto3.client("s3").put_object(Bucket=location.bucket, Key=key, Body=encode_manifest(forged))
    with pytest.raises(CorruptObjectError, match=re.escape(repr(name))) as caught:
        read_manifest(location, SnapRef(1, key, 0, 0), slice_id=SLICE)
    assert key in str(caught.value)
    with pytest.raises(CorruptObjectError, match="not a RocksDB file name"):
        download_snapshot(location, forged, tmp_path / "restore" / "r")
    assert not (tmp_path / "escaped.sst").exists() and not (tmp_path / "restore").exists()


@pytest.mark.parametrize("key", ["other-app/sst/slice-00005/x-000009.sst", "SLICE+1"])
def test_a_manifest_naming_another_slices_or_applications_object_is_refused(
    location, tmp_path, key
):
    """Nor can it make a restore read objects of another slice or application."""
    a = open_store(location, tmp_path / "a")
    a.commit(values("v1"), 1)
    _, m, _ = write_snapshot(location, SLICE, 1, a.checkpoint(tmp_path / "ck"), None)
    if key == "SLICE+1":
        key = m.files[0].key.replace(f"slice-{SLICE:05d}", f"slice-{SLICE + 1:05d}")
    forged = replace(m, files=(replace(m.files[0], key=key), *m.files[1:]))
    where = f"{location.prefix}/snapshots/slice-{SLICE:05d}/v{1:012d}-forged.manifest"
    boto3.client("s3").put_object(Bucket=location.bucket, Key=where, Body=encode_manifest(forged))
    with pytest.raises(CorruptObjectError, match="outside the slice's own SST objects"):
        read_manifest(location, SnapRef(1, where, 0, 0), slice_id=SLICE)


def _share_on_name_and_size(loc, key, path, size, previous):
    """How snapshots shared files before issue 28: on name and size alone."""
    if previous is not None:
        return previous, 0
    return SstFile(path.name, key, size, sst_module.upload_sst(loc, key, path, size)), size


def history(location, tmp_path: Path, damage: str, monkeypatch) -> tuple[SliceStore, str]:
    """Six committed versions of the slice, snapshots at v2 and v4 retained with the log
    from v3, then the v4 snapshot made unusable: an SST object of its own corrupted or
    deleted, or ("mixed") taken by another store of the slice, which shared the v2
    snapshot's 000009.sst on name and size. Returns a store holding v6 (the fold of the
    changes) and the S3 key of the damaged object."""
    durable = DurableState(location)
    w = open_store(location, tmp_path / "w")
    other = open_store(location, tmp_path / "other")  # caught up from the log
    ref, snaps = None, {}
    for v in range(1, 7):
        changes = [kv(v), *values(f"big{v}", 100)[v * 10 : v * 10 + 60]]
        done = commit(durable, SLICE, v, changes, batch=v, snapshot=ref)
        w.commit(changes, v, tag=done.uid)
        other.commit(changes, v, tag=done.uid)
        ref = None
        if v == 2:
            ref, snaps[2], _ = write_snapshot(
                location, SLICE, 2, w.checkpoint(tmp_path / "c2"), None
            )
            other.checkpoint(tmp_path / "other-c2")
        if v == 4 and damage == "mixed":
            with monkeypatch.context() as m:
                m.setattr(snapshot_module, "_share_or_upload", _share_on_name_and_size)
                point = other.checkpoint(tmp_path / "other-c4")
                ref, snaps[4], _ = write_snapshot(location, SLICE, 4, point, snaps[2])
        elif v == 4:
            point = w.checkpoint(tmp_path / "c4")
            ref, snaps[4], _ = write_snapshot(location, SLICE, 4, point, snaps[2])
    other.close()
    head = durable.heads([SLICE])[SLICE]
    assert [s.version for s in head.snaps] == [2, 4] and head.log[0].version == 3
    s3 = boto3.client("s3")
    if damage == "mixed":
        key = next(f.key for f in snaps[4].files if f in snaps[2].files)
    else:
        key = next(f.key for f in snaps[4].files if f not in snaps[2].files)
    if damage == "corrupt":
        body = bytearray(s3.get_object(Bucket=location.bucket, Key=key)["Body"].read())
        body[-100] ^= 0xFF
        s3.put_object(Bucket=location.bucket, Key=key, Body=bytes(body))
    elif damage == "delete":
        s3.delete_object(Bucket=location.bucket, Key=key)
    manifests._items.clear()
    return w, key


DAMAGES = ["corrupt", "delete", "mixed"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_restore_falls_back_past_an_unusable_snapshot(
    location, tmp_path, monkeypatch, caplog, damage
):
    """The newest snapshot does not restore: the slice comes back exactly from the older
    snapshot and the longer log, and the fallback is logged."""
    durable = DurableState(location)
    w, _ = history(location, tmp_path, damage, monkeypatch)
    head = durable.heads([SLICE])[SLICE]
    with caplog.at_level(logging.WARNING, logger="shardless.changelog.restore"):
        store, stats = materialize(durable, head, tmp_path / "r", SLICES)
    assert dict(store.items()) == dict(w.items()) and store.version == 6
    assert store.tag == head.log[-1].uid
    assert (stats.snapshot_version, stats.segments, stats.skipped_snapshots) == (2, 4, [4])
    assert "slice 5: snapshot v4 is unusable, restoring from snapshot v2" in caplog.text
    store.close()
    # without a fallback the same restore fails on the snapshot
    with pytest.raises(CorruptObjectError if damage != "delete" else MissingObjectError):
        restore(tmp_path / "r2", identity(location.app, SLICE, SLICES), durable, head, 6,
                fallback=False)  # fmt: skip
    assert not (tmp_path / "r2").exists()
    w.close()


def test_a_restore_with_no_other_path_raises_the_snapshots_error(location, tmp_path, monkeypatch):
    durable = DurableState(location)
    w, key = history(location, tmp_path, "corrupt", monkeypatch)
    head = durable.heads([SLICE])[SLICE]
    only = replace(head, snaps=head.snaps[1:], log=tuple(e for e in head.log if e.version > 4))
    with pytest.raises(CorruptObjectError, match=key):
        materialize(durable, only, tmp_path / "r", SLICES)
    assert not (tmp_path / "r").exists()
    w.close()


@pytest.mark.parametrize("damage", DAMAGES)
def test_verify_finds_an_unusable_snapshot_without_rebuilding(
    location, tmp_path, monkeypatch, damage
):
    """`state verify` (no --rebuild) reads each SST object of the retained snapshots:
    one that is gone, fails its checksum, or was written by another store than the one
    its snapshot's MANIFEST describes is a problem naming the snapshot and the object."""
    w, key = history(location, tmp_path, damage, monkeypatch)
    w.close()
    report = verify(location, slice_ids=[SLICE])
    assert not report.ok and report.manifests == 2, report.problems
    assert all("snapshot v4" in p for p in report.problems), report.problems
    if damage == "mixed":
        (problem,) = report.problems
        assert "000009.sst written by another store" in problem
    else:
        assert any(key in p for p in report.problems), report.problems


def test_verify_passes_snapshots_of_one_store_and_a_restored_one(location, tmp_path):
    """No false alarm: snapshots sharing files of the same store, and the snapshots of a
    store restored from them (on "another host"), verify clean."""
    durable = DurableState(location)
    w = open_store(location, tmp_path / "w")
    ref, previous = None, None
    for v in range(1, 7):
        changes = [kv(v), *values(f"big{v}", 100)[v * 10 : v * 10 + 60]]
        done = commit(durable, SLICE, v, changes, batch=v, snapshot=ref)
        w.commit(changes, v, tag=done.uid)
        ref = None
        if v in (2, 4, 5):
            if v == 4:  # the slice moves: a store restored on another host takes over
                head = durable.heads([SLICE])[SLICE]
                w.close()
                w, _ = materialize(durable, head, tmp_path / f"host{v}", SLICES)
            point = w.checkpoint(tmp_path / f"c{v}")
            ref, previous, _ = write_snapshot(location, SLICE, v, point, previous)
    w.close()
    assert len(durable.heads([SLICE])[SLICE].snaps) == 3
    report = verify(location, slice_ids=[SLICE])
    assert report.ok and report.manifests == 3 and report.sst_objects >= 4, report.problems
    assert verify(location, slice_ids=[SLICE], rebuild=True).ok
