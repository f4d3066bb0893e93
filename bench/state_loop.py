"""The state engine's task loop without Spark, on one core: `python -m bench.state_loop`.

Each micro-batch is routed to slices as in production, every slice's records go through
`run_slice` on a `Transaction` over the slice's own `SliceStore`, and then the local commit
(`store.commit(changes, version, tx.undo(changes))`). Events and the per-slice grouping are
built before timing (Spark's work in a job). The baseline does the same per-record work on
plain rocksdict: get, msgpack +1, put into a WriteBatch written per slice per batch.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from rocksdict import Options, Rdict, WriteBatch

from bench import harness
from shardless.processor.api.context import Context, Event, Timer
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.runtime.routing import route
from shardless.processor.runtime.slice_runner import run_slice
from shardless.state import encoding, keys
from shardless.state.store import SliceStore
from shardless.state.transaction import Transaction

SLICES = 256
ZIPF_S = 1.1
NOW_MS = 1_700_000_000_000
LATENESS_MS = 5_000
GOALS = {
    "zipf_records_per_s": 150_000,
    "uniform_records_per_s": 60_000,
    "max_raw_ratio": 2.0,
    "empty_batch_ms": 50,
}

Batch = list[tuple[int, list[Event]]]  # (slice, its events in stream order), by slice
Timing = list[tuple[int, float]]  # (records, seconds) per micro-batch


def counter(event: Event, ctx: Context) -> None:
    n = ctx.state.get(0) + 1
    ctx.state.set(n)


def key_ids(dist: str, records: int, n_keys: int, seed: int) -> list[int]:
    """Key indexes: bounded Zipf (p(k) ∝ 1/k^s over ranks 1..n_keys) or uniform."""
    rng = np.random.default_rng(seed)
    if dist == "uniform":
        return rng.integers(0, n_keys, records).tolist()
    cdf = np.cumsum(1.0 / np.arange(1, n_keys + 1, dtype=np.float64) ** ZIPF_S)
    cdf /= cdf[-1]
    ids = np.searchsorted(cdf, rng.random(records), side="right")
    return np.minimum(ids, n_keys - 1).tolist()


def build_batches(ids: list[int], prefix: str, slice_of: list[int], size: int) -> list[Batch]:
    """Events keyed `<prefix><id>`, each with its own key string, as Spark's rows give them."""
    arrival = datetime.fromtimestamp(NOW_MS / 1000, tz=UTC)
    batches = []
    for start in range(0, len(ids), size):
        by_slice: dict[int, list[Event]] = {}
        for seq, k in enumerate(ids[start : start + size], start):
            key = f"{prefix}{k}"
            event = Event("bench", "shardId-000000000000", str(seq), 0, key, arrival, b"{}")
            by_slice.setdefault(slice_of[k], []).append(event)
        batches.append(sorted(by_slice.items()))
    return batches


class Engine:
    """Every slice's open store and handler, run batch by batch as the runtime runs them."""

    def __init__(self, root: Path, factory: HandlerFactory) -> None:
        self.stores = [SliceStore(root / f"slice-{s:05d}", {"slice": s}) for s in range(SLICES)]
        self.handlers = [factory.make(s) for s in range(SLICES)]
        self.versions = [0] * SLICES

    def run(self, batch_id: int, batch: Batch) -> int:
        """One micro-batch (processing time advances 1 s per batch id); returns timers fired."""
        now = NOW_MS + 1_000 * batch_id
        fired = 0
        for s, events in batch:
            store = self.stores[s]
            tx = Transaction(store)
            result = run_slice(
                self.handlers[s], tx, s, batch_id, now, now - LATENESS_MS, events, encoding.MSGPACK
            )
            fired += result.timers_fired
            changes = tx.changes()
            if changes:
                self.versions[s] += 1
                store.commit(changes, self.versions[s], tx.undo(changes))
        return fired

    def total(self) -> int:
        """The sum of every stored counter."""
        return sum(
            encoding.decode(v) for st in self.stores for k, v in st.items() if keys.is_value_key(k)
        )

    def close(self) -> None:
        for store in self.stores:
            store.close()


def timed(batches: list[Batch], run: Callable[[int, Batch], Any]) -> Timing:
    gc.collect()
    out = []
    for b, batch in enumerate(batches):
        started = time.perf_counter()
        run(b, batch)
        out.append((sum(len(e) for _, e in batch), time.perf_counter() - started))
    return out


def rate(timing: Timing) -> float:
    return sum(n for n, _ in timing) / sum(t for _, t in timing)


class RawEngine:
    """The baseline: the same counting on plain rocksdict, one WriteBatch per slice per batch."""

    def __init__(self, root: Path) -> None:
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        self.dbs = [Rdict(str(root / f"raw-{s:05d}"), opts) for s in range(SLICES)]

    def run(self, _: int, batch: Batch) -> None:
        packb, unpackb = msgpack.packb, msgpack.unpackb
        for s, events in batch:
            db = self.dbs[s]
            wb = WriteBatch(raw_mode=True)
            seen: dict[bytes, int] = {}  # this batch's own writes, which the db cannot see
            for event in events:
                k = event.key.encode()
                n = seen.get(k)
                if n is None:
                    raw = db.get(k)
                    n = 0 if raw is None else unpackb(raw)
                n += 1
                seen[k] = n
                wb.put(k, packb(n))
            db.write(wb)

    def total(self) -> int:
        return sum(msgpack.unpackb(v) for db in self.dbs for _, v in db.items())

    def close(self) -> None:
        for db in self.dbs:
            db.close()


def interleaved(batches: list[Batch], *runs: Callable[[int, Batch], Any]) -> list[Timing]:
    """Time each batch on every contender in turn, so machine noise hits all of them alike."""
    gc.collect()
    timings: list[Timing] = [[] for _ in runs]
    for b, batch in enumerate(batches):
        size = sum(len(e) for _, e in batch)
        for run, timing in zip(runs, timings, strict=True):
            started = time.perf_counter()
            run(b, batch)
            timing.append((size, time.perf_counter() - started))
    return timings


def empty_batch_ms(engine: Engine, batch_id: int, reps: int) -> float:
    """Median ms of a batch of every slice with no records, no due timers, nothing to commit."""
    versions = list(engine.versions)
    runs = []
    for _ in range(reps):
        started = time.perf_counter()
        engine.run(batch_id, [(s, []) for s in range(SLICES)])
        runs.append(time.perf_counter() - started)
    assert engine.versions == versions, "an empty batch committed something"
    return statistics.median(runs) * 1000


def timer_bench(n: int, root: Path) -> dict[str, float]:
    """n timers set through `ctx.timers.set` in one batch, fired by `on_timer` in a later one."""
    fired: list[int] = [0]

    def set_timer(event: Event, ctx: Context) -> None:
        ctx.timers.set(ctx.now_ms + 1_000)

    def on_timer(timer: Timer, ctx: Context) -> None:
        fired[0] += 1

    slice_of = [route(f"timer-{i}", None, SLICES) for i in range(n)]
    [setting] = build_batches(list(range(n)), "timer-", slice_of, n)
    engine = Engine(root, HandlerFactory(set_timer, on_timer=on_timer))
    firing: Batch = [(s, []) for s in range(SLICES)]  # every slice has due timers
    # batch ids 0 then 2: processing time advances 2 s, past every timer (now + 1 s)
    (_, t_set), (_, t_fire) = timed([setting, firing], lambda b, batch: engine.run(2 * b, batch))
    assert fired[0] == n, f"{fired[0]} of {n} timers fired"
    after = empty_batch_ms(engine, 3, 5)
    engine.close()
    return {
        "timers_per_s": n / (t_set + t_fire),
        "timers_set_per_s": n / t_set,
        "timers_fired_per_s": n / t_fire,
        "empty_batch_ms_after_timers": after,
    }


def profile(batches: list[Batch], root: Path, top: int = 30) -> None:
    """cProfile of the steady-state batches (after one warm-up batch), to stderr."""
    engine = Engine(root, HandlerFactory(counter))
    engine.run(0, batches[0])
    prof = cProfile.Profile()
    prof.enable()
    for b, batch in enumerate(batches[1:], 1):
        engine.run(b, batch)
    prof.disable()
    engine.close()
    pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(top)


def workload(dist: str, batches: list[Batch], tmp: str, out: dict[str, Any]) -> None:
    gc.freeze()  # the pre-built events are not the loop's garbage to collect
    engine = Engine(Path(tmp, f"shardless-{dist}"), HandlerFactory(counter))
    baseline = RawEngine(Path(tmp, f"raw-{dist}"))
    timing, raw = interleaved(batches, engine.run, baseline.run)
    assert engine.total() == sum(n for n, _ in timing), "shardless counts do not add up"
    assert baseline.total() == sum(n for n, _ in raw), "raw counts do not add up"
    baseline.close()
    if dist == "uniform":
        out["empty_batch_ms_256_slices"] = empty_batch_ms(engine, len(batches), 9)
    engine.close()
    gc.unfreeze()
    out[f"{dist}_records_per_s"] = rate(timing[1:])
    out[f"raw_{dist}_records_per_s"] = rate(raw[1:])
    # the median of per-batch ratios: robust to a noisy neighbour slowing one batch
    ratios = sorted(r / t for (_, t), (_, r) in zip(timing[1:], raw[1:], strict=True))
    out[f"{dist}_vs_raw"] = ratios[len(ratios) // 2]
    out[f"{dist}_warmup_records_per_s"] = rate(timing[:1])
    out[f"raw_{dist}_warmup_records_per_s"] = rate(raw[:1])
    out[f"{dist}_steady_batch_records_per_s"] = [round(rate([t])) for t in timing[1:]]


def goals(out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    values = {
        "zipf_records_per_s": out["zipf_records_per_s"],
        "uniform_records_per_s": out["uniform_records_per_s"],
        "max_raw_ratio": 1 / min(out["zipf_vs_raw"], out["uniform_vs_raw"]),  # raw / shardless
        "empty_batch_ms": out["empty_batch_ms_256_slices"],
    }
    at_most = {"max_raw_ratio", "empty_batch_ms"}
    return {
        name: {
            "target": target,
            "value": round(values[name], 3),
            "met": values[name] <= target if name in at_most else values[name] >= target,
        }
        for name, target in GOALS.items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=100_000, help="records per micro-batch")
    parser.add_argument("--timers", type=int, default=200_000, help="0: no timer figures")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--profile", choices=["zipf", "uniform"], help="only cProfile to stderr")
    parser.add_argument("--cpu", type=int, help="pin to this CPU (RocksDB's threads included)")
    args = parser.parse_args(argv)
    for name in ("keys", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be 1 or more, not {getattr(args, name)}")
    if args.records < 2:
        parser.error(f"--records must be 2 or more (a warm-up batch, then one), not {args.records}")
    if args.timers < 0:
        parser.error(f"--timers must be 0 (none) or more, not {args.timers}")
    size = max(1, min(args.batch, args.records // 2))  # at least one batch after the warm-up
    if args.cpu is not None:  # the loop is one thread either way; this also pins RocksDB's
        os.sched_setaffinity(0, {args.cpu})

    slice_of = [route(f"user-{i}", None, SLICES) for i in range(args.keys)]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="shardless-bench-") as tmp:
        for i, dist in enumerate(("zipf", "uniform")):
            if args.profile not in (None, dist):
                continue
            ids = key_ids(dist, args.records, args.keys, args.seed + i)
            out[f"{dist}_distinct_keys"] = len(set(ids))
            batches = build_batches(ids, "user-", slice_of, size)
            del ids
            print(f"{dist}: {len(batches)} batches", file=sys.stderr, flush=True)
            if args.profile:
                return profile(batches, Path(tmp, "profile"))
            workload(dist, batches, tmp, out)
            del batches
        if args.timers:
            out |= timer_bench(args.timers, Path(tmp, "timers"))
    out["config"] = {
        "records": args.records,
        "keys": args.keys,
        "batch_size": size,
        "batches": -(-args.records // size),
        "warmup_batches": 1,
        "slices": SLICES,
        "zipf_s": ZIPF_S,
        "timers": args.timers,
        "seed": args.seed,
        "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": sys.version.split()[0],
        "rocksdict": version("rocksdict"),
        "msgpack": version("msgpack"),
        "numpy": np.__version__,
    }
    out["goals"] = goals(out)
    harness.print_figures(out, args.json, width=36, digits=2)


if __name__ == "__main__":
    main()
