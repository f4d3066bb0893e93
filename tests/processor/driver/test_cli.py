"""The `shardless` command line, called in-process through `shardless.processor.cli.main`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from shardless.processor import cli
from shardless.processor.local import emulators as local_aws
from tests.processor.local.test_local_aws import _alive


def _exports(stdout: str) -> dict[str, str]:
    found = {}
    for line in stdout.splitlines():
        assert line.startswith("export "), line
        name, _, value = line[len("export ") :].partition("=")
        found[name] = value
    return found


@pytest.fixture
def state_file(tmp_path: Path) -> Iterator[Path]:
    """Where `local up` keeps its state; whatever a failed test left running is stopped."""
    state = tmp_path / "state" / "local.json"
    yield state
    if state.exists():
        local_aws.LocalAws.from_json(state.read_text()).stop()


def test_local_up_then_down(state_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["local", "up", "--state-file", str(state_file)]) == 0
    out = capsys.readouterr()
    env = _exports(out.out)
    assert env["AWS_ENDPOINT_URL_KINESIS"].startswith("http://127.0.0.1:")
    assert env["AWS_ENDPOINT_URL_S3"].startswith("http://127.0.0.1:")
    assert env["AWS_ENDPOINT_URL_DYNAMODB"].startswith("http://127.0.0.1:")
    assert env["AWS_ACCESS_KEY_ID"] and env["AWS_DEFAULT_REGION"]
    assert "local down" in out.err

    state = json.loads(state_file.read_text())
    assert state["kinesis_endpoint"] == env["AWS_ENDPOINT_URL_KINESIS"]
    assert state["dynamodb_endpoint"] == env["AWS_ENDPOINT_URL_DYNAMODB"]
    pids = state["pids"]
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    kinesis = boto3.session.Session().client(
        "kinesis",
        endpoint_url=env["AWS_ENDPOINT_URL_KINESIS"],
        region_name=env["AWS_DEFAULT_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        config=Config(retries={"total_max_attempts": 1}, proxies={}),
    )
    assert kinesis.list_streams()["StreamNames"] == []
    dynamodb = boto3.session.Session().client(
        "dynamodb",
        endpoint_url=env["AWS_ENDPOINT_URL_DYNAMODB"],
        region_name=env["AWS_DEFAULT_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        config=Config(retries={"total_max_attempts": 1}, proxies={}),
    )
    assert "TableNames" in dynamodb.list_tables()

    # A second `up` on the same state file refuses and leaves the first one alone.
    saved = state_file.read_text()
    assert cli.main(["local", "up", "--state-file", str(state_file)]) == 1
    refused = capsys.readouterr()
    assert str(state_file) in refused.out + refused.err
    assert "export" not in refused.out
    assert state_file.read_text() == saved
    assert all(_alive(pid) for pid in pids)

    assert cli.main(["local", "down", "--state-file", str(state_file)]) == 0
    assert not state_file.exists()
    assert not any(_alive(pid) for pid in pids)

    # Nothing left to stop: `down` again says so and succeeds.
    capsys.readouterr()
    assert cli.main(["local", "down", "--state-file", str(state_file)]) == 0
    assert "nothing started" in capsys.readouterr().err


def test_run_with_a_missing_app_file_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)

    code = cli.main(["run", "missing.py", "--app", "a", "--stream", "s"])

    assert code == 2
    err = capsys.readouterr().err
    assert "missing.py" in err
    assert "does not exist" in err


def test_run_with_an_app_file_without_process_names_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    app = tmp_path / "no_process_app.py"
    app.write_text("def handle(event, ctx):\n    return []\n")

    code = cli.main(["run", str(app), "--app", "a", "--stream", "s"])

    assert code == 2
    err = capsys.readouterr().err
    assert str(app) in err
    assert "`process" in err


def test_refused_local_up_writes_nothing_to_stdout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "local.json"
    state.write_text("{}")  # as if `local up` had run; nothing is started when it refuses

    assert cli.main(["local", "up", "--state-file", str(state)]) == 1

    out = capsys.readouterr()
    assert str(state) in out.err
    assert out.out == ""


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("snapshot_every", 0, "--snapshot-every 0: must be between 1 and 1000"),
        ("snapshot_every", 5000, "400 KB"),
        ("snapshot_log_mb", 0, "--snapshot-log-mb 0"),
        ("keep_snapshots", 0, "--keep-snapshots 0"),
        ("transfer_process_mb", -1, r"--transfer-process-mb -1: must be between 0 \(every"),
        ("snapshot_uploads", "s3", r"--snapshot-uploads 's3': use worker \(threads of"),
    ],
)
def test_snapshot_options_are_checked(option, value, message):
    from shardless.processor.driver.config import JobConfig
    from shardless.processor.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        JobConfig(app="a", streams=("s",), checkpoint="/tmp/c", **{option: value})


def test_the_cause_of_a_failed_run_is_the_last_shardless_error_in_sparks_text():
    from shardless.processor.cli import our_error

    text = """pyspark.errors.exceptions.captured.StreamingQueryException: [STREAM_FAILED] ...
Traceback (most recent call last):
  File "/x/processor/task.py", line 70, in run_slice
ValueError: boom
The above exception was the direct cause of the following exception:
shardless.processor.errors.ProcessorError: handler failed on s/0/1: ValueError: boom
	at org.apache.spark.api.python.BasePythonRunner...
shardless.processor.runtime.dead_letter.DeadLetterError: cannot write 2 dead letters: NoSuchBucket
"""
    assert our_error(text) == "cannot write 2 dead letters: NoSuchBucket"
    assert our_error(text.rsplit("\n", 2)[0]) == ("handler failed on s/0/1: ValueError: boom")
    assert our_error("java.lang.RuntimeException: nothing of ours") is None


def test_run_leaves_the_master_to_spark_submit_unless_given(monkeypatch):
    from shardless.processor.driver import spark as spark_mod

    assert cli.parser().parse_args(["run", "app.py", "--app", "a", "--stream", "s"]).master is None
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "1234")
    assert spark_mod.launched_by_spark_submit()
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT")
    assert not spark_mod.launched_by_spark_submit()


def _run_args(*extra: str):  # noqa: ANN202
    run = dict(next(a for a in cli.parser()._actions if a.dest == "command").choices)["run"]
    return run.parse_args(["app.py", "--app", "a", "--stream", "s", *extra])


def test_every_jobconfig_field_has_its_run_flag_with_the_fields_default(tmp_path):
    """`shardless run`'s flags are made from JobConfig's fields: parsing no options gives
    the JobConfig of the fields' own defaults, and each field's flag sets that field."""
    import dataclasses

    from shardless.processor.driver.config import JobConfig
    from shardless.processor.driver.flags import job_config, option

    local = str(tmp_path / "stores")
    plain = job_config(_run_args("--local-dir", local), checkpoint="/ck")
    assert plain == JobConfig("a", ("s",), "/ck", local_dir=local)
    changed = {"slices": "64", "groups": "4", "bucket": "b", "timer_poll_ms": "250"}
    for f in dataclasses.fields(JobConfig):
        if f.name in changed:
            args = _run_args("--local-dir", local, option(f), changed[f.name])
            cfg = job_config(args, checkpoint="/ck")
            assert str(getattr(cfg, f.name)) == changed[f.name], f.name
    assert job_config(_run_args("--allow-recount"), checkpoint="/ck").allow_recount
    two = job_config(_run_args("--stream", "t"), checkpoint="/ck")
    assert two.streams == ("s", "t")
