"""`shardless state import`: keyed values from JSON lines or Parquet as the first committed
state of a NEW application, what Spark's `initialState` is to a stateful operator. A job
started on the application afterwards finds each value under its key (`ctx.state`, or
`ctx.state.map` for rows with a sub-key).

The import, in order (a dry run, without --apply, stops after step 2):

1. check: the application is new (no committed slice, no query begun, no progress, no
   earlier import) and does not look running (`state_app.refuse_if_running`);
2. stage: read every row, check and encode it as the job would (`import_rows`) into a
   scratch RocksDB store of its slice; a bad row stops the import here, nothing written;
3. claim: put the application's import record only if it has none (`attribute_not_exists`),
   so that of two imports one commits; then check step 1 again;
4. upload: each staged slice as a snapshot at version 1, objects no head references yet;
5. install: each slice's head, only where the slice has none (`reslice.install`, as a new
   re-sliced generation begins);
6. verify: restore each slice from S3, compare its digest with what was staged, run
   `changelog.verify` over them, and mark the import record done.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from shardless.changelog import aws, fence, resources, verify
from shardless.changelog.durable import DurableState
from shardless.changelog.errors import ChangelogError, CommitConflictError, ConfigurationError
from shardless.changelog.inspect import Digest, digest
from shardless.changelog.layout import AppLocation, Head, SnapRef, new_uid
from shardless.changelog.reslice import install
from shardless.changelog.restore import identity, materialize
from shardless.changelog.snapshot import write_snapshot
from shardless.processor.driver.imports import DONE, QUERY_PREFIX, import_key, read_import
from shardless.processor.driver.progress import LATEST_SK, describe, read_record
from shardless.processor.errors import ProcessorError
from shardless.processor.tools import import_rows
from shardless.processor.tools.import_rows import Fields, ImportInputError, Row
from shardless.processor.tools.state_app import location, progress_bar, refuse_if_running, show
from shardless.state.slices import DEFAULT_SLICES, check_slices
from shardless.state.store import SliceStore

_FLUSH_BYTES = 32 << 20  # staged values held in memory before they go to the stores


class StateImportError(ProcessorError):
    """The state cannot be imported as asked."""


@dataclass
class SliceCount:
    slice: int
    keys: int = 0
    map_entries: int = 0
    digest: Digest = field(default_factory=Digest)

    def to_dict(self) -> dict[str, Any]:
        return {
            "slice": self.slice,
            "keys": self.keys,
            "map_entries": self.map_entries,
            "digest": f"{self.digest.total:016x}",
        }


class Staging:
    """Rows routed into a scratch store per slice, each store key given once."""

    def __init__(self, app: str, slices: int, scratch: Path) -> None:
        self.app = app
        self.slices = slices
        self.scratch = scratch
        self.stores: dict[int, SliceStore] = {}
        self.counts: dict[int, SliceCount] = {}
        self._pending: dict[int, dict[bytes, tuple[bytes, str]]] = {}
        self._pending_bytes = 0

    def add(self, row: Row) -> None:
        pending = self._pending.setdefault(row.slice, {})
        earlier = pending.get(row.db_key)
        store = self.stores.get(row.slice)
        if earlier is not None or (store is not None and store.get(row.db_key) is not None):
            what = f"key {row.key!r}" + ("" if row.sub is None else f", map entry {row.sub!r},")
            first = f" (first at {earlier[1]})" if earlier is not None else ""
            raise ImportInputError(
                f"{row.where}: {what} is given a second time{first}; each key and each map "
                "entry may be given once"
            )
        pending[row.db_key] = (row.value, row.where)
        count = self.counts.setdefault(row.slice, SliceCount(row.slice))
        if row.sub is None:
            count.keys += 1
        else:
            count.map_entries += 1
        count.digest.add(row.db_key, row.value)
        self._pending_bytes += len(row.db_key) + len(row.value) + 64
        if self._pending_bytes > _FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        for s, pending in self._pending.items():
            if not pending:
                continue
            store = self.stores.get(s)
            if store is None:
                ident = identity(self.app, s, self.slices)
                store = self.stores[s] = SliceStore(self.scratch / f"slice-{s}", ident)
            store.commit([(k, v) for k, (v, _) in pending.items()], 1)
        self._pending = {}
        self._pending_bytes = 0

    def close(self) -> None:
        for store in self.stores.values():
            store.close()


@dataclass
class ImportReport:
    app: str
    slices: int
    inputs: list[str]
    dry_run: bool
    keys: int = 0
    map_entries: int = 0
    per_slice: list[dict[str, Any]] = field(default_factory=list)
    query: str = ""
    verified: bool = False
    bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# ---- 1 and 3: is the application new, and the claim ----------------------------------------


def existing_slices(loc: AppLocation) -> int | None:
    """The slice count of an application whose resources exist (None: they do not)."""
    try:
        return resources.app_slices(loc)
    except ConfigurationError:
        return None


def what_exists(loc: AppLocation, heads: dict[int, Head], mine: str = "") -> list[str]:
    """What makes the application not new (empty: it is new); `mine`: the import under
    way, whose own record does not count."""
    found = []
    committed = sorted((h for h in heads.values() if h.committed), key=lambda h: h.slice)
    if committed:
        first = committed[0]
        found.append(
            f"{len(committed)} slices with committed state (slice {first.slice} at version "
            f"{first.version}, query {first.query or '?'})"
        )
    claim = read_import(loc)
    if claim is not None and claim["query"] != mine:
        found.append(
            f"an import {claim['status']} ({claim['query']}, begun "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(claim['at'] / 1000))} UTC)"
        )
    progress = read_record(loc.table, LATEST_SK)
    if progress is not None:
        found.append(f"a progress record ({describe(progress)})")
    began = fence.lineage(loc)
    if began:
        found.append(f"{len(began)} queries began on it ({', '.join(began[:3])})")
    return found


def refuse_unless_new(loc: AppLocation, heads: dict[int, Head], mine: str = "") -> None:
    found = what_exists(loc, heads, mine)
    if found:
        raise StateImportError(
            f"application {loc.app!r} is not new: it has {'; '.join(found)}. An import writes "
            "only the first state of an application; import into a new application name"
        )


def claim(loc: AppLocation, query: str, inputs: list[str]) -> None:
    """Record that `query` imports into the application, unless an import already did."""
    try:
        aws.client("dynamodb").put_item(
            TableName=loc.table,
            Item={
                **import_key(),
                "query": {"S": query},
                "status": {"S": "in progress"},
                "at": {"N": str(int(time.time() * 1000))},
                "inputs": {"L": [{"S": p} for p in inputs]},
            },
            ConditionExpression="attribute_not_exists(pk)",
        )
    except ClientError as exc:
        if exc.response["Error"]["Code"] != "ConditionalCheckFailedException":
            raise
        found = read_import(loc) or {"status": "?", "query": "?", "at": 0}
        raise StateImportError(
            f"application {loc.app!r} already has an import {found['status']} "
            f"({found['query']}); import into a new application name"
        ) from None


def _set_claim(loc: AppLocation, query: str, status: str | None) -> None:
    """Mark `query`'s import record `status`, or (None) withdraw it."""
    cond = {
        "ConditionExpression": "#q = :q",
        "ExpressionAttributeNames": {"#q": "query"},
        "ExpressionAttributeValues": {":q": {"S": query}},
    }
    ddb = aws.client("dynamodb")
    if status is None:
        ddb.delete_item(TableName=loc.table, Key=import_key(), **cond)
        return
    cond["ExpressionAttributeNames"]["#s"] = "status"
    cond["ExpressionAttributeValues"][":s"] = {"S": status}
    ddb.update_item(TableName=loc.table, Key=import_key(), UpdateExpression="SET #s = :s", **cond)


# ---- 4 to 6: upload, install, verify ------------------------------------------------------


def commit(
    loc: AppLocation, staging: Staging, query: str, threads: int, on_slice: Any
) -> tuple[int, list[str]]:
    """Upload, install and verify every staged slice; returns the bytes uploaded and the
    problems verification found."""
    staging.flush()
    order = sorted(staging.stores)

    def upload(s: int) -> tuple[SnapRef, int]:
        store = staging.stores[s]
        store.commit([], 1)
        ref, _, sent = write_snapshot(
            loc, s, 1, store.checkpoint(staging.scratch / f"ck-{s}"), None
        )
        return ref, sent

    with ThreadPoolExecutor(max_workers=threads) as pool:
        uploaded = dict(zip(order, pool.map(upload, order), strict=True))
    durable = DurableState(loc)
    for installed, s in enumerate(order):
        try:
            install(durable, s, 1, uploaded[s][0], query)
        except CommitConflictError as exc:
            raise StateImportError(
                f"slice {s} of {loc.app!r} was committed by someone else during the import "
                f"({installed} of {len(order)} slices were installed; the application is "
                f"incomplete, its import record says 'in progress'): {exc}. Do not run a job "
                "on it; import into a new application name"
            ) from exc

    def check(s: int) -> list[str]:
        back, _ = materialize(
            durable, durable.heads([s])[s], staging.scratch / f"back-{s}", staging.slices
        )
        found = digest(back)
        back.close()
        want = staging.counts[s].digest
        on_slice()
        if (found.count, found.total) == (want.count, want.total):
            return []
        return [
            f"slice {s}: restored {found.count} entries (digest {found.total:016x}), staged "
            f"{want.count} ({want.total:016x})"
        ]

    with ThreadPoolExecutor(max_workers=threads) as pool:
        problems = [p for found in pool.map(check, order) for p in found]
    problems += verify.verify(loc, slice_ids=order, threads=threads).problems
    return sum(sent for _, sent in uploaded.values()), problems


# ---- the command ----------------------------------------------------------------------------


def import_command(args: argparse.Namespace) -> int:
    loc = location(args)
    fields = Fields(args.key_field, args.value_field, args.sub_field, args.value_json)
    files = import_rows.input_files(args.input, args.format)
    have = existing_slices(loc)
    slices = check_slices(args.slices or have or DEFAULT_SLICES)
    if have is not None and have != slices:
        raise StateImportError(
            f"--slices {slices}: application {loc.app!r} exists with {have} slices; give "
            f"--slices {have} or a new application name"
        )
    heads = DurableState(loc).heads(list(range(slices))) if have is not None else {}
    if have is not None:  # 1: refused before any row is read
        refuse_unless_new(loc, heads)
        if args.apply:
            refuse_if_running(args, loc, heads)
    report = ImportReport(loc.app, slices, [str(p) for p, _ in files], not args.apply)
    scratch = Path(tempfile.mkdtemp(prefix=f"shardless-import-{loc.app}-"))
    staging = Staging(loc.app, slices, scratch)
    try:
        with progress_bar(args, "reading", len(files), "files") as bar:  # 2: stage
            for path, fmt in files:
                for row in import_rows.rows(path, fmt, fields, slices):
                    staging.add(row)
                bar.update()
        if not staging.counts:
            raise ImportInputError(f"no rows in {', '.join(report.inputs)}: nothing to import")
        if args.apply:
            report.query = f"{QUERY_PREFIX}{loc.app}:{new_uid()[:8]}"
            _apply(args, loc, slices, staging, report)
    finally:
        staging.close()
        shutil.rmtree(scratch, ignore_errors=True)
    counts = sorted(staging.counts.values(), key=lambda c: c.slice)
    report.per_slice = [c.to_dict() for c in counts]
    report.keys = sum(c.keys for c in counts)
    report.map_entries = sum(c.map_entries for c in counts)
    show(args, report.to_dict(), _lines(report))
    return 0


def _apply(
    args: argparse.Namespace, loc: AppLocation, slices: int, staging: Staging, report: ImportReport
) -> None:
    resources.ensure(loc, slices)
    claim(loc, report.query, report.inputs)  # 3: of two imports, one gets here
    try:  # whatever began between step 1 and the claim
        heads = DurableState(loc).heads(list(range(slices)))
        refuse_unless_new(loc, heads, mine=report.query)
        refuse_if_running(args, loc, heads)
    except (ProcessorError, ChangelogError):
        _set_claim(loc, report.query, None)  # nothing was written: the import may be retried
        raise
    with progress_bar(args, "importing", len(staging.counts)) as bar:
        report.bytes, problems = commit(loc, staging, report.query, args.threads, bar.update)
    if problems:
        _set_claim(loc, report.query, "failed verification")
        raise StateImportError(
            f"application {loc.app!r}: the imported state does not verify; do not run a job "
            "on it: " + "; ".join(problems)
        )
    report.verified = True
    _set_claim(loc, report.query, DONE)


def _lines(report: ImportReport) -> list[str]:
    maps = f" and {report.map_entries} map entries" if report.map_entries else ""
    files = f"{len(report.inputs)} file{'s' if len(report.inputs) != 1 else ''}"
    lines = [
        f"{report.keys} keys{maps} from {files} into {len(report.per_slice)} of "
        f"{report.slices} slices of {report.app}; entries per slice (slice:entries):"
    ]
    cells = [f"{c['slice']:>5}:{c['keys'] + c['map_entries']:<6}" for c in report.per_slice]
    lines += ["".join(cells[i : i + 8]).rstrip() for i in range(0, len(cells), 8)]
    if report.dry_run:
        lines.append("dry run: every row is valid; pass --apply to import")
    else:
        lines.append(
            f"imported and verified by restoring each slice back ({report.bytes / 1e6:.1f} MB); "
            f"start the job with --app {report.app} --slices {report.slices} on a NEW checkpoint"
        )
    return lines
