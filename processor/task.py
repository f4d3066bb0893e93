"""One slice's work in one batch: its records in stream order, then its due timers, then
a bounded purge of expired values. The same code runs under Spark and in the test driver.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from processor.api import Context, Event, Timer
from processor.errors import ProcessorError
from processor.handlers import SliceHandler
from state import keys, timers, ttl
from state.transaction import Transaction

log = logging.getLogger(__name__)

TIMER_CHUNK = 1000
MAX_TIMER_FIRINGS = 100_000
TTL_PURGE_PER_BATCH = 1000


@dataclass
class SliceResult:
    outputs: list[tuple[str, Any]] = field(default_factory=list)
    timers_fired: int = 0
    expired_purged: int = 0
    next_processing_timer: int | None = None
    next_event_timer: int | None = None


def run_slice(
    handler: SliceHandler,
    tx: Transaction,
    slice_id: int,
    batch_id: int,
    now_ms: int,
    watermark_ms: int,
    events: Sequence[Event],
    value_format: int,
    allow_pickle: bool = False,
) -> SliceResult:
    ctx = Context(slice_id, batch_id, tx, value_format, allow_pickle)
    ctx._clock(now_ms, watermark_ms)
    result = SliceResult(outputs=ctx._outputs)
    data_key = keys.data_key
    db_keys: dict[str, bytes] = {}
    for e in events:
        if e.key not in db_keys:
            db_keys[e.key] = data_key(e.key)
    if len(db_keys) > 1:
        tx.prefetch(db_keys.values())
    process = handler.process
    bind = ctx._bind
    for event in events:
        bind(event.key, db_keys[event.key])
        try:
            process(event, ctx)
        except Exception as exc:
            raise ProcessorError(
                f"handler failed on record {event.coordinates()} (key {event.key!r}, slice "
                f"{slice_id}, batch {batch_id}): {type(exc).__name__}: {exc}"
            ) from exc
    result.timers_fired = _fire_timers(handler, tx, ctx, now_ms, watermark_ms)
    result.expired_purged = ttl.purge(tx, now_ms, watermark_ms, TTL_PURGE_PER_BATCH)
    result.next_processing_timer = timers.next_due(tx, keys.PROCESSING)
    result.next_event_timer = timers.next_due(tx, keys.EVENT)
    return result


def _fire_timers(
    handler: SliceHandler, tx: Transaction, ctx: Context, now_ms: int, watermark_ms: int
) -> int:
    """Fire due timers in (time, kind, key) order, including ones that fire due timers set."""
    fired = 0
    while fired < MAX_TIMER_FIRINGS:
        due = [
            (ts, "processing", k)
            for ts, k in timers.pop_due(tx, keys.PROCESSING, now_ms, TIMER_CHUNK)
        ]
        if watermark_ms >= 0:
            due += [
                (ts, "event", k)
                for ts, k in timers.pop_due(tx, keys.EVENT, watermark_ms, TIMER_CHUNK)
            ]
        if not due:
            return fired
        for ts, kind, key in sorted(due):
            ctx._bind(key)
            try:
                handler.on_timer(Timer(key, ts, kind), ctx)
            except Exception as exc:
                raise ProcessorError(
                    f"on_timer failed for key {key!r} at {ts} ({kind}), slice {ctx.slice}, "
                    f"batch {ctx.batch_id}: {type(exc).__name__}: {exc}"
                ) from exc
            fired += 1
    log.warning(
        "slice %s: over %s timers fired in one batch; the rest fire next batch",
        ctx.slice,
        MAX_TIMER_FIRINGS,
    )
    return fired
