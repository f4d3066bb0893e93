"""`shardless state ...`: look at, check, move and repair an application's durable state.

Every command reads S3 and DynamoDB only (never a running job's local stores), takes
`--app` (and `--bucket/--table/--prefix` when they are not the defaults), and `--json` for
scripts: one JSON object on stdout, nothing else there, no progress bars.

Exit codes: 0 ok; 1 the command worked and found something wrong or nothing (verify found
a problem, get found no such key); 2 an error (bad input, missing state, unreachable
service, a conflict); 3 refused because the application looks running (see `--force`).

Commands that change state (`rollback`, `reslice`, `gc --delete`) are dry runs unless
told otherwise, and refuse while the application's lease is held or its slices committed
recently; `gc --delete` runs beside a job when its grace period is at least
`gc.RUNNING_GRACE_S` (see `shardless.changelog.gc` for why that is safe).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from shardless.changelog import gc, lease, reslice, resources, rollback, verify
from shardless.changelog.durable import DurableState
from shardless.changelog.errors import ChangelogError
from shardless.changelog.inspect import StateQueryError, entries, jsonable, keys_of, opened
from shardless.changelog.layout import AppLocation, Head
from shardless.changelog.restore import materialize
from shardless.processor.driver import progress, takeover
from shardless.processor.errors import ProcessorError
from shardless.processor.runtime.routing import route
from shardless.processor.tools import export as state_export
from shardless.processor.tools.progress_bar import Bar
from shardless.processor.tools.selection import latest_query, parse_slices, targets

EXIT_FOUND_PROBLEM = 1
EXIT_RUNNING = 3


class StateBusyError(ProcessorError):
    """The application looks running; a command that changes its state refused."""


def _location(args: argparse.Namespace, prefix: str = "") -> AppLocation:
    app = getattr(args, f"{prefix}app")
    base = AppLocation.default(app)
    given = getattr(args, f"{prefix}prefix")
    return AppLocation(
        app=app,
        bucket=getattr(args, f"{prefix}bucket") or base.bucket,
        prefix=base.prefix if given is None else given,
        table=getattr(args, f"{prefix}table") or base.table,
    )


def _print(args: argparse.Namespace, data: Any, lines: list[str]) -> None:
    if args.json:
        print(json.dumps(data, default=str))
    else:
        print("\n".join(lines))


def _bar(args: argparse.Namespace, label: str, total: int, unit: str = "slices") -> Bar:
    return Bar(label, total, unit, enabled=False if args.json else None)


def _open_app(args: argparse.Namespace) -> tuple[AppLocation, int, dict[int, Head]]:
    loc = _location(args)
    slices = resources.app_slices(loc)
    return loc, slices, DurableState(loc).heads(list(range(slices)))


def _running(loc: AppLocation, heads: dict[int, Head], quiet_s: float) -> list[str]:
    return lease.activity(lease.read(loc), list(heads.values()), quiet_s)


def _refuse_if_running(
    args: argparse.Namespace, loc: AppLocation, heads: dict[int, Head], hint: str = ""
) -> None:
    if args.force:
        return
    reasons = _running(loc, heads, args.quiet_s)
    if reasons:
        raise StateBusyError(
            f"application {loc.app!r} looks running: {'; '.join(reasons)}. Stop the job (or "
            f"wait {args.quiet_s:.0f} s after its last commit){hint}, or pass --force if you "
            "are sure"
        )


# ---- ls -----------------------------------------------------------------------------------


def _ls(args: argparse.Namespace) -> int:
    loc, slices, heads = _open_app(args)
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
            }
        )
    if args.keys:
        durable = DurableState(loc)
        committed = [r for r in rows if r["version"]]
        with _bar(args, "counting keys", len(committed)) as bar:

            def count(row: dict[str, Any]) -> None:
                with opened(durable, heads[row["slice"]], slices) as store:
                    row["keys"] = keys_of(store)
                bar.update()

            with ThreadPoolExecutor(max_workers=args.threads) as pool:
                list(pool.map(count, committed))
        for r in rows:
            r["keys"] = r["keys"] or 0
    running = _running(loc, heads, args.quiet_s)
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
    lines.append("running: " + "; ".join(running) if running else "not running")
    _print(
        args,
        {"app": loc.app, "slices": slices, "running": running, "heads": rows},
        lines,
    )
    return 0


# ---- get / scan -----------------------------------------------------------------------------


def _get(args: argparse.Namespace) -> int:
    loc, slices, heads = _open_app(args)
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
    _print(args, data, lines)
    return 0 if found else EXIT_FOUND_PROBLEM


def _scan(args: argparse.Namespace) -> int:
    if args.key_prefix is not None and (args.start is not None or args.stop is not None):
        raise StateQueryError("give --key-prefix or a range (--start/--stop), not both")
    loc, slices, heads = _open_app(args)
    wanted = parse_slices(args.slice, slices)
    versions = targets(
        heads, wanted, version=args.version, batch=args.batch, query=args.query, loc=loc
    )
    durable = DurableState(loc)
    out: list[dict[str, Any]] = []
    truncated = False
    with _bar(args, "scanning", len(wanted)) as bar:
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
    _print(args, {"entries": out, "truncated": truncated}, lines)
    return 0


# ---- export / restore / verify ----------------------------------------------------------


def _export(args: argparse.Namespace) -> int:
    loc, slices, heads = _open_app(args)
    wanted = parse_slices(args.slice, slices)
    versions = targets(
        heads, wanted, version=args.version, batch=args.batch, query=args.query, loc=loc
    )
    out = Path(args.out)
    if args.format == "parquet" and out.exists() and any(out.iterdir()):
        raise StateQueryError(f"--out {out}: the directory is not empty")
    with _bar(args, "exporting", len(wanted)) as bar:
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
    _print(
        args,
        data,
        [f"exported {report.rows} entries of {report.slices} slices to {out} ({args.format})"],
    )
    return 0


def _restore(args: argparse.Namespace) -> int:
    loc, slices, heads = _open_app(args)
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
    with _bar(args, f"restoring slice {s}", 1) as bar:
        store, stats = materialize(DurableState(loc), head, dest, slices, version)
        keys = keys_of(store)
        store.close()
        bar.update(nbytes=stats.bytes)
    data = {**stats.to_dict(), "path": str(dest), "keys": keys}
    _print(
        args,
        data,
        [
            f"slice {s} at version {version} in {dest}: {keys} keys, "
            f"{stats.bytes / 1e6:.1f} MB in {stats.seconds:.1f} s ({stats.mb_per_s:.1f} MB/s)"
        ],
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    loc, slices, _ = _open_app(args)
    wanted = parse_slices(args.slice, slices)
    with _bar(args, "verifying", len(wanted)) as bar:
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
    _print(args, report.to_dict(), lines)
    return 0 if report.ok else EXIT_FOUND_PROBLEM


# ---- rollback / gc / reslice ------------------------------------------------------------


def _rollback(args: argparse.Namespace) -> int:
    loc, _, heads = _open_app(args)
    query = args.query or latest_query(heads)
    try:
        plan = rollback.plan(loc, query, args.batch)
    except rollback.RollbackError as exc:
        raise StateQueryError(str(exc)) from exc
    positions = progress.at_batch(loc, query, args.batch)
    data: dict[str, Any] = {
        **plan.to_dict(),
        "dry_run": not args.apply,
        "moved": 0,
        "source_positions": positions is not None,
    }
    lines = [f"{len(plan.moves)} slices move back to query {query} batch {args.batch}:"]
    lines += [f"  slice {s}: v{a} -> v{b}" for s, (a, b) in sorted(plan.moves.items())]
    if positions is None:
        lines.append(
            f"no source positions are recorded for batch {args.batch}: the roll-back "
            "withdraws the application's progress record; afterwards start the job on a NEW "
            "checkpoint at an explicit --starting-position AT_TIMESTAMP with --allow-recount"
        )
    if args.apply:
        _refuse_if_running(args, loc, heads)
        data["moved"] = rollback.apply(loc, plan)
        takeover.after_rollback(loc, query, args.batch)  # and every old checkpoint is fenced
        if positions is not None:
            lines.append(
                f"rolled back {data['moved']} slices; start the job on a NEW checkpoint with "
                "--starting-position COMMITTED to continue from batch "
                f"{args.batch}'s source positions"
            )
        else:
            lines.append(f"rolled back {data['moved']} slices; the progress record is withdrawn")
    else:
        lines.append("dry run: pass --apply to roll back")
    _print(args, data, lines)
    return 0


def _gc(args: argparse.Namespace) -> int:
    gc.check_grace(args.grace_s)
    loc, slices, heads = _open_app(args)
    if args.delete and args.grace_s < gc.RUNNING_GRACE_S:  # safe beside a job: see gc's doc
        _refuse_if_running(args, loc, heads, f", or keep --grace-s at least {gc.RUNNING_GRACE_S} s")
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


def _reslice(args: argparse.Namespace) -> int:
    loc, slices, heads = _open_app(args)
    target = _location(args, "to_")
    reslice.check_target(loc, target)
    groups = reslice.plan_groups(slices, args.to_slices)
    reslice.check_routing(slices, args.md5_routed)
    committed = sum(1 for h in heads.values() if h.committed)
    data: dict[str, Any] = {
        "source": loc.app,
        "target": target.app,
        "from_slices": slices,
        "to_slices": args.to_slices,
        "groups": len(groups),
        "committed_slices": committed,
        "dry_run": not args.apply,
    }
    lines = [
        f"{loc.app} ({slices} slices, {committed} with state) -> {target.app} "
        f"({args.to_slices} slices): {len(groups)} independent groups"
    ]
    if not args.apply:
        lines.append("dry run: pass --apply to write the new generation")
        _print(args, data, lines)
        return 0
    _refuse_if_running(args, loc, heads)
    # Commits past the latest progress record are of batches that never completed: a
    # COMMITTED start would undo them; the new generation must not carry them over.
    _, data["undone_slices"] = takeover.undo_uncommitted(loc)
    started = time.perf_counter()
    with _bar(args, "re-slicing", slices) as bar:
        report = reslice.reslice(
            loc, target, args.to_slices, threads=args.threads, on_progress=bar.callback,
            md5_routed=args.md5_routed,
        )  # fmt: skip
    found = progress.latest(loc)
    if found is not None:
        progress.set_latest(target, found)
    data.update(report.to_dict())
    data["seconds"] = round(time.perf_counter() - started, 2)
    data["source_positions"] = found is not None
    lines.append(
        f"wrote {report.entries} entries ({report.bytes / 1e6:.1f} MB) into {args.to_slices} "
        f"slices of {target.app}, digest {report.digest}, verified by restoring each back"
    )
    lines.append(
        f"run the job with --app {target.app} --slices {args.to_slices} on a NEW checkpoint"
        + (" with --starting-position COMMITTED" if found is not None else "")
    )
    _print(args, data, lines)
    return 0


# ---- parser ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    if args.json:  # stdout carries one JSON object; logs stay on stderr but quieter
        logging.getLogger("shardless.changelog").setLevel(logging.WARNING)
    try:
        return args.state_func(args)
    except (ProcessorError, ChangelogError) as exc:
        code = EXIT_RUNNING if isinstance(exc, StateBusyError) else 2
        if args.json:  # scripts get the error on stdout too, as the one JSON object
            print(json.dumps({"error": str(exc), "exit": code}))
        print(f"shardless: {exc}", file=sys.stderr)
        return code


def add_parser(sub: argparse._SubParsersAction) -> None:
    state = sub.add_parser("state", help="inspect and maintain an application's durable state")
    cmds = state.add_subparsers(dest="action", required=True)

    def common(name: str, help: str, func: Any) -> argparse.ArgumentParser:
        p = cmds.add_parser(name, help=help, description=help)
        p.add_argument("--app", required=True)
        p.add_argument("--bucket", help="default shardless-APP")
        p.add_argument("--table", help="default shardless-APP")
        p.add_argument("--prefix", help="default APP")
        p.add_argument("--json", action="store_true", help="one JSON object on stdout")
        p.set_defaults(func=run, state_func=func)
        return p

    def at(p: argparse.ArgumentParser) -> None:
        p.add_argument("--version", type=int, help="a version of one slice (with --slice)")
        p.add_argument("--batch", type=int, help="every slice as it stood after this batch")
        p.add_argument("--query", help="the query of --batch (default: the newest)")

    def pickled(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--allow-pickle",
            action="store_true",
            help="decode pickled values; unpickling runs code chosen by whoever wrote the "
            "value, so only for buckets whose every writer you trust",
        )

    def threads(p: argparse.ArgumentParser, n: int = 4) -> None:
        p.add_argument("--threads", type=int, default=n, help="slices worked on at once")

    def safety(p: argparse.ArgumentParser) -> None:
        p.add_argument("--force", action="store_true", help="even if the app looks running")
        p.add_argument(
            "--quiet-s",
            type=float,
            default=lease.DEFAULT_QUIET_S,
            help="commits this recent mean the application is running",
        )

    p = common("ls", "slices: version, size, keys, last commit, owner", _ls)
    p.add_argument("--keys", action="store_true", help="count keys (restores every slice)")
    p.add_argument("--quiet-s", type=float, default=lease.DEFAULT_QUIET_S)
    threads(p)

    p = common("get", "the value (and map entries) of one key", _get)
    p.add_argument("--key", required=True)
    p.add_argument("--slice", dest="slice_id", type=int, help="default: the key's MD5 slice")
    at(p)
    pickled(p)

    p = common("scan", "values of a key prefix or range, in some or all slices", _scan)
    p.add_argument("--slice", help="slices: 3, 0-15 or 1,4,9-12 (default: all)")
    p.add_argument("--key-prefix", help="keys starting with this")
    p.add_argument("--start", help="first key (inclusive)")
    p.add_argument("--stop", help="last key (exclusive)")
    p.add_argument("--limit", type=int, default=100, help="at most this many (0: all)")
    at(p)
    pickled(p)

    p = common("export", "slices to Parquet or JSON lines at a version", _export)
    p.add_argument("--format", choices=state_export.FORMATS, default="parquet")
    p.add_argument("--out", required=True, help="a directory (parquet) or a file (jsonl)")
    p.add_argument("--slice", help="slices: 3, 0-15 or 1,4,9-12 (default: all)")
    at(p)
    pickled(p)
    threads(p)

    p = common("verify", "checksums, manifests, changelog continuity; --rebuild", _verify)
    p.add_argument("--slice", help="slices: 3, 0-15 or 1,4,9-12 (default: all)")
    p.add_argument("--rebuild", action="store_true", help="restore every slice by two paths")
    threads(p, 8)

    p = common("restore", "materialise one slice at a version into a directory", _restore)
    p.add_argument("--slice", dest="slice_id", type=int, required=True)
    p.add_argument("--dest", required=True, help="an empty or new directory")
    at(p)

    p = common("rollback", "move every slice back to an earlier batch (dry run)", _rollback)
    p.add_argument("--batch", type=int, required=True, help="the last batch to keep")
    p.add_argument("--query", help="the query whose batch it is (default: the newest)")
    p.add_argument("--apply", action="store_true", help="roll back (default: dry run)")
    safety(p)

    p = common("gc", "objects retention no longer needs (dry run)", _gc)
    p.add_argument("--delete", action="store_true", help="delete them (default: dry run)")
    p.add_argument(
        "--grace-s",
        type=float,
        default=gc.DEFAULT_GRACE_S,
        help=f"keep unreferenced objects this long (>= {gc.RUNNING_GRACE_S}: safe while the "
        "job runs; shorter only when it is stopped)",
    )
    safety(p)

    p = common("reslice", "rewrite N slices as M into a new application (dry run)", _reslice)
    p.add_argument("--to-app", required=True, help="the new generation's application name")
    p.add_argument("--to-slices", type=int, required=True, help="a multiple or divisor of N")
    p.add_argument("--to-bucket", help="default shardless-TO_APP")
    p.add_argument("--to-table", help="default shardless-TO_APP")
    p.add_argument("--to-prefix", help="default TO_APP")
    p.add_argument("--apply", action="store_true", help="write it (default: dry run)")
    p.add_argument(
        "--md5-routed",
        action="store_true",
        help="every record was routed by its partition key's MD5 (no explicit hash keys); "
        "needed from 1 slice, where keys cannot be checked",
    )
    safety(p)
    threads(p)
