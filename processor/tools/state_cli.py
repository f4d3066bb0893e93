"""`shardless state ...`: look at, check, move and repair an application's durable state.

Every command reads S3 and DynamoDB only (never a running job's local stores), takes
`--app` (and `--bucket/--table/--prefix` when they are not the defaults), and `--json` for
scripts: one JSON object on stdout, nothing else there, no progress bars.

Exit codes: 0 ok; 1 the command worked and found something wrong or nothing (verify found
a problem, get found no such key); 2 an error (bad input, missing state, unreachable
service, a conflict); 3 refused because the application looks running (see `--force`).

Commands that change state (`rollback`, `reslice`, `import`, `gc --delete`) are dry runs
unless told otherwise, and refuse while the application's lease is held or its slices
committed recently; `gc --delete` runs beside a job when its grace period is at least
`gc.RUNNING_GRACE_S` (see `shardless.changelog.gc` for why that is safe).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from shardless.changelog import gc, lease
from shardless.changelog.errors import ChangelogError
from shardless.processor.errors import ProcessorError
from shardless.processor.tools import export as state_export
from shardless.processor.tools.import_rows import FORMATS as IMPORT_FORMATS
from shardless.processor.tools.state_app import EXIT_RUNNING, StateBusyError
from shardless.processor.tools.state_import import import_command
from shardless.processor.tools.state_read import (
    export_command,
    get_command,
    ls_command,
    restore_command,
    scan_command,
    verify_command,
)
from shardless.processor.tools.state_repair import gc_command, reslice_command, rollback_command

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

    p = common("ls", "slices: version, size, keys, last commit, owner", ls_command)
    p.add_argument("--keys", action="store_true", help="count keys (restores every slice)")
    p.add_argument("--quiet-s", type=float, default=lease.DEFAULT_QUIET_S)
    threads(p)

    p = common("get", "the value (and map entries) of one key", get_command)
    p.add_argument("--key", required=True)
    p.add_argument("--slice", dest="slice_id", type=int, help="default: the key's MD5 slice")
    at(p)
    pickled(p)

    p = common("scan", "values of a key prefix or range, in some or all slices", scan_command)
    p.add_argument("--slice", help="slices: 3, 0-15 or 1,4,9-12 (default: all)")
    p.add_argument("--key-prefix", help="keys starting with this")
    p.add_argument("--start", help="first key (inclusive)")
    p.add_argument("--stop", help="last key (exclusive)")
    p.add_argument("--limit", type=int, default=100, help="at most this many (0: all)")
    at(p)
    pickled(p)

    p = common("export", "slices to Parquet or JSON lines at a version", export_command)
    p.add_argument("--format", choices=state_export.FORMATS, default="parquet")
    p.add_argument("--out", required=True, help="a directory (parquet) or a file (jsonl)")
    p.add_argument("--slice", help="slices: 3, 0-15 or 1,4,9-12 (default: all)")
    at(p)
    pickled(p)
    threads(p)

    p = common("verify", "checksums, manifests, changelog continuity; --rebuild", verify_command)
    p.add_argument("--slice", help="slices: 3, 0-15 or 1,4,9-12 (default: all)")
    p.add_argument("--rebuild", action="store_true", help="restore every slice by two paths")
    threads(p, 8)

    p = common("restore", "materialise one slice at a version into a directory", restore_command)
    p.add_argument("--slice", dest="slice_id", type=int, required=True)
    p.add_argument("--dest", required=True, help="an empty or new directory")
    at(p)

    p = common("rollback", "move every slice back to an earlier batch (dry run)", rollback_command)
    p.add_argument("--batch", type=int, required=True, help="the last batch to keep")
    p.add_argument("--query", help="the query whose batch it is (default: the newest)")
    p.add_argument("--apply", action="store_true", help="roll back (default: dry run)")
    safety(p)

    p = common("gc", "objects retention no longer needs (dry run)", gc_command)
    p.add_argument("--delete", action="store_true", help="delete them (default: dry run)")
    p.add_argument(
        "--grace-s",
        type=float,
        default=gc.DEFAULT_GRACE_S,
        help=f"keep unreferenced objects this long (>= {gc.RUNNING_GRACE_S}: safe while the "
        "job runs; shorter only when it is stopped)",
    )
    safety(p)

    p = common("reslice", "rewrite N slices as M into a new application (dry run)", reslice_command)
    p.add_argument("--to-app", required=True, help="the new generation's application name")
    p.add_argument("--to-slices", type=int, required=True, help="a multiple or divisor of N")
    p.add_argument("--to-bucket", help="default shardless-TO_APP")
    p.add_argument("--to-table", help="default shardless-TO_APP")
    p.add_argument("--to-prefix", help="default TO_APP")
    p.add_argument("--apply", action="store_true", help="write it (default: dry run)")
    p.add_argument(
        "--md5-routed",
        action="store_true",
        help="every record was routed by its key's MD5 (its partition key's, or the app's "
        "chosen key's; no explicit hash keys); "
        "needed from 1 slice, where keys cannot be checked",
    )
    safety(p)
    threads(p)

    p = common(
        "import", "keyed values as a NEW application's first state (dry run)", import_command
    )
    p.add_argument(
        "--input",
        action="append",
        required=True,
        help="a JSON lines or Parquet file, or a directory of them (repeat for more)",
    )
    p.add_argument("--format", choices=IMPORT_FORMATS, help="default: from each file's suffix")
    p.add_argument("--key-field", default="key", help="the field holding the key (key)")
    p.add_argument("--value-field", default="value", help="the field holding the value (value)")
    p.add_argument(
        "--sub-field", help="a map entry's sub-key: rows where it is set go to the key's map state"
    )
    p.add_argument(
        "--value-json",
        action="store_true",
        help="the value field holds JSON text (as `state export` writes Parquet)",
    )
    p.add_argument("--slices", type=int, help="slice count (default: the application's, else 256)")
    p.add_argument("--apply", action="store_true", help="import (default: dry run)")
    safety(p)
    threads(p)
