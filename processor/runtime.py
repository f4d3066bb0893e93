"""The task runtime: one Spark group (a run of slices) for one batch, inside
`applyInPandasWithState`.

For every slice with records: bring the local store to the committed version, run the
handler over the slice's records in stream order with writes buffered, then commit all
changed slices durably (one S3 object and one DynamoDB transaction per 50 slices) and
only then locally. Outputs are yielded after the durable commit, so nothing is released
that a restore could not reproduce.

A batch that Spark runs again (same query, same batch id) finds its own earlier commit in
the slice's head; it re-processes from the version before it and re-commits in its place,
so state counts the input once and the outputs are the same.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from changelog.durable import DurableState, SliceCommit
from changelog.layout import AppLocation, Head
from processor.api import Context, Event
from processor.errors import ProcessorError
from processor.stores import cache_for
from state.transaction import Transaction

log = logging.getLogger(__name__)

OUTPUT_SCHEMA = "kind string, slice int, batch_id long, seq int, key string, value string"
STATE_SCHEMA = "unused int"
BATCH_ID_PROPERTY = "streaming.sql.batchId"
QUERY_ID_PROPERTY = "sql.streaming.queryId"

Handler = Callable[[Event, Context], None]


@dataclass(frozen=True)
class RuntimeConfig:
    location: AppLocation
    slices: int
    local_dir: str
    log_entries_per_base: int = 32


def _dumps(value: Any) -> str:
    return json.dumps(value, default=str, separators=(",", ":"))


def _plan(s: int, head: Head | None, query: str, batch: int) -> tuple[int, int, bool]:
    """The version slice `s` must start this batch from, and whether this is a re-run.

    A head written by this very batch of this query means Spark is running the batch
    again: start from the version before it and commit in its place.
    """
    if head is not None and head.query == query and head.batch > batch:
        raise ProcessorError(
            f"slice {s}: committed by batch {head.batch} of this query, but Spark is running "
            f"batch {batch}; the checkpoint is older than the state"
        )
    rerun = head is not None and head.query == query and head.batch == batch
    base = 0 if head is None else head.version - (1 if rerun else 0)
    return s, base, rerun


class GroupRunner:
    """The function Spark calls per group; pickled with the handler and the config."""

    def __init__(self, handler: Handler, config: RuntimeConfig) -> None:
        self.handler = handler
        self.config = config

    def __call__(
        self, key: tuple, pdfs: Iterator[pd.DataFrame], _state: Any
    ) -> Iterator[pd.DataFrame]:
        from pyspark import TaskContext

        tc = TaskContext.get()
        batch = int(tc.getLocalProperty(BATCH_ID_PROPERTY))
        query = tc.getLocalProperty(QUERY_ID_PROPERTY)
        frames = [p for p in pdfs if len(p)]
        if not frames:
            return
        pdf = pd.concat(frames, ignore_index=True)
        yield self.run(int(key[0]), query, batch, pdf)

    def run(self, group: int, query: str, batch: int, pdf: pd.DataFrame) -> pd.DataFrame:
        started = time.perf_counter()
        cfg = self.config
        pdf = pdf.sort_values(["slice", "stream_order"], kind="stable", ignore_index=True)
        durable = DurableState(cfg.location)
        cache = cache_for(cfg.local_dir, cfg.location.app, cfg.slices)
        slice_col = pdf["slice"].to_numpy()
        bounds = [0, *(np.flatnonzero(np.diff(slice_col)) + 1).tolist(), len(pdf)]
        slices = [int(slice_col[b]) for b in bounds[:-1]]
        heads = durable.heads(slices)
        cols = {
            name: pdf[name].tolist()
            for name in (
                "stream",
                "shard",
                "sequence_number",
                "subsequence",
                "partition_key",
                "data",
            )
        }
        arrivals = pdf["arrival"].tolist()
        rows: list[tuple] = []
        commits: list[SliceCommit] = []
        deltas: list[list] = []
        metrics = {"group": group, "records": len(pdf), "slices": len(slices), "restores": []}
        plans = [_plan(s, heads.get(s), query, batch) for s in slices]
        stores = cache.acquire_many([(s, heads.get(s), base) for s, base, _ in plans], durable)
        for _store, restored in stores.values():
            if restored is not None:
                metrics["restores"].append(restored.__dict__)
        for (s, base, rerun), lo, hi in zip(plans, bounds[:-1], bounds[1:], strict=True):
            head = heads.get(s)
            tx = Transaction(stores[s][0])
            ctx = Context(s, batch, tx)
            handler = self.handler
            for i in range(lo, hi):
                key = cols["partition_key"][i]
                ctx._bind(key)
                event = Event(
                    cols["stream"][i],
                    cols["shard"][i],
                    cols["sequence_number"][i],
                    cols["subsequence"][i],
                    key,
                    arrivals[i],
                    cols["data"][i],
                )
                try:
                    handler(event, ctx)
                except Exception as exc:
                    raise ProcessorError(
                        f"handler failed on record {event.coordinates()} (key {key!r}, slice "
                        f"{s}, batch {batch}): {type(exc).__name__}: {exc}"
                    ) from exc
            changes = tx.changes()
            if changes or rerun:
                log_size = len(head.log) if head else 0
                if log_size >= cfg.log_entries_per_base:
                    commits.append(SliceCommit(s, base + 1, head, tx.merged_items(), base=True))
                else:
                    commits.append(SliceCommit(s, base + 1, head, changes))
                deltas.append(changes)
            rows += [("out", s, batch, j, k, _dumps(v)) for j, (k, v) in enumerate(ctx._outputs)]
        metrics["segment_bytes"] = durable.commit(query, batch, group, commits)
        for c, delta in zip(commits, deltas, strict=True):
            stores[c.slice][0].commit(delta, c.version)
        metrics["committed_slices"] = len(commits)
        metrics["seconds"] = time.perf_counter() - started
        rows.append(("metrics", -1, batch, 0, "", _dumps(metrics)))
        return pd.DataFrame(rows, columns=["kind", "slice", "batch_id", "seq", "key", "value"])
