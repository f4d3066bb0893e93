"""Snapshots of one slice taken by different stores (another worker, a store caught up
from the log, one restored on another host): an SST file of the previous snapshot is
reused only when it is the same file, a restore falls back past an unusable snapshot,
`state verify` finds one, and a manifest cannot name files outside the store."""

from __future__ import annotations

import random
import re
from dataclasses import replace
from pathlib import Path

import boto3
import pytest

from changelog.durable import DurableState
from changelog.errors import CorruptObjectError
from changelog.restore import identity
from changelog.snapshot import (
    download_snapshot,
    encode_manifest,
    manifests,
    read_manifest,
    upload_checkpoint,
    write_snapshot,
)
from state.store import SliceStore
from tests.test_durable import SLICES, commit, kv

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
    ref_b, _ = upload_checkpoint(location, SLICE, 2, point, ref_a)  # as the runtime does
    manifests._items.clear()
    m_b = read_manifest(location, ref_b.key, slice_id=SLICE, version=2)
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
    from changelog import snapshot as snapshot_module

    a = open_store(location, tmp_path / "a")
    a.commit(values("v1"), 1)
    _, first, _ = write_snapshot(location, SLICE, 1, a.checkpoint(tmp_path / "ck1"), None)
    a.commit([kv(1000)], 2)
    reads: list[str] = []
    real = snapshot_module._file_crc
    monkeypatch.setattr(snapshot_module, "_file_crc", lambda p: reads.append(p.name) or real(p))
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
        read_manifest(location, key, slice_id=SLICE, version=1)
    assert key in str(caught.value)
    with pytest.raises(CorruptObjectError, match="not a RocksDB file name"):
        download_snapshot(location, forged, tmp_path / "restore" / "r")
    assert not (tmp_path / "escaped.sst").exists() and not (tmp_path / "restore").exists()
