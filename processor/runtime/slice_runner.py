"""One slice's work in one batch: its records in stream order, then its due timers, then
a bounded purge of expired values. The same code runs under Spark and in the test driver.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardless.processor.api.context import Binding, Context, Event, Timer
from shardless.processor.api.decoders import describe
from shardless.processor.api.event_time import is_late
from shardless.processor.api.handlers import SliceHandler
from shardless.processor.api.policies import RecordPolicy
from shardless.processor.errors import ProcessorError
from shardless.processor.runtime.dead_letter import DeadLetter
from shardless.state import keys, timers, ttl
from shardless.state.transaction import Transaction

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
    dead_letters: list[DeadLetter] = field(default_factory=list)
    handler_retries: int = 0  # handler attempts that raised and were run again
    late_records: int = 0  # records at or before the watermark (event time named only)


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
    policy: RecordPolicy | None = None,
) -> SliceResult:
    """Run the slice's records, then its due timers, in `tx`. With a `policy`, records are
    decoded first and a record that cannot be decoded or whose handler keeps raising is
    handled as the policy says (records set aside are in `dead_letters`)."""
    policy = policy or _DEFAULT
    if any(e.key_error is not None for e in events):
        events = _keyless(events, policy, slice_id, batch_id, result := SliceResult())
    else:
        result = SliceResult()
    if policy.event_time:
        events = _timed(events, policy, slice_id, batch_id, watermark_ms, result)
    ctx = Context(slice_id, batch_id, tx, value_format, allow_pickle, handler.check_output)
    binding = Binding(ctx, now_ms, watermark_ms)
    result.outputs = binding.outputs
    db_keys = keys.data_keys([e.key for e in events])
    if len(db_keys) > 1:
        tx.prefetch(db_keys.values())
    process = handler.process
    decode = policy.decode
    guarded = policy.guarded
    if decode is None and not guarded:
        binding.run_each(
            process, events, db_keys, lambda e, exc: _handler_failed(e, slice_id, batch_id, exc)
        )
    else:
        bind = binding.bind
        for event in events:
            if decode is not None and not _decoded(
                event, decode, policy, slice_id, batch_id, result
            ):
                continue
            bind(event.key, db_keys[event.key])
            if guarded:
                _guarded(process, event, ctx, tx, policy, slice_id, batch_id, result)
                continue
            try:
                process(event, ctx)
            except Exception as exc:
                raise _handler_failed(event, slice_id, batch_id, exc) from exc
    result.timers_fired = _fire_timers(handler, tx, ctx, binding, now_ms, watermark_ms)
    result.expired_purged = ttl.purge(tx, now_ms, watermark_ms, TTL_PURGE_PER_BATCH)
    result.next_processing_timer = timers.next_due(tx, keys.PROCESSING)
    result.next_event_timer = timers.next_due(tx, keys.EVENT)
    return result


_DEFAULT = RecordPolicy()


def _handler_failed(event: Event, slice_id: int, batch_id: int, exc: Exception) -> ProcessorError:
    return ProcessorError(
        f"handler failed on record {event.coordinates()} (key {event.key!r}, slice "
        f"{slice_id}, batch {batch_id}): "
        f"{type(exc).__name__}: {exc}; --on-handler-error dead-letter sets such records "
        "aside, --handler-retries N runs them again"
    )


def _letter(
    event: Event, slice_id: int, stage: str, exc: BaseException | str, attempts: int
) -> DeadLetter:
    return DeadLetter(
        event.stream,
        event.shard,
        event.sequence_number,
        event.subsequence,
        event.partition_key,
        slice_id,
        event.data,
        stage,
        exc if isinstance(exc, str) else describe(exc),
        attempts,
        key=event.key if event.key != event.partition_key else None,
    )


def _keyless(
    events: Sequence[Event], policy: RecordPolicy, slice_id: int, batch_id: int, result: SliceResult
) -> list[Event]:
    """The events left to run once records without the app's chosen key are dealt with as
    `--on-decode-error` says: the batch fails naming the first, they are set aside (stage
    `key`), or they run keyed by their partition key with `event.decode_error` set."""
    kept = []
    for event in events:
        why = event.key_error
        if why is None:
            kept.append(event)
            continue
        text = f"record {event.coordinates()} has no key: {why}"
        how = policy.on_decode_error
        if how == "fail":
            raise ProcessorError(
                f"{text} (partition key {event.partition_key!r}, slice {slice_id}, batch "
                f"{batch_id}); --on-decode-error dead-letter sets such records aside, raw "
                "passes them to the handler keyed by their partition key"
            )
        if how == "dead-letter":
            result.dead_letters.append(_letter(event, slice_id, "key", f"no key: {why}", 1))
            log.warning("slice %s batch %s: %s; set aside", slice_id, batch_id, text)
            continue
        event.decode_error = f"no key: {why}"
        log.warning(
            "slice %s batch %s: %s; passed on keyed by its partition key %r",
            slice_id, batch_id, text, event.partition_key,
        )  # fmt: skip
        kept.append(event)
    return kept


def _timed(
    events: Sequence[Event],
    policy: RecordPolicy,
    slice_id: int,
    batch_id: int,
    watermark_ms: int,
    result: SliceResult,
) -> list[Event]:
    """The events left to run once records without a readable event time have gone where
    `--on-decode-error` says (stage `event-time`), and late records (at or before the
    watermark) where `--on-late` says. Late records are counted whatever the policy."""
    kept = []
    how_late = policy.on_late
    dropped: list[Event] = []
    for event in events:
        why = event.event_time_error
        if why is not None:
            if _without_event_time(event, why, policy, slice_id, batch_id, result):
                kept.append(event)
            continue
        at = event.event_time_ms
        if not is_late(at, watermark_ms):
            kept.append(event)
            continue
        result.late_records += 1
        if how_late == "process":
            kept.append(event)
        elif how_late == "drop":
            dropped.append(event)
        else:
            text = f"late: event time {at} ms is at or before the watermark {watermark_ms} ms"
            result.dead_letters.append(_letter(event, slice_id, "late", text, 1))
            log.warning(
                "slice %s batch %s: record %s (key %r) set aside: %s",
                slice_id, batch_id, event.coordinates(), event.key, text,
            )  # fmt: skip
    if dropped:
        log.warning(
            "slice %s batch %s: %d late record(s) dropped (event time at or before the "
            "watermark %s ms), the first %s",
            slice_id, batch_id, len(dropped), watermark_ms,
            ", ".join(f"{e.coordinates()} at {e.event_time_ms} ms" for e in dropped[:5]),
        )  # fmt: skip
    return kept


def _without_event_time(
    event: Event,
    why: str,
    policy: RecordPolicy,
    slice_id: int,
    batch_id: int,
    result: SliceResult,
) -> bool:
    """Deal with a record whose event time cannot be read, as `--on-decode-error` says;
    True when it still runs (`raw`, with its arrival time as event time)."""
    text = f"record {event.coordinates()} has no event time: {why}"
    how = policy.on_decode_error
    if how == "fail":
        raise ProcessorError(
            f"{text} (key {event.key!r}, slice {slice_id}, batch {batch_id}); "
            "--on-decode-error dead-letter sets such records aside, raw passes them to the "
            "handler with their arrival time as event time"
        )
    if how == "dead-letter":
        letter = _letter(event, slice_id, "event-time", f"no event time: {why}", 1)
        result.dead_letters.append(letter)
        log.warning("slice %s batch %s: %s; set aside", slice_id, batch_id, text)
        return False
    event.decode_error = f"no event time: {why}"
    log.warning(
        "slice %s batch %s: %s; passed on with its arrival time as event time",
        slice_id, batch_id, text,
    )  # fmt: skip
    return True


def _decoded(
    event: Event,
    decode: Callable[[bytes], Any],
    policy: RecordPolicy,
    slice_id: int,
    batch_id: int,
    result: SliceResult,
) -> bool:
    """Decode the record into `event.value`; False when it is set aside instead."""
    try:
        event.value = decode(event.data)
        return True
    except Exception as exc:
        how = policy.on_decode_error
        if how == "raw":
            event.decode_error = describe(exc)
            log.warning(
                "slice %s batch %s: record %s (key %r) passed raw: the %s decoder cannot read "
                "it: %s",
                slice_id, batch_id, event.coordinates(), event.key, policy.decoder,
                event.decode_error,
            )  # fmt: skip
            return True
        if how == "dead-letter":
            result.dead_letters.append(_letter(event, slice_id, "decode", exc, 1))
            log.warning(
                "slice %s batch %s: record %s (key %r) set aside: the %s decoder cannot read "
                "it: %s",
                slice_id, batch_id, event.coordinates(), event.key, policy.decoder, describe(exc),
            )  # fmt: skip
            return False
        raise ProcessorError(
            f"the {policy.decoder} decoder cannot read record {event.coordinates()} (key "
            f"{event.key!r}, {len(event.data)} bytes, slice {slice_id}, batch {batch_id}): "
            f"{describe(exc)}; --on-decode-error dead-letter sets such records aside, raw "
            "passes them to the handler as bytes"
        ) from exc


def _guarded(
    process: Callable[[Event, Context], None],
    event: Event,
    ctx: Context,
    tx: Transaction,
    policy: RecordPolicy,
    slice_id: int,
    batch_id: int,
    result: SliceResult,
) -> None:
    """Run the handler on one record, undoing a failed attempt's writes and outputs; retry,
    then set aside or fail, as the policy says."""
    outputs = result.outputs
    for attempt in range(1, policy.handler_retries + 2):
        mark, emitted = tx.savepoint(), len(outputs)
        try:
            process(event, ctx)
        except Exception as exc:
            tx.rollback_to(mark)
            del outputs[emitted:]
            if attempt <= policy.handler_retries:
                result.handler_retries += 1
                log.warning(
                    "slice %s batch %s: handler failed on record %s (attempt %s of %s), "
                    "running it again: %s",
                    slice_id, batch_id, event.coordinates(), attempt,
                    policy.handler_retries + 1, describe(exc),
                )  # fmt: skip
                continue
            if policy.on_handler_error == "dead-letter":
                result.dead_letters.append(_letter(event, slice_id, "handler", exc, attempt))
                log.warning(
                    "slice %s batch %s: record %s (key %r) set aside after %s attempt(s): %s",
                    slice_id, batch_id, event.coordinates(), event.key, attempt, describe(exc),
                )  # fmt: skip
                return
            raise ProcessorError(
                f"handler failed on record {event.coordinates()} (key {event.key!r}, slice "
                f"{slice_id}, batch {batch_id}) after {attempt} attempt(s): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        tx.release(mark)
        return


def _fire_timers(
    handler: SliceHandler,
    tx: Transaction,
    ctx: Context,
    binding: Binding,
    now_ms: int,
    watermark_ms: int,
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
            binding.bind(key)
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
