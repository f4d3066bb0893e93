"""The fault-injection harness (`python -m bench.faults`) in CI: one schedule of the real
job on a two-executor Spark (`local-cluster[2,1,1024]`, its own driver subprocess)
against this session's emulators, with an executor killed mid-batch (its disk lost) and
S3 5xx. The state rebuilt from S3 and DynamoDB and the outputs deduplicated by batch must
equal a plain-Python fold of the stream, and the killed executor's slices, reassigned,
must be restored from S3 with their restore time and bytes in the job's batch metrics.

The on-demand run with many random schedules is `python -m bench.faults --schedules N`
(see docs/fault-tolerance.md). The SparkSession of the other tests is not touched: the
harness starts a driver subprocess of its own.
"""

from __future__ import annotations

import pytest

from bench.faults import run_harness
from processor.fault_proxy import Rule
from processor.faults.schedule import EXECUTOR_KILL, S3_ERRORS, Fault, Schedule

pytestmark = pytest.mark.slow

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
