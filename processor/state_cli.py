"""`shardless state ...`: look at and maintain an application's durable state.

Every command takes `--app` (and `--bucket/--table/--prefix` when they are not the
defaults) and `--json` for scripts. Exit codes: 0 ok, 1 a check found a problem, 2 an
error (bad input, unreachable service, missing state).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from changelog import gc, resources
from changelog.durable import DurableState
from changelog.layout import AppLocation


def _location(args: argparse.Namespace) -> AppLocation:
    base = AppLocation.default(args.app)
    return AppLocation(
        app=args.app,
        bucket=args.bucket or base.bucket,
        prefix=base.prefix if args.prefix is None else args.prefix,
        table=args.table or base.table,
    )


def _print(args: argparse.Namespace, data: Any, lines: list[str]) -> None:
    if args.json:
        print(json.dumps(data, default=str))
    else:
        print("\n".join(lines))


def _ls(args: argparse.Namespace) -> int:
    loc = _location(args)
    slices = resources.app_slices(loc)
    heads = DurableState(loc).heads(list(range(slices)))
    rows = []
    for s in range(slices):
        h = heads.get(s)
        rows.append(
            {
                "slice": s,
                "version": h.version if h else 0,
                "batch": h.batch if h else None,
                "committed_at": h.at_ms / 1000 if h and h.at_ms else None,
                "snapshots": [x.version for x in h.snaps] if h else [],
                "snapshot_bytes": h.snaps[-1].bytes if h and h.snaps else 0,
                "log_entries": len(h.log) if h else 0,
                "log_bytes": sum(e.length for e in h.log) if h else 0,
                "owner": h.owner if h else "",
                "epoch": h.epoch if h else 0,
            }
        )
    lines = [f"{'slice':>6} {'version':>8} {'batch':>7} {'snapshot':>9} {'log':>5} {'owner'}"]
    for r in rows:
        if r["version"] or r["owner"]:
            snap = r["snapshots"][-1] if r["snapshots"] else "-"
            lines.append(
                f"{r['slice']:>6} {r['version']:>8} {r['batch']!s:>7} {snap!s:>9} "
                f"{r['log_entries']:>5} {r['owner']}"
            )
    committed = sum(1 for r in rows if r["version"])
    lines.append(f"{committed} of {slices} slices committed")
    _print(args, {"app": loc.app, "slices": slices, "heads": rows}, lines)
    return 0


def _gc(args: argparse.Namespace) -> int:
    loc = _location(args)
    slices = resources.app_slices(loc)
    report = gc.collect(loc, slices, grace_s=args.grace_s, dry_run=not args.delete)
    verb = "deleted" if args.delete else "would delete"
    lines = [
        f"{report.objects} objects, {report.referenced} referenced, "
        f"{report.unreferenced} unreferenced",
        f"{verb} {len(report.deleted)} objects ({report.deleted_bytes / 1e6:.1f} MB); "
        f"{report.waiting} wait out the {args.grace_s:.0f}s grace period",
    ]
    if not args.delete:
        lines.append("dry run: pass --delete to delete")
    _print(args, {**report.to_dict(), "keys": report.deleted, "at": time.time()}, lines)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    state = sub.add_parser("state", help="inspect and maintain an application's durable state")
    cmds = state.add_subparsers(dest="action", required=True)

    def common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--app", required=True)
        p.add_argument("--bucket", help="default shardless-APP")
        p.add_argument("--table", help="default shardless-APP")
        p.add_argument("--prefix", help="default APP")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    common(cmds.add_parser("ls", help="slices: version, snapshots, log, owner")).set_defaults(
        func=_ls
    )
    g = common(cmds.add_parser("gc", help="objects retention no longer needs (dry run)"))
    g.add_argument("--delete", action="store_true", help="delete them (default: dry run)")
    g.add_argument("--grace-s", type=float, default=gc.DEFAULT_GRACE_S)
    g.set_defaults(func=_gc)
