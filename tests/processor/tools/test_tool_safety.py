"""The `shardless state` tools against a hostile or shared bucket and a running job (moto
over HTTP, the task runtime without Spark): pickle only on request, gc scoped to its own
application and safe beside a running job, re-slicing that refuses what it cannot check."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import boto3
import pytest

from shardless.changelog import gc, reslice, resources
from shardless.changelog.errors import ChangelogError
from shardless.changelog.layout import AppLocation
from shardless.processor import cli
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.runtime.group_runner import GroupRunner, RuntimeConfig
from shardless.processor.runtime.routing import route
from shardless.processor.tools.state_source import StateReader
from shardless.state import encoding
from shardless.state.slices import HASH_SPACE, key_hash, slice_of
from tests.processor.runtime.test_runtime import KEYS, SLICES, durable_counts, frame, runner

HOUR_MS = 3600 * 1000


def objects(loc: AppLocation) -> set[str]:
    s3 = boto3.client("s3")
    found: set[str] = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket):
        found |= {o["Key"] for o in page.get("Contents", [])}
    return found


def run_cli(capsys, *argv: str) -> tuple[int, dict]:  # noqa: ANN001
    code = cli.main(["state", *argv])
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1]) if out else {}


# ---- pickle only behind --allow-pickle ------------------------------------------------------


class Boom:
    """A value whose unpickling creates a directory: code run by whoever decodes it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.mkdir, (str(self.marker),))


@pytest.fixture
def pickled_app(location, tmp_path):  # noqa: ANN001, ANN201
    """An application whose handler stored a pickle bomb under "evil" and a harmless pickled
    tuple under "fine" (an application that opted in to pickle; anyone with write access
    to the bucket could have done the same)."""
    marker = tmp_path / "unpickled"

    def handler(event, ctx) -> None:  # noqa: ANN001
        ctx.state.set(Boom(marker) if event.key == "evil" else (1, "a"))

    r = runner(
        location, tmp_path / "stores", handler, value_format=encoding.PICKLE, allow_pickle=True
    )
    r.run(0, "q", 0, frame(["evil", "fine"]))
    assert not marker.exists()
    return location, marker


def test_get_and_scan_refuse_a_pickled_value_unless_allowed(pickled_app, capsys):
    loc, marker = pickled_app
    evil = route("evil", None, SLICES)
    code, data = run_cli(capsys, "get", "--app", loc.app, "--key", "evil", "--json")
    assert code == 2 and not marker.exists()
    assert "'evil'" in data["error"] and f"slice {evil}" in data["error"]
    assert "--allow-pickle" in data["error"]
    code, data = run_cli(capsys, "scan", "--app", loc.app, "--limit", "0", "--json")
    assert code == 2 and "--allow-pickle" in data["error"] and not marker.exists()
    code, data = run_cli(
        capsys, "get", "--app", loc.app, "--key", "fine", "--json", "--allow-pickle"
    )
    assert code == 0 and data["value"] == [1, "a"]


def test_export_refuses_a_pickled_value_unless_allowed(pickled_app, capsys, tmp_path):
    loc, marker = pickled_app
    out = tmp_path / "out.jsonl"
    code, data = run_cli(
        capsys, "export", "--app", loc.app, "--format", "jsonl", "--out", str(out), "--json"
    )
    assert code == 2 and "'evil'" in data["error"] and "--allow-pickle" in data["error"]
    assert not marker.exists()
    code, data = run_cli(
        capsys, "export", "--app", loc.app, "--format", "jsonl", "--out", str(out), "--json",
        "--slice", str(route("fine", None, SLICES)), "--allow-pickle",
    )  # fmt: skip
    assert code == 0 and data["rows"] == 1
    assert json.loads(out.read_text())["value"] == [1, "a"]


def test_the_state_data_source_refuses_a_pickled_value_unless_allowed(pickled_app):
    loc, marker = pickled_app
    options = {"app": loc.app, "bucket": loc.bucket, "prefix": loc.prefix, "table": loc.table}
    reader = StateReader(options)
    with pytest.raises(ChangelogError, match=r"'evil'.*allowPickle"):
        for p in reader.partitions():
            list(reader.read(p))
    assert not marker.exists()
    fine = str(route("fine", None, SLICES))
    reader = StateReader({**options, "slices": fine, "allowPickle": "true"})
    rows = [row for p in reader.partitions() for row in reader.read(p)]
    assert [(r[1], json.loads(r[3])) for r in rows] == [("fine", [1, "a"])]


# ---- gc ----------------------------------------------------------------------------------------


def run_batches(loc: AppLocation, tmp_path: Path, batches: range) -> None:
    r = runner(loc, tmp_path, snapshot_every=2, keep_snapshots=1)
    for b in batches:
        r.run(0, "q", b, frame(KEYS[(b % 8) * 50 : (b % 8 + 1) * 50] + ["user-1"] * 3, b * 1000))


def expected(batches: range) -> Counter:
    out: Counter = Counter()
    for b in batches:
        out += Counter(KEYS[(b % 8) * 50 : (b % 8 + 1) * 50] + ["user-1"] * 3)
    return out


def test_gc_refuses_to_touch_a_bucket_and_prefix_another_application_shares(location, tmp_path):
    other = AppLocation(
        app=f"{location.app}-b", bucket=location.bucket, prefix=location.prefix,
        table=f"shardless-{location.app}-b",
    )  # fmt: skip
    resources.ensure(other, SLICES)
    run_batches(location, tmp_path / "a", range(4))
    run_batches(other, tmp_path / "b", range(6))
    before = objects(location)
    with pytest.raises(ChangelogError, match=rf"{other.app}.*own prefix"):
        gc.collect(location, SLICES, grace_s=0, dry_run=False)
    assert objects(location) == before
    assert durable_counts(other) == expected(range(6))


def test_reslice_into_the_source_prefix_is_refused_before_anything_is_written(location, tmp_path):
    run_batches(location, tmp_path, range(3))
    before = objects(location)
    target = AppLocation(
        app=f"{location.app}-r", bucket=location.bucket, prefix=location.prefix,
        table=f"shardless-{location.app}-r",
    )  # fmt: skip
    with pytest.raises(ChangelogError, match="prefix"):
        reslice.reslice(location, target, 32)
    assert objects(location) == before
    with pytest.raises(boto3.client("dynamodb").exceptions.ResourceNotFoundException):
        boto3.client("dynamodb").describe_table(TableName=target.table)


def test_reslice_cli_refuses_the_source_prefix_even_in_a_dry_run(location, tmp_path, capsys):
    run_batches(location, tmp_path, range(2))
    code, data = run_cli(
        capsys, "reslice", "--app", location.app, "--to-app", "x-" + location.app,
        "--to-slices", "32", "--to-bucket", location.bucket, "--to-prefix", location.prefix,
        "--json",
    )  # fmt: skip
    assert code == 2 and "prefix" in data["error"]


def test_a_negative_grace_period_is_refused(location, tmp_path, capsys):
    run_batches(location, tmp_path, range(3))
    before = objects(location)
    with pytest.raises(ValueError, match="grace"):
        gc.collect(location, SLICES, grace_s=-1, dry_run=False)
    code, data = run_cli(
        capsys, "gc", "--app", location.app, "--delete", "--grace-s", "-60", "--json", "--force"
    )
    assert code == 2 and "grace" in data["error"]
    assert objects(location) == before


def test_gc_deletes_while_the_job_runs_with_a_safe_grace_period(location, tmp_path, capsys):
    r = runner(location, tmp_path, snapshot_every=1, keep_snapshots=1)
    for b in range(4):
        r.run(0, "q", b, frame(KEYS[:50], b * 100))
    code, data = run_cli(capsys, "gc", "--app", location.app, "--delete", "--json")
    assert code == 0 and not data["dry_run"]  # it just committed: running, but safe
    code, data = run_cli(
        capsys, "gc", "--app", location.app, "--delete", "--grace-s", "0", "--json"
    )
    assert code == 3 and "looks running" in data["error"] and "grace" in data["error"]


def test_gc_beside_commits_between_its_listing_and_its_deletions(
    location, tmp_path, monkeypatch, clock_ahead
):
    """The job commits (new segments and snapshots, trimming old ones) while gc lists, reads
    heads and deletes, with a clock far enough ahead that every object looks old: nothing a
    head needs is deleted, and every slice still restores."""
    r = runner(location, tmp_path, snapshot_every=2, keep_snapshots=1)
    batch = iter(range(100))

    def commit() -> None:
        b = next(batch)
        r.run(0, "q", b, frame(KEYS[(b % 8) * 50 : (b % 8 + 1) * 50] + ["user-1"] * 3, b * 1000))

    for _ in range(6):
        commit()
    now = int(time.time() * 1000)
    gc.collect(location, SLICES, dry_run=False, now_ms=now)  # the first sighting
    listing, heads = gc._listing, gc.referenced

    def listing_then_commit(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        found = listing(*a, **kw)
        commit()
        return found

    def heads_then_commit(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        found = heads(*a, **kw)
        commit()
        return found

    monkeypatch.setattr(gc, "_listing", listing_then_commit)
    monkeypatch.setattr(gc, "referenced", heads_then_commit)
    for step in (1, 2, 3):  # the job's commits are as far ahead as gc's clock
        report = gc.collect(location, SLICES, dry_run=False, now_ms=clock_ahead(step * 2 * HOUR_MS))
        assert report.deleted or step > 1
    monkeypatch.undo()
    done = next(batch)
    assert durable_counts(location) == expected(range(done))
    assert set(gc.referenced(location, SLICES)) <= objects(location)


# ---- reslice's routing check -----------------------------------------------------------------


def one_slice_app(loc: AppLocation, tmp_path: Path, key: str, explicit: int) -> None:
    """One slice whose only key's records carry an explicit hash key."""
    resources.ensure(loc, 1)
    cfg = RuntimeConfig(loc, 1, str(tmp_path / "stores"))
    runner_1 = GroupRunner(HandlerFactory(lambda event, ctx: ctx.state.set({"n": 1})), cfg)
    pdf = frame([key])
    pdf["explicit_hash_key"] = str(explicit)
    pdf["slice"] = 0
    runner_1.run(0, "q", 0, pdf, {}, 1_000)


def test_reslice_of_one_slice_refuses_keys_it_cannot_check(aws, tmp_path):
    source = AppLocation.default(f"t-one-{os.urandom(4).hex()}")
    key = "user-1"
    md5_half = slice_of(key_hash(key), 2)
    explicit = (1 - md5_half) * (HASH_SPACE // 2) + 12345  # its records go to the other half
    one_slice_app(source, tmp_path, key, explicit)
    target = AppLocation.default(f"{source.app}-2")
    with pytest.raises(ChangelogError, match="explicit hash key"):
        reslice.reslice(source, target, 2)
    # an operator who knows every record was routed by its partition key says so
    assert reslice.reslice(source, target, 2, md5_routed=True).verified


def test_reslice_refuses_slice_state_written_under_another_slices_key(location, tmp_path):
    def handler(event, ctx) -> None:  # noqa: ANN001
        ctx.slice_state.put(f"{event.key}#daily", 1)

    key = next(k for k in KEYS if route(f"{k}#daily", None, SLICES) != route(k, None, SLICES))
    runner(location, tmp_path, handler).run(0, "q", 0, frame([key]))
    with pytest.raises(ChangelogError, match=rf"'{key}#daily'.*slice_state"):
        reslice.reslice(location, AppLocation.default(f"{location.app}-32"), 32)
