"""A worker keeps at most its limit of stores open: one that runs more slices than its file
descriptors allow (4,096 slices on a few cores) closes the least recently used between
batches and reopens them from disk, exact and without a restore."""

from __future__ import annotations

import resource
from collections import Counter

from shardless.changelog import resources
from shardless.changelog.layout import AppLocation
from shardless.processor.runtime import stores
from shardless.processor.runtime.routing import route
from shardless.processor.runtime.stores import cache_for
from tests.processor.runtime.test_runtime import (
    KEYS,
    SLICES,
    counts_run_in_order,
    durable_counts,
    frame,
    metrics_of,
    open_files_under,
    outputs,
    runner,
)

# two groups of slices, as Spark's partitions have them
halves = [
    [k for k in KEYS if route(k, None, SLICES) < SLICES // 2],
    [k for k in KEYS if route(k, None, SLICES) >= SLICES // 2],
]


def test_open_store_limit_follows_the_descriptor_limit(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    assert stores.open_store_limit() == (1024 - stores.FDS_KEPT_FREE) // stores.FDS_PER_STORE
    monkeypatch.setattr(resource, "getrlimit", lambda _: (100, 4096))
    assert stores.open_store_limit() == 16
    monkeypatch.setattr(resource, "getrlimit", lambda _: (resource.RLIM_INFINITY,) * 2)
    assert stores.open_store_limit() > 100_000


def test_a_worker_over_its_store_limit_closes_idle_stores_and_stays_exact(
    location, tmp_path, monkeypatch
):
    monkeypatch.setattr(stores, "open_store_limit", lambda: 4)
    assert all(len({route(k, None, SLICES) for k in keys}) > 4 for keys in halves)
    r = runner(location, tmp_path)
    cache = cache_for(str(tmp_path), location.app, SLICES)
    seen: list[dict] = []
    seq = 0
    for batch in range(4):
        for group, keys in enumerate(halves):
            part = keys[batch::4]
            out = r.run(group, "q", batch, frame(part, seq))
            seq += len(part)
            seen += outputs(out)
            # every store reopened from its local files, none rebuilt (a slice's first
            # batch makes an empty store: a "restore" to version 0)
            assert [r for r in metrics_of(out)["restores"] if r["to_version"] > 0] == []
            # the batch's stores stay open through it; idle ones beyond the limit are closed
            touched = {route(k, None, SLICES) for k in part}
            assert touched <= set(cache._open) and len(cache._open) == max(4, len(touched))
            closed = {s for s in range(SLICES) if s not in cache._open}
            assert all(open_files_under(cache._path(s)) == 0 for s in closed)
    assert durable_counts(location) == dict(Counter(KEYS))
    assert counts_run_in_order(seen)


def test_without_a_limit_reached_no_store_is_closed(location, tmp_path):
    r = runner(location, tmp_path)
    r.run(0, "q", 0, frame(halves[0]))
    r.run(1, "q", 0, frame(halves[1], 400))
    cache = cache_for(str(tmp_path), location.app, SLICES)
    assert set(cache._open) == {route(k, None, SLICES) for k in KEYS}


def test_the_limit_counts_the_stores_of_every_cache_in_the_process(location, tmp_path, monkeypatch):
    monkeypatch.setattr(stores, "open_store_limit", lambda: 4)
    other = AppLocation.default(f"{location.app}-b")
    resources.ensure(other, SLICES)
    a, b = runner(location, tmp_path / "a"), runner(other, tmp_path / "b")
    a.run(0, "q", 0, frame(halves[0]))
    first = cache_for(str(tmp_path / "a"), location.app, SLICES)
    assert len(first._open) > 4  # one batch's stores all stay open
    b.run(0, "q", 0, frame(halves[1][:3]))
    second = cache_for(str(tmp_path / "b"), other.app, SLICES)
    assert len(first._open) + len(second._open) == 4
    assert open_files_under(tmp_path / "a") <= len(first._open) * stores.FDS_PER_STORE
    out = a.run(0, "q", 1, frame(halves[0], 400))  # reopened from disk, exact
    assert [r for r in metrics_of(out)["restores"] if r["to_version"] > 0] == []
    assert durable_counts(location) == {k: 2 * n for k, n in Counter(halves[0]).items()}
