"""What a batch's multi-get of its keys costs a slice store, with shardless's RocksDB options
and with RocksDB's defaults (`python -m bench.store_reads --json`).

A batch reads each distinct key it touches once, in one multi-get (`Transaction.prefetch`).
On a large key space many of those keys are not in the store yet, and after a snapshot's
checkpoint has flushed the memtable a few times the store is a memtable plus several L0
SST files: without filters, every miss searches all of them. Measured here per key, on
stores built the same way under both sets of options (`--writes` batches of `--keys`
keys over 1,000,000 possible ones, a flush every `--flush-every` batches, as a snapshot's
checkpoint does), for reads that all miss, half hit, and all hit; interleaved over
`--rounds`, medians, and the ratio of shardless's options to the defaults in the same run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rocksdict import Checkpoint, Options, Rdict, WriteBatch

from shardless.state.keys import data_key
from shardless.state.store import SliceStore

MIXES = {"all_miss": 0.0, "half_hit": 0.5, "all_hit": 1.0}


def _defaults() -> Options:
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    return opts


def _flusher(db: Rdict, where: Path) -> Callable[[int], None]:
    """What a snapshot does to a store: a checkpoint, which flushes its memtable to L0."""
    return lambda b: Checkpoint(db).create_checkpoint(str(where.with_name(f"{where.name}-ck{b}")))


def _build(
    db: Rdict, flush: Callable[[int], None], rng: random.Random, args: argparse.Namespace
) -> list[bytes]:
    """Write like a slice's batches do; return the keys written."""
    written: list[bytes] = []
    for b in range(args.writes):
        wb = WriteBatch(raw_mode=True)
        batch = [data_key(str(rng.randrange(1_000_000))) for _ in range(args.keys)]
        for k in batch:
            wb.put(k, b"\x01\x05")
        db.write(wb)
        written += batch
        if (b + 1) % args.flush_every == 0:
            flush(b)
    return written


def _queries(
    written: list[bytes], rng: random.Random, keys: int, hit: float, reads: int
) -> list[list[bytes]]:
    """`reads` batches of `keys` distinct keys in key order, a share `hit` of them written
    and the rest from the same key space but never written."""
    known = set(written)
    absent = [k for k in (data_key(str(i)) for i in range(1_000_000)) if k not in known]
    hits = int(keys * hit)
    return [
        sorted(rng.sample(sorted(known), hits) + rng.sample(absent, keys - hits))
        for _ in range(reads)
    ]


def _per_key_us(db: Rdict, queries: list[list[bytes]]) -> float:
    started = time.perf_counter()
    for q in queries:
        db.get(q)
    return (time.perf_counter() - started) / sum(len(q) for q in queries) * 1e6


def measure(args: argparse.Namespace) -> dict:
    runs: dict[str, dict[str, list[float]]] = {
        o: {m: [] for m in MIXES} for o in ("shardless", "rocksdb_defaults")
    }
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="store-reads-") as tmp:
            root = Path(tmp)
            store = SliceStore(root / "shardless", {"bench": r})
            raw = Rdict(str(root / "defaults"), _defaults())
            dbs = {"shardless": store._db, "rocksdb_defaults": raw}
            written = {
                name: _build(db, _flusher(db, root / name), random.Random(r), args)
                for name, db in dbs.items()
            }
            rng = random.Random(1000 + r)
            seen = written["shardless"]
            assert seen == written["rocksdb_defaults"]  # the same seed: the same keys
            for mix, hit in MIXES.items():
                queries = _queries(seen, rng, args.keys, hit, args.reads)
                for name in (("shardless", "rocksdb_defaults") if r % 2 else
                             ("rocksdb_defaults", "shardless")):  # fmt: skip
                    runs[name][mix].append(_per_key_us(dbs[name], queries))
            store.close()
            raw.close()
    median = {o: {m: statistics.median(v) for m, v in ms.items()} for o, ms in runs.items()}
    return {
        "config": {
            "keys_per_batch": args.keys,
            "write_batches": args.writes,
            "flush_every": args.flush_every,
            "read_batches": args.reads,
            "rounds": args.rounds,
            "measure": "microseconds per key of one multi-get of a batch's sorted keys",
        },  # fmt: skip
        "us_per_key": {o: {m: round(v, 3) for m, v in ms.items()} for o, ms in median.items()},
        "ratio_shardless_to_defaults": {
            m: round(median["shardless"][m] / median["rocksdb_defaults"][m], 2) for m in MIXES
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=390, help="keys a slice reads per batch")
    parser.add_argument("--writes", type=int, default=32, help="batches written before reading")
    parser.add_argument("--flush-every", type=int, default=8, help="batches between flushes")
    parser.add_argument("--reads", type=int, default=200, help="read batches per mix")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    result = measure(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for mix, ratio in result["ratio_shardless_to_defaults"].items():
            us = result["us_per_key"]
            s, d = us["shardless"][mix], us["rocksdb_defaults"][mix]
            print(f"{mix:9s} shardless {s:.2f} us/key, RocksDB defaults {d:.2f} ({ratio:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
