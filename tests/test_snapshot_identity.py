"""Snapshots of one slice taken by different stores (another worker, a store caught up
from the log, one restored on another host): an SST file of the previous snapshot is
reused only when it is the same file, a restore falls back past an unusable snapshot,
`state verify` finds one, and a manifest cannot name files outside the store."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from changelog.durable import DurableState
from changelog.restore import identity
from changelog.snapshot import (
    download_snapshot,
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
