"""The `shardless state` tools against a hostile or shared bucket and a running job (moto
over HTTP, the task runtime without Spark): pickle only on request, gc scoped to its own
application and safe beside a running job, re-slicing that refuses what it cannot check."""

from __future__ import annotations

import json
import os
from pathlib import Path

import boto3
import pytest

from changelog.errors import ChangelogError
from changelog.layout import AppLocation
from processor import cli
from processor.routing import route
from processor.state_source import StateReader
from state import encoding
from tests.test_runtime import SLICES, frame, runner

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
