"""A group's steady batches on the host it moved to: `python -m bench.moved_group --json`.

Two groups of `--slices` slices each run batch by batch through `GroupRunner.run` against
moto server over HTTP, on one host, for `--history` batches (snapshots every 32 versions,
as in production). Then the second group moves to another host (its own local directory
and store cache, as after a lost executor: its first batch there restores its slices) and
goes on committing into its chain. Then both groups run `--reps` more batches, in turns:

- `stayed`: the group on the host that claimed its slices;
- `moved`: the group on the host it moved to, whose heads still name the host it left.

Per arm: the batch's seconds (median), its `restore` step (each slice's store brought to
the batch's version: nothing to restore in a steady batch), and the slices that took the
rebuild path (`StoreCache._job`, counted by wrapping it) instead of their open store as it
was. The move's own batch is reported apart; every one of its slices takes that path, which
is how the count is seen to work. Ratios are against `stayed` in the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import harness
from bench.batch_cost import counter, keys_by_slice, new_app
from bench.idle_group import metrics_of
from bench.restore import frame
from shardless.changelog.layout import AppLocation
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.runtime import stores
from shardless.processor.runtime.group_runner import GroupRunner, RuntimeConfig

QUERY = "bench-moved"
NOW_MS = 1_700_000_000_000
ARMS = ("stayed", "moved")


@contextmanager
def rebuild_paths() -> Iterator[Counter[str]]:
    """Slices that `StoreCache.acquire_many` sent down the rebuild path, by cache root."""
    seen: Counter[str] = Counter()
    real = stores.StoreCache._job

    def counted(self: stores.StoreCache, slice_id: int, *args: Any) -> Any:
        seen[str(self.root)] += 1
        return real(self, slice_id, *args)

    stores.StoreCache._job = counted  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        stores.StoreCache._job = real  # type: ignore[method-assign]


class Group:
    """One group of a 2-group job, run batch by batch on the host of `root`."""

    def __init__(self, loc: AppLocation, group: int, keys: list[list[str]], per: int) -> None:
        self.loc = loc
        self.group = group
        self.keys = keys  # per slice of the group: its record keys
        self.first = group * len(keys)  # the group's first slice
        self.per = per
        self.seq = 0
        self.pending: dict = {}
        self.runner: GroupRunner | None = None

    def on(self, root: Path) -> None:
        """Run from now on on the host of `root` (a store cache of its own)."""
        cfg = RuntimeConfig(self.loc, 2 * len(self.keys), str(root))
        self.runner = GroupRunner(HandlerFactory(counter), cfg)

    def root(self) -> str:
        assert self.runner is not None
        cfg = self.runner.config
        return str(Path(cfg.local_dir) / cfg.location.app)

    def run(self, batch: int) -> dict[str, Any]:
        """Batch `batch`: `per` records for every slice of the group; its metrics."""
        assert self.runner is not None
        rows = [(ks[(batch * self.per + j) % len(ks)], self.first + i)
                for i, ks in enumerate(self.keys) for j in range(self.per)]  # fmt: skip
        started = time.perf_counter()
        out, self.pending = self.runner.run(
            self.group, QUERY, batch, frame(rows, self.seq), self.pending, NOW_MS + 1_000 * batch
        )
        seconds = time.perf_counter() - started
        self.seq += len(rows)
        return {**metrics_of(out), "wall_s": seconds}


def one(group: Group, batch: int, seen: Counter[str]) -> dict[str, Any]:
    """One batch of `group`: its seconds, its restore step, its slices rebuilt."""
    before = seen[group.root()]
    m = group.run(batch)
    return {
        "seconds": m["wall_s"],
        "restore_s": m["timings"].get("restore", 0.0),
        "rebuilt_slices": seen[group.root()] - before,
        "restored_slices": len(m["restores"]),
    }


def measure(slices: int, history: int, reps: int, per: int) -> dict[str, Any]:
    loc = new_app("moved", 2 * slices)
    keys = keys_by_slice(2 * slices, 50, "user-")
    groups = [Group(loc, 0, keys[:slices], per), Group(loc, 1, keys[slices:], per)]
    work = Path(tempfile.mkdtemp(prefix="bench-moved-"))
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    try:
        for g in groups:
            g.on(work / "home")
        with rebuild_paths() as seen:
            for b in range(history):
                for g in groups:
                    g.run(b)
            stayed, moved = groups
            moved.on(work / "new")
            move = one(moved, history, seen)
            one(stayed, history, seen)
            for rep in range(reps):
                b = history + 1 + rep
                order = [(stayed, "stayed"), (moved, "moved")]
                for g, arm in order if rep % 2 == 0 else order[::-1]:
                    runs[arm].append(one(g, b, seen))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    arms = {arm: summary(rs) for arm, rs in runs.items()}
    return {
        "slices_per_group": slices,
        "history_batches": history,
        "reps": reps,
        "records_per_batch": slices * per,
        "move_batch": move,
        "arms": arms,
        "moved_over_stayed": round(arms["moved"]["seconds"] / arms["stayed"]["seconds"], 2),
        "moved_restore_over_stayed": round(
            arms["moved"]["restore_s"] / max(arms["stayed"]["restore_s"], 1e-6), 2
        ),
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "seconds": round(statistics.median(r["seconds"] for r in runs), 4),
        "seconds_each": [round(r["seconds"], 4) for r in runs],
        "restore_s": round(statistics.median(r["restore_s"] for r in runs), 4),
        "rebuilt_slices": statistics.median(r["rebuilt_slices"] for r in runs),
        "restored_slices": max(r["restored_slices"] for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the JSON summary only")
    p.add_argument("--slices", type=int, default=128, help="each group's slices")
    p.add_argument("--history", type=int, default=60, help="batches before the move")
    p.add_argument("--reps", type=int, default=15, help="batches of each arm after it")
    p.add_argument("--per", type=int, default=4, help="records per slice and batch")
    args = p.parse_args(argv)
    for name in ("slices", "history", "reps", "per"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be 1 or more, not {getattr(args, name)}")
    with harness.emulated_aws("bench-moved-aws-"):
        out = measure(args.slices, args.history, args.reps, args.per)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for arm, f in out["arms"].items():
            print(
                f"{arm:8s} {f['seconds'] * 1000:8.1f} ms  restore {f['restore_s'] * 1000:7.1f} ms"
                f"  slices rebuilt {f['rebuilt_slices']:5}"
            )
        print(f"moved / stayed: {out['moved_over_stayed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
