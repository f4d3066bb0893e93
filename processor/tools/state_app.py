"""An application's durable state as the `shardless state` commands open it: its location
from the flags, its heads, whether it looks running, and output as text or one JSON object."""

from __future__ import annotations

import argparse
import json
from typing import Any

from shardless.changelog import lease, resources
from shardless.changelog.durable import DurableState
from shardless.changelog.layout import AppLocation, Head
from shardless.processor.errors import ProcessorError
from shardless.processor.tools.progress_bar import Bar

EXIT_FOUND_PROBLEM = 1
EXIT_RUNNING = 3


class StateBusyError(ProcessorError):
    """The application looks running; a command that changes its state refused."""


def location(args: argparse.Namespace, prefix: str = "") -> AppLocation:
    return AppLocation.of(
        *(getattr(args, prefix + n) for n in ("app", "bucket", "prefix", "table"))
    )


def show(args: argparse.Namespace, data: Any, lines: list[str]) -> None:
    if args.json:
        print(json.dumps(data, default=str))
    else:
        print("\n".join(lines))


def progress_bar(args: argparse.Namespace, label: str, total: int, unit: str = "slices") -> Bar:
    return Bar(label, total, unit, enabled=False if args.json else None)


def open_app(args: argparse.Namespace) -> tuple[AppLocation, int, dict[int, Head]]:
    loc = location(args)
    slices = resources.app_slices(loc)
    return loc, slices, DurableState(loc).heads(list(range(slices)))


def activity(loc: AppLocation, heads: dict[int, Head], quiet_s: float) -> list[str]:
    return lease.activity(lease.read(loc), list(heads.values()), quiet_s)


def refuse_if_running(
    args: argparse.Namespace, loc: AppLocation, heads: dict[int, Head], hint: str = ""
) -> None:
    if args.force:
        return
    reasons = activity(loc, heads, args.quiet_s)
    if reasons:
        raise StateBusyError(
            f"application {loc.app!r} looks running: {'; '.join(reasons)}. Stop the job (or "
            f"wait {args.quiet_s:.0f} s after its last commit){hint}, or pass --force if you "
            "are sure"
        )
