"""A group's records as the handler's events: sorted into slices, in stream order within
each, with wake-up rows (a new checkpoint's timer wake-ups) set apart. When the app chose
its key (`shardless.processor.driver.keys`), the rows carry it in `key` (null, with the
reason in `key_error`, for a record without one: its event keeps the partition key). When
the app named its event time (`shardless.processor.api.event_time`), the rows carry it in
`event_time_ms` (with the reason in `event_time_error` for a record without one)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import pairwise, repeat
from typing import Any

import numpy as np
import pandas as pd

from shardless.processor.api.context import Event

_EVENT_COLUMNS = ("stream", "shard", "sequence_number", "subsequence", "partition_key")


def _column(pdf: pd.DataFrame, name: str, order: np.ndarray, fixed: dict[str, Any]) -> Any:
    """Column `name` in `order`, as a list (or an iterable of its one fixed value)."""
    if name in pdf.columns:
        return pdf[name].to_numpy()[order].tolist()
    if name == "sequence_number" and fixed.get(name) is None:
        return [str(x) for x in pdf["stream_order"].to_numpy()[order].tolist()]
    return repeat(fixed[name], len(order))


@dataclass
class GroupInput:
    """A group's records sorted into slices in stream order: each slice's span of events,
    and the slices woken to look for timers (`shardless.processor.driver.timer_source`)."""

    records: int
    events: list[Event]
    spans: dict[int, tuple[int, int]]
    woken: frozenset[int] = frozenset()


def prepare(pdf: pd.DataFrame | None, fixed: dict[str, Any] | None = None) -> GroupInput:
    """Sort by (slice, stream_order) and make one Event per record; `arrival` is taken
    from its column only when a handler reads it. Wake-up rows (no data) are set apart.
    `fixed`: columns the records' source does not send, with their one value (None for
    `sequence_number`: the string of `stream_order`)."""
    fixed = fixed or {}
    if pdf is None or not len(pdf):
        return GroupInput(0, [], {})
    wake = pdf["data"].isna().to_numpy()
    if wake.any():
        woken = frozenset(int(s) for s in pdf["slice"].to_numpy()[wake])
        found = prepare(pdf[~wake].reset_index(drop=True), fixed)
        return replace(found, woken=woken)
    slices = pdf["slice"].to_numpy()
    by_order = np.argsort(pdf["stream_order"].to_numpy(), kind="stable")
    order = by_order[np.argsort(slices[by_order], kind="stable")]
    ordered = slices[order]
    bounds = [0, *(np.flatnonzero(np.diff(ordered)) + 1).tolist(), len(order)]
    spans = {int(ordered[lo]): (lo, hi) for lo, hi in pairwise(bounds)}
    cols = [_column(pdf, name, order, fixed) for name in _EVENT_COLUMNS]
    arrivals = repeat(pdf["arrival"].array, len(order))
    data = pdf["data"].to_numpy()[order].tolist()
    if "key" not in pdf.columns:
        events = list(map(Event, *cols, arrivals, data, order.tolist()))
        return _timed(GroupInput(len(order), events, spans), pdf, order)
    partition_keys = cols[-1]
    chosen = pdf["key"].to_numpy()[order].tolist()
    cols[-1] = [k if isinstance(k, str) else p for k, p in zip(chosen, partition_keys, strict=True)]
    events = list(map(Event, *cols, arrivals, data, order.tolist(), partition_keys))
    errors = pdf["key_error"].to_numpy()[order]
    for i in np.flatnonzero(pd.notna(errors)).tolist():
        events[i].key_error = errors[i]
    return _timed(GroupInput(len(order), events, spans), pdf, order)


def _timed(found: GroupInput, pdf: pd.DataFrame, order: np.ndarray) -> GroupInput:
    """The events with their event times (`Event.event_time_ms`), when the rows carry them."""
    if "event_time_ms" not in pdf.columns:
        return found
    times = pdf["event_time_ms"].to_numpy()[order].tolist()
    errors = pdf["event_time_error"].to_numpy()[order].tolist()
    for event, at, why in zip(found.events, times, errors, strict=True):
        if isinstance(why, str):
            event.timed(None, why)
        else:
            event.timed(int(at), None)
    return found
