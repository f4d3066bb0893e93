"""Zombies and speculation: two attempts of the same group and batch, on two executors
(two local directories, two store caches, two owners), against moto over HTTP.

Spark runs a second attempt of a task with speculative execution on, or when an executor
it gave up on (a long GC pause, a network partition) was only stalled and resumes. Each
commit is conditional on the exact head its attempt started from, so:

- racing from the same heads, exactly one commit lands and the other raises
  `HeadConflictError`; its segment, written before the DynamoDB transaction, is never
  referenced by any head;
- a stalled attempt resumed after the batch and a later one were committed elsewhere is
  refused (its heads are stale, and fresh ones are past its batch);
- a stalled attempt resumed right after the other attempt committed the same batch re-runs
  it in place from the version before: same outputs, the input counted once, one segment
  of that batch referenced.

State is always compared with a plain-Python fold of the input. The pause is a wrapper
around `DurableState.commit` that holds one thread before the real commit runs.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import pytest

from shardless.changelog.durable import DurableState, HeadConflictError
from shardless.changelog.layout import AppLocation
from shardless.processor.errors import ProcessorError
from tests.processor.runtime.test_runtime import (
    KEYS,
    SLICES,
    Runner,
    durable_counts,
    frame,
    outputs,
    runner,
)


class Gate:
    """Holds `DurableState.commit` in the threads named in `hold` until released, or until
    `parties` of them are waiting (a barrier: every attempt has read its heads and run its
    records before any commits)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, parties: int = 0) -> None:
        self.release: dict[str, threading.Event] = {}
        self.arrived: dict[str, threading.Event] = {}
        self.barrier = threading.Barrier(parties) if parties else None
        real = DurableState.commit

        def commit(durable: DurableState, *args: Any, **kw: Any) -> Any:
            name = threading.current_thread().name
            if self.barrier is not None and name.startswith("attempt-"):
                self.barrier.wait(timeout=60)
            if name in self.release:
                self.arrived[name].set()
                assert self.release[name].wait(timeout=120), f"{name} never released"
            return real(durable, *args, **kw)

        monkeypatch.setattr(DurableState, "commit", commit)

    def hold(self, name: str) -> None:
        self.release[name] = threading.Event()
        self.arrived[name] = threading.Event()


class Attempt(threading.Thread):
    """One task attempt: `fn()` in a thread of its own; its result or its exception."""

    def __init__(self, name: str, fn: Callable[[], Any]) -> None:
        super().__init__(name=name, daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - the loser's error is the point
            self.error = exc

    def outcome(self, timeout_s: float = 120) -> Any:
        self.join(timeout_s)
        assert not self.is_alive(), f"{self.name} still running"
        return self.error if self.error is not None else self.result


def batch_segments(location: AppLocation, batch: int) -> set[str]:
    """The uids of every changelog segment written for `batch` (group 0), referenced or not."""
    prefix = location.key(f"changelog/{batch:012d}/")
    found = boto3.client("s3").list_objects_v2(Bucket=location.bucket, Prefix=prefix)
    return {o["Key"].rsplit("-", 1)[1].removesuffix(".seg") for o in found.get("Contents", [])}


def referenced(location: AppLocation) -> dict[int, set[str]]:
    """Per batch, the segment uids that some slice's head references."""
    out: dict[int, set[str]] = {}
    for head in DurableState(location).heads(list(range(SLICES))).values():
        for entry in head.log:
            out.setdefault(entry.batch, set()).add(entry.uid)
    return out


def fold(*batches: list[str]) -> dict[str, int]:
    return dict(Counter(k for keys in batches for k in keys))


B0, B1, B2, B3 = KEYS[:100], KEYS[100:200], KEYS[200:300], KEYS[300:400]


@pytest.fixture
def executors(location, tmp_path) -> Iterator[tuple[Runner, Runner, Runner]]:
    """Three executors' runners; batch 0 committed by the third, so that the two racing
    ones start batch 1 from heads read in DynamoDB (as a speculative copy does)."""
    a, b, c = (runner(location, tmp_path / n) for n in "abc")
    c.run(0, "q", 0, frame(B0))
    yield a, b, c


def test_racing_attempts_of_one_batch_exactly_one_commit_wins(location, executors, monkeypatch):
    a, b, _ = executors
    Gate(monkeypatch, parties=2)  # both attempts reach the commit with the same heads
    attempts = [
        Attempt(f"attempt-{n}", lambda r=r: outputs(r.run(0, "q", 1, frame(B1, 100))))
        for n, r in (("a", a), ("b", b))
    ]
    for t in attempts:
        t.start()
    results = {t.name: t.outcome() for t in attempts}
    won = {n: v for n, v in results.items() if isinstance(v, list)}
    lost = {n: v for n, v in results.items() if not isinstance(v, list)}
    assert len(won) == 1 and len(lost) == 1, results
    (error,) = lost.values()
    assert isinstance(error, HeadConflictError), error
    assert "lost to another writer" in str(error)
    # the winner's outputs continue batch 0's counts, once each
    (out,) = won.values()
    seen = Counter(B0)
    for o in out:
        seen[o["key"]] += 1
        assert o["n"] == seen[o["key"]]
    assert durable_counts(location) == fold(B0, B1)
    # both wrote a segment; only the winner's is in any head
    segments, used = batch_segments(location, 1), referenced(location)
    assert len(segments) == 2 and len(used[1]) == 1 and used[1] < segments
    # the loser's executor goes on with the next batch from the winner's state
    loser = a if "attempt-a" in lost else b
    assert outputs(loser.run(0, "q", 2, frame(["user-9"], 300))) == [
        {"key": "user-9", "n": fold(B0, B1)["user-9"] + 1}
    ]
    assert referenced(location)[1] == used[1]


def test_a_zombie_resumed_after_later_batches_is_refused(location, tmp_path, monkeypatch):
    """The executor that ran batch 0 stalls in batch 1 before its commit; Spark runs batch 1
    again elsewhere and goes on to batch 2. The zombie then wakes up: its commit loses
    (stale heads), and heads read afresh are past its batch: it fails, writing nothing
    that any head references."""
    a, b = runner(location, tmp_path / "a"), runner(location, tmp_path / "b")
    a.run(0, "q", 0, frame(B0))
    gate = Gate(monkeypatch)
    gate.hold("zombie")
    zombie = Attempt("zombie", lambda: outputs(a.run(0, "q", 1, frame(B1, 100))))
    zombie.start()
    assert gate.arrived["zombie"].wait(120)  # its records processed, about to commit
    again = outputs(b.run(0, "q", 1, frame(B1, 100)))
    b.run(0, "q", 2, frame(B2, 200))
    gate.release["zombie"].set()
    error = zombie.outcome()
    assert isinstance(error, ProcessorError), error
    assert "checkpoint is older than the state" in str(error)
    assert durable_counts(location) == fold(B0, B1, B2)
    segments, used = batch_segments(location, 1), referenced(location)
    assert len(segments) == 2 and len(used[1]) == 1 and used[1] < segments
    assert again[-1]["n"] == fold(B0, B1)[again[-1]["key"]]
    # the zombie's executor serves batch 3 correctly: its stores catch up from the log
    out = outputs(a.run(0, "q", 3, frame(B3, 300)))
    assert durable_counts(location) == fold(B0, B1, B2, B3)
    assert {o["key"]: o["n"] for o in out} == {
        k: n for k, n in fold(B0, B1, B2, B3).items() if k in B3
    }


def test_a_zombie_resumed_right_after_the_other_commit_reruns_in_place(
    location, tmp_path, monkeypatch
):
    """Resumed before the next batch, the stalled attempt finds batch 1 committed by the
    other one and re-runs it in place: the same outputs, its input counted once, and one
    batch-1 segment referenced (the later). The other executor's next batch notices that
    its batch-1 heads and stores were replaced."""
    a, b = runner(location, tmp_path / "a"), runner(location, tmp_path / "b")
    a.run(0, "q", 0, frame(B0))
    gate = Gate(monkeypatch)
    gate.hold("zombie")
    zombie = Attempt("zombie", lambda: a.run(0, "q", 1, frame(B1, 100)))
    zombie.start()
    assert gate.arrived["zombie"].wait(120)
    first = outputs(b.run(0, "q", 1, frame(B1, 100)))
    gate.release["zombie"].set()
    rerun = zombie.outcome()
    assert not isinstance(rerun, BaseException), rerun
    assert outputs(rerun) == first
    assert json_metrics(rerun)["attempts"] == 2  # lost once, then ran again in place
    assert durable_counts(location) == fold(B0, B1)
    segments, used = batch_segments(location, 1), referenced(location)
    assert len(segments) == 3 and len(used[1]) == 1  # a's lost try, b's, a's in place
    out = b.run(0, "q", 2, frame(B2, 200))
    assert json_metrics(out)["attempts"] == 2
    assert durable_counts(location) == fold(B0, B1, B2)
    assert {o["key"]: o["n"] for o in outputs(out)} == {
        k: n for k, n in fold(B0, B1, B2).items() if k in B2
    }


def json_metrics(out: Any) -> dict:
    return json.loads(out[out.kind == "metrics"].value.iloc[0])
