"""`--starting-position COMMITTED`: a new query on a fresh checkpoint continues an
application's state exactly once, including after a driver died between a batch's state
commit and its progress record.

The first tests drive `shardless.processor.driver.progress` against moto (records, fencing, undo of
commits past the progress); the slow ones run the real job (Spark, kinesalite, moto over HTTP) and
compare state and outputs with a plain-Python fold of the whole stream.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from shardless.changelog import resources
from shardless.changelog.durable import DurableState, SliceCommit
from shardless.changelog.layout import AppLocation
from shardless.processor.api.app import load_handler
from shardless.processor.driver import progress, takeover
from shardless.processor.driver.config import JobConfig
from shardless.processor.driver.job import BatchReport, parquet_sink, prepare, start
from shardless.processor.errors import ConfigError, ProcessorError
from shardless.processor.local import demo
from tests.e2e.test_end_to_end import APP, produce

POSITIONS = {
    "clicks/shardId-000000000000": {"after": "4960", "done": True, "since": 1.0},
    "clicks/shardId-000000000001": {"after": None, "done": False},
}


def a_record(query: str, batch: int, **more: object) -> dict:
    return {
        "query": query,
        "batch": batch,
        "positions": POSITIONS,
        "initial": {"type": "AT_TIMESTAMP", "ts": 12.5},
        "offset": {"run": "r1", "n": batch + 1},
        **more,
    }


def commit(loc: AppLocation, query: str, batch: int, slices: list[int]) -> None:
    """Commit one change per slice, as a task of `query` running `batch` would."""
    durable = DurableState(loc)
    heads = durable.heads(slices)
    commits = []
    for s in slices:
        head = heads.get(s)
        version = (head.version if head else 0) + 1
        commits.append(SliceCommit(s, version, head, [(f"d{s}".encode(), f"{batch}".encode())]))
    durable.commit(query, batch, 0, commits)


def versions(loc: AppLocation, slices: list[int]) -> dict[int, int]:
    return {s: h.version for s, h in DurableState(loc).heads(slices).items()}


# ---- records, fencing and undo, against moto ----------------------------------------------


def test_a_record_is_self_contained_and_can_be_made_another_applications_latest(aws):
    a = AppLocation.default(f"t-{uuid.uuid4().hex[:10]}")
    b = AppLocation.default(f"t-{uuid.uuid4().hex[:10]}")
    for loc in (a, b):
        resources.ensure(loc, 16)
    assert takeover.register(a, "query-one", 0, None) == []
    progress.record(a, a_record("query-one", 0))
    progress.record(a, a_record("query-one", 1))
    found = progress.latest(a)
    assert (found["query"], found["batch"]) == ("query-one", 1)
    assert found["positions"] == POSITIONS
    assert found["initial"] == {"type": "AT_TIMESTAMP", "ts": 12.5}
    assert progress.at_batch(a, "query-one", 0)["batch"] == 0
    assert progress.at_batch(a, "query-one", 7) is None
    # copied into another application (a re-sliced generation): no batch log needed there
    progress.set_latest(b, found)
    copied = progress.latest(b)
    assert copied["positions"] == POSITIONS and copied["batch"] == 1
    assert copied["fenced"] == ["query-one"]  # its checkpoint never worked on `b`
    _, positions = takeover.committed_start(b)
    assert positions == POSITIONS


def test_no_progress_means_committed_cannot_start(location):
    with pytest.raises(ConfigError, match="has no recorded progress"):
        takeover.committed_start(location)


def test_fencing_refuses_stale_checkpoints_and_a_taken_over_query(location):
    loc = location
    takeover.register(loc, "old", 0, None)
    progress.record(loc, a_record("old", 3))
    assert takeover.register(loc, "old", 4, None) == []  # its own checkpoint resumes
    # a new query at COMMITTED from (old, 3) fences `old`
    assert takeover.register(loc, "new", 0, {"query": "old", "batch": 3}) == ["old"]
    with pytest.raises(ProcessorError, match="may no longer work on application"):
        takeover.register(loc, "old", 4, None)
    with pytest.raises(ProcessorError, match="this query was fenced"):
        progress.record(loc, a_record("old", 4))
    progress.record(loc, a_record("new", 0, fenced=["old"]))
    assert progress.latest(loc)["fenced"] == ["old"]  # carried forward by the new query
    # another checkpoint that ran before resumes: stale
    with pytest.raises(ProcessorError, match="this checkpoint is stale"):
        takeover.register(loc, "third", 9, None)
    # a COMMITTED start from a record that moved on meanwhile is refused
    with pytest.raises(ProcessorError, match="is another query running on it"):
        takeover.register(loc, "fourth", 0, {"query": "old", "batch": 3})
    # a rolled-back application fences the query whose record it now stands at
    progress.set_latest(loc, progress.at_batch(loc, "new", 0))
    with pytest.raises(ProcessorError, match="rolled back behind it"):
        takeover.register(loc, "new", 1, None)


def test_undo_rolls_back_commits_past_the_progress_and_of_queries_without_any(location):
    loc = location
    slices = list(range(6))
    takeover.register(loc, "q-one-aaaa", 0, None)
    commit(loc, "q-one-aaaa", 0, slices)
    progress.record(loc, a_record("q-one-aaaa", 0))
    commit(loc, "q-one-aaaa", 1, [0, 1, 2])
    progress.record(loc, a_record("q-one-aaaa", 1))
    commit(loc, "q-one-aaaa", 2, [1, 2])  # the driver dies before recording batch 2
    before = versions(loc, slices)
    assert before == {0: 2, 1: 3, 2: 3, 3: 1, 4: 1, 5: 1}
    found, moved = takeover.undo_uncommitted(loc)
    assert (found["batch"], moved) == (1, 2)
    assert versions(loc, slices) == {0: 2, 1: 2, 2: 2, 3: 1, 4: 1, 5: 1}
    assert takeover.undo_uncommitted(loc)[1] == 0  # idempotent

    # a COMMITTED query registers, commits batch 0 on some slices, and dies unrecorded
    takeover.register(loc, "q-two-bbbb", 0, {"query": "q-one-aaaa", "batch": 1})
    commit(loc, "q-two-bbbb", 0, [3, 4])
    commit(loc, "q-two-bbbb", 1, [4])
    found, moved = takeover.undo_uncommitted(loc)
    assert (found["query"], moved) == ("q-one-aaaa", 2)
    assert versions(loc, slices) == {0: 2, 1: 2, 2: 2, 3: 1, 4: 1, 5: 1}


def test_the_first_query_leaves_a_placeholder_so_its_first_batch_can_be_undone(location):
    takeover.register(location, "first-qq", 0, None)
    commit(location, "first-qq", 0, [0, 1])
    assert progress.latest(location) is None  # no batch completed
    with pytest.raises(ConfigError, match="2 slices with commits of unfinished batches"):
        takeover.committed_start(location)
    assert versions(location, [0, 1]) == {0: 0, 1: 0}


# ---- the real job -----------------------------------------------------------------------


def run_job(
    spark,  # noqa: ANN001
    cfg: JobConfig,
    out_dir: Path,
    reports: list[BatchReport] | None = None,
) -> list[BatchReport]:
    """Run `cfg` until the stream is drained, with Spark's shuffle partitions = its groups."""
    reports = [] if reports is None else reports
    saved = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", str(cfg.groups))
    try:
        query = start(
            spark,
            load_handler(APP),
            cfg,
            sink=parquet_sink(str(out_dir)),
            on_report=reports.append,
            available_now=True,
        )
        query.awaitTermination()
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", saved)
    return reports


def outputs_by_user(spark, out_dir: Path) -> dict[str, list[int]]:  # noqa: ANN001
    counts: dict[str, list[int]] = defaultdict(list)
    for row in spark.read.parquet(str(out_dir)).select("value").collect():
        v = json.loads(row.value)
        counts[v["user"]].append(v["count"])
    return counts


def job_config(location: AppLocation, stream: str, tmp_path: Path, name: str) -> JobConfig:
    return JobConfig(
        app=location.app,
        streams=(stream,),
        checkpoint=str(tmp_path / f"checkpoint-{name}"),
        slices=16,
        groups=2,  # one wave of tasks on local[2]; a new query below takes another count
        local_dir=str(tmp_path / f"stores-{name}"),
        max_records_per_shard=200,
    )


@pytest.mark.slow
def test_a_new_query_with_other_groups_continues_the_state_exactly_once(
    spark, kinesis, make_stream, location, tmp_path
):
    stream = make_stream(2)
    produce(kinesis, stream, 1500, seed=21)
    first_cfg = job_config(location, stream, tmp_path, "a")
    first = run_job(spark, first_cfg, tmp_path / "out" / "query=a")
    assert len([r for r in first if r.records]) >= 3
    recorded = progress.latest(location)
    assert recorded["batch"] == max(r.batch_id for r in first if r.records)
    assert sum(p["after"] is not None for p in recorded["positions"].values()) == 2

    produce(kinesis, stream, 800, seed=22)
    # a new cluster: fresh checkpoint, no local stores, another Spark partition count
    second_cfg = replace(
        job_config(location, stream, tmp_path, "b"), groups=1, starting_position="COMMITTED"
    )
    second = run_job(spark, second_cfg, tmp_path / "out" / "query=b")

    expected, total = demo.reference_fold(kinesis, stream)
    assert total == 2300
    assert sum(r.records for r in first) == 1500
    assert sum(r.records for r in second) == 800  # only what the first query had not read
    assert demo.check_outputs(spark, str(tmp_path / "out"), expected) == []
    rebuilt, _ = demo.durable_state(second_cfg, tmp_path / "verify")
    assert rebuilt == expected
    assert progress.latest(location)["query"] != recorded["query"]


@pytest.mark.slow
def test_commits_of_a_batch_that_never_recorded_progress_are_undone_by_a_committed_start(
    spark, kinesis, make_stream, location, tmp_path, monkeypatch
):
    """The driver dies after the slices committed batch 1 and the sink wrote it, before
    the progress record: a new query at COMMITTED rolls those commits back and reads
    batch 1's records again, so state counts them once; the old checkpoint is fenced."""
    stream = make_stream(2)
    produce(kinesis, stream, 1200, seed=31)
    first_cfg = job_config(location, stream, tmp_path, "a")
    real_record = progress.record

    def dies_at_batch_1(loc: AppLocation, found: dict) -> None:
        if found["batch"] == 1:
            raise RuntimeError("driver died between the state commit and the progress record")
        real_record(loc, found)

    monkeypatch.setattr(progress, "record", dies_at_batch_1)
    first: list[BatchReport] = []
    with pytest.raises(Exception, match="driver died"):
        run_job(spark, first_cfg, tmp_path / "out" / "query=a", first)
    monkeypatch.undo()
    assert [r.batch_id for r in first] == [0]  # batch 1 never completed
    recorded = progress.latest(location)
    assert recorded["batch"] == 0
    heads = DurableState(location).heads(list(range(16)))
    past = [s for s, h in heads.items() if h.query == recorded["query"] and h.batch == 1]
    assert past, "no slice committed batch 1: the crash window was not reached"
    written = outputs_by_user(spark, tmp_path / "out" / "query=a" / "batch_id=1")
    assert written, "the sink did not write batch 1"

    produce(kinesis, stream, 300, seed=32)
    second_cfg = replace(
        job_config(location, stream, tmp_path, "b"), groups=1, starting_position="COMMITTED"
    )
    second = run_job(spark, second_cfg, tmp_path / "out" / "query=b")
    heads = DurableState(location).heads(list(range(16)))
    assert all(not (h.query == recorded["query"] and h.batch == 1) for h in heads.values())

    expected, total = demo.reference_fold(kinesis, stream)
    assert total == 1500
    assert sum(r.records for r in second) == 1500 - first[0].records  # batch 1 read again
    rebuilt, _ = demo.durable_state(second_cfg, tmp_path / "verify")
    assert rebuilt == expected
    # Outputs: every count once, plus batch 1's as the dead driver's sink wrote them (the
    # one batch a sink may see twice across a COMMITTED start)
    got = outputs_by_user(spark, tmp_path / "out")
    for user, want in expected.items():
        extra = Counter(written.get(user, []))
        assert Counter(got[user]) - extra == Counter(range(1, want["count"] + 1)), user
        assert not extra - Counter(got[user])

    # the dead query's checkpoint may no longer run on this state
    with pytest.raises(Exception, match="may no longer work on application"):
        run_job(spark, first_cfg, tmp_path / "out" / "query=a-again")
    rebuilt, _ = demo.durable_state(second_cfg, tmp_path / "verify-again")
    assert rebuilt == expected


@pytest.mark.slow
def test_a_restart_from_the_checkpoint_after_the_crash_window_keeps_the_spark_path(
    spark, kinesis, make_stream, location, tmp_path, monkeypatch
):
    """Same crash, restarted from its own checkpoint (COMMITTED still among its options):
    Spark re-runs batch 1 and the slices re-commit it in place; no roll-back happens."""
    stream = make_stream(2)
    produce(kinesis, stream, 800, seed=41)
    cfg = replace(job_config(location, stream, tmp_path, "a"), starting_position="COMMITTED")
    with pytest.raises(ConfigError, match="no recorded progress"):
        prepare(cfg)  # a COMMITTED start needs a completed batch
    cfg = replace(cfg, starting_position="TRIM_HORIZON")
    real_record = progress.record

    def dies_at_batch_1(loc: AppLocation, found: dict) -> None:
        if found["batch"] == 1:
            raise RuntimeError("driver died between the state commit and the progress record")
        real_record(loc, found)

    monkeypatch.setattr(progress, "record", dies_at_batch_1)
    with pytest.raises(Exception, match="driver died"):
        run_job(spark, cfg, tmp_path / "out")
    monkeypatch.undo()
    run_job(spark, replace(cfg, starting_position="COMMITTED"), tmp_path / "out")
    expected, total = demo.reference_fold(kinesis, stream)
    assert total == 800
    assert demo.check_outputs(spark, str(tmp_path / "out"), expected) == []
    rebuilt, _ = demo.durable_state(cfg, tmp_path / "verify")
    assert rebuilt == expected
    assert progress.latest(location)["batch"] >= 1
