"""bench.commit_latency: its baseline really sends a wide commit's transactions (and a wide
read's BatchGetItem calls) one at a time and its contender together, round by round in
alternating order, and the module's settings are put back afterwards."""

from __future__ import annotations

import threading

import pytest

from bench import commit_latency
from changelog import aws as clients
from changelog import durable as durable_module


def test_the_baseline_sends_one_at_a_time_and_the_contender_together(aws, monkeypatch):
    lock = threading.Lock()
    in_flight, most = [0], [0]

    def before(**_):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])

    def after(**_):
        with lock:
            in_flight[0] -= 1

    most_per_commit: list[int] = []
    original = commit_latency._commit

    def commit(durable, heads, batch):
        most[0] = 0
        out = original(durable, heads, batch)
        most_per_commit.append(most[0])
        return out

    monkeypatch.setattr(commit_latency, "_commit", commit)
    monkeypatch.setattr(durable_module, "TRANSACTION_THREADS", 5)
    client = clients.client("dynamodb", validated=False)
    hooks = [
        ("before-call.dynamodb.TransactWriteItems", before),
        ("after-call.dynamodb.TransactWriteItems", after),
        ("after-call-error.dynamodb.TransactWriteItems", after),
    ]
    for event, hook in hooks:
        client.meta.events.register(event, hook)
    try:
        f = commit_latency.measure(256, rounds=2, warmup=0, threads=8)
    finally:
        for event, hook in hooks:
            client.meta.events.unregister(event, hook)
    assert f["transactions"] == 3
    assert [len(v) for v in f["runs"].values()] == [2, 2]
    assert f["ratio"] == pytest.approx(f["together_s"] / f["one_at_a_time_s"], rel=0.01)
    # the most transactions in flight at once, per measured commit: one at a time, then
    # together; the next round the other way round
    one_at_a_time, together = most_per_commit[0::3], most_per_commit[1:3]
    assert one_at_a_time == [1, 1] and min(together) >= 2, most_per_commit
    assert durable_module.TRANSACTION_THREADS == 5


def test_the_read_baseline_reads_one_call_at_a_time_and_the_contender_together(aws, monkeypatch):
    lock = threading.Lock()
    in_flight, most = [0], [0]

    def before(**_):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])

    def after(**_):
        with lock:
            in_flight[0] -= 1

    most_per_read: list[int] = []
    original = durable_module.DurableState.heads

    def heads(self, slices):
        most[0] = 0
        out = original(self, slices)
        if len(slices) == 256:  # the measured reads, not the commits' own
            most_per_read.append(most[0])
        return out

    monkeypatch.setattr(durable_module.DurableState, "heads", heads)
    monkeypatch.setattr(durable_module, "READ_THREADS", 5)
    client = clients.client("dynamodb")
    hooks = [
        ("before-call.dynamodb.BatchGetItem", before),
        ("after-call.dynamodb.BatchGetItem", after),
        ("after-call-error.dynamodb.BatchGetItem", after),
    ]
    for event, hook in hooks:
        client.meta.events.register(event, hook)
    try:
        f = commit_latency.measure_reads(256, rounds=2, warmup=1, threads=8)
    finally:
        for event, hook in hooks:
            client.meta.events.unregister(event, hook)
    assert f["calls"] == 3
    assert [len(v) for v in f["runs"].values()] == [2, 2]
    assert f["ratio"] == pytest.approx(f["together_s"] / f["one_at_a_time_s"], rel=0.01)
    # round 0: one at a time, then together; round 1 the other way round
    assert most_per_read[0] == 1 and most_per_read[3] == 1, most_per_read
    assert min(most_per_read[1:3]) >= 2, most_per_read
    assert durable_module.READ_THREADS == 5
