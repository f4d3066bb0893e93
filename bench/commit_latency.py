"""How long a group's DynamoDB round trips wait when it has more than 100 slices:
`python -m bench.commit_latency --json`.

A group commits its slices' heads in one `TransactWriteItems` per 100 slices, and reads heads it
does not know (its first batch on a host, a group that moved, a tool over every slice) in one
`BatchGetItem` per 100 (`shardless.changelog.durable`). Both are sent together; the baseline,
measured in the same run and interleaved round by round, sends them one at a time
(`TRANSACTION_THREADS = 1`, `READ_THREADS = 1`, how it was done before). Both go to moto server over
HTTP, through `shardless.processor.local.faults.fault_proxy`, which adds a fixed delay to every
`TransactWriteItems` and `BatchGetItem` to stand for the round trip to a regional DynamoDB endpoint
(`--rtt-ms`); a delay of 0 goes to moto on loopback directly, without the proxy. The figures: the
`dynamodb` step of `DurableState.commit` (the transactions, from the first request to the last
answer) and the whole of `DurableState.heads`, median per configuration; the ratio is together / one
at a time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import time
from importlib.metadata import version
from typing import Any

from bench import harness
from shardless.changelog import durable as durable_module
from shardless.changelog import resources
from shardless.changelog.durable import DurableState, SliceCommit
from shardless.changelog.layout import AppLocation, Head
from shardless.processor.local.faults.fault_proxy import FaultProxy
from shardless.processor.local.faults.rules import Rule

SIZES = (100, 128, 256)  # changed slices in one group's commit: 1, 2 and 3 transactions
READ_SIZES = (100, 128, 256, 1024)  # heads read at once: 1, 2, 3 and 11 BatchGetItem calls
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


def _ready(size: int, warmup: int) -> tuple[DurableState, dict[int, Head], int]:
    """An application whose first `size` slices are committed `warmup + 1` times (heads grow
    their logs to a steady size): its state, the heads and the next batch."""
    loc = AppLocation.default(f"bench-commit-{size}-{os.getpid()}-{time.monotonic_ns()}")
    resources.ensure(loc, max(SLICES, size))
    durable = DurableState(loc)
    created = durable.commit("bench", 0, 0, [SliceCommit(s, 1, None, []) for s in range(size)])
    heads = dict(created.heads)
    for batch in range(1, warmup + 1):
        _commit(durable, heads, batch)
    return durable, heads, warmup + 1


def _modes(r: int) -> tuple[str, str]:
    """Round `r`'s order: the baseline first in even rounds, second in odd ones."""
    return ("one_at_a_time", "together")[:: 1 if r % 2 == 0 else -1]


def _figures(seconds: dict[str, list[float]]) -> dict[str, Any]:
    one, together = (statistics.median(seconds[m]) for m in ("one_at_a_time", "together"))
    return {
        "one_at_a_time_s": round(one, 4),
        "together_s": round(together, 4),
        "ratio": round(together / one, 3),
        "runs": {m: [round(x, 4) for x in v] for m, v in seconds.items()},
    }


def measure(size: int, rounds: int, warmup: int, threads: int) -> dict[str, Any]:
    """Commit `size` slices `warmup` times, then `rounds` times each way, alternating which
    goes first."""
    durable, heads, batch = _ready(size, warmup)
    seconds: dict[str, list[float]] = {"one_at_a_time": [], "together": []}
    transactions = 0
    saved = durable_module.TRANSACTION_THREADS
    try:
        for r in range(rounds):
            for mode in _modes(r):
                durable_module.TRANSACTION_THREADS = 1 if mode == "one_at_a_time" else threads
                took, transactions = _commit(durable, heads, batch)
                seconds[mode].append(took)
                batch += 1
    finally:
        durable_module.TRANSACTION_THREADS = saved
    return {"transactions": transactions, **_figures(seconds)}


def measure_reads(size: int, rounds: int, warmup: int, threads: int) -> dict[str, Any]:
    """Read the heads of `size` committed slices `rounds` times each way, alternating which
    goes first; every read must find every head as committed."""
    durable, heads, _ = _ready(size, warmup)
    wanted = list(range(size))
    seconds: dict[str, list[float]] = {"one_at_a_time": [], "together": []}
    saved = durable_module.READ_THREADS
    try:
        for r in range(rounds):
            for mode in _modes(r):
                durable_module.READ_THREADS = 1 if mode == "one_at_a_time" else threads
                started = time.perf_counter()
                found = durable.heads(wanted)
                seconds[mode].append(time.perf_counter() - started)
                if {s: h.log for s, h in found.items()} != {s: h.log for s, h in heads.items()}:
                    raise RuntimeError(f"{mode}: the heads read are not the ones committed")
    finally:
        durable_module.READ_THREADS = saved
    return {"calls": -(-size // 100), **_figures(seconds)}


def _at(endpoint: str, rtt_ms: float, rounds: int, warmup: int) -> dict[str, Any]:
    """Every size with `rtt_ms` added to each transaction and read (0: straight to moto)."""

    def both() -> dict[str, Any]:
        commits = durable_module.TRANSACTION_THREADS
        reads = durable_module.READ_THREADS
        return {
            "dynamodb_commit": {f"slices_{n}": measure(n, rounds, warmup, commits) for n in SIZES},
            "heads_read": {
                f"slices_{n}": measure_reads(n, rounds, warmup, reads) for n in READ_SIZES
            },
        }

    if rtt_ms <= 0:
        os.environ["AWS_ENDPOINT_URL_DYNAMODB"] = endpoint
        return both()
    with FaultProxy(endpoint, seed=1) as proxy:
        for op in ("TransactWriteItems", "BatchGetItem"):
            proxy.add(Rule("dynamodb", op, delay_s=rtt_ms / 1000))
        os.environ["AWS_ENDPOINT_URL_DYNAMODB"] = proxy.url
        try:
            return both()
        finally:
            os.environ["AWS_ENDPOINT_URL_DYNAMODB"] = endpoint


def run(rtts_ms: list[float], rounds: int, warmup: int) -> dict[str, Any]:
    """{"dynamodb_commit": {rtt: {size: figures}}, "heads_read": {...}}."""
    out: dict[str, Any] = {"dynamodb_commit": {}, "heads_read": {}}
    with harness.emulated_aws("shardless-bench-commit-") as (_, emulators):
        for rtt in rtts_ms:
            for what, sizes in _at(emulators.dynamodb_endpoint, rtt, rounds, warmup).items():
                out[what][f"rtt_{rtt:g}ms"] = sizes
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--rtt-ms",
        type=float,
        action="append",
        help="delay added to each TransactWriteItems and BatchGetItem, ms (repeatable; "
        "default 0 and 30)",
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
        **figures,
        "config": {
            "sizes": list(SIZES),
            "read_sizes": list(READ_SIZES),
            "rtt_ms": rtts,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "transaction_threads": durable_module.TRANSACTION_THREADS,
            "read_threads": durable_module.READ_THREADS,
            "measure": "median seconds of DurableState.commit's dynamodb step, and of "
            "DurableState.heads",
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
    for what in ("dynamodb_commit", "heads_read"):
        for rtt, sizes in figures[what].items():
            for size, f in sizes.items():
                calls = (
                    f"{f['transactions']} transactions"
                    if "transactions" in f
                    else f"{f['calls']} BatchGetItem calls"
                )
                print(
                    f"{what:>15} {rtt:>9} {size:>11}: {calls}, one at a time "
                    f"{f['one_at_a_time_s'] * 1000:7.1f} ms, together "
                    f"{f['together_s'] * 1000:7.1f} ms, ratio {f['ratio']:.2f}"
                )


if __name__ == "__main__":
    main()
