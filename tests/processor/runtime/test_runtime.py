"""The task runtime without Spark: GroupRunner.run over real RocksDB and moto over HTTP,
compared with a plain-Python fold of the same records."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import pytest

from shardless.changelog import resources
from shardless.changelog.durable import DurableState
from shardless.changelog.layout import AppLocation
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.errors import ProcessorError
from shardless.processor.runtime.group_runner import GroupRunner, RuntimeConfig
from shardless.processor.runtime.routing import route

SLICES = 16


def count_handler(event, ctx):
    n = ctx.state.get(0) + 1
    ctx.state.set(n)
    ctx.emit({"key": event.key, "n": n})


def frame(keys: list[str], first_seq: int = 0) -> pd.DataFrame:
    rows = []
    for i, k in enumerate(keys):
        seq = str(10**30 + first_seq + i)
        rows.append(
            {
                "stream": "s",
                "shard": "shardId-0",
                "sequence_number": seq,
                "subsequence": 0,
                "partition_key": k,
                "explicit_hash_key": None,
                "arrival": datetime(2026, 1, 1, tzinfo=UTC),
                "data": json.dumps({"i": i}).encode(),
                "slice": route(k, None, SLICES),
                "stream_order": "0000" + seq.rjust(64, "0") + "0" * 10,
            }
        )
    return pd.DataFrame(rows).sample(frac=1, random_state=1)  # Spark's shuffle loses order


FORMAT = {"commit_format": "heads"}


@pytest.fixture(autouse=True, params=["heads", "chains"])
def commit_format(request, monkeypatch) -> str:
    """Every test here runs with both commit formats (docs/design/group-commits.md)."""
    monkeypatch.setitem(FORMAT, "commit_format", request.param)
    return request.param


class Runner:
    """GroupRunner.run with a fixed clock, returning only the output frame."""

    def __init__(self, location, local_dir: Path, handler, **kw) -> None:
        kw = {**FORMAT, **kw}
        self.inner = GroupRunner(
            HandlerFactory(handler), RuntimeConfig(location, SLICES, str(local_dir), **kw)
        )
        self.pending: dict = {}

    def run(self, group: int, query: str, batch: int, pdf, now_ms: int = 1_000) -> pd.DataFrame:
        out, self.pending = self.inner.run(group, query, batch, pdf, self.pending, now_ms)
        return out


def runner(location, local_dir: Path, handler=count_handler, **kw) -> Runner:
    return Runner(location, local_dir, handler, **kw)


def wipe_stores(root: Path) -> None:
    """Remove every slice store under `root` while its handle is open, as a lost disk does.
    RocksDB may still be flushing into it (`SliceStore.flush_soon`): a log file it deletes
    itself is gone when rmtree reaches it, and a file it creates keeps the directory from
    going, so remove until nothing is left."""
    for path in root.glob("*/w*/slice-*"):
        for _ in range(200):
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                break
            time.sleep(0.01)
        else:
            raise AssertionError(f"{path} could not be removed")


def outputs(out: pd.DataFrame) -> list[dict]:
    return [json.loads(v) for v in out[out.kind == "out"].sort_values(["slice", "seq"]).value]


def durable_counts(location, slices: int = SLICES) -> dict[str, int]:
    """State rebuilt from S3 and DynamoDB alone."""
    import tempfile

    from shardless.changelog.restore import materialize_heads
    from shardless.state import encoding
    from shardless.state.keys import record_key

    durable = DurableState(location)
    found = {}
    with tempfile.TemporaryDirectory() as scratch:
        heads = durable.heads(list(range(slices)))
        for _, store in materialize_heads(durable, heads, Path(scratch), slices):
            found.update({record_key(k): encoding.decode(v) for k, v in store.items()})
            store.close()
    return found


KEYS = [f"user-{i % 37}" for i in range(400)]


def counts_run_in_order(seen: list[dict]) -> bool:
    """Each key's outputs count 1, 2, 3, ... in the order they were emitted."""
    per_key: dict[str, list[int]] = {}
    for o in seen:
        per_key.setdefault(o["key"], []).append(o["n"])
    return all(ns == list(range(1, len(ns) + 1)) for ns in per_key.values())


def test_batches_fold_to_the_reference_and_emit_in_key_order(location, tmp_path):
    r = runner(location, tmp_path)
    seen: list[dict] = []
    for b in range(4):
        batch_keys = KEYS[b * 100 : (b + 1) * 100]
        seen += outputs(r.run(0, "q", b, frame(batch_keys, b * 100)))
    assert durable_counts(location) == dict(Counter(KEYS))
    assert counts_run_in_order(seen)


def test_rerun_of_a_batch_counts_its_input_once_and_repeats_its_outputs(location, tmp_path):
    r = runner(location, tmp_path)
    r.run(0, "q", 0, frame(KEYS[:200]))
    first = outputs(r.run(0, "q", 1, frame(KEYS[200:], 200)))
    rerun = r.run(0, "q", 1, frame(KEYS[200:], 200))
    assert outputs(rerun) == first
    # the same worker rolled its stores back locally: nothing was read from S3
    assert json.loads(rerun[rerun.kind == "metrics"].value.iloc[0])["restores"] == []
    assert durable_counts(location) == dict(Counter(KEYS))
    third = outputs(r.run(0, "q", 2, frame(["user-1"], 400)))
    assert third == [{"key": "user-1", "n": Counter(KEYS)["user-1"] + 1}]


def test_slice_moving_between_workers_keeps_every_write(location, tmp_path):
    a, b = runner(location, tmp_path / "a"), runner(location, tmp_path / "b")
    for batch in range(4):
        worker = a if batch % 2 == 0 else b
        worker.run(0, "q", batch, frame(KEYS[batch * 100 : (batch + 1) * 100], batch * 100))
    out = outputs(b.run(0, "q", 4, frame(["user-5"], 400)))
    assert out == [{"key": "user-5", "n": Counter(KEYS)["user-5"] + 1}]


def open_files_under(path: Path) -> int:
    """Descriptors of this process open on files under `path`."""
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd).startswith(str(path)))


def test_closing_a_cache_releases_its_stores_and_the_next_batch_reopens_them(location, tmp_path):
    from shardless.processor.runtime.stores import cache_for, close_caches

    other = AppLocation.default(f"{location.app}-b")
    resources.ensure(other, SLICES)
    a, b = runner(location, tmp_path / "a"), runner(other, tmp_path / "b")
    a.run(0, "q", 0, frame(KEYS[:200]))
    b.run(0, "q", 0, frame(KEYS[:10]))
    held = cache_for(str(tmp_path / "a"), location.app, SLICES)  # closed even while held
    assert open_files_under(tmp_path / "a") > 0
    stores = len(held._open)
    assert stores > 0 and close_caches(str(tmp_path / "a")) == stores
    assert open_files_under(tmp_path / "a") == 0
    assert open_files_under(tmp_path / "b") > 0  # another base's cache stays open
    out = a.run(0, "q", 1, frame(KEYS[200:], 200))
    assert metrics_of(out)["restores"] == []  # reopened from the local files, not rebuilt
    assert durable_counts(location) == dict(Counter(KEYS))
    assert outputs(a.run(0, "q", 2, frame(["user-1"], 400))) == [
        {"key": "user-1", "n": Counter(KEYS)["user-1"] + 1}
    ]


def test_wiped_local_stores_are_rebuilt_from_s3(location, tmp_path):
    r = runner(location, tmp_path)
    r.run(0, "q", 0, frame(KEYS[:200]))
    wipe_stores(tmp_path)
    out = r.run(0, "q", 1, frame(KEYS[200:], 200))
    metrics = json.loads(out[out.kind == "metrics"].value.iloc[0])
    assert metrics["restores"] and all(m["from_version"] == 0 for m in metrics["restores"])
    assert durable_counts(location) == dict(Counter(KEYS))
    assert outputs(out)[-1]["n"] == Counter(KEYS)[outputs(out)[-1]["key"]]


def test_snapshots_bound_the_log_and_a_wiped_store_restores_from_one(location, tmp_path):
    r = runner(location, tmp_path, snapshot_every=2, keep_snapshots=2)
    hot = ["user-1"] * 5
    for b in range(8):
        r.run(0, "q", b, frame(KEYS[b * 50 : (b + 1) * 50] + hot, b * 100))
    heads = DurableState(location).heads(list(range(SLICES)))
    hot_head = heads[route("user-1", None, SLICES)]
    assert len(hot_head.snaps) == 2 and hot_head.version == 8
    # entries only after the oldest kept snapshot: bounded by keep * every (+ the head)
    assert [e.version for e in hot_head.log] == list(range(hot_head.snaps[0].version + 1, 9))
    assert durable_counts(location) == Counter(KEYS) + Counter(hot * 8)
    wipe_stores(tmp_path)
    out = r.run(0, "q", 8, frame(["user-1"], 900))
    metrics = json.loads(out[out.kind == "metrics"].value.iloc[0])
    (restored,) = metrics["restores"]
    assert restored["snapshot_version"] in {s.version for s in hot_head.snaps}
    assert restored["segments"] == 8 - restored["snapshot_version"]
    assert outputs(out) == [{"key": "user-1", "n": Counter(KEYS)["user-1"] + 5 * 8 + 1}]


def test_a_chain_rolls_over_at_its_length_and_keeps_every_version(
    location, tmp_path, commit_format
):
    """Chains stay short: at `chain_length` positions the group seals its chain and starts
    a new one; slices move over as they change, the others read through the sealed one."""
    if commit_format != "chains":
        pytest.skip("chains only")
    from shardless.changelog.chain_reads import all_chains, read_chain

    kw = {"chain_length": 2, "snapshot_every": 2, "keep_snapshots": 2}
    a, b = runner(location, tmp_path / "a", **kw), runner(location, tmp_path / "b", **kw)
    fed: list[str] = []
    for batch in range(7):  # batches 1, 5 and 6 touch one key only: most slices stay behind
        keys = ["user-3"] if batch in (1, 5, 6) else KEYS[batch * 50 : (batch + 1) * 50]
        (a if batch % 3 else b).run(0, "q", batch, frame(keys, batch * 100))
        fed += keys
    chains = all_chains(location)
    assert len(chains) == 4  # positions 1-2, then a new chain each time: 7 batches
    for g in chains[:-1]:
        _, links = read_chain(location, g.chain)
        assert [link.sealed for link in links] == [False, False, True]
    heads = DurableState(location).heads(list(range(SLICES)))
    assert len({h.chain for h in heads.values()}) > 1  # untouched slices stayed behind
    assert durable_counts(location) == dict(Counter(fed))
    fresh = runner(location, tmp_path / "c", **kw)  # a host that knows nothing
    out = outputs(fresh.run(0, "q", 7, frame(["user-5"], 900)))
    assert out == [{"key": "user-5", "n": Counter(fed)["user-5"] + 1}]


def test_a_roll_over_by_the_chains_writer_reads_no_head_through_the_sealed_chain(
    location, tmp_path, commit_format, monkeypatch
):
    """The group that committed the chain's last link knows its slices' heads as of that
    tip; its seal landing right after the tip shows nothing came after it, so the takeover
    into the new chain writes them without reading them again through the whole sealed
    chain (2.0-2.6 s of a 512-link chain's roll-over batch on moto, in bench.latency)."""
    if commit_format != "chains":
        pytest.skip("chains only")
    from shardless.changelog.chain_reads import all_chains

    kw = {"chain_length": 2, "snapshot_every": 2, "keep_snapshots": 2}
    r = runner(location, tmp_path / "a", **kw)
    fed: list[str] = []
    for batch in range(2):  # positions 1 and 2 of the first chain
        keys = KEYS[batch * 50 : (batch + 1) * 50]
        r.run(0, "q", batch, frame(keys, batch * 100))
        fed += keys
    through: list[list[int]] = []  # the slices read each time heads are read through chains
    heads = DurableState.heads
    monkeypatch.setattr(
        DurableState,
        "heads",
        lambda self, slices: through.append(list(slices)) or heads(self, slices),
    )
    keys = KEYS[100:150]
    r.run(0, "q", 2, frame(keys, 200))  # at the chain's length: sealed, a new one started
    fed += keys
    assert len(all_chains(location)) == 2
    assert through == []
    monkeypatch.setattr(DurableState, "heads", heads)
    assert durable_counts(location) == dict(Counter(fed))
    fresh = runner(location, tmp_path / "b", **kw)  # a host that knows nothing reads them all
    out = outputs(fresh.run(0, "q", 3, frame(["user-5"], 900)))
    assert out == [{"key": "user-5", "n": Counter(fed)["user-5"] + 1}]


def test_a_roll_over_settles_only_a_chain_its_own_seal_closed_right_after_the_tip(
    location, tmp_path, commit_format
):
    """The heads a group knows are final only when its own seal landed at the position
    right after the tip they were read at. A seal further on (a link came after the tip the
    group remembers) or one another writer put there first leaves the chain unsettled: its
    heads are read again."""
    if commit_format != "chains":
        pytest.skip("chains only")
    from dataclasses import replace

    from shardless.changelog.chain_reads import all_chains
    from shardless.changelog.chain_writes import ChainTip, find_tip, read_link, seal
    from shardless.processor.runtime.group_chain import roll_over

    def chain_at_two(query: str) -> ChainTip:
        r = runner(location, tmp_path / query, chain_length=10)
        for batch in range(2):
            r.run(0, query, batch, frame(KEYS[batch * 50 : (batch + 1) * 50], batch * 100))
        (genesis,) = [g for g in all_chains(location) if g.query == query]
        return find_tip(location, genesis)

    cfg = replace(runner(location, tmp_path / "cfg").inner.config, chain_length=1)
    durable = DurableState(location)

    tip = chain_at_two("q-own")
    new, settled = roll_over(durable, cfg, 0, "q-own", tip, "me")
    assert settled == {tip.chain} and new.chain != tip.chain

    tip = chain_at_two("q-stale")  # the group remembers position 1; the chain is at 2
    stale = ChainTip(tip.genesis, 1, read_link(location, tip.genesis, 1))
    new, settled = roll_over(durable, cfg, 0, "q-stale", stale, "me")
    assert settled == frozenset() and new.chain != tip.chain  # rolled over, not settled

    tip = chain_at_two("q-other")  # another writer sealed it right after the tip first
    seal(location, tip.chain, "other")
    _, settled = roll_over(durable, cfg, 0, "q-other", tip, "me")
    assert settled == frozenset()


def test_handler_error_names_the_record_and_commits_nothing(location, tmp_path, commit_format):
    def fails_on_seven(event, ctx):
        count_handler(event, ctx)
        if event.key == "user-7":
            raise ValueError("bad record")

    with pytest.raises(ProcessorError, match=r"s/shardId-0/\d+\.0 \(key 'user-7', slice \d+"):
        runner(location, tmp_path, fails_on_seven).run(0, "q", 0, frame(KEYS[:100]))
    heads = DurableState(location).heads(list(range(SLICES)))
    assert not [h for h in heads.values() if h.committed]
    if commit_format == "heads":  # ownership is taken in the commit's own write
        assert heads == {}


def test_older_batch_than_the_committed_state_is_refused(location, tmp_path):
    r = runner(location, tmp_path)
    r.run(0, "q", 5, frame(["user-1"]))
    with pytest.raises(ProcessorError, match="checkpoint is older than the state"):
        r.run(0, "q", 4, frame(["user-1"]))


def test_timers_survive_a_lost_store_and_fire_in_a_batch_without_records(location, tmp_path):
    """Timers are state: set in one batch, the store lost, then a call with no records
    (Spark's timeout) restores the slice from S3 and fires them once."""

    def process(event, ctx):
        ctx.timers.set(ctx.now_ms + 500)

    def on_timer(timer, ctx):
        ctx.emit({"fired": timer.key, "at": timer.ts})

    r = Runner(location, tmp_path, process)
    r.inner.handlers = HandlerFactory(process, on_timer=on_timer)
    r.run(0, "q", 0, frame(["a", "b"]), now_ms=1_000)
    assert set(r.pending) == {route("a", None, SLICES), route("b", None, SLICES)}
    wipe_stores(tmp_path)
    early = r.run(0, "q", 1, None, now_ms=1_400)
    assert outputs(early) == []
    due = r.run(0, "q", 2, None, now_ms=1_500)
    assert sorted(o["fired"] for o in outputs(due)) == ["a", "b"]
    metrics = json.loads(due[due.kind == "metrics"].value.iloc[0])
    assert metrics["timers_fired"] == 2 and r.pending == {}
    assert metrics["restores"] and all(m["from_version"] == 0 for m in metrics["restores"])
    assert outputs(r.run(0, "q", 3, None, now_ms=5_000)) == []  # fired once


def test_two_attempts_of_one_batch_racing_count_its_input_once(location, tmp_path):
    """Speculative execution or a stalled task resumed: two workers run the same batch at
    the same time. Claims fence one of them; whichever commits, the state counts once."""
    import threading

    a, b = runner(location, tmp_path / "a"), runner(location, tmp_path / "b")
    a.run(0, "q", 0, frame(KEYS[:100]))
    results: dict[str, object] = {}
    barrier = threading.Barrier(2)

    def attempt(name: str, r: Runner) -> None:
        barrier.wait()
        try:
            results[name] = outputs(r.run(0, "q", 1, frame(KEYS[100:200], 100)))
        except Exception as exc:  # noqa: BLE001 - the loser's error is the point
            results[name] = exc

    threads = [threading.Thread(target=attempt, args=(n, r)) for n, r in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [v for v in results.values() if isinstance(v, list)]
    assert won, results
    if len(won) == 2:  # one ran after the other had committed: a re-run in place
        assert won[0] == won[1]
    assert durable_counts(location) == Counter(KEYS[:200])
    out = outputs(b.run(0, "q", 2, frame(["user-9"], 300)))
    assert out == [{"key": "user-9", "n": Counter(KEYS[:200])["user-9"] + 1}]


def metrics_of(out: pd.DataFrame) -> dict:
    return json.loads(out[out.kind == "metrics"].value.iloc[0])


def test_steady_batches_read_no_heads_and_a_head_changed_behind_them_is_caught(location, tmp_path):
    r = runner(location, tmp_path)
    first = metrics_of(r.run(0, "q", 0, frame(KEYS[:100])))
    second = metrics_of(r.run(0, "q", 1, frame(KEYS[100:200], 100)))
    assert first["heads_read"] == first["slices"] and first["heads_known"] == 0
    assert second["heads_read"] == 0 and second["heads_known"] == second["slices"]
    assert second["transactions"] == 1 and second["attempts"] == 1
    # a tool takes every slice over between batches: the known heads are stale now
    durable = DurableState(location)
    durable.claim(durable.heads(list(range(SLICES))), owner="tool")
    out = r.run(0, "q", 2, frame(KEYS[200:300], 200))
    assert metrics_of(out)["attempts"] == 2  # the commit lost, the run began again
    assert durable_counts(location) == Counter(KEYS[:300])
    owners = {h.owner for h in durable.heads(list(range(SLICES))).values()}
    assert "tool" not in owners  # every slice with records was taken back by the commit
    assert metrics_of(r.run(0, "q", 3, frame(KEYS[300:], 300)))["heads_read"] == 0
    assert durable_counts(location) == Counter(KEYS)


def test_a_rerun_elsewhere_is_seen_by_the_worker_that_ran_the_batch_before(location, tmp_path):
    a, b = runner(location, tmp_path / "a"), runner(location, tmp_path / "b")
    a.run(0, "q", 0, frame(KEYS[:200]))
    elsewhere = outputs(b.run(0, "q", 1, frame(KEYS[200:], 200)))
    again = a.run(0, "q", 1, frame(KEYS[200:], 200))  # a's heads are from batch 0: stale
    assert metrics_of(again)["attempts"] == 2 and outputs(again) == elsewhere
    assert durable_counts(location) == Counter(KEYS)


def test_a_group_moving_to_another_worker_of_the_host_reads_no_heads_and_no_s3(
    location, tmp_path, monkeypatch
):
    """Python workers of one executor share the host: the worker that gets a group next
    finds its heads in the group's hint file and the missing versions in the host's
    segment cache."""
    import os

    from shardless.changelog import aws
    from shardless.processor.runtime import stores

    r = runner(location, tmp_path)
    key = (str(tmp_path), location.app, SLICES)
    other_pid = os.getpid() + 1_000_000

    def as_other_worker(batch: int, keys: list[str], first: int) -> dict:
        with monkeypatch.context() as m:
            m.setattr(os, "getpid", lambda: other_pid)
            if other is not None:
                m.setitem(stores._caches, key, other)
            out = r.run(0, "q", batch, frame(keys, first))
            return metrics_of(out), stores._caches[key]

    r.run(0, "q", 0, frame(KEYS[:100]))
    this = stores._caches[key]
    other = None
    _, other = as_other_worker(1, KEYS[100:200], 100)  # builds its stores: first time here
    stores._caches[key] = this
    r.run(0, "q", 2, frame(KEYS[200:300], 200))

    def no_s3(**request):  # noqa: ANN003, ANN202
        raise AssertionError(f"S3 read while the host's segment cache has it: {request}")

    monkeypatch.setattr(aws.client("s3"), "get_object", no_s3)
    metrics, _ = as_other_worker(3, KEYS[300:], 300)  # one version behind
    monkeypatch.undo()
    assert metrics["heads_read"] == 0 and metrics["heads_known"] == metrics["slices"]
    assert metrics["restores"] and all(
        m["from_version"] == 2 and m["to_version"] == 3 for m in metrics["restores"]
    )
    assert durable_counts(location) == Counter(KEYS)


def test_the_cycle_collector_pauses_for_a_batch_and_freezes_the_worker_once(monkeypatch):
    import gc

    from shardless.processor.runtime import process

    monkeypatch.setattr(process, "_frozen", False)
    frozen_before = gc.get_freeze_count()
    assert gc.isenabled()
    try:
        with process.no_cycle_collection():
            assert not gc.isenabled()
        assert gc.isenabled() and process._frozen
        assert gc.get_freeze_count() > frozen_before  # the worker's objects, once
        with process.no_cycle_collection():
            assert not gc.isenabled()
        assert gc.isenabled()
        with pytest.raises(ValueError), process.no_cycle_collection():
            raise ValueError("a failing batch")
        assert gc.isenabled()  # back on after a failure
        gc.disable()
        with process.no_cycle_collection():
            pass
        assert not gc.isenabled()  # a caller that turned it off keeps it off
    finally:
        gc.enable()
        gc.unfreeze()


@pytest.fixture
def helper(monkeypatch, transfer_helper):
    """The runtime's snapshot uploads go to a new helper process."""
    from shardless.processor.runtime import attempt

    monkeypatch.setattr(attempt, "transfer_process", lambda: transfer_helper)
    return transfer_helper


@pytest.mark.parametrize("uploads", ["helper", "worker"])
def test_snapshots_upload_where_configured_name_their_batch_and_restore(
    location, tmp_path, helper, uploads
):
    from shardless.changelog.layout import query_tag

    r = runner(location, tmp_path, snapshot_every=2, snapshot_uploads=uploads)
    hot = ["user-1"] * 3
    taken = packs = 0
    for b in range(6):
        out = r.run(0, "q", b, frame(KEYS[b * 20 : (b + 1) * 20] + hot, b * 100))
        snapshots = json.loads(out[out.kind == "metrics"].value.iloc[0])["snapshots"]
        taken += snapshots
        packs += snapshots > 0  # a batch's snapshots are one pack, one upload
    assert taken > packs
    s = route("user-1", None, SLICES)
    head = DurableState(location).heads([s])[s]
    assert taken >= 2 and head.snaps
    # each snapshot names the batch that committed its version (batch b commits b + 1)
    assert all((x.batch, x.query) == (x.version - 1, query_tag("q")) for x in head.snaps)
    if uploads == "helper":
        assert (helper.sent, helper.ran_here) == (packs, 0)
    else:
        assert (helper.sent, helper.ran_here) == (0, 0)
    assert not list(tmp_path.glob("**/snap-*"))  # every checkpoint removed after its upload
    wipe_stores(tmp_path)
    out = r.run(0, "q", 6, frame(["user-1"], 900))
    (restored,) = json.loads(out[out.kind == "metrics"].value.iloc[0])["restores"]
    assert restored["snapshot_version"] == head.snaps[-1].version
    assert outputs(out) == [{"key": "user-1", "n": Counter(KEYS[:120])["user-1"] + 3 * 6 + 1}]


@pytest.mark.parametrize("fails", [False, True])
def test_a_snapshot_pack_is_done_only_once_its_checkpoints_are_removed(
    location, tmp_path, monkeypatch, fails
):
    """A batch that waited for its pack finds its checkpoints gone: a removal that ran after
    the wait left them on disk while later code, or a test, looked (a glob that met a
    directory being removed failed with FileNotFoundError)."""
    import time

    from shardless.changelog.pack import Due
    from shardless.processor.runtime import attempt

    def upload(loc, due):
        time.sleep(0.05)  # still running when `_start_pack` adds its callback
        if fails:
            raise RuntimeError("S3 is down")
        return {d.slice: f"ref-{d.slice}" for d in due}

    real = shutil.rmtree

    def slow_rmtree(path, *args, **kw):
        time.sleep(0.2)  # a removal slower than the waiter's wake-up
        real(path, *args, **kw)

    monkeypatch.setattr(attempt, "upload_pack", upload)
    monkeypatch.setattr(attempt.shutil, "rmtree", slow_rmtree)
    points = [tmp_path / f"snap-{s}" for s in (1, 2)]
    for point in points:
        point.mkdir()
        (point / "CURRENT").write_text("MANIFEST-000001\n")
    cfg = runner(location, tmp_path, snapshot_uploads="worker").inner.config
    pack = attempt._start_pack(
        cfg, [Due(s, 3, p, None) for s, p in zip((1, 2), points, strict=True)]
    )
    if fails:
        with pytest.raises(RuntimeError, match="S3 is down"):
            pack.result()
    else:
        assert pack.result() == {1: "ref-1", 2: "ref-2"}
    assert not any(p.exists() for p in points)


def test_a_snapshot_pack_whose_checkpoints_cannot_be_removed_still_ends(
    location, tmp_path, monkeypatch
):
    """The batch waiting for its pack must not wait for ever when the removal fails."""
    from shardless.changelog.pack import Due
    from shardless.processor.runtime import attempt

    def broken_rmtree(path, *args, **kw):
        raise OSError("the disk is gone")

    monkeypatch.setattr(attempt, "upload_pack", lambda loc, due: {d.slice: "ref" for d in due})
    monkeypatch.setattr(attempt.shutil, "rmtree", broken_rmtree)
    cfg = runner(location, tmp_path, snapshot_uploads="worker").inner.config
    pack = attempt._start_pack(cfg, [Due(1, 3, tmp_path / "snap-1", None)])
    assert pack.result(timeout=10) == {1: "ref"}


def test_a_snapshot_the_helper_cannot_take_is_left_out_and_the_batch_commits(
    location, tmp_path, helper, monkeypatch, caplog
):
    from shardless.processor.runtime import attempt

    def no_checkpoint(cfg, due):
        for d in due:
            shutil.rmtree(d.checkpoint)  # the helper finds nothing to upload
        return start(cfg, due)

    start = attempt._start_pack
    monkeypatch.setattr(attempt, "_start_pack", no_checkpoint)
    r = runner(location, tmp_path, snapshot_every=1, snapshot_uploads="helper")
    r.run(0, "q", 0, frame(["user-1"]))
    out = r.run(0, "q", 1, frame(["user-1"], 100))
    metrics = json.loads(out[out.kind == "metrics"].value.iloc[0])
    assert metrics["snapshots"] == 0 and metrics["committed_slices"] == 1
    s = route("user-1", None, SLICES)
    head = DurableState(location).heads([s])[s]
    assert (head.version, head.snaps) == (2, ())
    assert helper.sent == 1 and helper.ran_here == 0
    assert f"slices [{s}]: snapshots failed, committing without them" in caplog.text
    assert f"snapshot pack of slices [{s}]" in caplog.text


def test_the_batch_before_a_snapshot_starts_its_memtable_flush(location, tmp_path):
    import time

    from shardless.changelog.history import snapshot_due
    from shardless.processor.runtime.stores import cache_for

    every = 3
    r = runner(location, tmp_path, snapshot_every=every)
    s = route("user-1", None, SLICES)
    flushed_before = []
    for b in range(7):
        r.run(0, "q", b, frame(["user-1"] * 4, b * 10))
        head = DurableState(location).heads([s])[s]
        store = cache_for(str(tmp_path), location.app, SLICES)._open[s]

        def in_memtable(store=store) -> int:
            return store._db.property_int_value("rocksdb.num-entries-active-mem-table")

        if snapshot_due(head, head.version, s, every, 1 << 40):
            deadline = time.monotonic() + 10
            while in_memtable() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert in_memtable() == 0, f"after batch {b}: the memtable was not flushed"
            flushed_before.append(head.version)
        else:
            assert in_memtable() > 0, f"after batch {b}: flushed with no snapshot due"
    assert len(flushed_before) >= 2
    assert head.snaps and {x.version for x in head.snaps} <= set(flushed_before)


def test_a_group_on_a_new_host_keeps_its_open_stores_in_its_steady_batches(
    location, tmp_path, monkeypatch
):
    """After a group moves (a lost executor), its new host commits into the group's chain
    without a head write, so the heads keep naming the old host as their owner. Its later
    batches must still find their open stores ready by their tags: before, every slice
    went through the rebuild path (`_job`, walking the head's log) in every batch until
    the chain rolled over (20-60 ms a batch for 128 slices in `bench.latency`)."""
    from shardless.processor.runtime import stores

    old, new = runner(location, tmp_path / "old"), runner(location, tmp_path / "new")
    old.run(0, "q", 0, frame(KEYS[:100]))
    old.run(0, "q", 1, frame(KEYS[100:200], 100))
    new.run(0, "q", 2, frame(KEYS[200:300], 200))  # restores the group's slices here
    cache = stores._caches[(str(tmp_path / "new"), location.app, SLICES)]
    rebuilt: list[int] = []
    real = stores.StoreCache._job

    def counted(self, slice_id, *args):  # noqa: ANN001, ANN002, ANN202
        rebuilt.append(slice_id)
        return real(self, slice_id, *args)

    monkeypatch.setattr(stores.StoreCache, "_job", counted)
    out = new.run(0, "q", 3, frame(KEYS[300:], 300))
    assert metrics_of(out)["restores"] == []
    assert rebuilt == [], f"{len(rebuilt)} slices took the rebuild path on their own host"
    assert set(cache._open) >= {route(k, None, SLICES) for k in KEYS[300:]}
    assert durable_counts(location) == Counter(KEYS)
