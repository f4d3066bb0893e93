"""Timers against a model: whatever times are set (past, present, future, repeated), each
fires exactly once, at the first batch whose processing time reaches it, in time order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.testing import TestDriver

# a step: set timers (offsets from now, possibly negative) on keys, then advance time
steps = st.lists(
    st.tuples(
        st.lists(st.tuples(st.sampled_from("abcde"), st.integers(-50, 200)), max_size=6),
        st.integers(0, 120),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(steps)
def test_every_timer_fires_once_when_due_in_time_order(history):
    def process(event, ctx):
        ctx.timers.set(max(0, ctx.now_ms + int(event.data)))

    def on_timer(timer, ctx):
        ctx.emit(timer.ts)

    d = TestDriver(HandlerFactory(process, on_timer=on_timer), slices=1, start_ms=1000)
    pending: set[tuple[str, int]] = set()
    for sets, advance in history:
        for key, offset in sets:
            d.send(key, str(offset))
            pending.add((key, max(0, d.now_ms + offset)))
        fired = d.run_batch()
        due = sorted((ts, k) for k, ts in pending if ts <= d.now_ms)
        assert [(ts, k) for k, ts in fired] == due
        pending -= {(k, ts) for ts, k in due}
        d.advance(advance)
    d.advance(10_000)
    assert sorted(ts for _, ts in d.run_batch()) == sorted(ts for _, ts in pending)
