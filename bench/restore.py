"""Restore speed and the durable cost of a batch, against moto over HTTP:
`python -m bench.restore`.

1. Restore of ~1 GB of state in 256 slices (random, incompressible values), each slice a
   snapshot plus one log entry, by `StoreCache.acquire_many` on empty local directories as
   a new worker does. The baseline, interleaved with it run by run, is a plain parallel
   download (boto3 `get_object` to files) of exactly the objects and byte ranges the
   restore fetches; and the same restore with its transfers kept in this process instead
   of the transfer process (`restore_in_process_*`). The transfer process is stopped
   before each restore: a new worker pays for starting it.
2. Restore time of 16 slices after a short and a long history of small batches driven
   through `GroupRunner.run` (snapshots every 32 versions, as in production).
3. A group's 128 small slices restored on a host without its segments
   (`bench.restore_group`): read in spans (`changelog.coalesce`) against one GET each.
4. What a batch costs (`bench.batch_cost`): every S3 and DynamoDB call counted by type
   with DynamoDB's billed units from the real request sizes, at 256 and 4,096 slices in 8
   groups, every slice changed and 10 % of them; dollars a month at 1 s and 10 s
   triggers; and the requests of a batch with nothing to do.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from datetime import UTC, datetime
from importlib.metadata import version
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from bench import billing, harness, restore_group
from bench.batch_cost import (
    batch_cost,
    cost_table,
    counter,
    keys_by_slice,
    new_app,
    with_roll_overs,
)
from bench.billing import Requests
from shardless.changelog import aws, restore_transfers
from shardless.changelog.coalesce import coalesce
from shardless.changelog.durable import DurableState, SliceCommit
from shardless.changelog.history import plan_restore
from shardless.changelog.layout import AppLocation, Head
from shardless.changelog.manifest import manifests, read_manifest
from shardless.changelog.objects import FILE_THREADS
from shardless.changelog.pack import Due, write_pack
from shardless.changelog.restore import identity
from shardless.changelog.sst import object_size
from shardless.changelog.transfer_process import TRANSFER_PROCESS_BYTES, transfer_process
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.runtime.group_chain import CHAIN_POSITIONS, POSITIONS_PER_SLICE
from shardless.processor.runtime.group_runner import GroupRunner, RuntimeConfig
from shardless.processor.runtime.grouping import group_slices
from shardless.processor.runtime.stores import StoreCache
from shardless.state import encoding, keys
from shardless.state.store import SliceStore

SLICES = 256
GROUPS = 8
BUILD_CHUNKS = 16  # slices built (and committed) together, one segment each
HISTORY_SLICES = 16
SHORT_HISTORY = 10
PARTS = ["restore", "history", "group", "requests"]
QUERY = "bench-query"
NOW_MS = 1_700_000_000_000
ARRIVAL = datetime.fromtimestamp(NOW_MS / 1000, tz=UTC)
LARGE_SLICES = 4096
ROLLED_PAIRS = 2  # roll-overs measured: each over two batches
TOUCHED_SOME = 0.1
GOALS = {
    "restore_vs_download": 0.7,
    "restore_ratio_long_vs_short": 1.5,
    "s3_puts_per_batch": 8,
    "dynamodb_writes_per_batch": 8,
    "dynamodb_write_units_per_batch": 32,
    "s3_puts_per_batch_with_snapshots": 16,
    "idle_batch_requests": 0,
}
AT_MOST = set(GOALS) - {"restore_vs_download"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def frame(records: list[tuple[str, int]], first_seq: int) -> pd.DataFrame:
    """Input rows of (key, slice) as the Kinesis source gives them to a group."""
    n = len(records)
    seqs = [f"{first_seq + i:030d}" for i in range(n)]
    return pd.DataFrame(
        {
            "stream": ["bench"] * n,
            "shard": ["shardId-000000000000"] * n,
            "sequence_number": seqs,
            "subsequence": [0] * n,
            "partition_key": [k for k, _ in records],
            "explicit_hash_key": [None] * n,
            "arrival": [ARRIVAL] * n,
            "data": [b"{}"] * n,
            "slice": [s for _, s in records],
            "stream_order": seqs,
        }
    )


def forget_manifests() -> None:
    """A new worker has no manifest cached: make this process fetch them again."""
    manifests._items.clear()  # in place: every module that imported the cache sees it empty


# 1. Restore of a large state against a plain download ------------------------------------


def build_slices(
    loc: AppLocation,
    durable: DurableState,
    group: int,
    slices: range,
    root: Path,
    values: int,
    value_bytes: int,
    seed: int,
) -> None:
    """Commit random values to each slice (v1), then snapshot v1 (the slices' snapshots in
    one pack) and commit v2 with it, as the runtime does when a snapshot is due: head =
    snapshot v1 + log entry v2."""
    claimed = durable.claim(dict.fromkeys(slices), "bench-builder")
    rng = np.random.default_rng(seed + slices[0])
    stores, first = {}, []
    for s in slices:
        stores[s] = SliceStore(root / f"slice-{s:05d}", identity(loc.app, s, SLICES))
        changes = [
            (keys.data_key(f"k{i:07d}"), encoding.encode(rng.bytes(value_bytes), fmt=encoding.RAW))
            for i in range(values)
        ]
        first.append(SliceCommit(s, 1, claimed[s], changes))
    done = durable.commit(QUERY, 0, group, first)
    for c in first:
        stores[c.slice].commit(c.changes, 1, tag=done.uid)
    del first
    heads = durable.heads(list(slices))
    due = [Due(s, 1, stores[s].checkpoint(root / f"snap-{s:05d}")) for s in slices]
    packed = write_pack(loc, due, {})  # the group's snapshots in one pack, as a batch takes them
    for d in due:
        shutil.rmtree(d.checkpoint)
    second = []
    for s in slices:
        entry = next(e for e in heads[s].log if e.version == 1)
        ref = replace(packed[s][0], batch=entry.batch, query=entry.query)
        touch = [(keys.data_key("touched"), encoding.encode(1))]
        second.append(SliceCommit(s, 2, heads[s], touch, snapshot=ref))
    done = durable.commit(QUERY, 1, group, second)
    for c in second:
        stores[c.slice].commit(c.changes, 2, tag=done.uid)
        stores[c.slice].close()


def fetch_list(loc: AppLocation, heads: dict[int, Head]) -> list[tuple[str, str | None]]:
    """(key, byte range) of every GET a restore of `heads` makes, from its plans: each
    manifest, SST file and changelog section, or the span it is read in as the restore
    reads them (`changelog.coalesce`: a pack's manifests, its small SST files, a segment's
    neighbouring sections)."""
    snaps, files, sections = [], [], []
    for head in heads.values():
        how = plan_restore(head, None, head.version)
        if how.snapshot is not None:
            snaps.append(how.snapshot)
            files += read_manifest(loc, how.snapshot, slice_id=head.slice).files
        sections += [(e.key(loc), e.offset, e.length) for e in how.entries]
    small = restore_transfers.SMALL_SST_BYTES
    out: list[tuple[str, str | None]] = []

    def spans_of(items: list, where: list[tuple[str, int, int] | None]) -> None:
        seen = set()
        for item, span in zip(items, coalesce(where), strict=True):
            if span is None:
                out.append(item)
            elif span not in seen:
                seen.add(span)
                out.append((span.key, span.byte_range))

    spans_of(
        [(s.key, s.byte_range) for s in snaps],
        [(s.key, s.at, s.length) if s.at >= 0 else None for s in snaps],
    )
    spans_of(
        [
            (f.key, None)
            if f.offset < 0
            else (f.key, f"bytes={f.offset}-{f.offset + object_size(f.size) - 1}")
            for f in files
        ],
        [
            (f.key, f.offset, object_size(f.size)) if f.offset >= 0 and f.size <= small else None
            for f in files
        ],
    )
    spans_of([(k, f"bytes={o}-{o + n - 1}") for k, o, n in sections], sections)
    return out


def plain_download(
    loc: AppLocation, objects: list[tuple[str, str | None]], dest: Path, threads: int
) -> tuple[float, int]:
    """Seconds and bytes to fetch `objects` into files under `dest` (left there): the same
    client, no checks of our own."""
    s3 = aws.client("s3")
    dest.mkdir(parents=True)

    def fetch(job: tuple[int, tuple[str, str | None]]) -> int:
        i, (key, byte_range) = job
        extra = {"Range": byte_range} if byte_range else {}
        body = s3.get_object(Bucket=loc.bucket, Key=key, **extra)["Body"]
        n = 0
        with open(dest / f"{i:06d}", "wb") as out:
            while chunk := body.read(1 << 20):
                out.write(chunk)
                n += len(chunk)
        return n

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(fetch, enumerate(objects)))
    seconds = time.perf_counter() - started
    return seconds, total


def restore_all(
    loc: AppLocation,
    slices: int,
    root: Path,
    check: bool = False,
    transfer_process_bytes: int | None = TRANSFER_PROCESS_BYTES,
    heads: dict[int, Head] | None = None,
) -> tuple[float, int, list[dict[str, Any]], int]:
    """Seconds and bytes for a new worker to restore every slice to its head into empty
    directories (claims included), each slice's stats, and (with `check`) the sum of
    the restored counters. The restored stores are closed and left under `root`.
    `transfer_process_bytes` as in `DurableState` (None: no transfer process); `heads`:
    read already (default: read here, untimed)."""
    durable = DurableState(loc, transfer_process_bytes=transfer_process_bytes)
    if heads is None:
        heads = durable.heads(list(range(slices)))
    forget_manifests()
    transfer_process().stop()  # a new worker has no helper yet: starting it is part of the restore
    cache = StoreCache(root, loc.app, slices)
    started = time.perf_counter()
    got = cache.acquire_many([(s, h, h.version) for s, h in sorted(heads.items())], durable)
    seconds = time.perf_counter() - started
    stats, total = [], 0
    for s, (store, _, restored) in got.items():
        assert store.version == heads[s].version, f"slice {s} restored to v{store.version}"
        assert restored is not None, f"slice {s} was not restored"
        stats.append(restored.to_dict())
        if check:
            total += sum(encoding.decode(v) for k, v in store.items() if keys.is_value_key(k))
        store.close()
    return seconds, sum(s["bytes"] for s in stats), stats, total


def store_opens(root: Path) -> dict[str, float]:
    """Open each store under `root` in turn while another thread ticks every 1 ms: how long
    an open takes, and for how much of it no other Python thread could run (the GIL)."""
    paths = sorted(root.glob("*/w*/slice-*"))
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    opens, spans = [], []
    for path in paths:
        started = time.perf_counter()
        store = SliceStore(path, identity(path.parent.parent.name, int(path.name[6:]), SLICES))
        spans.append((started, time.perf_counter()))
        opens.append(spans[-1][1] - started)
        store.close()
    done.set()
    ticker.join()
    # the ticker's silences (gaps over 5 ms) that fall inside an open
    stalled = sum(
        min(b, hi) - max(a, lo)
        for a, b in pairwise(ticks)
        if b - a > 0.005
        for lo, hi in spans
        if a < hi and b > lo
    )
    return {
        "store_open_ms_median": statistics.median(opens) * 1000,
        "store_opens_total_s": sum(opens),
        "store_open_gil_held_fraction": stalled / sum(opens),
    }


def quiesce() -> None:
    """Write out what earlier steps left dirty, so a timed step does not pay for it."""
    os.sync()


def keep_outputs(local: Path, reps: int, state_bytes: int) -> bool:
    """Whether every rep's files can stay until the last rep is done (given the free space).

    Deleting them between reps would tax the next timed step: on ext4 without a journal
    (this machine's disk), creating a file skips every inode deleted in the last 60 s (360
    s while its inode table block is dirty), checking each in turn. A restore creates about
    12 files per slice against a download's 3, so the previous rep's clean-up costs it four
    times as much; a new host restoring its slices has no such backlog. (The build's own
    stores are kept too, for the same reason.)"""
    free = shutil.disk_usage(local).free
    keep = free > (3 * reps + 1) * state_bytes * 1.2 + (2 << 30)
    if not keep:
        log(f"restore: {free / 1e9:.1f} GB free, so each rep's files are removed after it")
    return keep


def large_restore(
    tmp: Path, local: Path, slice_bytes: int, value_bytes: int, threads: int, reps: int, seed: int
) -> dict[str, Any]:
    """Build the state under `tmp`; download and restore it under `local`."""
    loc = new_app("restore", SLICES)
    durable = DurableState(loc)
    values = max(1, slice_bytes // value_bytes)
    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        jobs = [
            pool.submit(build_slices, loc, durable, g, r, tmp / "build", values, value_bytes, seed)
            for g, r in enumerate(
                group_slices(c, SLICES, BUILD_CHUNKS) for c in range(BUILD_CHUNKS)
            )
        ]
        for job in jobs:
            job.result()
    built = time.perf_counter() - started
    heads = durable.heads(list(range(SLICES)))
    objects = fetch_list(loc, heads)
    log(f"restore: built {SLICES} slices in {built:.1f}s; {len(objects)} objects to fetch")
    keep = keep_outputs(local, reps, slice_bytes * SLICES)
    if not keep:
        shutil.rmtree(tmp / "build")  # else kept until the reps are done (`keep_outputs`)
    runs, here = [], []
    for rep in range(reps):  # interleaved, so machine noise hits all alike
        quiesce()
        d_s, d_bytes = plain_download(loc, objects, local / f"download-{rep}", threads)
        quiesce()
        r_s, r_bytes, stats, _ = restore_all(loc, SLICES, local / f"restore-{rep}")
        runs.append((d_bytes / 1e6 / d_s, r_bytes / 1e6 / r_s, r_s, r_bytes, d_bytes, stats))
        quiesce()
        h_s, h_bytes, _, _ = restore_all(
            loc, SLICES, local / f"here-{rep}", transfer_process_bytes=None
        )
        here.append(h_bytes / 1e6 / h_s)
        log(
            f"  rep {rep}: download {runs[-1][0]:.0f} MB/s, restore {runs[-1][1]:.0f} MB/s "
            f"({r_s:.2f}s), restore without the transfer process {here[-1]:.0f} MB/s"
        )
        if not keep:
            shutil.rmtree(local / f"download-{rep}")
            shutil.rmtree(local / f"here-{rep}")
            if rep < reps - 1:
                shutil.rmtree(local / f"restore-{rep}")
    opens = store_opens(local / f"restore-{reps - 1}")
    shutil.rmtree(tmp / "build", ignore_errors=True)
    for rep in range(reps):
        for name in (f"download-{rep}", f"restore-{rep}", f"here-{rep}"):
            shutil.rmtree(local / name, ignore_errors=True)
    # the run with the median ratio: per-run ratios are robust to a noisy neighbour
    download, restored, seconds, r_bytes, d_bytes, stats = sorted(runs, key=lambda r: r[1] / r[0])[
        reps // 2
    ]
    return {
        "restore_mb_per_s": restored,
        "plain_download_mb_per_s": download,
        "restore_vs_download": restored / download,
        "restore_seconds": seconds,
        "restored_mb": r_bytes / 1e6,
        "downloaded_mb": d_bytes / 1e6,
        "restore_objects": len(objects),
        "restore_vs_download_runs": [round(r[1] / r[0], 3) for r in runs],
        # the same restore with every transfer in this process (the GIL shared with the
        # store opens), in the same reps: what the transfer process is worth
        "restore_in_process_mb_per_s": statistics.median(here),
        "restore_in_process_vs_download": statistics.median(
            h / r[0] for h, r in zip(here, runs, strict=True)
        ),
        "restore_in_process_vs_download_runs": [
            round(h / r[0], 3) for h, r in zip(here, runs, strict=True)
        ],
        "restore_mb_per_s_runs": [round(r[1], 1) for r in runs],
        "plain_download_mb_per_s_runs": [round(r[0], 1) for r in runs],
        "restore_slice_seconds_median": statistics.median(s["seconds"] for s in stats),
        "restore_slice_seconds_max": max(s["seconds"] for s in stats),
        **opens,
        "restore_build_seconds": built,
        "_restore_config": {
            "slices": SLICES,
            "values_per_slice": values,
            "value_bytes": value_bytes,
            "manifests_ahead": restore_transfers.MANIFESTS_AHEAD,
            "finish_threads": restore_transfers.FINISH_THREADS,
            "transfer_process_bytes": TRANSFER_PROCESS_BYTES,
            "open_after_transfers": restore_transfers.OPEN_AFTER_TRANSFERS,
            "file_threads": FILE_THREADS,
            "download_threads": threads,
            "reps": reps,
            "kept_outputs_between_reps": keep,
        },
    }


# 2. Restore time against history length ---------------------------------------------------


def run_history(
    loc: AppLocation, root: Path, by_slice: list[list[str]], batches: int, per_slice: int
) -> int:
    """The initial load of every key, then `batches` small batches updating the same keys;
    returns the records processed."""
    runner = GroupRunner(HandlerFactory(counter), RuntimeConfig(loc, HISTORY_SLICES, str(root)))
    load = [(k, s) for s, ks in enumerate(by_slice) for k in ks]
    started = time.perf_counter()
    _, pending = runner.run(0, QUERY, 0, frame(load, 0), {}, NOW_MS)
    records, seq, n = len(load), len(load), len(by_slice[0])
    for b in range(1, batches + 1):
        rows = [
            (ks[(b * per_slice + j) % n], s)
            for s, ks in enumerate(by_slice)
            for j in range(per_slice)
        ]
        _, pending = runner.run(0, QUERY, b, frame(rows, seq), pending, NOW_MS + 1_000 * b)
        records += len(rows)
        seq += len(rows)
        if b % 100 == 0:
            log(f"  {loc.app}: batch {b}/{batches}, {time.perf_counter() - started:.0f}s")
    return records


def history_restore(
    tmp: Path, batches: int, keys_per_slice: int, per_slice: int, reps: int
) -> dict[str, Any]:
    by_slice = keys_by_slice(HISTORY_SLICES, keys_per_slice, "user-")
    runs: dict[int, dict[str, Any]] = {}
    for n in (SHORT_HISTORY, batches):
        loc = new_app(f"history{n}", HISTORY_SLICES)
        started = time.perf_counter()
        records = run_history(loc, tmp / f"history-{n}", by_slice, n, per_slice)
        runs[n] = {
            "loc": loc,
            "records": records,
            "seconds": time.perf_counter() - started,
            "restores": [],
        }
        log(f"history: {n} batches in {runs[n]['seconds']:.1f}s")
    for rep in range(reps):
        for n, run in runs.items():
            check = rep == 0
            root = tmp / f"history-restore-{n}-{rep}"
            seconds, restored, stats, total = restore_all(run["loc"], HISTORY_SLICES, root, check)
            shutil.rmtree(root)
            if check:
                assert total == run["records"], f"restored {total} of {run['records']} counts"
                run["stats"] = stats
                run["bytes"] = restored
            run["restores"].append(seconds)
    short, long = (statistics.median(runs[n]["restores"]) for n in (SHORT_HISTORY, batches))
    out: dict[str, Any] = {}
    for n, run in runs.items():
        stats = run["stats"]
        out[f"restore_s_after_{n}_batches"] = statistics.median(run["restores"])
        out[f"history_{n}_restore_runs_s"] = [round(x, 3) for x in run["restores"]]
        out[f"history_{n}_restored_mb"] = run["bytes"] / 1e6
        out[f"history_{n}_segments_replayed"] = sum(s["segments"] for s in stats)
        out[f"history_{n}_slices_from_snapshot"] = sum(
            s["snapshot_version"] is not None for s in stats
        )
        out[f"history_{n}_run_seconds"] = run["seconds"]
    out[f"restore_ratio_{batches}_vs_{SHORT_HISTORY}"] = long / short
    out["restore_ratio_long_vs_short"] = long / short
    return out


# 3. Requests and their cost per batch ------------------------------------------------------


def requests_part(
    tmp: Path, requests: Requests, batches: int, batches_large: int, commit_format: str = "chains"
) -> dict:
    """The calls and billed units of a batch at 256 and 4,096 slices in 8 groups, every
    slice touched and 10 % of them; the 256-slice, every-slice figures at the top."""
    runs = [
        batch_cost(
            tmp / f"cost-{n}-{t}",
            requests,
            frame,
            n,
            GROUPS,
            b,
            touched=t,
            commit_format=commit_format,
        )  # fmt: skip
        for n, b in ((SLICES, batches), (LARGE_SLICES, batches_large))
        for t in (1.0, TOUCHED_SOME)
    ]
    if commit_format == "chains":  # what the chains' roll-overs add, spread over their length
        for i, n in ((0, SLICES), (2, LARGE_SLICES)):
            rolled = batch_cost(
                tmp / f"cost-{n}-rolled", requests, frame, n, GROUPS, 1 + 2 * ROLLED_PAIRS,
                commit_format=commit_format, chain_length=2,
            )  # fmt: skip
            length = max(CHAIN_POSITIONS, POSITIONS_PER_SLICE * n // GROUPS)
            runs[i : i + 2] = [with_roll_overs(r, rolled, length) for r in runs[i : i + 2]]
    top = {k: v for k, v in runs[0].items() if k not in ("slices", "groups", "touched", "batches")}
    return top | {
        f"at_{LARGE_SLICES}_slices": {
            k: v for k, v in runs[2].items() if not isinstance(v, dict) or k == "dollars_per_month"
        },
        "cost_runs": runs,
        "cost_table": cost_table(runs),
        "prices": asdict(billing.PRICES),
        "_requests_config": {
            "slices": [SLICES, LARGE_SLICES],
            "groups": GROUPS,
            "batches": [batches, batches_large],
            "touched": [1.0, TOUCHED_SOME],
            "records_per_slice_per_batch": 4,
            "snapshot_every": RuntimeConfig.snapshot_every,
            "commit_format": commit_format,
        },
    }


# -------------------------------------------------------------------------------------------


def goals(out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: {
            "target": target,
            "value": round(out[name], 3),
            "met": out[name] <= target if name in AT_MOST else out[name] >= target,
        }
        for name, target in GOALS.items()
        if name in out
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="~100 MB, 200 batches")
    parser.add_argument("--slice-mb", type=float, help="state per slice (default 4, quick 0.4)")
    parser.add_argument("--value-bytes", type=int, default=4096)
    parser.add_argument(
        "--threads",
        type=int,
        default=FILE_THREADS,
        help="download threads of the baseline",
    )
    parser.add_argument("--reps", type=int, help="restores of each kind (default 7, quick 3)")
    parser.add_argument("--batches", type=int, help="long history (default 1000, quick 200)")
    parser.add_argument("--keys-per-slice", type=int, default=20_000)
    parser.add_argument("--updates-per-slice", type=int, default=4, help="per history batch")
    parser.add_argument("--request-batches", type=int, help="(default 100, quick 17)")
    parser.add_argument(
        "--request-batches-large",
        type=int,
        help=f"at {LARGE_SLICES} slices (default 40, quick 6)",
    )
    parser.add_argument(
        "--commit-format",
        choices=("heads", "chains"),
        default="chains",
        help="how the requests part's batches commit (docs/design/group-commits.md)",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--local-dir", help="where the large restore writes (default: temp)")
    parser.add_argument("--only", choices=PARTS, action="append", help="run only these parts")
    args = parser.parse_args(argv)
    parts = args.only or PARTS
    slice_mb = args.slice_mb or (0.4 if args.quick else 4.0)
    batches = args.batches or (200 if args.quick else 1000)
    request_batches = args.request_batches or (17 if args.quick else 100)
    large_batches = args.request_batches_large or (6 if args.quick else 40)
    reps = args.reps or (3 if args.quick else 7)
    harness.quiet()
    out: dict[str, Any] = {}
    with harness.emulated_aws("shardless-bench-restore-") as (tmp, _):
        requests = Requests()
        try:
            if "restore" in parts:
                local = Path(tempfile.mkdtemp(prefix="restore-", dir=args.local_dir or tmp))
                size = int(slice_mb * 1e6)
                out |= large_restore(
                    Path(tmp), local, size, args.value_bytes, args.threads, reps, args.seed
                )
                shutil.rmtree(local)
            if "history" in parts:
                out |= history_restore(
                    Path(tmp), batches, args.keys_per_slice, args.updates_per_slice, reps
                )
            if "group" in parts:
                out |= restore_group.group_restore(Path(tmp), frame, restore_all, reps=reps)
            if "requests" in parts:
                out |= requests_part(
                    Path(tmp), requests, request_batches, large_batches, args.commit_format
                )
        finally:
            requests.close()
    out["config"] = {
        "parts": parts,
        "restore": {
            **out.pop("_restore_config", {}),
            "slice_mb": slice_mb,
            "local_dir": args.local_dir,
        },
        "history": {
            "slices": HISTORY_SLICES,
            "keys_per_slice": args.keys_per_slice,
            "updates_per_slice_per_batch": args.updates_per_slice,
            "batches": [SHORT_HISTORY, batches],
            "snapshot_every": RuntimeConfig.snapshot_every,
            "keep_snapshots": RuntimeConfig.keep_snapshots,
            "reps": reps,
        },
        "group": out.pop("_group_config", {}),
        "requests": out.pop("_requests_config", {}),
        "quick": args.quick,
        "seed": args.seed,
        "python": sys.version.split()[0],
        "moto": version("moto"),
        "boto3": version("boto3"),
        "rocksdict": version("rocksdict"),
        "cpus": len(os.sched_getaffinity(0)),
    }
    out["goals"] = goals(out)
    harness.print_figures(out, args.json)


if __name__ == "__main__":
    main()
