"""The rig of `bench.latency`: the producer, the job as a subprocess with the faults it
suffers, and what the latency app's sink wrote.

`Producer` puts `{"id", "put_ms"}` records at a paced rate and remembers each record's key
and put time; `Job` runs `shardless run bench/latency_app.py` on `local-cluster[2,1,1024]`
with a 1-second trigger and can kill an executor (with its disk) or the whole job and
restart it; `Deliveries` reads the sink's file as it grows.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import latency_app
from bench.latency_stats import Output, due
from shardless.processor.kinesis.put import Retries, put_records
from shardless.processor.local.faults import procs
from shardless.processor.local.faults.driver import Driver

MASTER = "local-cluster[2,1,1024]"
TRIGGER_S = 1.0
PUT_CHUNK = 500
# The producer puts what is due once per tick, as a batching producer (the KPL buffers
# 100 ms) would. Putting each record as soon as it was due cost a PutRecords call per
# record or two: 0.55-0.64 of the 2 cores in the producer and 0.3-0.4 in kinesalite at
# half load, taken from the job being measured (`docs/benchmarks.md`, latency).
PUT_TICK_S = 0.05


@dataclass
class Deliveries:
    """The sink's file, read as it grows; each batch identity kept once (the first call:
    a batch run again after a driver restart delivers the same outputs later)."""

    path: Path
    batches: dict[tuple[str, int], tuple[float, list[tuple[str, Output]]]] = field(
        default_factory=dict
    )
    delivered: dict[int, float] = field(default_factory=dict)  # record -> first delivery
    calls: int = 0  # sink calls, repeated batches included
    _offset: int = 0

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line being written stays for the next poll
        self._offset += end
        for raw in data[:end].splitlines():
            line = json.loads(raw)
            self.calls += 1
            ident = (line["query"], int(line["batch"]))
            if ident in self.batches:
                continue
            outs = []
            for key, value in zip(line["keys"], line["values"], strict=True):
                record, put_ms, count = json.loads(value)
                outs.append((key, Output(record, put_ms, count)))
                self.delivered.setdefault(record, line["t"])
            self.batches[ident] = (line["t"], outs)

    def latencies(self, records: dict[int, float]) -> list[tuple[float, float]]:
        """(delivery time, latency) of each of `records` (id to put time) delivered."""
        return [(self.delivered[r], self.delivered[r] - t) for r, t in records.items()
                if r in self.delivered]  # fmt: skip

    def batch_ids(self, ids: set[int]) -> set[int]:
        """Spark's batch ids of the batches holding any of `ids`."""
        return {b for (_, b), (_, outs) in self.batches.items()
                if any(o.record in ids for _, o in outs)}  # fmt: skip

    def with_records(self, ids: set[int]) -> list[tuple[float, int]]:
        """(delivery time, records) of the batches holding any of `ids`."""
        return [(t, len(outs)) for t, outs in self.batches.values()
                if any(o.record in ids for _, o in outs)]  # fmt: skip


def read_progress(path: Path) -> list[dict[str, Any]]:
    """Spark's progress reports the sink's listener wrote, one per batch."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------- the producer


@dataclass
class Producer:
    """Puts `{"id", "put_ms"}` records over `keys` partition keys; remembers each record's
    key and put time (seconds)."""

    kinesis: Any
    stream: str
    keys: int
    rng: random.Random
    put_keys: dict[int, str] = field(default_factory=dict)
    put_at: dict[int, float] = field(default_factory=dict)
    calls: int = 0  # PutRecords calls made (each retry of a partial failure counts once)

    def put(self, n: int) -> list[int]:
        """Put `n` records now (in calls of 500); their ids."""
        ids: list[int] = []
        while n > 0:
            count = min(n, PUT_CHUNK)
            first = len(self.put_keys)
            now = time.time()
            entries = []
            for i in range(first, first + count):
                key = f"k{self.rng.randrange(self.keys):05d}"
                self.put_keys[i] = key
                self.put_at[i] = now
                body = {"id": i, "put_ms": round(now * 1000)}
                entries.append({"PartitionKey": key, "Data": json.dumps(body).encode()})
            put_records(self.kinesis, self.stream, entries, Retries(attempts=60))
            self.calls += 1
            ids += range(first, first + count)
            n -= count
        return ids

    def at_rate(
        self, rate: float, seconds: float, stop: Callable[[list[int]], bool] | None = None
    ) -> dict[str, Any]:
        """Put at `rate` records/s for `seconds` (or until `stop(ids put so far)` says so,
        asked every 0.5 s), what is due once every `PUT_TICK_S`; the phase's records,
        start, end, the rate it reached, its PutRecords calls and this process's CPU."""
        started, cpu, calls = time.time(), time.process_time(), self.calls
        t0 = time.monotonic()
        ids: list[int] = []
        next_check = 0.5
        tick = 0
        while (elapsed := time.monotonic() - t0) < seconds:
            n = due(rate, elapsed, len(ids))
            if n:
                ids += self.put(n)
            if stop is not None and elapsed >= next_check:
                next_check += 0.5
                if stop(ids):
                    break
            tick += 1  # the next tick on the phase's own clock: a slow put does not shift it
            wait = t0 + tick * PUT_TICK_S - time.monotonic()
            if wait > 0:
                time.sleep(min(wait, seconds - elapsed))
            else:
                tick = math.ceil((time.monotonic() - t0) / PUT_TICK_S)
        ended, took = time.time(), time.monotonic() - t0
        return {
            "ids": ids,
            "started": started,
            "ended": ended,
            # on the monotonic clock: the wall clock this host keeps can step mid-phase
            "put_rate": len(ids) / max(took, 1e-9),
            "put_calls": self.calls - calls,
            "producer_cpu_s": round(time.process_time() - cpu, 2),
        }


# ---------------------------------------------------------------- the job


@dataclass
class Job:
    """`shardless run` of the latency app as a subprocess, on one checkpoint."""

    work: Path
    app: str
    aws_env: dict[str, str]
    drivers: list[Driver] = field(default_factory=list)

    @property
    def driver(self) -> Driver:
        return self.drivers[-1]

    def start(self) -> Driver:
        args = [
            str(Path(latency_app.__file__)),
            "--app", self.app,
            "--stream", self.app,
            "--checkpoint", str(self.work / "checkpoint"),
            "--local-dir", str(self.work / "stores"),
            "--foreach-batch", "bench.latency_app:deliver",
            "--trigger", f"{TRIGGER_S:g} seconds",
            "--master", MASTER,
        ]  # fmt: skip
        env = {
            **os.environ,
            **self.aws_env,
            latency_app.OUT_VARIABLE: str(self.work),
            "SPARK_LOCAL_IP": "127.0.0.1",
        }
        log = self.work / f"driver-{len(self.drivers) + 1}.log"
        driver = Driver(args, env, log)
        driver.start()
        self.drivers.append(driver)
        return driver

    def reports(self) -> list[dict[str, Any]]:
        for d in self.drivers:
            d.poll()
        return [r for d in self.drivers for r in d.reports]

    def kill_executor(self) -> dict[str, Any]:
        """kill -9 one executor JVM and its Python processes, and remove their slice
        stores (the executor's host is lost with its disk)."""
        executors = procs.executors(self.driver.pid)
        if not executors:
            raise RuntimeError(f"no executor under driver {self.driver.pid} to kill")
        victim = executors[0]
        tree = procs.descendants(victim.pid)
        pythons = [p.pid for p in tree if procs.is_python_worker(p)]
        hit = procs.kill9([victim, *tree])
        return {"pid": victim.pid, "processes": len(hit), "stores_removed": self._lose(pythons)}

    def _lose(self, pids: list[int]) -> int:
        root = self.work / "stores" / self.app
        lost = 0
        for pid in pids:
            folder = root / f"w{pid}"
            if folder.is_dir():
                lost += sum(1 for p in folder.iterdir() if p.name.startswith("slice-"))
                shutil.rmtree(folder, ignore_errors=True)
        return lost

    def restart_driver(self) -> dict[str, Any]:
        """kill -9 the whole job, then start it again on the same checkpoint."""
        killed = self.driver.kill()
        self.start()
        return {"processes": killed}

    def stop(self) -> None:
        for d in self.drivers:
            d.kill()
