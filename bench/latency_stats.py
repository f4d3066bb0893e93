"""The pure parts of `bench.latency`: percentiles, the producer's pacing, the drain rate of
a backlog, recovery from a latency series, and the exactly-once check of the outputs.

No servers and no clocks here: every function takes the figures it judges, so each is
tested on its own (`tests/bench/test_latency_harness.py`).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` percentile (0 < q <= 100) of `values`: the smallest value with
    at least q % of the values at or below it. Raises ValueError on no values."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 < q <= 100:
        raise ValueError(f"percentile q must be in (0, 100], got {q}")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def latency_summary(seconds: Sequence[float]) -> dict[str, float | int]:
    """p50, p99 and max of latencies given in seconds, in whole milliseconds."""
    if not seconds:
        return {"records": 0}
    return {
        "records": len(seconds),
        "p50_ms": round(percentile(seconds, 50) * 1000),
        "p99_ms": round(percentile(seconds, 99) * 1000),
        "max_ms": round(max(seconds) * 1000),
    }


def distribution(values: Sequence[float], digits: int = 3) -> dict[str, float | int]:
    """Count, mean, p50, p90, p99 and max of `values` (e.g. batch seconds)."""
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "mean": round(sum(values) / len(values), digits),
        "p50": round(percentile(values, 50), digits),
        "p90": round(percentile(values, 90), digits),
        "p99": round(percentile(values, 99), digits),
        "max": round(max(values), digits),
    }


def due(rate: float, elapsed_s: float, sent: int) -> int:
    """Records a producer at `rate` per second must put now, `elapsed_s` into a phase in
    which it has put `sent`: the pacing never drifts, however late a put call returns."""
    return max(0, math.floor(rate * elapsed_s) - sent)


def phase_rates(throughput: float, fractions: Iterable[float]) -> list[float]:
    """The put rate of each load phase: its fraction of the measured throughput."""
    if throughput <= 0:
        raise ValueError(f"no throughput to take a share of ({throughput})")
    return [throughput * f for f in fractions]


def drain_rate(deliveries: Sequence[tuple[float, int]]) -> float | None:
    """Records per second a job drained a backlog at, from its batches' (delivery time,
    records): the records of every batch after the first over the time from the first
    delivery to the last. The first batch is left out, with the job's warm-up in it.
    None with fewer than two batches."""
    ordered = sorted(deliveries)
    if len(ordered) < 2 or ordered[-1][0] <= ordered[0][0]:
        return None
    return sum(n for _, n in ordered[1:]) / (ordered[-1][0] - ordered[0][0])


def recovery_seconds(
    samples: Sequence[tuple[float, float]],
    fault_at: float,
    threshold_s: float,
    window_s: float = 5.0,
    step_s: float = 0.5,
    min_records: int = 1,
) -> float | None:
    """Seconds from a fault until latency is back under `threshold_s`.

    `samples` are (delivery time, latency) of the records put after the fault. Windows of
    `window_s` seconds of deliveries slide by `step_s` from the fault on; the answer is the
    end of the first window holding at least `min_records` whose p99 latency is at most
    the threshold, less `fault_at`. None when no window recovers."""
    watch = RecoveryWatch(fault_at, threshold_s, window_s, step_s, min_records)
    watch.add(samples)
    return watch.seconds()


def window_p99s(
    samples: Sequence[tuple[float, float]],
    window_s: float = 5.0,
    step_s: float = 0.5,
    min_records: int = 1,
) -> list[float]:
    """The p99 latency of each window that the recovery check would judge, over a steady
    stretch: `samples` are (delivery time, latency); windows of `window_s` seconds of
    deliveries slide by `step_s` from the first delivery, and only windows that end by the
    last delivery and hold at least `min_records` count.

    Their spread shows how tight a bar the stretch's own p99 is: a window of a few seconds
    holds a few batches, so even before a fault some windows' p99 lie above the p99 of the
    whole stretch."""
    if not samples:
        return []
    ordered = sorted(samples)
    times = [t for t, _ in ordered]
    out = []
    start, last = times[0], times[-1]
    while start + window_s <= last:
        window = [
            lat
            for _, lat in ordered[bisect_left(times, start) : bisect_left(times, start + window_s)]
        ]
        if len(window) >= min_records:
            out.append(percentile(window, 99))
        start += step_s
    return out


def median_recovery(figures: Sequence[float | None]) -> float | None:
    """The median of several faults' recovery seconds, a fault that never recovered (None)
    counting as slower than any that did: None when at least half never recovered. With an
    even count the slower of the two middle figures, so the median never flatters."""
    if not figures:
        return None
    ordered = sorted(figures, key=lambda f: math.inf if f is None else f)
    return ordered[len(ordered) // 2]


@dataclass
class RecoveryWatch:
    """`recovery_seconds` asked again and again while deliveries come in, at a cost that
    follows the new deliveries, not every one since the fault.

    A window that ended before the newest delivery is complete (deliveries come in time
    order), so once it failed it is never judged again: the next question starts after it.
    Asking `recovery_seconds` of every sample since the fault instead cost 0.25 s of CPU a
    question 20 s after a fault at 4,620 records/s, and 0.75 s at 60 s: twice a second, a
    core of the two the job runs on."""

    fault_at: float
    threshold_s: float
    window_s: float = 5.0
    step_s: float = 0.5
    min_records: int = 1
    _times: list[float] = field(default_factory=list)
    _latencies: list[float] = field(default_factory=list)
    _start: float | None = None  # the first window not yet judged for good
    judged: int = 0  # windows judged, over every question: what the watch costs

    def add(self, samples: Iterable[tuple[float, float]]) -> None:
        """More (delivery time, latency) samples, in any order."""
        new = sorted(samples)
        if not new:
            return
        if self._times and new[0][0] < self._times[-1]:  # out of order: merge once
            merged = sorted([*zip(self._times, self._latencies, strict=True), *new])
            self._times = [t for t, _ in merged]
            self._latencies = [lat for _, lat in merged]
            self._start = None  # a window judged for good may have changed
            return
        self._times += [t for t, _ in new]
        self._latencies += [lat for _, lat in new]

    def seconds(self) -> float | None:
        """`recovery_seconds` of every sample added so far."""
        if not self._times:
            return None
        times, last = self._times, self._times[-1]
        start = self.fault_at if self._start is None else self._start
        while start + self.window_s <= last + self.step_s:
            end = start + self.window_s
            window = self._latencies[bisect_left(times, start) : bisect_left(times, end)]
            self.judged += 1
            if len(window) >= self.min_records and percentile(window, 99) <= self.threshold_s:
                return round(end - self.fault_at, 3)
            start += self.step_s
            if end < last:  # complete and failed: not asked again
                self._start = start
        return None


@dataclass(frozen=True)
class Output:
    """One output of the latency app: the record it came from and its key's count after it."""

    record: int
    put_ms: int
    count: int


def exactly_once_problems(
    batches: Iterable[Sequence[tuple[str, Output]]], put_keys: Mapping[int, str]
) -> list[str]:
    """What is wrong with the delivered outputs (deduplicated by batch identity) against
    the records put (`put_keys`: record id to its partition key): a record missing, seen
    twice or under another key, and per key counts that are not exactly 1..n (state that
    lost or counted a record twice)."""
    problems: list[str] = []
    seen: Counter[int] = Counter()
    counts: dict[str, list[int]] = {}
    for batch in batches:
        for key, out in batch:
            seen[out.record] += 1
            counts.setdefault(key, []).append(out.count)
            if put_keys.get(out.record, key) != key:
                problems.append(f"record {out.record} delivered under key {key!r}")
    missing = [r for r in put_keys if r not in seen]
    twice = [r for r, n in seen.items() if n > 1]
    unknown = [r for r in seen if r not in put_keys]
    if missing:
        problems.append(f"{len(missing)} records put never delivered (e.g. {missing[:5]})")
    if twice:
        problems.append(f"{len(twice)} records delivered in two batches (e.g. {twice[:5]})")
    if unknown:
        problems.append(f"{len(unknown)} outputs of records never put (e.g. {unknown[:5]})")
    for key, got in counts.items():
        if sorted(got) != list(range(1, len(got) + 1)):
            problems.append(f"key {key!r}: counts are not 1..{len(got)}: state lost or doubled")
            break
    return problems
