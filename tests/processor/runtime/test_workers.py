"""Two long-lived Python worker processes taking the same slices in turn, as Spark's
Python workers do under local[2]: no LOCK error, no lost write, stale stores caught up,
and a dead worker's stores adopted."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections import Counter

import pytest

from tests.processor.runtime.test_runtime import KEYS, count_handler, durable_counts, frame

pytestmark = pytest.mark.slow


def _worker(conn, location, local_dir: str) -> None:
    from shardless.processor.api.handlers import HandlerFactory
    from shardless.processor.runtime.group_runner import GroupRunner, RuntimeConfig

    runner = GroupRunner(HandlerFactory(count_handler), RuntimeConfig(location, 16, local_dir))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        batch, keys, first = msg
        out, _ = runner.run(0, "q", batch, frame(keys, first), {}, 1000)
        metrics = out[out.kind == "metrics"].value.iloc[0]
        conn.send((os.getpid(), metrics))


class Worker:
    def __init__(self, location, local_dir: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, location, local_dir))
        self.proc.start()

    def run(self, batch: int, keys: list[str], first: int) -> str:
        self.conn.send((batch, keys, first))
        return self.conn.recv()[1]

    def stop(self) -> None:
        self.conn.send(None)
        self.proc.join(30)


def test_two_workers_alternating_on_the_same_slices_lose_nothing(location, tmp_path):
    a, b = Worker(location, str(tmp_path)), Worker(location, str(tmp_path))
    try:
        for batch in range(4):
            worker = a if batch % 2 == 0 else b
            worker.run(batch, KEYS[batch * 100 : (batch + 1) * 100], batch * 100)
    finally:
        a.stop()
        b.stop()
    assert durable_counts(location) == dict(Counter(KEYS))
    assert len(list(tmp_path.glob("*/w*"))) == 2  # each worker kept its own stores


def test_a_dead_workers_stores_are_adopted_not_restored(location, tmp_path):
    import json

    a = Worker(location, str(tmp_path))
    a.run(0, KEYS[:200], 0)
    a.stop()
    b = Worker(location, str(tmp_path))
    try:
        metrics = json.loads(b.run(1, KEYS[200:], 200))
    finally:
        b.stop()
    assert metrics["restores"] == []  # adopted a's up-to-date stores: nothing to replay
    assert durable_counts(location) == dict(Counter(KEYS))


def test_a_corrupted_local_store_is_rebuilt_from_durable_state(location, tmp_path):
    import json

    a = Worker(location, str(tmp_path))
    a.run(0, KEYS[:200], 0)
    a.stop()
    damaged = 0
    for f in tmp_path.glob("*/w*/slice-*/*"):
        if f.name.startswith(("MANIFEST", "CURRENT")):
            f.write_bytes(os.urandom(64))
            damaged += 1
    assert damaged
    b = Worker(location, str(tmp_path))
    try:
        metrics = json.loads(b.run(1, KEYS[200:], 200))
    finally:
        b.stop()
    assert metrics["restores"] and all(r["from_version"] == 0 for r in metrics["restores"])
    assert durable_counts(location) == dict(Counter(KEYS))
