"""A group's slices restored on a host that holds none of its segments (a lost executor's
group on a new host, a scale-out): `python -m bench.restore --only group`.

One group of `slices` small slices is driven through `GroupRunner.run` for `batches` batches
(each batch one segment with a section of every slice; snapshots every 32 versions, as in
production), then restored into empty directories by `StoreCache.acquire_many`, as a new
worker does, with no segment cache. Two arms, alternated rep by rep: the restore as it
is (`changelog.coalesce`: a segment's neighbouring sections, a pack's manifests and its
small SST files each read with one GET) and the baseline, the same restore reading each
section, manifest and file alone. Every S3 GET of each arm is counted
(`bench.billing.Requests`; transfers in this process, as for any restore of this size).
"""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from bench.batch_cost import counter, keys_by_slice, new_app
from bench.billing import Requests
from shardless.changelog import restore_transfers
from shardless.changelog.durable import DurableState
from shardless.changelog.layout import AppLocation
from shardless.changelog.transfer_process import transfer_process
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.runtime.group_runner import GroupRunner, RuntimeConfig

QUERY = "bench-group"
NOW_MS = 1_700_000_000_000
ARMS = ("coalesced", "one_by_one")

Frame = Callable[[list[tuple[str, int]], int], pd.DataFrame]
RestoreAll = Callable[..., tuple[float, int, list[dict[str, Any]], int]]  # bench.restore's


def build(
    loc: AppLocation, root: Path, frame: Frame, slices: int, batches: int, keys: int, per: int
) -> int:
    """`batches` batches of `per` records for every slice over `keys` keys each; the
    records processed."""
    runner = GroupRunner(HandlerFactory(counter), RuntimeConfig(loc, slices, str(root)))
    by_slice = keys_by_slice(slices, keys, "user-")
    pending: dict = {}
    seq = 0
    for b in range(batches):
        rows = [
            (ks[(b * per + j) % len(ks)], s) for s, ks in enumerate(by_slice) for j in range(per)
        ]
        _, pending = runner.run(0, QUERY, b, frame(rows, seq), pending, NOW_MS + 1_000 * b)
        seq += len(rows)
    return seq


def one_by_one(sections: list) -> list[None]:
    """The baseline's plan: everything read alone, as before `coalesce`."""
    return [None] * len(sections)


def restore_once(
    loc: AppLocation, slices: int, root: Path, restore_all: RestoreAll
) -> dict[str, Any]:
    """Every slice restored to its head into empty directories under `root` by
    `bench.restore.restore_all`, as a new worker on a new host does: its seconds and S3
    GETs (the heads, read before as the batch reads them, with their GETs apart), bytes
    and sections applied."""
    durable = DurableState(loc, transfer_process_bytes=None)
    requests = Requests()
    try:
        heads = durable.heads(list(range(slices)))  # through the chain: segment indexes too
        heads_gets = requests.calls[("s3", "GetObject")]
        seconds, restored, stats, _ = restore_all(
            loc, slices, root, transfer_process_bytes=None, heads=heads
        )
    finally:
        requests.close()
    return {
        "seconds": seconds,
        "gets": requests.calls[("s3", "GetObject")] - heads_gets,
        "heads_gets": heads_gets,
        "bytes": restored,
        "segments": sum(x["segments"] for x in stats),
        "from_snapshot": sum(x["snapshot_version"] is not None for x in stats),
        "restored": len(stats),
    }


def group_restore(
    tmp: Path,
    frame: Frame,
    restore_all: RestoreAll,
    slices: int = 128,
    batches: int = 40,
    keys: int = 40,
    per: int = 10,
    reps: int = 5,
) -> dict[str, Any]:
    loc = new_app("group", slices)
    records = build(loc, tmp / "group-build", frame, slices, batches, keys, per)
    transfer_process().stop()
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    original = restore_transfers.coalesce
    for rep in range(reps):
        for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
            restore_transfers.coalesce = original if arm == "coalesced" else one_by_one
            root = tmp / f"group-restore-{arm}-{rep}"
            try:
                runs[arm].append(restore_once(loc, slices, root, restore_all))
            finally:
                restore_transfers.coalesce = original
                shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {"group_records": records}
    for arm in ARMS:
        seconds = [r["seconds"] for r in runs[arm]]
        out[f"group_restore_s_{arm}"] = statistics.median(seconds)
        out[f"group_restore_{arm}_runs_s"] = [round(x, 3) for x in seconds]
        out[f"group_restore_gets_{arm}"] = statistics.median(r["gets"] for r in runs[arm])
    first = runs["coalesced"][0]
    out["group_heads_gets"] = first["heads_gets"]
    out["group_restore_slices"] = first["restored"]
    out["group_restore_bytes"] = first["bytes"]
    out["group_restore_segments_applied"] = first["segments"]
    out["group_restore_slices_from_snapshot"] = first["from_snapshot"]
    out["group_restore_speedup"] = (
        out["group_restore_s_one_by_one"] / out["group_restore_s_coalesced"]
    )
    out["_group_config"] = {
        "slices": slices,
        "batches": batches,
        "keys_per_slice": keys,
        "records_per_slice_per_batch": per,
        "reps": reps,
        "segment_cache": None,
    }
    return out
