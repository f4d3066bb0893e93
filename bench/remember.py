"""A group's `remember` step in a job that has run a while: `python -m bench.remember --json`.

After each batch a group's host writes what it knows of the group's heads to the group's
hint file, every slice's log included (`shardless.processor.runtime.known_heads`). A log
lists the versions since the oldest snapshot kept, so it grows over a job's first
`keep_snapshots * snapshot_every` batches (96 by default) and stays about that long.

One group of `--slices` slices is driven through `GroupRunner.run` against moto server
over HTTP for `--history` batches, so that its logs reach their length in a long run;
then `--batches` more, the two arms taking turns batch by batch on the same group:

- `carried`: the default, each log's encoding carried from the batch before
  (`shardless.changelog.log_encoder.LogEncoder`);
- `whole`: every log encoded whole in every hint (`layout.encode_log`), as before.

Per arm: the median `remember` step and the median batch, and the logs each arm encoded
whole (counted; a run in which `carried` encoded a log whole after the history, or `whole`
did not encode every slice's log in each of its batches, is refused). Ratios are `carried`
against `whole`, measured in the same run. Also what another worker of the host pays to
read the hint left at the end (`hint`: every head decoded), against msgpack unpacking the
same bytes.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack

from bench import harness
from bench.idle_group import QUERY, Group
from shardless.changelog import log_encoder
from shardless.changelog.layout import encode_log
from shardless.processor.runtime import stores
from shardless.processor.runtime.known_heads import KnownHeads

ARMS = ("carried", "whole")


@contextmanager
def whole_logs(counted: list[int]) -> Iterator[None]:
    """Every hint's logs encoded whole, as before `LogEncoder`; each one counted."""
    carried = log_encoder.LogEncoder.encode

    def encode(self: log_encoder.LogEncoder, log: Any) -> bytes:
        counted[0] += 1
        return encode_log(log)

    log_encoder.LogEncoder.encode = encode  # type: ignore[method-assign]
    try:
        yield
    finally:
        log_encoder.LogEncoder.encode = carried  # type: ignore[method-assign]


@contextmanager
def carried_counted(counted: list[int]) -> Iterator[None]:
    """Each log a `LogEncoder` finds does not continue the one before, counted: it is
    encoded whole."""
    real = log_encoder.continues

    def continues(old: Any, new: Any) -> int | None:
        dropped = real(old, new)
        counted[0] += dropped is None
        return dropped

    log_encoder.continues = continues
    try:
        yield
    finally:
        log_encoder.continues = real


def measure(slices: int, history: int, batches: int, per: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="bench-remember-"))
    try:
        group = Group(root, slices, per)
        for _ in range(history):
            group.run()
        runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
        counted, carried = [0], [0]
        for b in range(batches):
            arm = ARMS[b % 2]
            with whole_logs(counted) if arm == "whole" else carried_counted(carried):
                m = group.run()
            runs[arm].append({"remember_s": m["timings"]["remember"], "seconds": m["wall_s"]})
        carried_whole = carried[0]
        hint = hint_reads(group)
        log_entries = hint.pop("log_entries")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    whole_batches = len(runs["whole"])
    if carried_whole:
        raise RuntimeError(f"arm carried encoded {carried_whole} logs whole after the history")
    if counted[0] != whole_batches * slices:
        raise RuntimeError(
            f"arm whole encoded {counted[0]} logs in {whole_batches} batches of {slices} slices"
        )
    arms = {arm: summary(rs) for arm, rs in runs.items()}
    return {
        "slices": slices,
        "history_batches": history,
        "batches_per_arm": {arm: len(rs) for arm, rs in runs.items()},
        "records_per_batch": slices * per,
        "log_entries": log_entries,
        "arms": arms,
        "logs_encoded_whole": {"carried": carried_whole, "whole": counted[0]},
        "hint": hint,
        "remember_carried_over_whole": round(
            arms["carried"]["remember_s"] / arms["whole"]["remember_s"], 3
        ),
        "batch_carried_over_whole": round(arms["carried"]["seconds"] / arms["whole"]["seconds"], 3),
    }


def hint_reads(group: Group, reps: int = 7) -> dict[str, Any]:
    """What another worker of the host pays for the group's heads from its hint as it stands
    after the run (`KnownHeads.heads` in a process that did not write it: the file read,
    every head decoded), against msgpack unpacking the same bytes; the medians of `reps`.
    Also the lengths of the logs in it."""
    cfg = group.runner.config
    hints = stores.cache_for(cfg.local_dir, cfg.location.app, cfg.slices).root / "hints"
    raw = (hints / "g0.msgpack").read_bytes()
    decode, unpack = [], []
    heads: dict = {}
    for _ in range(reps):
        started = time.perf_counter()
        heads = KnownHeads(hints, pid=-1).heads(0, QUERY, group.batch, range(group.slices))
        decode.append(time.perf_counter() - started)
        started = time.perf_counter()
        msgpack.unpackb(raw, raw=False, strict_map_key=False)
        unpack.append(time.perf_counter() - started)
    if len(heads) != group.slices:
        raise RuntimeError(f"the hint read back holds {len(heads)} heads of {group.slices}")
    lengths = [len(h.log) for h in heads.values() if h is not None]
    return {
        "bytes": len(raw),
        "heads": len(heads),
        "decode_s": round(statistics.median(decode), 4),
        "unpack_s": round(statistics.median(unpack), 4),
        "decode_over_unpack": round(statistics.median(decode) / statistics.median(unpack), 1),
        "log_entries": {
            "min": min(lengths), "mean": round(statistics.mean(lengths), 1), "max": max(lengths),
        },
    }  # fmt: skip


def summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "remember_s": round(statistics.median(r["remember_s"] for r in runs), 4),
        "seconds": round(statistics.median(r["seconds"] for r in runs), 4),
        "remember_s_each": [round(r["remember_s"], 4) for r in runs],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the JSON summary only")
    p.add_argument("--slices", type=int, default=128, help="the group's slices (of twice that)")
    p.add_argument("--history", type=int, default=130, help="batches before the arms")
    p.add_argument("--batches", type=int, default=80, help="batches of the arms, in turn")
    p.add_argument("--per", type=int, default=8, help="records per slice and batch")
    args = p.parse_args(argv)
    harness.quiet()
    with harness.emulated_aws("bench-remember-aws-"):
        out = measure(args.slices, args.history, args.batches, args.per)
    harness.print_result(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
