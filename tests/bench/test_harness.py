"""`bench.harness`: the emulators a benchmark runs against, and how it prints its result."""

from __future__ import annotations

import json
import os

import boto3
import pytest

from bench import harness


def test_a_run_has_live_emulators_its_environment_points_at_and_nothing_after() -> None:
    before = dict(os.environ)
    with harness.emulated_aws("bench-harness-test-") as (tmp, emulators):
        assert tmp.is_dir() and (tmp / "local-aws").is_dir()
        assert os.environ["AWS_ENDPOINT_URL_S3"] == emulators.s3_endpoint
        boto3.client("s3").create_bucket(Bucket="bench-harness")  # answered: it is up
        pids = list(emulators.pids)
        assert pids
    assert not tmp.exists()
    for pid in pids:  # stopped (and reaped)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert dict(os.environ) == before


def test_emulators_stop_when_the_run_fails() -> None:
    pids: list[int] = []
    with (
        pytest.raises(RuntimeError, match="mid-run"),
        harness.emulated_aws("bench-harness-test-") as (_, emulators),
    ):
        pids += emulators.pids
        raise RuntimeError("mid-run")
    assert pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_result_prints_as_json_or_as_lines_without_the_bulky_keys(capsys) -> None:
    out = {"speedup": 4.5, "runs": [1, 2], "config": {"reps": 2}, "gets": 3}
    harness.print_result(out, as_json=True)
    assert json.loads(capsys.readouterr().out) == out
    harness.print_result(out, as_json=False)
    assert capsys.readouterr().out.splitlines() == ["speedup: 4.5", "gets: 3"]


def test_figures_print_numbers_goals_and_config(capsys) -> None:
    out = {
        "restore_s": 1.25,
        "label": "not a number",
        "goals": {"ratio": {"value": 0.9, "target": 0.7, "met": True},
                  "speed": {"value": 1.0, "target": 2, "met": False}},
        "config": {"reps": 7},
    }  # fmt: skip
    harness.print_figures(out, as_json=False, width=12, digits=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["restore_s", "1.25"]
    assert lines[1].split() == ["goal", "ratio", "0.90", "target", "0.7", "met"]
    assert lines[2].split() == ["goal", "speed", "1.00", "target", "2", "NOT", "met"]
    assert lines[3] == 'config {"reps": 7}'
    assert len(lines) == 4
    harness.print_figures(out, as_json=True)
    assert json.loads(capsys.readouterr().out) == out
