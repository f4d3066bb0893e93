"""The application every `bench.protocol` run drives: its input, its handler and the
oracle's fold.

Per key the handler keeps the ids of the records it saw (so loss and double counting are
visible) and the timers that fired; it emits one output per record (the key's count after
it) and one per timer. Some records set a processing-time timer one or two batches ahead.
In read batches every record only peeks: it emits its key's count and changes nothing, so
a group's part of the batch commits nothing, and only the heads it read stand between it
and stale state.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pandas as pd

from shardless.processor.runtime.routing import route

T0 = 1_800_000_000_000  # processing time of input batch 0
STEP_MS = 1_000  # processing time between input batches
FAR_MS = 10**9  # the last batch of a run is this far in the future: every timer is due


@dataclass(frozen=True)
class Spec:
    """The shape of one run's application."""

    slices: int = 8
    keys: int = 24
    batches: int = 6
    per_batch: int = 6
    workers: int = 3
    timers: bool = True
    snapshot_every: int = 3
    keep_snapshots: int = 2
    commit_format: str = "chains"  # or "heads" (docs/design/group-commits.md)
    chain_length: int = 3  # chains roll over within a run
    peeks: float = 0.25  # the share of read batches: their records only peek


@dataclass(frozen=True)
class Rec:
    id: int
    key: str
    timer: int | None  # the processing-time timer the record sets, if any
    peek: bool = False  # reads its key's count, writes nothing


def make_input(
    rng: random.Random, spec: Spec, peeks: random.Random | None = None
) -> list[list[Rec]]:
    """Input batches: record ids in stream order, a few keys, a timer on some records; and
    with `peeks` (drawn apart, so keys and ids are what `rng` always made) a share
    `spec.peeks` of read batches, whose records only peek (and set no timer) at keys the
    batch before wrote: a group's part of one commits nothing, and what it emits differs
    if it reads state from before that batch."""
    out, rid = [], 0
    for b in range(spec.batches):
        batch = []
        written = [r.key for r in out[-1] if not r.peek] if out else []
        read = peeks is not None and bool(written) and peeks.random() < spec.peeks
        for _ in range(rng.randint(1, spec.per_batch)):
            ts = None
            if spec.timers and rid % 3 == 0 and not read:
                ts = now_of(b) + (1 + rid % 2) * STEP_MS - 500 + rid % 500
            key = f"k{rng.randrange(spec.keys)}"
            if read:
                key = written[peeks.randrange(len(written))]  # type: ignore[union-attr]
            batch.append(Rec(rid, key, ts, read))
            rid += 1
        out.append(batch)
    return out


def now_of(index: int) -> int:
    """The processing time of input batch `index` (Spark keeps it on a re-run)."""
    return T0 + index * STEP_MS


def process(event: Any, ctx: Any) -> None:
    rec = json.loads(event.data)
    st = ctx.state.get(None) or {"ids": [], "fired": []}
    if rec.get("peek"):
        ctx.emit({"id": rec["id"], "n": len(st["ids"])})
        return
    st["ids"].append(rec["id"])
    ctx.state.set(st)
    if rec["t"] is not None:
        ctx.timers.set(rec["t"])
    ctx.emit({"id": rec["id"], "n": len(st["ids"])})


def on_timer(timer: Any, ctx: Any) -> None:
    st = ctx.state.get(None) or {"ids": [], "fired": []}
    st["fired"].append(timer.ts)
    ctx.state.set(st)
    ctx.emit({"timer": timer.ts})


def frame(
    records: list[Rec], slices: int, only: range, woken: tuple[int, ...] = ()
) -> pd.DataFrame | None:
    """The records of one group, as Spark hands them to the runtime (shuffled), with a
    wake-up row (no data) for each slice of `woken` in the group
    (`shardless.processor.driver.timer_source`)."""
    rows = [
        {
            "stream": "",
            "shard": "",
            "sequence_number": "",
            "subsequence": 0,
            "partition_key": "",
            "explicit_hash_key": None,
            "arrival": datetime(1970, 1, 1, tzinfo=UTC),
            "data": None,
            "slice": s,
            "stream_order": "",
        }
        for s in woken
        if s in only
    ]
    for r in records:
        s = route(r.key, None, slices)
        if s not in only:
            continue
        seq = str(10**30 + r.id)
        rows.append(
            {
                "stream": "s",
                "shard": "shardId-0",
                "sequence_number": seq,
                "subsequence": 0,
                "partition_key": r.key,
                "explicit_hash_key": None,
                "arrival": datetime(2026, 1, 1, tzinfo=UTC),
                "data": json.dumps({"id": r.id, "t": r.timer, "peek": r.peek}).encode(),
                "slice": s,
                "stream_order": "0000" + seq.rjust(64, "0") + "0" * 10,
            }
        )
    if not rows:
        return None
    return pd.DataFrame(rows).sample(frac=1, random_state=len(rows))


@dataclass
class Fold:
    """The oracle: per key, the record ids in stream order; per output, what it says."""

    ids: dict[str, list[int]] = field(default_factory=dict)

    def apply(self, records: list[Rec]) -> dict[int, int]:
        """Fold one batch; return each record's output (its key's count after it)."""
        out = {}
        for r in records:
            if not r.peek:
                self.ids.setdefault(r.key, []).append(r.id)
            out[r.id] = len(self.ids.get(r.key, ()))
        return out
