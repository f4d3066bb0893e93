"""A/B of one benchmark between an older commit and the working tree, in the same run:

    python -m bench.ab --base 3a9bf1b --module bench.state_loop --figure zipf_records_per_s \
        --figure uniform_records_per_s --rounds 3 --json

The base commit is checked out into a temporary git worktree and the benchmark module runs
there and here in turn, round by round (A B, B A, A B, ...), with this tree's Python, so a
slow spell of the machine falls on both. Each figure is reported per side as the median
over rounds, with the ratio working tree / base. The benchmark must print one JSON object
(`--json`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def figure(report: dict[str, Any], path: str) -> float:
    """A number in a nested report, by dotted path (`goals.zipf.value`)."""
    value: Any = report
    for part in path.split("."):
        value = value[part]
    return float(value)


def own_code(tree: Path) -> None:
    """Give a tree with the one import name its own `shardless.processor`, `.changelog` and
    `.state`: links in its `shardless/` to the folders its pyproject.toml maps them to
    (`[tool.setuptools.package-dir]`). Without them Python finds only the tree's
    `shardless/__init__.py`, and this checkout's editable install answers for the rest with
    this checkout's folders: the base side ran the working tree's product code."""
    own = tree / "shardless"
    if not (own / "__init__.py").exists():
        return  # before the one import name: top-level packages, found in the tree
    with (tree / "pyproject.toml").open("rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    for name, folder in mapping.items():
        link = own / name.removeprefix("shardless.")
        if name.startswith("shardless.") and not link.exists():
            link.symlink_to(Path("..") / folder)


def check_own_code(tree: Path) -> None:
    """Refuse a side whose runtime would be imported from outside its tree."""
    name = "shardless.processor" if (tree / "shardless").is_dir() else "processor"
    out = subprocess.run(
        [sys.executable, "-c", f"import {name} as m; print(m.__file__)"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
    )
    found = Path(out.stdout.strip() or "?").resolve()
    if out.returncode != 0 or not found.is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree}: {name} is imported from {found}, not from the tree")


def run_in(tree: Path, module: str, args: list[str]) -> dict[str, Any]:
    """The benchmark's JSON, run with `tree` as the working directory and first on the path
    (a tree from before the one import name imports its top-level packages from there)."""
    out = subprocess.run(
        [sys.executable, "-m", module, *args, "--json"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"{module} in {tree} exited {out.returncode}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout[out.stdout.index("{") :])


def ratio(tree: float, base: float) -> float | None:
    """tree / base; None where the base is 0 (a count the change took from 0)."""
    return tree / base if base else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--module", required=True, help="e.g. bench.state_loop")
    parser.add_argument("--figure", action="append", required=True, help="dotted JSON path")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bench-args", default="", help="extra arguments for the benchmark")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    extra = args.bench_args.split()
    base_dir = Path(tempfile.mkdtemp(prefix="ab-base-"))
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(base_dir), args.base],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    own_code(base_dir)
    for tree in (base_dir, ROOT):
        check_own_code(tree)
    tools = ROOT / ".tools"
    if tools.exists():  # the Node emulators, installed once
        (base_dir / ".tools").symlink_to(tools)
    sides: dict[str, dict[str, list[float]]] = {"base": {}, "tree": {}}
    try:
        for r in range(args.rounds):
            order = [("base", base_dir), ("tree", ROOT)]
            for side, tree in order if r % 2 == 0 else order[::-1]:
                report = run_in(tree, args.module, extra)
                for f in args.figure:
                    sides[side].setdefault(f, []).append(figure(report, f))
                print(f"round {r} {side}: {[sides[side][f][-1] for f in args.figure]}",
                      file=sys.stderr, flush=True)  # fmt: skip
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base_dir)], cwd=ROOT)
        shutil.rmtree(base_dir, ignore_errors=True)
    result = {
        "module": args.module,
        "base": args.base,
        "rounds": args.rounds,
        "figures": {
            f: {
                "base": statistics.median(sides["base"][f]),
                "tree": statistics.median(sides["tree"][f]),
                "tree_vs_base": ratio(
                    statistics.median(sides["tree"][f]), statistics.median(sides["base"][f])
                ),
                "base_rounds": sides["base"][f],
                "tree_rounds": sides["tree"][f],
            }
            for f in args.figure
        },
    }
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
