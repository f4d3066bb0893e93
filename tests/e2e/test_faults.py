"""The fault-injection harness (`python -m bench.faults`) in CI: one schedule of the real
job on a two-executor Spark (`local-cluster[2,1,1024]`, its own driver subprocess)
against this session's emulators, with an executor killed mid-batch (its disk lost) and
S3 5xx. The state rebuilt from S3 and DynamoDB and the outputs deduplicated by batch must
equal a plain-Python fold of the stream, and the killed executor's slices, reassigned,
must be restored from S3 with their restore time and bytes in the job's batch metrics.

The on-demand run with many random schedules is `python -m bench.faults --schedules N`
(see docs/fault-tolerance.md). The SparkSession of the other tests is not touched: the
harness starts a driver subprocess of its own.

Fast tests (no Spark, no emulators): the seeded schedules' operator actions, and the
outputs check over several queries (what it accepts after a takeover or a rollback, and
that a record counted twice is still caught).
"""

from __future__ import annotations

import json

import pytest

from bench.faults import run_harness
from shardless.processor.local.faults import check
from shardless.processor.local.faults.rules import Rule
from shardless.processor.local.faults.schedule import (
    EXECUTOR_KILL,
    GC_RUNNING,
    KILLS,
    NEW_QUERY,
    OPERATOR_ACTIONS,
    S3_ERRORS,
    Fault,
    Schedule,
    draw,
)

# ---- schedules ------------------------------------------------------------------------


def test_every_schedule_has_an_operator_action_and_the_rest_is_unchanged():
    plans = [draw(7, i) for i in range(12)]
    for i, plan in enumerate(plans):
        ops = [f for f in plan.faults if f.kind in OPERATOR_ACTIONS]
        assert OPERATOR_ACTIONS[i % len(OPERATOR_ACTIONS)] in [f.kind for f in ops]
        assert [f for f in plan.faults if f.kind not in OPERATOR_ACTIONS] == list(
            draw(7, i, operator=False).faults
        )
        new = [f for f in ops if f.kind in NEW_QUERY]
        assert len(new) <= 1 and all(1 <= f.after_batch <= 3 for f in new)
        kills = {f.after_batch for f in plan.faults if f.kind == KILLS[0]}
        assert not any(f.after_batch in kills for f in new)
    kinds = {f.kind for p in plans for f in p.faults}
    assert set(OPERATOR_ACTIONS) <= kinds
    assert draw(7, 3) == draw(7, 3)  # a pure function of (seed, index)
    assert any(f.kind == GC_RUNNING for p in plans[:4] for f in p.faults)


# ---- the outputs check over several queries -----------------------------------------------

TS = {"u1": [10, 20, 30, 40, 50], "u2": [15, 25]}
FOLD = {"u1": {"count": 5, "last_seen": 50}, "u2": {"count": 2, "last_seen": 25}}


def out(user: str, k: int, ts: int | None = None) -> str:
    return json.dumps(
        {"user": user, "count": k, "last_seen": TS[user][k - 1] if ts is None else ts}
    )


def problems(rows, queries):
    return check.output_problems(rows, check.lineage(queries), FOLD, TS)


ONE = [check.QueryRun("A", "a")]
ONE_ROWS = [
    ("A", 0, out("u1", 1)), ("A", 0, out("u2", 1)), ("A", 1, out("u1", 2)),
    ("A", 1, out("u1", 3)), ("A", 2, out("u1", 4)), ("A", 2, out("u2", 2)),
    ("A", 3, out("u1", 5)),
]  # fmt: skip


def test_one_query_exact_passes():
    assert problems(ONE_ROWS, ONE) == []


def test_a_record_counted_twice_is_caught():
    """u1's third event counted twice: its state ends at 6, and the outputs say counts
    3 and 4 for the same event (count 4 with the 3rd event's timestamp)."""
    rows = [r for r in ONE_ROWS if r[0:2] != ("A", 2) and r[0:2] != ("A", 3)]
    rows += [("A", 2, out("u1", 4, ts=30)), ("A", 2, out("u1", 5, ts=40)), ("A", 2, out("u2", 2))]
    rows += [("A", 3, out("u1", 6, ts=50))]
    found = problems(rows, ONE)
    assert any(p.startswith("outputs: u1") for p in found), found
    assert any("order: u1: output 4 says last_seen=30" in p for p in found), found


def test_a_lost_record_is_caught():
    rows = [r for r in ONE_ROWS if r[2] != out("u2", 2)]
    assert any(p.startswith("outputs: u2") for p in problems(rows, ONE))


# A ran batches 0..3; B took over (or A was rolled back) from A's record of batch 1: A's
# batches 2 and 3 are superseded, and B emits their outputs again in its batches 0, 1.
TAKEN_OVER = [check.QueryRun("A", "a"), check.QueryRun("B", "b", ("A", 1))]
B_ROWS = [("B", 0, out("u1", 4)), ("B", 0, out("u2", 2)), ("B", 1, out("u1", 5))]


def test_outputs_re_emitted_after_the_record_a_new_query_continued_from_are_accepted():
    assert check.lineage(TAKEN_OVER) == {"B": None, "A": 1}
    assert problems(ONE_ROWS + B_ROWS, TAKEN_OVER) == []
    # A query that never got past its first batch (a refused takeover) is off the lineage
    refused = [TAKEN_OVER[0], check.QueryRun("R", "r", ("A", 0)), TAKEN_OVER[1]]
    assert check.lineage(refused) == {"B": None, "A": 1}
    assert problems(ONE_ROWS + B_ROWS + [("R", 0, out("u1", 2))], refused) == []


def test_a_new_query_that_counts_again_what_its_record_covered_is_caught():
    """B re-emits u1's count 3 (A's batch 1, which B's record covers): counted twice."""
    found = problems(ONE_ROWS + B_ROWS + [("B", 0, out("u1", 3))], TAKEN_OVER)
    assert any("two outputs for count 3" in p for p in found), found


def test_a_new_query_that_misses_what_it_should_re_read_is_caught():
    rows = ONE_ROWS + [r for r in B_ROWS if r[2] != out("u1", 5)]
    assert any(p.startswith("outputs: u1") for p in problems(rows, TAKEN_OVER))


def test_a_superseded_output_must_still_be_one_of_the_folds():
    """A fenced query's last batch counted a record twice before it was superseded: its
    outputs are dropped from the lineage, but a made-up count is still a divergence."""
    found = problems(ONE_ROWS + B_ROWS + [("A", 3, out("u1", 5, ts=40))], TAKEN_OVER)
    assert any(p.startswith("superseded: query A batch 3") for p in found), found


# ---- the real job ---------------------------------------------------------------------

EXECUTOR_KILL_MID_BATCH = Schedule(
    index=0,
    seed=20_261_123,
    shards=2,
    events=1200,  # 150 records per shard and batch: four batches or more
    more_events=0,
    faults=(
        Fault(S3_ERRORS, 0, rules=(Rule("s3", "PutObject", status=503, probability=0.3, times=3),)),
        Fault(EXECUTOR_KILL, 1, delay_s=0.3),  # while batch 2 runs
    ),
)


@pytest.mark.slow
def test_an_executor_killed_mid_batch_leaves_state_and_outputs_exact(aws, tmp_path):
    lines: list[str] = []
    summary = run_harness(
        aws, 1, 0, tmp_path, plans=[EXECUTOR_KILL_MID_BATCH], progress=lines.append
    )
    (schedule,) = summary["per_schedule"]
    assert summary["incomplete"] == 0, schedule["incomplete"]
    assert summary["divergences"] == 0, summary["divergence_details"]
    assert summary["faults_by_kind"][EXECUTOR_KILL] == 1, schedule["happened"]
    (kill,) = [f for f in schedule["happened"] if f["kind"] == EXECUTOR_KILL]
    assert kill["processes"] >= 1
    assert summary["events"] == 1200 and summary["batches"] >= 4
    # the killed executor's slices were restored from S3 where Spark ran them next, and the
    # batch metrics say how long that took and how many bytes it read
    after_kill = summary["restores"]["after_executor_kill"]
    assert after_kill["batches"] >= 1, schedule["restores"]
    assert after_kill["slices"] >= 1 and after_kill["bytes_total"] > 0
    assert 0 < after_kill["slice_seconds_max"] < 120
    assert any(r["restored_bytes"] > 0 for r in schedule["restores"])
    assert lines and "ok" in lines[0]
