"""How long a group's DynamoDB commit waits when it has more than 100 changed slices:
`python -m bench.commit_latency --json`.

A group commits its slices' heads in one `TransactWriteItems` per 100 slices
(`changelog.durable`). They are sent together; the baseline, measured in the same run and
interleaved round by round, sends them one at a time (`TRANSACTION_THREADS = 1`, how it
was done before). Both commit the same heads to moto server over HTTP, through
`processor.fault_proxy`, which adds a fixed delay to every `TransactWriteItems` to stand
for the round trip to a regional DynamoDB endpoint (`--rtt-ms`); a delay of 0 goes to
moto on loopback directly, without the proxy. The figure is the `dynamodb` step of
`DurableState.commit` (the transactions, from the first request to the last answer),
median per configuration; the ratio is together / one at a time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from changelog import durable as durable_module
from changelog import resources
from changelog.durable import DurableState, SliceCommit
from changelog.layout import AppLocation, Head
from processor import local_aws
from processor.fault_proxy import FaultProxy, Rule

SIZES = (100, 128, 256)  # changed slices in one group's commit: 1, 2 and 3 transactions
SLICES = 256


def _commit(durable: DurableState, heads: dict[int, Head], batch: int) -> tuple[float, int]:
    """One batch's commit of every slice in `heads` (one small change each); the heads are
    updated to the ones written."""
    commits = [
        SliceCommit(s, h.version + 1, h, [(b"d" + f"k{s}".encode(), str(batch).encode())])
        for s, h in heads.items()
    ]
    done = durable.commit("bench", batch, 0, commits, owner="bench")
    heads.update(done.heads)
    return done.seconds["dynamodb"], done.transactions


def measure(size: int, rounds: int, warmup: int, threads: int) -> dict[str, Any]:
    """Commit `size` slices `warmup` times (heads grow their logs to a steady size), then
    `rounds` times each way, alternating which goes first."""
    loc = AppLocation.default(f"bench-commit-{size}-{os.getpid()}-{time.monotonic_ns()}")
    resources.ensure(loc, SLICES)
    durable = DurableState(loc)
    created = durable.commit("bench", 0, 0, [SliceCommit(s, 1, None, []) for s in range(size)])
    heads = dict(created.heads)
    batch = 1
    for _ in range(warmup):
        _commit(durable, heads, batch)
        batch += 1
    seconds: dict[str, list[float]] = {"one_at_a_time": [], "together": []}
    transactions = 0
    saved = durable_module.TRANSACTION_THREADS
    try:
        for r in range(rounds):
            for mode in ("one_at_a_time", "together")[:: 1 if r % 2 == 0 else -1]:
                durable_module.TRANSACTION_THREADS = 1 if mode == "one_at_a_time" else threads
                took, transactions = _commit(durable, heads, batch)
                seconds[mode].append(took)
                batch += 1
    finally:
        durable_module.TRANSACTION_THREADS = saved
    one, together = (statistics.median(seconds[m]) for m in ("one_at_a_time", "together"))
    return {
        "transactions": transactions,
        "one_at_a_time_s": round(one, 4),
        "together_s": round(together, 4),
        "ratio": round(together / one, 3),
        "runs": {m: [round(x, 4) for x in v] for m, v in seconds.items()},
    }


def _at(endpoint: str, rtt_ms: float, rounds: int, warmup: int) -> dict[str, Any]:
    """Every size with `rtt_ms` added to each transaction (0: straight to moto, no proxy)."""
    threads = durable_module.TRANSACTION_THREADS
    if rtt_ms <= 0:
        os.environ["AWS_ENDPOINT_URL_DYNAMODB"] = endpoint
        return {f"slices_{n}": measure(n, rounds, warmup, threads) for n in SIZES}
    with FaultProxy(endpoint, seed=1) as proxy:
        proxy.add(Rule("dynamodb", "TransactWriteItems", delay_s=rtt_ms / 1000))
        os.environ["AWS_ENDPOINT_URL_DYNAMODB"] = proxy.url
        try:
            return {f"slices_{n}": measure(n, rounds, warmup, threads) for n in SIZES}
        finally:
            os.environ["AWS_ENDPOINT_URL_DYNAMODB"] = endpoint


def run(rtts_ms: list[float], rounds: int, warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="shardless-bench-commit-") as tmp:
        emulators = local_aws.start("kinesalite", log_dir=Path(tmp, "local-aws"))
        try:
            emulators.apply_env()
            for rtt in rtts_ms:
                out[f"rtt_{rtt:g}ms"] = _at(emulators.dynamodb_endpoint, rtt, rounds, warmup)
        finally:
            emulators.stop()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--rtt-ms",
        type=float,
        action="append",
        help="delay added to each TransactWriteItems, ms (repeatable; default 0 and 30)",
    )
    parser.add_argument("--rounds", type=int, default=15, help="commits each way per size")
    parser.add_argument("--warmup", type=int, default=8, help="unmeasured commits per size")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the emulators on a kill
    rtts = args.rtt_ms or [0.0, 30.0]
    started = time.monotonic()
    figures = run(rtts, args.rounds, args.warmup)
    out = {
        "dynamodb_commit": figures,
        "config": {
            "sizes": list(SIZES),
            "rtt_ms": rtts,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "transaction_threads": durable_module.TRANSACTION_THREADS,
            "measure": "median seconds of DurableState.commit's dynamodb step",
            "python": sys.version.split()[0],
            "moto": version("moto"),
            "boto3": version("boto3"),
            "cpus": len(os.sched_getaffinity(0)),
            "wall_s": round(time.monotonic() - started, 1),
        },
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for rtt, sizes in figures.items():
        for size, f in sizes.items():
            print(
                f"{rtt:>9} {size:>11}: {f['transactions']} transactions, one at a time "
                f"{f['one_at_a_time_s'] * 1000:7.1f} ms, together {f['together_s'] * 1000:7.1f} "
                f"ms, ratio {f['ratio']:.2f}"
            )


if __name__ == "__main__":
    main()
