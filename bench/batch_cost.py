"""What one batch costs on AWS: the S3 and DynamoDB calls of batches driven through the real
`GroupRunner.run` against moto over HTTP, counted by type with their billed units
(`bench.billing`), for a slice count, a group count and a share of slices each batch
touches; and what that makes a month at a given trigger.

Part of `python -m bench.restore` (its "requests" part).
"""

from __future__ import annotations

import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import urllib3

from bench import billing
from bench.billing import Requests
from shardless.changelog import resources
from shardless.changelog.durable import DurableState
from shardless.changelog.layout import AppLocation, encode_log, encode_snaps
from shardless.processor.api.context import Context, Event
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.runtime.config import RuntimeConfig
from shardless.processor.runtime.group_runner import GroupRunner
from shardless.processor.runtime.grouping import group_keys, group_slices
from shardless.processor.runtime.routing import route

QUERY = "bench-query"
NOW_MS = 1_700_000_000_000
DDB_WRITES = {"PutItem", "UpdateItem", "TransactWriteItems", "BatchWriteItem", "DeleteItem"}
TRIGGERS_S = (1, 10)


def counter(event: Event, ctx: Context) -> None:
    ctx.state.set(ctx.state.get(0) + 1)


def keys_by_slice(slices: int, per_slice: int, prefix: str) -> list[list[str]]:
    """`per_slice` record keys routed to each slice, as production routes them."""
    out: list[list[str]] = [[] for _ in range(slices)]
    short, i = slices, 0
    while short:
        key = f"{prefix}{i}"
        i += 1
        found = out[route(key, None, slices)]
        if len(found) < per_slice:
            found.append(key)
            short -= len(found) == per_slice
    return out


def new_app(name: str, slices: int) -> AppLocation:
    loc = AppLocation.default(f"bench-{name}-{int(time.time() * 1000) % 10**8}")
    resources.ensure(loc, slices)
    return loc


@contextmanager
def http_requests() -> Iterator[list[int]]:
    """Every HTTP request this process sends through urllib3 (any client, any service)."""
    seen = [0]
    pool = urllib3.connectionpool.HTTPConnectionPool
    original = pool.urlopen

    def urlopen(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        return original(self, *args, **kwargs)

    pool.urlopen = urlopen
    try:
        yield seen
    finally:
        pool.urlopen = original


def summary(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "max": max(values), "min": min(values)}


def _of(calls: Counter, service: str, names: set[str] | None = None) -> int:
    return sum(
        n for (svc, op), n in calls.items() if svc == service and (names is None or op in names)
    )


def batch_cost(
    tmp: Path,
    requests: Requests,
    frame: Any,
    slices: int,
    groups: int,
    batches: int,
    per_slice: int = 4,
    touched: float = 1.0,
    seed: int = 42,
    commit_format: str = "chains",
    chain_length: int | None = None,
) -> dict[str, Any]:
    """Run `batches` batches of `groups` groups over `slices` slices, each batch touching a
    random `touched` share of the slices with `per_slice` records each; then one batch with
    no records. `frame(rows, first_seq)` builds a group's input from (key, slice) rows.

    Figures are per batch, over every batch but the first: means, since snapshots come on
    a cadence, and the most seen. The first batch touches every slice whatever `touched`
    says: it reads the heads it starts from and, with chains, takes every slice over (one
    head write each, once per query); its requests are reported on their own, so the
    others show the steady state, not a mix of slices seen for the first time."""
    loc = new_app(f"cost-{slices}", slices)
    # laid out as a job lays its groups out (each group a range, named by its Spark key)
    cfg = RuntimeConfig(
        loc, slices, str(tmp / "cost"), partitions=groups, commit_format=commit_format,
        chain_length=chain_length,
    )  # fmt: skip
    runner = GroupRunner(HandlerFactory(counter), cfg)
    by_slice = keys_by_slice(slices, per_slice, "req-")
    members = [group_slices(g, slices, groups) for g in range(groups)]
    keys = group_keys(groups)
    rng = random.Random(seed)
    wanted = max(1, round(slices * touched))
    pending: list[dict] = [{} for _ in range(groups)]
    calls: list[Counter] = []
    units: list[Counter] = []
    seconds: list[float] = []
    seq = 0
    requests.take()
    for b in range(batches):
        every = touched >= 1 or b == 0
        chosen = set(range(slices)) if every else set(rng.sample(range(slices), wanted))
        started = time.perf_counter()
        for g in range(groups):
            rows = [(k, s) for s in members[g] if s in chosen for k in by_slice[s]]
            pdf = frame(rows, seq) if rows else None
            seq += len(rows)
            _, pending[g] = runner.run(keys[g], QUERY, b, pdf, pending[g], NOW_MS + 1_000 * b)
        seconds.append(time.perf_counter() - started)
        c, u = requests.take()
        calls.append(c)
        units.append(u)
    assert all(not p for p in pending), "the counter handler set no timers"
    with http_requests() as http:  # nothing at all, through any client
        for g in range(groups):
            runner.run(keys[g], QUERY, batches, None, {}, NOW_MS + 1_000 * batches)
    idle_calls, idle_units = requests.take()
    heads = DurableState(loc).heads(list(range(slices))).values()
    head_kb = [(len(encode_log(h.log)) + len(encode_snaps(h.snaps)) + 100) / 1024 for h in heads]

    steady, steady_units = calls[1:], units[1:]
    segment_puts = [c[("s3", "PutObject:segment")] for c in steady]
    snapshot_puts = [c[("s3", "PutObject:snapshot")] for c in steady]
    s3 = [billing.s3_requests(c) for c in steady]
    per_batch = {
        "dynamodb_write_units": statistics.fmean(u["dynamodb_write_units"] for u in steady_units),
        "dynamodb_read_units": statistics.fmean(u["dynamodb_read_units"] for u in steady_units),
        "s3_puts": statistics.fmean(p for p, _ in s3),
        "s3_gets": statistics.fmean(g for _, g in s3),
    }
    return {
        "slices": slices,
        "groups": groups,
        "commit_format": commit_format,
        "touched": touched,
        "batches": batches,
        "dynamodb_write_units_per_batch": per_batch["dynamodb_write_units"],
        "dynamodb_write_units_per_batch_max": max(u["dynamodb_write_units"] for u in steady_units),
        "dynamodb_read_units_per_batch": per_batch["dynamodb_read_units"],
        "dynamodb_writes_per_batch": max(_of(c, "dynamodb", DDB_WRITES) for c in steady),
        "s3_puts_per_batch": max(segment_puts),
        "s3_snapshot_puts_per_batch": statistics.fmean(snapshot_puts),
        "s3_puts_per_batch_with_snapshots": statistics.fmean(
            s + p for s, p in zip(segment_puts, snapshot_puts, strict=True)
        ),
        "s3_gets_per_batch": per_batch["s3_gets"],
        "steady_batch_requests": {
            f"{svc}.{op}": round(n / len(steady), 2)
            for (svc, op), n in sorted(sum(steady, Counter()).items())
        },
        "first_batch_requests": {f"{svc}.{op}": n for (svc, op), n in sorted(calls[0].items())},
        "head_item_kb": summary(head_kb),
        "head_log_entries": summary([len(h.log) for h in heads]),
        "idle_batch_requests": max(http[0], sum(idle_calls.values())),
        "idle_batch_units": sum(idle_units.values()),
        "batch_seconds": summary(seconds[1:]),
        "per_batch": per_batch,
        "dollars_per_month": monthly(per_batch),
    }


def monthly(per_batch: dict[str, float]) -> dict[str, dict[str, float]]:
    """Dollars a month at each trigger of `TRIGGERS_S` for a batch costing `per_batch`."""
    return {
        f"trigger_{t}s": {
            k: round(v, 2) for k, v in billing.dollars_per_month(per_batch, t).items()
        }
        for t in TRIGGERS_S
    }


def with_roll_overs(run: dict[str, Any], rolled: dict[str, Any], length: int) -> dict[str, Any]:
    """`run` (chains, at the default chain length) with what its roll-overs add, measured in
    `rolled`: the same slices, every slice touched, chains rolled over every 2 positions, so
    every other steady batch rolls every group's chain over (sealing it and taking each
    slice over: a head write each). One roll-over of all groups then costs twice the extra
    units per batch; a chain of `length` positions spreads it over `length` batches (at
    10 % of slices touched a batch, every slice still changes within a chain's life)."""
    extra = max(
        0.0, rolled["per_batch"]["dynamodb_write_units"] - run["per_batch"]["dynamodb_write_units"]
    )
    roll_over = extra * 2
    per_batch = dict(run["per_batch"])
    per_batch["dynamodb_write_units"] += roll_over / length
    return run | {
        "chain_length": length,
        "roll_over_write_units": roll_over,
        "dynamodb_write_units_per_batch_steady": run["dynamodb_write_units_per_batch"],
        "dynamodb_write_units_per_batch": per_batch["dynamodb_write_units"],
        "per_batch": per_batch,
        "dollars_per_month": monthly(per_batch),
    }


def cost_table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (slices, touched share, trigger): units and dollars a month."""
    return [
        {
            "slices": r["slices"],
            "touched": r["touched"],
            "trigger_s": t,
            "dynamodb_write_units_per_batch": round(r["dynamodb_write_units_per_batch"], 1),
            "s3_puts_per_batch": round(r["s3_puts_per_batch_with_snapshots"], 1),
            **{
                f"{k}_dollars_per_month": v
                for k, v in r["dollars_per_month"][f"trigger_{t}s"].items()
            },
        }
        for r in runs
        for t in TRIGGERS_S
    ]
