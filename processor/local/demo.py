"""`make demo`: the whole path on local emulators, checked against a plain-Python fold.

Starts moto server and kinesalite, produces skewed per-user events into a 4-shard stream,
runs `examples/user_activity.py` on Spark (`local-cluster[2,1,1024]`: two executor JVMs;
`SHARDLESS_DEMO_MASTER` changes it) in several batches, wipes the local
stores of some slices between batches so they must be rebuilt from S3, then compares
the job's outputs and its durable state (rebuilt from S3 alone) with a fold of the same
records read straight from the stream. Exits non-zero on any mismatch.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import boto3

from shardless.changelog.durable import DurableState
from shardless.changelog.restore import materialize_heads
from shardless.processor.driver.config import JobConfig
from shardless.processor.driver.job import BatchReport, parquet_sink, start
from shardless.processor.kinesis.shards import stream_records
from shardless.processor.local import emulators as local_aws
from shardless.processor.local.producer import ensure_stream, produce
from shardless.state import encoding
from shardless.state.keys import record_key

log = logging.getLogger("shardless.demo")

EVENTS = 100_000
USERS = 5_000
ZIPF_S = 1.1
SHARDS = 4
SLICES = 256
# Two executors of one core each: one Python worker per executor keeps slices sticky.
MASTER = os.environ.get("SHARDLESS_DEMO_MASTER", "local-cluster[2,1,1024]")
WIPED_SLICES = list(range(0, SLICES, 16))
APP_FILE = Path(__file__).resolve().parents[2] / "examples" / "user_activity.py"


def reference_fold(kinesis, stream: str) -> tuple[dict[str, dict], int]:  # noqa: ANN001
    """The expected state: the app's logic as a plain loop over the stream, shard by shard."""
    state: dict[str, dict] = {}
    total = 0
    for r in stream_records(kinesis, stream):
        body = json.loads(r["Data"])
        seen = state.setdefault(r["PartitionKey"], {"count": 0, "last_seen": 0})
        seen["count"] += 1
        seen["last_seen"] = max(seen["last_seen"], body["ts"])
        total += 1
    return state, total


def durable_state(cfg: JobConfig, scratch: Path) -> tuple[dict[str, dict], int]:
    """Every slice rebuilt from S3 and DynamoDB alone into fresh stores, decoded."""
    durable = DurableState(cfg.location)
    heads = durable.heads(list(range(cfg.slices)))
    state: dict[str, dict] = {}
    for _, store in materialize_heads(durable, heads, scratch, cfg.slices):
        for k, v in store.items():
            state[record_key(k)] = encoding.decode(v)
        store.close()
    return state, len(heads)


def check_outputs(spark, out_dir: str, expected: dict[str, dict]) -> list[str]:  # noqa: ANN001
    """Per user, outputs must be counts 1..n exactly once, ending at the expected state."""
    by_user: dict[str, list[dict]] = defaultdict(list)
    for row in spark.read.parquet(out_dir).select("value").collect():
        v = json.loads(row.value)
        by_user[v["user"]].append(v)
    problems = []
    for user, want in expected.items():
        got = sorted(by_user.get(user, []), key=lambda v: v["count"])
        if [v["count"] for v in got] != list(range(1, want["count"] + 1)):
            problems.append(f"{user}: output counts are not exactly 1..{want['count']}")
        elif got[-1]["last_seen"] != want["last_seen"]:
            problems.append(f"{user}: last output says {got[-1]} but expected {want}")
    problems += [f"{u}: outputs for a user never produced" for u in by_user if u not in expected]
    return problems


def wipe(local_dir: Path, app: str, slices: list[int]) -> int:
    """Remove the local stores of `slices` in every worker's directory (a lost disk)."""
    removed = 0
    for s in slices:
        for path in (local_dir / app).glob(f"w*/slice-{s:05d}"):
            shutil.rmtree(path)
            removed += 1
    return removed


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    work = Path(tempfile.mkdtemp(prefix="shardless-demo-"))
    print(f"shardless demo: working in {work}")
    aws = local_aws.start("kinesalite", log_dir=work / "emulator-logs")
    try:
        aws.apply_env()
        return _run(work)
    finally:
        aws.stop()


def _run(work: Path) -> int:
    from shardless.processor.api.app import load_handler
    from shardless.processor.driver.spark import session

    kinesis = boto3.client("kinesis")
    stream = "demo-user-events"
    ensure_stream(kinesis, stream, SHARDS)
    produce_s = produce(kinesis, stream, EVENTS, USERS, ZIPF_S)
    print(f"produced {EVENTS:,} events for {USERS:,} users (Zipf s={ZIPF_S}) in {produce_s:.1f}s")

    cfg = JobConfig(
        app="demo",
        streams=(stream,),
        checkpoint=str(work / "checkpoint"),
        slices=SLICES,
        groups=4,
        local_dir=str(work / "stores"),
        max_records_per_shard=8_000,
    )
    out_dir = str(work / "outputs")
    spark = session(MASTER, groups=cfg.groups, app_name="shardless-demo", ui=False)
    reports: list[BatchReport] = []
    finished: list[float] = []
    wiped = 0

    def on_report(report: BatchReport) -> None:
        nonlocal wiped
        reports.append(report)
        finished.append(time.perf_counter())
        full = sum(1 for r in report.restored if r["from_version"] == 0)
        print(
            f"  batch {report.batch_id}: {report.records:,} records, {report.outputs:,} outputs, "
            f"{report.committed_slices} slices committed, {full} slices rebuilt from S3, "
            f"slowest group {report.group_seconds_max:.2f}s, "
            f"at {time.perf_counter() - started:.1f}s"
        )
        if report.batch_id in (1, 2):
            wiped += wipe(Path(cfg.local_dir), cfg.app, WIPED_SLICES)
            print(f"  -> wiped the local stores of {len(WIPED_SLICES)} slices")

    handler = load_handler(APP_FILE)
    started = time.perf_counter()
    query = start(
        spark, handler, cfg, sink=parquet_sink(out_dir), on_report=on_report, available_now=True
    )
    query.awaitTermination()
    job_s = time.perf_counter() - started

    t = time.perf_counter()
    expected, total = reference_fold(kinesis, stream)
    print(f"reference fold {time.perf_counter() - t:.1f}s")
    problems = check_outputs(spark, out_dir, expected)
    rebuilt, committed_slices = durable_state(cfg, work / "verify")
    if rebuilt != expected:
        missing = [u for u in expected if rebuilt.get(u) != expected[u]][:5]
        problems.append(f"durable state differs from the reference fold, e.g. for {missing}")
    processed = sum(r.records for r in reports)
    if processed != total:
        problems.append(f"job processed {processed} records, the stream holds {total}")
    # restores that brought state (a first look at a slice without any is not one)
    restores = [r for rep in reports for r in rep.restored]
    full = [r for r in restores if r["from_version"] == 0]
    if not full:
        problems.append("no slice was rebuilt from S3: the restore was not exercised")
    spark.stop()

    summary = {
        "events": total,
        "users": len(expected),
        "slices": SLICES,
        "slices_with_state": committed_slices,
        "batches": len(reports),
        "slices_rebuilt_from_s3": len(full),
        "records_restored": sum(r["records"] for r in full),
        "catch_ups": len(restores) - len(full),
        "job_seconds": round(job_s, 1),
        "events_per_second": round(total / job_s),
        "steady_events_per_second": round(
            sum(r.records for r in reports[1:]) / max(finished[-1] - finished[0], 1e-9)
        ),
        "check": "ok" if not problems else "MISMATCH",
    }
    print(json.dumps(summary, indent=2))
    for p in problems[:20]:
        print(f"MISMATCH: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
