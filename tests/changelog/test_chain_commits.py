"""Commits through group chains against moto server over HTTP: a group's batch is one link
in one transaction whatever its slice count; a position goes to one writer; a takeover
seals the chain it takes slices from and loses none of its versions; a fenced query cannot
append; the state read back equals a plain fold of the batches that landed."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.billing import Requests
from shardless.changelog import fence
from shardless.changelog.chain import SliceRange
from shardless.changelog.chain_commits import PositionTakenError, commit_link, take_over
from shardless.changelog.chain_gc import delete_chain
from shardless.changelog.chain_writes import create_chain, find_tip, seal
from shardless.changelog.durable import DurableState, SliceCommit
from shardless.changelog.errors import CommitConflictError
from shardless.changelog.fence import QueryFencedError
from shardless.changelog.restore import materialize
from shardless.changelog.transactions import GuardFailedError
from tests.changelog.folds import fold

SLICES = 16
ALL = SliceRange(0, SLICES)


def batch_commits(durable, heads, changed: dict[int, dict[bytes, bytes | None]]):  # noqa: ANN001, ANN201
    return [
        SliceCommit(s, (heads[s].version if heads.get(s) else 0) + 1, heads.get(s),
                    [(b"d" + k, v) for k, v in kv.items()])
        for s, kv in sorted(changed.items())
    ]  # fmt: skip


def read_state(durable: DurableState, slice_id: int, path: Path) -> dict[bytes, bytes]:
    head = durable.heads([slice_id])[slice_id]
    store, _ = materialize(durable, head, path, SLICES)
    try:
        return {k[1:]: v for k, v in store.items()}
    finally:
        store.close()


def run_batches(durable, tip, query, batches, first=0):  # noqa: ANN001, ANN201
    """Commit `batches` as links of `tip`'s chain, the way a group does: heads held in
    memory between batches (never read back)."""
    slices = sorted({s for b in batches for s in b})
    heads = take_over(durable, dict.fromkeys(slices) | durable.heads(slices), tip, "host:1", query)
    for i, changed in enumerate(batches):
        done = commit_link(durable, query, first + i, tip, batch_commits(durable, heads, changed))
        heads.update(done.heads)
        tip = done.tip
    return tip, heads


def test_a_groups_batches_are_one_transaction_each_and_read_back_as_the_fold(
    location, tmp_path: Path
) -> None:
    durable = DurableState(location)
    fence.join(location, "q1")
    tip = create_chain(location, "q1", 1, 0, ALL)
    batches = [{s: {b"k%d" % s: b"%d" % i} for s in range(SLICES)} for i in range(3)]
    batches.append({3: {b"k3": None}, 5: {b"x": b"y"}})
    heads = dict.fromkeys(range(SLICES)) | durable.heads(list(range(SLICES)))
    requests = Requests()
    try:
        heads = take_over(durable, heads, tip, "host:1", "q1")
        took_over, _ = requests.take()
        for i, changed in enumerate(batches):
            done = commit_link(durable, "q1", i, tip, batch_commits(durable, heads, changed))
            heads.update(done.heads)
            tip = done.tip
        calls, units = requests.take()
    finally:
        requests.close()
    assert took_over[("dynamodb", "TransactWriteItems")] == 1  # 16 heads, once
    # then each batch: one segment and one transaction of its link (2 write units) and the
    # fence check, however many of the 16 slices it changed
    assert calls == {
        ("s3", "PutObject:segment"): len(batches),
        ("dynamodb", "TransactWriteItems"): len(batches),
    }
    assert units["dynamodb_write_units"] == 2 * len(batches)
    assert tip.position == len(batches)
    read = durable.heads(list(range(SLICES)))
    assert {s: h.version for s, h in read.items()} == {s: 3 + (s in (3, 5)) for s in range(SLICES)}
    assert {s: read[s] for s in range(SLICES)} == {s: heads[s] for s in range(SLICES)}
    for s in (0, 3, 5, 15):
        assert read_state(durable, s, tmp_path / f"s{s}") == fold(batches, s)


def test_a_position_goes_to_one_writer_and_the_loser_is_told_what_holds_it(location) -> None:
    durable = DurableState(location)
    fence.join(location, "q1")
    tip = create_chain(location, "q1", 1, 0, ALL)
    heads = take_over(durable, {1: None}, tip, "host:1", "q1")
    first = commit_link(durable, "q1", 7, tip, batch_commits(durable, heads, {1: {b"a": b"1"}}))
    with pytest.raises(PositionTakenError, match="position holds batch 7 of query q1") as lost:
        commit_link(durable, "q1", 7, tip, batch_commits(durable, heads, {1: {b"a": b"2"}}))
    assert lost.value.found == first.tip.last
    assert durable.heads([1])[1].version == 1


def test_a_takeover_seals_the_old_chain_and_keeps_every_version_it_committed(
    location, tmp_path: Path
) -> None:
    durable = DurableState(location)
    fence.join(location, "q1")
    old = create_chain(location, "q1", 1, 0, ALL)
    before = [{2: {b"a": b"1"}, 4: {b"b": b"1"}}, {2: {b"a": b"2"}}]
    old, old_heads = run_batches(durable, old, "q1", before)
    # a second chain (a new group layout) takes slice 2 over: the old chain is sealed
    new = create_chain(location, "q1", 2, 0, SliceRange(0, 8))
    taken = take_over(durable, durable.heads([2]), new, "host:2", "q1")
    assert (taken[2].version, taken[2].chain, taken[2].chain_from) == (2, new.chain, 1)
    assert find_tip(location, old.genesis).sealed
    # the old writer cannot append any more, for any slice
    with pytest.raises(PositionTakenError, match="position holds a seal") as lost:
        commit_link(durable, "q1", 2, old, batch_commits(durable, old_heads, {4: {b"b": b"2"}}))
    assert lost.value.found.sealed
    after = [{2: {b"a": b"3", b"c": b"1"}}]
    commit_link(durable, "q1", 2, new, batch_commits(durable, taken, after[0]))
    assert read_state(durable, 2, tmp_path / "two") == fold(before + after, 2)
    # slice 4 still reads through the sealed chain, up to its seal
    assert durable.heads([4])[4].version == 1
    assert read_state(durable, 4, tmp_path / "four") == fold(before, 4)


def test_a_takeover_refuses_a_head_another_writer_changed(location) -> None:
    durable = DurableState(location)
    fence.join(location, "q1")
    first = create_chain(location, "q1", 1, 0, ALL)
    stale = {6: None}
    take_over(durable, stale, first, "host:1", "q1")
    second = create_chain(location, "q1", 1, 0, ALL)
    with pytest.raises(CommitConflictError, match="takeover of slices \\[6\\] lost"):
        take_over(durable, stale, second, "host:2", "q1")


def test_a_takeover_into_a_chain_sealed_since_its_tip_was_read_names_no_slice(location) -> None:
    """A zombie that remembers a chain's tip must not make heads name the chain after a
    seal: gc deletes sealed chains that no head names."""
    durable = DurableState(location)
    fence.join(location, "q1")
    tip = create_chain(location, "q1", 1, 0, ALL)
    take_over(durable, {1: None}, tip, "host:1", "q1")
    seal(location, tip.chain, "gc")
    heads = durable.heads([2, 3])
    with pytest.raises(CommitConflictError, match=f"chain {tip.chain} moved past position 0"):
        take_over(durable, {2: heads.get(2), 3: heads.get(3)}, tip, "zombie:1", "q1")
    assert durable.heads([2, 3]) == heads  # nothing was written


def test_a_takeover_seals_the_chain_a_stale_head_moved_to_before_taking_it(location) -> None:
    """A host remembers slice 7 in chain A; another writer took it into chain B since. The
    takeover into C reads 7 again after sealing A and finds B: it must seal B too, or B's
    writer, trusting its own memory of 7, appends a version no head will ever name."""
    durable = DurableState(location)
    fence.join(location, "q1")
    a = create_chain(location, "q1", 1, 0, ALL)
    a, remembered = run_batches(durable, a, "q1", [{7: {b"k": b"1"}}])
    b = create_chain(location, "q1", 1, 0, ALL)
    in_b = take_over(durable, durable.heads([7]), b, "host:b", "q1")
    c = create_chain(location, "q1", 1, 0, ALL)
    taken = take_over(durable, {7: remembered[7]}, c, "host:c", "q1")
    assert taken[7].chain == c.chain and find_tip(location, b.genesis).sealed
    with pytest.raises(PositionTakenError, match="position holds a seal"):
        commit_link(durable, "q1", 1, b, batch_commits(durable, in_b, {7: {b"k": b"2"}}))


def test_a_writer_remembering_a_tip_of_a_chain_gc_deleted_lands_nothing(location) -> None:
    """gc deletes a sealed chain, seal included, so the position after an old tip is free
    again: a takeover or a link from a host that remembers that tip must still fail."""
    durable = DurableState(location)
    fence.join(location, "q1")
    tip = create_chain(location, "q1", 1, 0, ALL)  # never named: gc seals it, then deletes it
    seal(location, tip.chain, "gc")
    assert delete_chain(location, tip.chain) == 2
    with pytest.raises(GuardFailedError, match=f"chain {tip.chain} was deleted by gc"):
        take_over(durable, {3: None}, tip, "zombie:1", "q1")
    assert durable.heads([3]) == {}
    with pytest.raises(PositionTakenError, match="gc deleted the chain"):
        commit_link(durable, "q1", 0, tip, batch_commits(durable, {}, {3: {b"a": b"1"}}))
    assert find_tip(location, tip.genesis).position == 0


def test_sealing_is_idempotent_and_moves_past_a_link_that_landed_first(location) -> None:
    durable = DurableState(location)
    fence.join(location, "q1")
    tip = create_chain(location, "q1", 1, 0, ALL)
    tip, _ = run_batches(durable, tip, "q1", [{0: {b"a": b"1"}}])
    sealed = seal(location, tip.chain, "tool")
    assert (sealed.position, sealed.sealed) == (2, True)
    assert seal(location, tip.chain, "other") == sealed


def test_a_fenced_query_cannot_append_a_link(location) -> None:
    durable = DurableState(location)
    fence.join(location, "q1")
    tip = create_chain(location, "q1", 1, 0, ALL)
    heads = take_over(durable, {9: None}, tip, "host:1", "q1")
    fence.fence(location, ["q1"])
    with pytest.raises(QueryFencedError):
        commit_link(durable, "q1", 0, tip, batch_commits(durable, heads, {9: {b"a": b"1"}}))
    assert find_tip(location, tip.genesis).position == 0


def test_a_claim_on_chain_heads_seals_the_chain_and_refuses_heads_it_moved_past(location):
    """A claim (or a per-slice commit) writes a head whole: it seals the chain the head was
    read through first, and a link that landed after the read makes it lose, not drop it."""
    durable = DurableState(location)
    fence.join(location, "q1")
    tip = create_chain(location, "q1", 1, 0, ALL)
    tip, heads = run_batches(durable, tip, "q1", [{7: {b"a": b"1"}}])
    stale = durable.heads([7])
    commit_link(durable, "q1", 1, tip, batch_commits(durable, heads, {7: {b"a": b"2"}}))
    with pytest.raises(CommitConflictError, match=r"heads of slices \[7\] lost"):
        durable.claim(stale, owner="tool")
    assert find_tip(location, tip.genesis).sealed
    claimed = durable.claim(durable.heads([7]), owner="tool")[7]
    assert (claimed.version, claimed.chain) == (2, "")
    assert durable.heads([7])[7].version == 2  # its versions are in its own log now
