"""The `shardless state` commands that change durable state: rollback, gc and reslice.
Each is a dry run unless told otherwise and refuses while the application looks running
(`state_app.refuse_if_running`)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from shardless.changelog import gc, reslice, rollback
from shardless.changelog.inspect import StateQueryError
from shardless.processor.driver import progress, takeover
from shardless.processor.tools.selection import latest_query
from shardless.processor.tools.state_app import (
    location,
    open_app,
    progress_bar,
    refuse_if_running,
    show,
)

# ---- rollback / gc / reslice ------------------------------------------------------------


def rollback_command(args: argparse.Namespace) -> int:
    loc, _, heads = open_app(args)
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
        refuse_if_running(args, loc, heads)
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
    show(args, data, lines)
    return 0


def gc_command(args: argparse.Namespace) -> int:
    gc.check_grace(args.grace_s)
    loc, slices, heads = open_app(args)
    if args.delete and args.grace_s < gc.RUNNING_GRACE_S:  # safe beside a job: see gc's doc
        refuse_if_running(args, loc, heads, f", or keep --grace-s at least {gc.RUNNING_GRACE_S} s")
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
    show(args, {**report.to_dict(), "keys": report.deleted, "at": time.time()}, lines)
    return 0


def reslice_command(args: argparse.Namespace) -> int:
    loc, slices, heads = open_app(args)
    target = location(args, "to_")
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
        show(args, data, lines)
        return 0
    refuse_if_running(args, loc, heads)
    # Commits past the latest progress record are of batches that never completed: a
    # COMMITTED start would undo them; the new generation must not carry them over.
    _, data["undone_slices"] = takeover.undo_uncommitted(loc)
    started = time.perf_counter()
    with progress_bar(args, "re-slicing", slices) as bar:
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
    show(args, data, lines)
    return 0
