"""Snapshot packs against moto server: a group's snapshots of one batch are one object, a
later pack names the files an earlier one holds instead of packing them again, each slice
restores from its range of the pack, and a pack names the application that wrote it."""

from __future__ import annotations

import random
from pathlib import Path

import boto3
import pytest

from shardless.changelog import pack as pack_module
from shardless.changelog.download import download_snapshot
from shardless.changelog.errors import CorruptObjectError
from shardless.changelog.layout import SnapRef, pack_prefix
from shardless.changelog.manifest import manifests, read_manifest
from shardless.changelog.pack import Due, decode_pack_header, upload_pack
from shardless.changelog.restore import identity
from shardless.changelog.sst import object_size
from shardless.state.store import SliceStore
from tests.changelog.test_durable import SLICES, kv


def store(location, path: Path, slice_id: int) -> SliceStore:
    return SliceStore(path, identity(location.app, slice_id, SLICES))


def fill(s: SliceStore, version: int, seed: int, n: int = 300) -> None:
    r = random.Random(seed)
    s.commit([(kv(r.randrange(100_000))[0], r.randbytes(64)) for _ in range(n)], version)


def objects(location) -> dict[str, int]:
    s3 = boto3.client("s3")
    found = {}
    for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=location.bucket, Prefix=location.root
    ):
        found |= {o["Key"]: o["Size"] for o in page.get("Contents", [])}
    return found


def restored(location, tmp_path: Path, ref: SnapRef, slice_id: int, name: str) -> dict:
    manifests._items.clear()  # read from S3, as another host would
    m = read_manifest(location, ref, slice_id=slice_id)
    download_snapshot(location, m, tmp_path / name)
    s = store(location, tmp_path / name, slice_id)
    try:
        return dict(s.items())
    finally:
        s.close()


def test_a_groups_snapshots_are_one_object_and_each_slice_restores_from_it(location, tmp_path):
    stores = {s: store(location, tmp_path / f"s{s}", s) for s in (3, 4, 7)}
    for s, st in stores.items():
        fill(st, 1, seed=s)
    before = objects(location)
    got = upload_pack(
        location, [Due(s, 1, st.checkpoint(tmp_path / f"ck{s}")) for s, st in stores.items()]
    )
    new = {k: n for k, n in objects(location).items() if k not in before}
    assert list(new) == [got[3][0].key] and new[got[3][0].key] > 0  # one PUT, the pack
    assert new[got[3][0].key] == max(r.at + r.length for r, _ in got.values())
    assert {r.key for r, _ in got.values()} == {got[3][0].key}
    assert got[3][0].key.startswith(pack_prefix(location))
    header = decode_pack_header(
        boto3.client("s3").get_object(Bucket=location.bucket, Key=got[3][0].key)["Body"].read(),
        where="pack",
    )
    assert header["app"] == location.app
    for s, st in stores.items():
        ref, sent = got[s]
        m = read_manifest(location, ref, slice_id=s)
        assert ref.version == 1 and ref.files == len(m.files) and m.files
        assert all(f.key == ref.key and f.offset > 0 for f in m.files)
        assert sent == sum(object_size(f.size) for f in m.files) + ref.length
        assert restored(location, tmp_path, ref, s, f"r{s}") == dict(st.items())
        st.close()


def test_a_later_pack_names_the_files_an_earlier_pack_holds(location, tmp_path):
    st = store(location, tmp_path / "s", 5)
    fill(st, 1, seed=1)
    first, _ = upload_pack(location, [Due(5, 1, st.checkpoint(tmp_path / "ck1"))])[5]
    fill(st, 2, seed=2)
    second, sent = upload_pack(location, [Due(5, 2, st.checkpoint(tmp_path / "ck2"), first)])[5]
    m1 = read_manifest(location, first, slice_id=5)
    m2 = read_manifest(location, second, slice_id=5)
    kept = [f for f in m2.files if f.key == first.key]
    assert kept and set(kept) <= set(m1.files)  # the same object and offset
    fresh = [f for f in m2.files if f.key == second.key]
    assert fresh and sent == sum(object_size(f.size) for f in fresh) + second.length
    assert restored(location, tmp_path, second, 5, "r2") == dict(st.items())
    st.close()


def test_a_file_too_large_for_a_pack_is_uploaded_alone(location, tmp_path, monkeypatch):
    monkeypatch.setattr(pack_module, "PACK_FILE_LIMIT", 1000)
    st = store(location, tmp_path / "s", 6)
    fill(st, 1, seed=6, n=2000)
    ref, _ = upload_pack(location, [Due(6, 1, st.checkpoint(tmp_path / "ck"))])[6]
    m = read_manifest(location, ref, slice_id=6)
    alone = [f for f in m.files if f.offset < 0]
    assert alone and all(f.size > 1000 and "/sst/slice-00006/" in f.key for f in alone)
    assert ref.at > 0  # the manifest is still in the pack
    assert restored(location, tmp_path, ref, 6, "r") == dict(st.items())
    st.close()


def test_a_manifest_range_that_is_not_the_manifest_is_refused_naming_the_pack(location, tmp_path):
    st = store(location, tmp_path / "s", 2)
    fill(st, 1, seed=2)
    ref, _ = upload_pack(location, [Due(2, 1, st.checkpoint(tmp_path / "ck"))])[2]
    manifests._items.clear()
    wrong = SnapRef(ref.version, ref.key, ref.bytes, ref.files, at=ref.at - 8, length=ref.length)
    with pytest.raises(CorruptObjectError, match=rf"{ref.key} bytes {ref.at - 8}\+{ref.length}"):
        read_manifest(location, wrong, slice_id=2)
    with pytest.raises(CorruptObjectError, match="expected app .* slice 3"):
        read_manifest(location, ref, slice_id=3)  # another slice's snapshot
    st.close()


def test_a_pack_header_that_is_not_ours_is_refused() -> None:
    with pytest.raises(CorruptObjectError, match="not a shardless snapshot pack"):
        decode_pack_header(b"SHMF" + bytes(40), where="k")
    good = pack_module.pack_header("app", "u" * 32)
    with pytest.raises(CorruptObjectError, match="checksum"):
        decode_pack_header(good[:-1] + bytes([good[-1] ^ 1]), where="k")
