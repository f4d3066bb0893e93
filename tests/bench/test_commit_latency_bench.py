"""bench.commit_latency: its baseline really sends a wide commit's transactions (and a wide
read's BatchGetItem calls) one at a time and its contender together, round by round in
alternating order, and the module's settings are put back afterwards."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest

from bench import commit_latency
from shardless.changelog import aws as clients
from shardless.changelog import durable as durable_module


class InFlight:
    """The most calls of one operation in flight at once since the last `reset`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now = 0
        self.most = 0

    def reset(self) -> None:
        self.most = 0

    def before(self, **_) -> None:
        with self._lock:
            self._now += 1
            self.most = max(self.most, self._now)

    def after(self, **_) -> None:
        with self._lock:
            self._now -= 1


@contextlib.contextmanager
def counting(client, op: str) -> Iterator[InFlight]:
    """Count `op`'s calls in flight on `client` (botocore's before and after hooks)."""
    counter = InFlight()
    hooks = [
        (f"before-call.dynamodb.{op}", counter.before),
        (f"after-call.dynamodb.{op}", counter.after),
        (f"after-call-error.dynamodb.{op}", counter.after),
    ]
    for event, hook in hooks:
        client.meta.events.register(event, hook)
    try:
        yield counter
    finally:
        for event, hook in hooks:
            client.meta.events.unregister(event, hook)


def test_the_baseline_sends_one_at_a_time_and_the_contender_together(aws, monkeypatch):
    most_per_commit: list[int] = []
    original = commit_latency._commit
    client = clients.client("dynamodb", validated=False)
    with counting(client, "TransactWriteItems") as in_flight:

        def commit(durable, heads, batch):
            in_flight.reset()
            out = original(durable, heads, batch)
            most_per_commit.append(in_flight.most)
            return out

        monkeypatch.setattr(commit_latency, "_commit", commit)
        monkeypatch.setattr(durable_module, "TRANSACTION_THREADS", 5)
        f = commit_latency.measure(256, rounds=2, warmup=0, threads=8)
    assert f["transactions"] == 3
    assert [len(v) for v in f["runs"].values()] == [2, 2]
    assert f["ratio"] == pytest.approx(f["together_s"] / f["one_at_a_time_s"], rel=0.01)
    # the most transactions in flight at once, per measured commit: one at a time, then
    # together; the next round the other way round
    one_at_a_time, together = most_per_commit[0::3], most_per_commit[1:3]
    assert one_at_a_time == [1, 1] and min(together) >= 2, most_per_commit
    assert durable_module.TRANSACTION_THREADS == 5


def test_the_read_baseline_reads_one_call_at_a_time_and_the_contender_together(aws, monkeypatch):
    most_per_read: list[int] = []
    original = durable_module.DurableState.heads
    with counting(clients.client("dynamodb"), "BatchGetItem") as in_flight:

        def heads(self, slices):
            in_flight.reset()
            out = original(self, slices)
            if len(slices) == 256:  # the measured reads, not the commits' own
                most_per_read.append(in_flight.most)
            return out

        monkeypatch.setattr(durable_module.DurableState, "heads", heads)
        monkeypatch.setattr(durable_module, "READ_THREADS", 5)
        f = commit_latency.measure_reads(256, rounds=2, warmup=1, threads=8)
    assert f["calls"] == 3
    assert [len(v) for v in f["runs"].values()] == [2, 2]
    assert f["ratio"] == pytest.approx(f["together_s"] / f["one_at_a_time_s"], rel=0.01)
    # round 0: one at a time, then together; round 1 the other way round
    assert most_per_read[0] == 1 and most_per_read[3] == 1, most_per_read
    assert min(most_per_read[1:3]) >= 2, most_per_read
    assert durable_module.READ_THREADS == 5
