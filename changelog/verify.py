"""Verification of an application's durable state without changing it.

Per slice: the head's history is continuous (restore can reach the head from its newest
snapshot, and every retained version from the oldest one), every changelog section it
references exists and passes its checksum, every retained manifest passes its checks,
every SST object it names exists and passes its checksum, and the SST files of each
snapshot were written by the store its RocksDB MANIFEST describes (a snapshot that mixes
two stores' files will not open: `sst.foreign_files`). A restore would fall back past
such a snapshot; verify reports it. With `rebuild`, each slice is also restored from S3
(with no fallback) and, where the history allows two different paths to the head (two
snapshots, or a snapshot and the whole log), both are taken and must agree.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from shardless.changelog import resources
from shardless.changelog.durable import DurableState
from shardless.changelog.errors import ChangelogError
from shardless.changelog.history import RestorePlan, plan_restore
from shardless.changelog.inspect import digest
from shardless.changelog.layout import AppLocation, Head
from shardless.changelog.manifest import read_manifest
from shardless.changelog.restore import identity, restore
from shardless.changelog.sst import foreign_files, scan_sst


@dataclass
class VerifyReport:
    slices: int = 0
    versions: int = 0
    segments: int = 0
    manifests: int = 0
    sst_objects: int = 0
    rebuilt: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, object]:
        return {**self.__dict__, "ok": self.ok}


def _paths(head: Head) -> list[RestorePlan]:
    """Distinct ways to restore the head: its plan, and one from an older snapshot or 0."""
    main = plan_restore(head, None, head.version)
    plans = [main]
    for snap in head.snaps[:-1]:
        alt = Head(**{**head.__dict__, "snaps": (snap,)})
        try:
            plans.append(plan_restore(alt, None, head.version))
            break
        except ValueError:
            continue
    else:
        if main.snapshot is not None and head.log and head.log[0].version == 1:
            plans.append(RestorePlan(None, head.log, fresh=True))
    return plans


def _check_slice(loc: AppLocation, slices: int, head: Head, rebuild: bool) -> VerifyReport:
    r = VerifyReport(slices=1)
    durable = DurableState(loc)
    sessions: dict[str, int | None] = {}  # per SST object read (`where`): its writing session
    bad: dict[str, str] = {}  # per SST object refused (`where`): why
    try:
        plan_restore(head, None, head.version)
        floor = head.snaps[0].version if head.snaps else 0
        for v in range(floor, head.version + 1):
            plan_restore(head, None, v)
            r.versions += 1
    except ValueError as exc:
        r.problems.append(f"slice {head.slice}: history is not continuous: {exc}")
        return r
    for entry in head.log:
        try:
            durable.read_changes(head.slice, entry)
            r.segments += 1
        except ChangelogError as exc:
            r.problems.append(f"slice {head.slice} v{entry.version}: {exc}")
    for snap in head.snaps:
        try:
            m = read_manifest(loc, snap, slice_id=head.slice)
            r.manifests += 1
        except ChangelogError as exc:
            r.problems.append(f"slice {head.slice} snapshot v{snap.version}: {exc}")
            continue
        for f in m.files:
            if f.where not in sessions and f.where not in bad:
                try:
                    sessions[f.where] = scan_sst(loc.bucket, f)
                except Exception as exc:  # noqa: BLE001 - reported, not raised
                    bad[f.where] = str(exc)
            if f.where in bad:
                r.problems.append(f"slice {head.slice} snapshot v{snap.version}: {bad[f.where]}")
            else:
                r.sst_objects += 1
        foreign = foreign_files(m, sessions)
        if foreign:
            r.problems.append(
                f"slice {head.slice} snapshot v{snap.version} (s3://{loc.bucket}/{snap.key}): "
                f"{', '.join(foreign)} written by another store than its MANIFEST describes; "
                "RocksDB will not open it (restore falls back to an older snapshot)"
            )
    if rebuild and not r.problems:
        digests = []
        scratch = Path(tempfile.mkdtemp(prefix=f"shardless-verify-{head.slice}-"))
        try:
            for i, p in enumerate(_paths(head)):
                alt = Head(**{**head.__dict__, "snaps": (p.snapshot,) if p.snapshot else ()})
                if p.snapshot is None:
                    alt = Head(**{**alt.__dict__, "log": p.entries})
                store, _ = restore(
                    scratch / f"p{i}", identity(loc.app, head.slice, slices), durable, alt,
                    head.version, fallback=False,
                )  # fmt: skip
                d = digest(store)
                store.close()
                digests.append(((d.count, d.total), p.snapshot.version if p.snapshot else 0))
            r.rebuilt += 1
            if len({d for d, _ in digests}) > 1:
                r.problems.append(
                    f"slice {head.slice}: restores from different starting points disagree "
                    f"({[(f'from v{v}', f'{c} entries {t:016x}') for (c, t), v in digests]})"
                )
        except ChangelogError as exc:
            r.problems.append(f"slice {head.slice}: rebuild failed: {exc}")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return r


def verify(
    loc: AppLocation,
    *,
    slice_ids: list[int] | None = None,
    rebuild: bool = False,
    threads: int = 8,
    on_progress: Callable[[int, int], None] = lambda done, total: None,
) -> VerifyReport:
    slices = resources.app_slices(loc)
    wanted = slice_ids if slice_ids is not None else list(range(slices))
    heads = [h for h in DurableState(loc).heads(wanted).values() if h.committed]
    total = VerifyReport()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = [pool.submit(_check_slice, loc, slices, h, rebuild) for h in heads]
        for i, f in enumerate(futures, 1):
            r = f.result()
            for name in ("slices", "versions", "segments", "manifests", "sst_objects", "rebuilt"):
                setattr(total, name, getattr(total, name) + getattr(r, name))
            total.problems += r.problems
            on_progress(i, len(futures))
    return total
