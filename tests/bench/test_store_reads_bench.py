"""bench.store_reads: it compares the two option sets on stores that really hold the keys
it reads as hits and not the ones it reads as misses, and reports every mix."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_report_compares_every_mix_against_rocksdb_defaults() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.store_reads", "--rounds", "1", "--reads", "5",
         "--writes", "4", "--flush-every", "2", "--json"],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    report = json.loads(out.stdout)
    mixes = {"all_miss", "half_hit", "all_hit"}
    assert set(report["ratio_shardless_to_defaults"]) == mixes
    for options in ("shardless", "rocksdb_defaults"):
        assert set(report["us_per_key"][options]) == mixes
        assert all(v > 0 for v in report["us_per_key"][options].values())


def test_the_stores_hold_every_written_key_and_are_flushed_as_asked(tmp_path) -> None:
    import argparse
    import random

    from rocksdict import Rdict

    from bench import store_reads

    args = argparse.Namespace(keys=50, writes=4, flush_every=2)
    raw = Rdict(str(tmp_path / "d"), store_reads._defaults())
    try:
        flushes: list[int] = []
        written = store_reads._build(raw, flushes.append, random.Random(0), args)
        assert flushes == [1, 3]
        assert len(written) == 200
        assert all(v == b"\x01\x05" for v in raw.get(written))
    finally:
        raw.close()


def test_queries_hit_exactly_their_share_of_written_keys() -> None:
    import random

    from bench import store_reads
    from shardless.state.keys import data_key

    written = [data_key(str(i)) for i in range(0, 1000, 3)]
    for hit in (0.0, 0.5, 1.0):
        for q in store_reads._queries(written, random.Random(1), 40, hit, 3):
            assert q == sorted(set(q)) and len(q) == 40
            assert sum(k in set(written) for k in q) == int(40 * hit)
