"""The `shardless state` commands that leave the durable state as it is: ls, get, scan,
export, restore (a copy into a local directory) and verify."""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from shardless.changelog import verify
from shardless.changelog.chain_reads import all_chains
from shardless.changelog.chain_writes import find_tip
from shardless.changelog.durable import DurableState
from shardless.changelog.inspect import StateQueryError, entries, jsonable, keys_of, opened
from shardless.changelog.layout import AppLocation
from shardless.changelog.restore import materialize
from shardless.processor.runtime.routing import route
from shardless.processor.tools import export as state_export
from shardless.processor.tools.selection import parse_slices, targets
from shardless.processor.tools.state_app import (
    EXIT_FOUND_PROBLEM,
    activity,
    open_app,
    progress_bar,
    show,
)

# ---- ls -----------------------------------------------------------------------------------


def ls_command(args: argparse.Namespace) -> int:
    loc, slices, heads = open_app(args)
    rows = []
    for s in range(slices):
        h = heads.get(s)
        snap_bytes = h.snaps[-1].bytes if h and h.snaps else 0
        since = h.snaps[-1].version if h and h.snaps else 0
        log_bytes = sum(e.length for e in h.log if e.version > since) if h else 0
        rows.append(
            {
                "slice": s,
                "version": h.version if h else 0,
                "query": h.query if h else "",
                "batch": h.batch if h else None,
                "committed_at": h.at_ms / 1000 if h and h.at_ms else None,
                "snapshots": [x.version for x in h.snaps] if h else [],
                "snapshot_bytes": snap_bytes,
                "log_entries": len(h.log) if h else 0,
                "log_bytes": log_bytes,
                "size_bytes": snap_bytes + log_bytes,
                "keys": None,
                "owner": h.owner if h else "",
                "epoch": h.epoch if h else 0,
                # commit_format="chains": the group chain that commits the slice, and the
                # position from which its links are the slice's versions
                "chain": h.chain if h else "",
                "chain_from": h.chain_from if h else 0,
            }
        )
    if args.keys:
        durable = DurableState(loc)
        committed = [r for r in rows if r["version"]]
        with progress_bar(args, "counting keys", len(committed)) as bar:

            def count(row: dict[str, Any]) -> None:
                with opened(durable, heads[row["slice"]], slices) as store:
                    row["keys"] = keys_of(store)
                bar.update()

            with ThreadPoolExecutor(max_workers=args.threads) as pool:
                list(pool.map(count, committed))
        for r in rows:
            r["keys"] = r["keys"] or 0
    running = activity(loc, heads, args.quiet_s)
    lines = [
        f"{'slice':>6} {'version':>8} {'batch':>7} {'snapshot':>9} {'log':>5} {'size':>10} "
        f"{'keys':>8} {'committed':>20} owner"
    ]
    for r in rows:
        if r["version"] or r["owner"]:
            snap = r["snapshots"][-1] if r["snapshots"] else "-"
            at = (
                time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["committed_at"]))
                if r["committed_at"]
                else "-"
            )
            keys = "-" if r["keys"] is None else r["keys"]
            lines.append(
                f"{r['slice']:>6} {r['version']:>8} {r['batch']!s:>7} {snap!s:>9} "
                f"{r['log_entries']:>5} {r['size_bytes']:>10} {keys!s:>8} {at:>20} {r['owner']}"
            )
    committed_n = sum(1 for r in rows if r["version"])
    total = sum(r["size_bytes"] for r in rows)
    lines.append(f"{committed_n} of {slices} slices committed, {total / 1e6:.1f} MB")
    chains = chain_rows(loc, rows)
    for c in chains:
        lines.append(
            f"chain {c['chain']}: query {c['query']} group {c['group']} slices {c['first']}-"
            f"{c['last']}, {c['positions']} positions{', sealed' if c['sealed'] else ''}, "
            f"named by {c['heads']} heads"
        )
    lines.append("running: " + "; ".join(running) if running else "not running")
    show(
        args,
        {"app": loc.app, "slices": slices, "running": running, "heads": rows, "chains": chains},
        lines,
    )
    return 0


def chain_rows(loc: AppLocation, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every group chain of the application: who writes it, how long it is, whether it is
    sealed, and how many heads name it (none and sealed: gc deletes it)."""
    named: dict[str, int] = {}
    for r in rows:
        if r["chain"]:
            named[r["chain"]] = named.get(r["chain"], 0) + 1
    out = []
    for g in all_chains(loc):
        tip = find_tip(loc, g)
        out.append(
            {
                "chain": g.chain,
                "query": g.query,
                "group": g.group,
                "first": g.range.first,
                "last": g.range.first + g.range.count - 1,
                "positions": tip.position - tip.sealed,
                "sealed": tip.sealed,
                "heads": named.get(g.chain, 0),
                "created_at": g.created_ms / 1000,
            }
        )
    return out


# ---- get / scan -----------------------------------------------------------------------------


def get_command(args: argparse.Namespace) -> int:
    loc, slices, heads = open_app(args)
    s = args.slice_id if args.slice_id is not None else route(args.key, None, slices)
    if not 0 <= s < slices:
        raise StateQueryError(f"--slice {s}: the application has slices 0..{slices - 1}")
    version = targets(
        heads, [s], version=args.version, batch=args.batch, query=args.query, loc=loc
    )[s]
    with opened(DurableState(loc), heads.get(s), slices, version) as store:
        found = list(entries(store, s, key=args.key, allow_pickle=args.allow_pickle))
    value = next((e.value for e in found if e.sub is None), None)
    mapped = {e.sub: e.value for e in found if e.sub is not None}
    data = {
        "key": args.key,
        "slice": s,
        "version": version,
        "found": bool(found),
        "value": jsonable(value),
        "map": jsonable(mapped),
    }
    lines = [f"{args.key!r} in slice {s} at version {version}: "]
    if not found:
        lines[0] += "no state"
    else:
        lines[0] += json.dumps(jsonable(value)) if value is not None else "(no value)"
        lines += [f"  [{sub!r}] = {json.dumps(jsonable(v))}" for sub, v in mapped.items()]
    show(args, data, lines)
    return 0 if found else EXIT_FOUND_PROBLEM


def scan_command(args: argparse.Namespace) -> int:
    if args.key_prefix is not None and (args.start is not None or args.stop is not None):
        raise StateQueryError("give --key-prefix or a range (--start/--stop), not both")
    loc, slices, heads = open_app(args)
    wanted = parse_slices(args.slice, slices)
    versions = targets(
        heads, wanted, version=args.version, batch=args.batch, query=args.query, loc=loc
    )
    durable = DurableState(loc)
    out: list[dict[str, Any]] = []
    truncated = False
    with progress_bar(args, "scanning", len(wanted)) as bar:
        for s in wanted:
            with opened(durable, heads.get(s), slices, versions[s]) as store:
                for e in entries(
                    store, s, prefix=args.key_prefix, start=args.start, stop=args.stop,
                    allow_pickle=args.allow_pickle,
                ):  # fmt: skip
                    if args.limit and len(out) >= args.limit:
                        truncated = True
                        break
                    out.append(e.to_dict())
            bar.update()
            if truncated:
                break
    lines = [
        f"{e['slice']:>5} {e['key']}{'' if e['sub'] is None else '[' + e['sub'] + ']'} = "
        f"{json.dumps(e['value'])}"
        for e in out
    ]
    more = f" (stopped at --limit {args.limit})" if truncated else ""
    lines.append(f"{len(out)} entries{more}")
    show(args, {"entries": out, "truncated": truncated}, lines)
    return 0


# ---- export / restore / verify ----------------------------------------------------------


def export_command(args: argparse.Namespace) -> int:
    loc, slices, heads = open_app(args)
    wanted = parse_slices(args.slice, slices)
    versions = targets(
        heads, wanted, version=args.version, batch=args.batch, query=args.query, loc=loc
    )
    out = Path(args.out)
    if args.format == "parquet" and out.exists() and any(out.iterdir()):
        raise StateQueryError(f"--out {out}: the directory is not empty")
    with progress_bar(args, "exporting", len(wanted)) as bar:
        report = state_export.export(
            DurableState(loc),
            heads,
            slices,
            versions,
            args.format,
            out,
            threads=args.threads,
            on_slice=lambda rows, nbytes: bar.update(nbytes=nbytes),
            allow_pickle=args.allow_pickle,
        )
    data = {**report.to_dict(), "versions": {str(s): v for s, v in versions.items()}}
    show(
        args,
        data,
        [f"exported {report.rows} entries of {report.slices} slices to {out} ({args.format})"],
    )
    return 0


def restore_command(args: argparse.Namespace) -> int:
    loc, slices, heads = open_app(args)
    s = parse_slices(str(args.slice_id), slices)[0]
    head = heads.get(s)
    version = targets(
        heads, [s], version=args.version, batch=args.batch, query=args.query, loc=loc
    )[s]
    dest = Path(args.dest)
    if dest.exists() and any(dest.iterdir()):
        raise StateQueryError(f"--dest {dest}: the directory is not empty")
    if head is None or not head.committed or version == 0:
        raise StateQueryError(f"slice {s} has no committed state to restore")
    with progress_bar(args, f"restoring slice {s}", 1) as bar:
        store, stats = materialize(DurableState(loc), head, dest, slices, version)
        keys = keys_of(store)
        store.close()
        bar.update(nbytes=stats.bytes)
    data = {**stats.to_dict(), "path": str(dest), "keys": keys}
    show(
        args,
        data,
        [
            f"slice {s} at version {version} in {dest}: {keys} keys, "
            f"{stats.bytes / 1e6:.1f} MB in {stats.seconds:.1f} s ({stats.mb_per_s:.1f} MB/s)"
        ],
    )
    return 0


def verify_command(args: argparse.Namespace) -> int:
    loc, slices, _ = open_app(args)
    wanted = parse_slices(args.slice, slices)
    with progress_bar(args, "verifying", len(wanted)) as bar:
        report = verify.verify(
            loc, slice_ids=wanted, rebuild=args.rebuild, threads=args.threads,
            on_progress=bar.callback,
        )  # fmt: skip
    lines = [
        f"{report.slices} slices, {report.versions} restorable versions, {report.segments} "
        f"changelog sections, {report.manifests} manifests, {report.sst_objects} SST objects"
        + (f", {report.rebuilt} rebuilt" if args.rebuild else ""),
        *report.problems,
        "OK" if report.ok else f"{len(report.problems)} problems",
    ]
    show(args, report.to_dict(), lines)
    return 0 if report.ok else EXIT_FOUND_PROBLEM
