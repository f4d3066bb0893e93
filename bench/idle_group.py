"""A group back on its host after batches Spark did not call it in (no records, no timer
due): `python -m bench.idle_group --json`.

One group of `--slices` slices is driven through `GroupRunner.run` against moto server
over HTTP for `--history` batches (a chain that long; snapshots every 32 versions, as in
production). Then three arms, alternated for `--reps` rounds, each one batch of the same
records:

- `steady`: the batch right after the group's previous one (the heads the host knows are
  current by Spark's order alone);
- `vouched`: after `--idle` batches without the group, what the host knew is checked
  against DynamoDB (`group_chain.unchanged_since`: the chain's tip and the head items);
- `read_afresh`: the same gap with what the host knew forgotten first
  (`KnownHeads.forget`): every head read again through the chain and the chain found
  again, as every batch after a gap did before.

Per arm: the batch's seconds (median), the seconds of its `heads` and `chain` steps, and
its S3 and DynamoDB requests, counted (`bench.billing.Requests`). Ratios are against
`steady` in the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd

from bench import harness
from bench.batch_cost import counter, keys_by_slice, new_app
from bench.billing import Requests
from bench.restore import frame
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.runtime import stores
from shardless.processor.runtime.group_runner import GroupRunner, RuntimeConfig

QUERY = "bench-idle"
NOW_MS = 1_700_000_000_000
ARMS = ("steady", "vouched", "read_afresh")


def metrics_of(out: pd.DataFrame) -> dict[str, Any]:
    return json.loads(out[out.kind == "metrics"].value.iloc[-1])


class Group:
    """One group of a 2-group job (`slices` of 2 * `slices`), run batch by batch."""

    def __init__(self, root: Path, slices: int, per: int) -> None:
        self.loc = new_app("idle", 2 * slices)
        self.root = root
        self.slices = slices
        self.runner = GroupRunner(
            HandlerFactory(counter), RuntimeConfig(self.loc, 2 * slices, str(root))
        )
        self.keys = keys_by_slice(2 * slices, 50, "user-")[:slices]
        self.per = per
        self.batch = 0
        self.seq = 0
        self.pending: dict = {}

    def run(self) -> dict[str, Any]:
        """The next batch: `per` records for every slice of the group; its metrics."""
        b = self.batch
        rows = [(ks[(b * self.per + j) % len(ks)], s) for s, ks in enumerate(self.keys)
                for j in range(self.per)]  # fmt: skip
        started = time.perf_counter()
        out, self.pending = self.runner.run(
            0, QUERY, b, frame(rows, self.seq), self.pending, NOW_MS + 1_000 * b
        )
        seconds = time.perf_counter() - started
        self.seq += len(rows)
        self.batch += 1
        return {**metrics_of(out), "wall_s": seconds}

    def forget(self) -> None:
        cfg = self.runner.config
        stores.cache_for(cfg.local_dir, cfg.location.app, cfg.slices).known.forget(0)


def one(group: Group, arm: str, idle: int, requests: Requests) -> dict[str, Any]:
    """One batch of `arm`, its seconds, steps and requests."""
    if arm != "steady":
        group.batch += idle  # batches Spark ran without calling this group
    if arm == "read_afresh":
        group.forget()
    requests.take()
    m = group.run()
    calls, _ = requests.take()
    if (arm == "vouched") != ("heads_vouched" in m) or (arm == "read_afresh") != bool(
        m["heads_read"]
    ):
        raise RuntimeError(f"arm {arm}: the batch did not take its path: {m}")
    return {
        "seconds": m["wall_s"],
        "heads_s": m["timings"].get("heads", 0.0),
        "chain_s": m["timings"].get("chain", 0.0),
        "heads_read": m["heads_read"],
        "s3_gets": calls[("s3", "GetObject")],
        "dynamodb_requests": sum(n for (service, _), n in calls.items() if service == "dynamodb"),
    }


def measure(slices: int, history: int, idle: int, reps: int, per: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="bench-idle-"))
    try:
        group = Group(root, slices, per)
        for _ in range(history):
            group.run()
        requests = Requests()
        try:
            runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
            for rep in range(reps):
                order = ARMS if rep % 2 == 0 else ARMS[::-1]
                for arm in order:
                    runs[arm].append(one(group, arm, idle, requests))
        finally:
            requests.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    arms = {arm: summary(rs) for arm, rs in runs.items()}
    steady = arms["steady"]["seconds"]
    return {
        "slices": slices,
        "history_batches": history,
        "idle_batches": idle,
        "reps": reps,
        "records_per_batch": slices * per,
        "arms": arms,
        "vouched_over_steady": round(arms["vouched"]["seconds"] / steady, 2),
        "read_afresh_over_steady": round(arms["read_afresh"]["seconds"] / steady, 2),
        "read_afresh_over_vouched": round(
            arms["read_afresh"]["seconds"] / arms["vouched"]["seconds"], 2
        ),
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {
        "seconds": round(med["seconds"], 4),
        "seconds_each": [round(r["seconds"], 4) for r in runs],
        "heads_s": round(med["heads_s"], 4),
        "chain_s": round(med["chain_s"], 4),
        "heads_read": med["heads_read"],
        "s3_gets": med["s3_gets"],
        "dynamodb_requests": med["dynamodb_requests"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the JSON summary only")
    p.add_argument("--slices", type=int, default=128, help="the group's slices (of twice that)")
    p.add_argument("--history", type=int, default=60, help="batches before the arms")
    p.add_argument("--idle", type=int, default=2, help="batches without the group")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--per", type=int, default=4, help="records per slice and batch")
    args = p.parse_args(argv)
    with harness.emulated_aws("bench-idle-aws-"):
        out = measure(args.slices, args.history, args.idle, args.reps, args.per)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for arm, f in out["arms"].items():
            print(
                f"{arm:12s} {f['seconds'] * 1000:8.1f} ms  heads {f['heads_s'] * 1000:7.1f} ms"
                f"  chain {f['chain_s'] * 1000:7.1f} ms  S3 GETs {f['s3_gets']:4}"
                f"  DynamoDB {f['dynamodb_requests']:4}"
            )
        print(f"read afresh / vouched: {out['read_afresh_over_vouched']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
