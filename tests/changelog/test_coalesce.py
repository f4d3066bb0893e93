"""Sections of one segment read together in a restore (`coalesce`, `TailSections`): the pure
planning, property-tested, and restores of slices that share segments against moto server
over HTTP, with every S3 GET counted."""

from __future__ import annotations

from pathlib import Path

import boto3
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bench.billing import Requests
from shardless.changelog.coalesce import Span, coalesce
from shardless.changelog.commits import SliceCommit
from shardless.changelog.durable import DurableState
from shardless.changelog.errors import CorruptObjectError
from shardless.changelog.manifest import manifests
from shardless.changelog.restore import identity, restore_many
from shardless.changelog.restore_jobs import RestoreJob
from shardless.state.store import SliceStore
from tests.changelog.test_durable import SLICES

# (key index, offset, length) per section; sections of one key do not overlap in a segment
sections_strategy = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 400), st.integers(1, 60)), max_size=40
)


def _layout(raw: list[tuple[int, int, int]]) -> list[tuple[str, int, int] | None]:
    """Non-overlapping sections per key (offsets made cumulative), in the drawn order."""
    ends: dict[int, int] = {}
    out = []
    for k, gap, length in raw:
        start = ends.get(k, 0) + gap
        ends[k] = start + length
        out.append((f"obj-{k}", start, length))
    return out


@settings(max_examples=400, deadline=None)
@given(
    sections_strategy,
    st.integers(0, 100),
    st.integers(1, 600),
    st.integers(0, 2_000),
    st.sets(st.integers(0, 39)),
)
@example([(0, 0, 10), (0, 0, 10), (0, 500, 10)], 64, 600, 2_000, set())
def test_every_span_holds_its_sections_within_the_limits(raw, hole, longest, budget, cached):
    sections = [None if i in cached else s for i, s in enumerate(_layout(raw))]
    spans = coalesce(sections, hole=hole, longest=longest, budget=budget)
    assert len(spans) == len(sections)
    members: dict[Span, list[tuple[str, int, int]]] = {}
    for s, span in zip(sections, spans, strict=True):
        if span is None:
            continue
        assert s is not None, "a section read from the host got a span"
        key, offset, length = s
        assert span.key == key and span.start <= offset and offset + length <= span.end
        members.setdefault(span, []).append(s)
    assert sum(span.length for span in members) <= budget
    for span, inside in members.items():
        assert len(inside) >= 2, "a span for one section is one GET, as reading it alone"
        assert span.length <= longest
        assert span.start == min(o for _, o, _ in inside)
        assert span.end == max(o + n for _, o, n in inside)
        covered = sorted((o, o + n) for _, o, n in inside)
        for (_, end), (start, _) in zip(covered, covered[1:], strict=False):
            assert start - end <= hole, "a hole wider than allowed read and thrown away"
    # a span's sections are never read otherwise, and no two spans overlap
    for a in members:
        for b in members:
            if a is not b and a.key == b.key:
                assert a.end <= b.start or b.end <= a.start


@given(st.integers(2, 40), st.integers(1, 50))
def test_the_sections_of_a_whole_segment_are_read_as_one_span(n, length):
    sections = [("seg", i * length, length) for i in range(n)][::-1]  # asked in any order
    spans = coalesce(sections)
    assert set(spans) == {Span("seg", 0, n * length)}


def test_spans_are_granted_in_the_order_they_are_needed_until_the_budget_is_spent():
    sections = [("b", 0, 10), ("a", 0, 10), ("b", 10, 10), ("a", 10, 10)]
    assert coalesce(sections, budget=20) == [Span("b", 0, 20), None, Span("b", 0, 20), None]
    assert coalesce(sections, budget=19) == [None] * 4


# -- restores of slices that share segments -------------------------------------------------

WIDE = 12  # slices committed together, one segment per batch
BATCHES = 5


def kv(s: int, v: int) -> tuple[bytes, bytes]:
    return (b"d" + f"s{s:02d}-k{v % 3}".encode(), f"v{v}-{'x' * (s * 7)}".encode())


def commit_together(location) -> tuple[DurableState, dict[int, dict[bytes, bytes]]]:
    """`BATCHES` batches, each one segment holding a section of every one of `WIDE` slices;
    the state each slice must have after them."""
    durable = DurableState(location, transfer_process_bytes=None)  # transfers in this process
    expected: dict[int, dict[bytes, bytes]] = {s: {} for s in range(WIDE)}
    for b in range(1, BATCHES + 1):
        heads = durable.heads(list(range(WIDE)))
        commits = []
        for s in range(WIDE):
            head = heads.get(s)
            change = kv(s, b)
            expected[s][change[0]] = change[1]
            commits.append(SliceCommit(s, b, head if head and head.committed else None, [change]))
        durable.commit("q", b, 0, commits)
    return durable, expected


def restore(location, durable: DurableState, tmp_path: Path, name: str, target: int = BATCHES):
    """Every slice restored to `target` into `tmp_path/name`, as a new worker does (no
    manifest cached); the heads restored from and the outcomes."""
    heads = durable.heads(list(range(WIDE)))
    manifests._items.clear()
    jobs = [
        RestoreJob(tmp_path / name / f"s{s}", identity(location.app, s, SLICES), heads[s], target)
        for s in range(WIDE)
    ]
    return heads, restore_many(jobs, durable)


def counted_restore(location, durable: DurableState, tmp_path: Path, target: int = BATCHES):
    """`restore`'s outcomes, and the S3 GETs it made (the transfer threads' included)."""
    requests = Requests()
    try:
        _, outcomes = restore(location, durable, tmp_path, "r", target)
    finally:
        requests.close()
    return outcomes, requests.calls[("s3", "GetObject")]


def test_slices_sharing_segments_restore_with_one_get_a_segment(location, tmp_path):
    durable, expected = commit_together(location)
    outcomes, got = counted_restore(location, durable, tmp_path)
    for o in outcomes:
        assert o.error is None and o.store is not None and o.stats is not None
        assert o.stats.segments == BATCHES
        user = {k: v for k, v in o.store.items()}
        assert user == expected[o.job.slice]
        assert o.store.version == BATCHES
        o.store.close()
    assert got == BATCHES  # one span per segment, not one GET per section


def test_the_counter_sees_every_get_of_a_restore_read_section_by_section(
    location, tmp_path, monkeypatch
):
    """The same restore with coalescing turned off reads each section alone: the count above
    would fail to show a regression if the counter missed the transfer threads' calls."""
    from shardless.changelog import restore_transfers

    durable, _ = commit_together(location)
    monkeypatch.setattr(restore_transfers, "coalesce", lambda sections: [None] * len(sections))
    outcomes, got = counted_restore(location, durable, tmp_path)
    for o in outcomes:
        assert o.error is None and o.store is not None
        o.store.close()
    assert got == WIDE * BATCHES


def test_a_damaged_section_fails_its_slice_alone_and_names_its_object(location, tmp_path):
    durable, expected = commit_together(location)
    heads = durable.heads(list(range(WIDE)))
    bad = next(e for e in heads[5].log if e.version == 3)
    s3 = boto3.client("s3")
    key = bad.key(location)
    body = bytearray(s3.get_object(Bucket=location.bucket, Key=key)["Body"].read())
    body[bad.offset + bad.length - 1] ^= 0xFF  # the last byte of slice 5's section
    s3.put_object(Bucket=location.bucket, Key=key, Body=bytes(body))
    _, outcomes = restore(location, durable, tmp_path, "r")
    failed = {o.job.slice: o.error for o in outcomes if o.error is not None}
    assert set(failed) == {5}
    assert isinstance(failed[5], CorruptObjectError) and key in str(failed[5])
    assert not (tmp_path / "r" / "s5").exists()
    for o in outcomes:
        if o.store is not None:
            assert {k: v for k, v in o.store.items()} == expected[o.job.slice]
            o.store.close()


def test_a_restore_from_a_truncated_segment_fails_every_slice_whose_section_is_gone(
    location, tmp_path
):
    durable, _ = commit_together(location)
    heads = durable.heads(list(range(WIDE)))
    entry = next(e for e in heads[0].log if e.version == 2)
    s3 = boto3.client("s3")
    key = entry.key(location)
    body = s3.get_object(Bucket=location.bucket, Key=key)["Body"].read()
    cut = next(e for e in heads[WIDE // 2].log if e.version == 2).offset
    s3.put_object(Bucket=location.bucket, Key=key, Body=body[:cut])  # the later half is gone
    _, outcomes = restore(location, durable, tmp_path, "r")
    failed = sorted(o.job.slice for o in outcomes if o.error is not None)
    lost = sorted(
        s for s in range(WIDE) if next(e for e in heads[s].log if e.version == 2).offset >= cut
    )
    assert failed == lost and lost
    assert all(isinstance(o.error, CorruptObjectError) for o in outcomes if o.error is not None)
    for o in outcomes:
        if o.store is not None:
            o.store.close()


def test_a_store_restored_from_spans_opens_again_at_its_version(location, tmp_path):
    durable, expected = commit_together(location)
    heads, outcomes = restore(location, durable, tmp_path, "r")
    for o in outcomes:
        assert o.store is not None
        o.store.close()
    again = SliceStore(tmp_path / "r" / "s3", identity(location.app, 3, SLICES))
    assert again.version == BATCHES and again.tag == heads[3].log[-1].uid
    assert {k: v for k, v in again.items()} == expected[3]
    again.close()


# -- snapshots from one pack ----------------------------------------------------------------


def bulk(s: int) -> list[tuple[bytes, bytes]]:
    return [(b"d" + f"s{s:02d}-bulk{i:02d}".encode(), b"y" * 50) for i in range(30)]


def snapshot_together(location, tmp_path: Path) -> tuple[DurableState, dict[int, dict]]:
    """`WIDE` slices at version 1 (one segment), snapshotted there as one pack, then version
    2 (one segment) referencing the snapshots; each slice's state after version 2."""
    from shardless.changelog.pack import Due, upload_pack

    durable = DurableState(location, transfer_process_bytes=None)
    stores = {
        s: SliceStore(tmp_path / f"writer-{s}", identity(location.app, s, SLICES))
        for s in range(WIDE)
    }
    first = {s: sorted([kv(s, 1), *bulk(s)]) for s in range(WIDE)}
    done = durable.commit("q", 1, 0, [SliceCommit(s, 1, None, first[s]) for s in range(WIDE)])
    for s, st_ in stores.items():
        st_.commit(first[s], 1, tag=done.uid)
    due = [Due(s, 1, st_.checkpoint(tmp_path / f"ck{s}")) for s, st_ in stores.items()]
    refs = upload_pack(location, due)
    heads = durable.heads(list(range(WIDE)))
    second = {s: [kv(s, 2)] for s in range(WIDE)}
    durable.commit(
        "q", 2, 0, [SliceCommit(s, 2, heads[s], second[s], refs[s][0]) for s in range(WIDE)]
    )
    expected = {}
    for s, st_ in stores.items():
        expected[s] = {k: v for k, v in first[s]} | dict(second[s])
        st_.close()
    return durable, expected


def test_slices_snapshotted_in_one_pack_read_it_with_two_gets(location, tmp_path):
    durable, expected = snapshot_together(location, tmp_path)
    outcomes, got = counted_restore(location, durable, tmp_path, target=2)
    for o in outcomes:
        assert o.error is None and o.store is not None and o.stats is not None
        assert (o.stats.snapshot_version, o.stats.segments) == (1, 1)
        assert {k: v for k, v in o.store.items()} == expected[o.job.slice]
        o.store.close()
    # the pack's manifests in one GET, its SST files in another, the segment's sections in one
    assert got == 3


def test_a_damaged_manifest_in_a_shared_pack_fails_its_slice_alone_naming_its_bytes(
    location, tmp_path
):
    """Cut from the pack's manifests read as one span, slice 4's damaged manifest is refused
    by its own checksum, named by its own byte range; the others restore from the pack (no
    older path reaches slice 4's version: its log starts after the snapshot)."""
    durable, expected = snapshot_together(location, tmp_path)
    heads = durable.heads(list(range(WIDE)))
    snap = heads[4].snaps[-1]
    s3 = boto3.client("s3")
    body = bytearray(s3.get_object(Bucket=location.bucket, Key=snap.key)["Body"].read())
    body[snap.at + snap.length // 2] ^= 0xFF  # inside slice 4's manifest
    s3.put_object(Bucket=location.bucket, Key=snap.key, Body=bytes(body))
    _, outcomes = restore(location, durable, tmp_path, "r", target=2)
    for o in outcomes:
        if o.job.slice == 4:
            assert isinstance(o.error, CorruptObjectError)
            assert f"{snap.key} bytes {snap.at}+{snap.length}: manifest checksum" in str(o.error)
            assert o.store is None
            continue
        assert o.error is None and o.store is not None and o.stats is not None
        assert o.stats.snapshot_version == 1
        assert {k: v for k, v in o.store.items()} == expected[o.job.slice]
        o.store.close()


def test_a_damaged_sst_file_in_a_shared_span_fails_its_slice_alone_naming_its_bytes(
    location, tmp_path
):
    from shardless.changelog.manifest import read_manifest
    from shardless.changelog.sst import object_size

    durable, expected = snapshot_together(location, tmp_path)
    heads = durable.heads(list(range(WIDE)))
    snap = heads[7].snaps[-1]
    f = read_manifest(location, snap, slice_id=7).files[0]
    assert f.offset >= 0  # in the pack
    s3 = boto3.client("s3")
    body = bytearray(s3.get_object(Bucket=location.bucket, Key=f.key)["Body"].read())
    body[f.offset + object_size(f.size) - 1] ^= 0xFF  # the last byte of slice 7's file
    s3.put_object(Bucket=location.bucket, Key=f.key, Body=bytes(body))
    _, outcomes = restore(location, durable, tmp_path, "r", target=2)
    for o in outcomes:
        if o.job.slice == 7:
            assert isinstance(o.error, CorruptObjectError), o.error
            assert f"{f.key} bytes {f.offset}+{object_size(f.size)}: content" in str(o.error)
            assert o.store is None and not (tmp_path / "r" / "s7").exists()
            continue
        assert o.error is None and o.store is not None and o.stats is not None
        assert o.stats.snapshot_version == 1
        assert {k: v for k, v in o.store.items()} == expected[o.job.slice]
        o.store.close()


def test_a_restore_lets_every_span_go_once_its_last_part_is_used(location, tmp_path, monkeypatch):
    """Spans are held only until their last section or file is applied or written: after a
    restore the pipeline holds no span's bytes and counts none as held."""
    from shardless.changelog import restore as restore_module
    from shardless.changelog.restore_transfers import SnapshotTransfers, TailSections

    made: list = []

    class Tails(TailSections):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            made.append(self)

    class Snaps(SnapshotTransfers):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(restore_module, "TailSections", Tails)
    monkeypatch.setattr(restore_module, "SnapshotTransfers", Snaps)
    durable, expected = snapshot_together(location, tmp_path)
    _, outcomes = restore(location, durable, tmp_path, "r", target=2)
    for o in outcomes:
        assert o.error is None and o.store is not None
        assert {k: v for k, v in o.store.items()} == expected[o.job.slice]
        o.store.close()
    tails = [m for m in made if isinstance(m, Tails)]
    snaps = [m for m in made if isinstance(m, Snaps)]
    assert tails and snaps
    for t in tails:
        assert t.held == 0 and not t.fetched and not t.users and not t.ahead
    for s in snaps:
        assert s.file_spans == {} and s.file_users == {} and s.files_fetched == {}


def test_spans_of_a_large_restore_are_fetched_by_the_helper_process(location, tmp_path, helper):
    """A restore that hands its transfers to the helper process sends it one GET per span
    (the pack's manifests, its SST files, the segment), and still says so in its stats."""
    durable, expected = snapshot_together(location, tmp_path)
    via_helper = DurableState(location, transfer_process_bytes=0)
    _, outcomes = restore(location, via_helper, tmp_path, "r", target=2)
    for o in outcomes:
        assert o.error is None and o.store is not None and o.stats is not None
        assert o.stats.snapshot_version == 1 and o.stats.transfer_process
        assert {k: v for k, v in o.store.items()} == expected[o.job.slice]
        o.store.close()
    assert helper.starts == 1 and helper.ran_here == 0
    assert helper.sent == 3
