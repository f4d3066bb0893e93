"""The command line's habits: `--version`, defaults in `--help`, `run` options from a TOML
file and `SHARDLESS_*` variables (the command line first), `--log-level` and JSON logs.

Parsing is tested through `cli.parse_args(argv, env)`, with the environment given; nothing
here starts Spark or an emulator."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
from collections.abc import Iterator
from datetime import datetime
from importlib import metadata
from pathlib import Path

import pytest

from shardless.processor import cli
from shardless.processor.driver import settings
from shardless.processor.driver.config import JobConfig
from shardless.processor.driver.flags import job_config, option
from shardless.processor.errors import ConfigError
from tests.jobs import capture_cli_starts

RUN = ["run", "app.py"]
NEEDED = ["--app", "a", "--stream", "s"]


def run_parser() -> argparse.ArgumentParser:
    top = cli.parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["run"]


def toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


# --- --version ------------------------------------------------------------------------------


def test_version_prints_the_installed_packages_version(monkeypatch, capsys):
    with pytest.raises(SystemExit) as done:
        cli.parse_args(["--version"], env={})
    assert done.value.code == 0
    assert capsys.readouterr().out == f"shardless {metadata.version('shardless')}\n"

    monkeypatch.setattr(cli.metadata, "version", lambda name: f"9.8.7-{name}")
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out == "shardless 9.8.7-shardless\n"


# --- defaults in --help ---------------------------------------------------------------------


def help_blocks(text: str) -> dict[str, str]:
    """Each option's entry in `--help`, by its long flag, with whitespace made single."""
    blocks: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        if (m := re.match(r"^  (-\w, )?(--[\w-]+)", line)) is not None:
            flag = m.group(2)
            blocks[flag] = ""
        elif not line.strip() or not line.startswith("  "):
            flag = None
        if flag is not None:
            blocks[flag] = " ".join(f"{blocks[flag]} {line}".split())
    return blocks


def test_run_help_shows_every_options_default(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args([*RUN, "--help"], env={})
    blocks = help_blocks(capsys.readouterr().out)
    checked = 0
    for action in run_parser()._actions:
        if not settings.shows_default(action):
            continue
        block = blocks[action.option_strings[-1]]
        if "(default:" in (action.help or "").replace("%(default)s", ""):
            continue  # its help says the default in its own words (`--output`, `--bucket`)
        assert f"(default: {action.default})" in block, block
        checked += 1
    assert checked >= 20
    assert "(default: 32)" in blocks["--snapshot-every"]
    assert "(default: worker)" in blocks["--snapshot-uploads"]  # "(default)" in its help
    assert "(default: INFO)" in blocks["--log-level"]
    assert "(default: text)" in blocks["--log-format"]
    assert "(required)" in blocks["--app"] and "(required)" in blocks["--stream"]


def test_an_option_without_help_shows_its_default_too(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["produce", "--help"], env={})
    assert "(default: 100000)" in help_blocks(capsys.readouterr().out)["--events"]


# --- the environment and the file -------------------------------------------------------------


def test_a_shardless_variable_sets_a_run_option():
    args = cli.parse_args(
        [*RUN],
        env={
            "SHARDLESS_APP": "clicks",
            "SHARDLESS_STREAMS": "a, b",
            "SHARDLESS_SNAPSHOT_EVERY": "16",
            "SHARDLESS_TRANSFER_PROCESS_MB": "8",
            "SHARDLESS_ON_TRIMMED": "oldest",
            "SHARDLESS_ALLOW_RECOUNT": "yes",
            "SHARDLESS_MASTER": "local[1]",
            "SHARDLESS_GROUPS": "",  # empty: unset
        },
    )
    assert (args.app, args.streams, args.snapshot_every) == ("clicks", ["a", "b"], 16)
    assert args.transfer_process_mb == 8.0 and isinstance(args.transfer_process_mb, float)
    assert (args.on_trimmed, args.allow_recount, args.master) == ("oldest", True, "local[1]")
    assert args.groups == 0  # the default: one group per task slot
    assert args.set_by["snapshot_every"] == "SHARDLESS_SNAPSHOT_EVERY"
    cfg = job_config(args, checkpoint="/ck", local_dir="/stores")
    assert (cfg.streams, cfg.snapshot_every, cfg.allow_recount) == (("a", "b"), 16, True)


def test_a_toml_file_sets_a_run_option(tmp_path):
    path = toml(
        tmp_path,
        'app = "clicks"\nstream = ["a", "b"]\nsnapshot-every = 16\ntransfer_process_mb = 8\n'
        'allow_recount = true\nlog_level = "debug"\ntrigger = "5 seconds"\n',
    )
    args = cli.parse_args([*RUN, "--config", path], env={})
    assert (args.app, args.streams, args.snapshot_every) == ("clicks", ["a", "b"], 16)
    assert args.transfer_process_mb == 8.0 and args.allow_recount
    assert (args.log_level, args.trigger) == ("DEBUG", "5 seconds")
    assert args.set_by["snapshot_every"] == f"{path}: snapshot-every"
    assert cli.parse_args([*RUN], env={"SHARDLESS_CONFIG": path}).snapshot_every == 16


@pytest.mark.parametrize("field", dataclasses.fields(JobConfig), ids=lambda f: f.name)
def test_every_jobconfig_field_has_its_variable_and_key(field, tmp_path):
    """Named after the field (`SHARDLESS_FIELD`, `field` or `field-name`) and converted by
    its flag's type: a new field needs nothing more."""
    action = next(a for a in run_parser()._actions if a.dest == field.name)
    if action.nargs == 0:
        text, want = "true", True
    elif action.choices:
        text = want = action.choices[-1]
    elif action.type in (int, float):
        text, want = "7", action.type("7")
    else:
        text, want = "x", ["x"] if field.name == "streams" else "x"
    base = [*RUN] + [a for a in NEEDED if field.name not in ("app", "streams")]
    if field.name == "streams":
        base += ["--app", "a"]
    if field.name == "app":
        base += ["--stream", "s"]
    env = {settings.env_name(field.name): text}
    assert getattr(cli.parse_args(base, env=env), field.name) == want
    key = option(field)[2:]  # the flag's name: `snapshot-every`, `stream`
    quoted = text if action.nargs == 0 or action.type in (int, float) else f'"{text}"'
    args = cli.parse_args([*base, "--config", toml(tmp_path, f"{key} = {quoted}\n")], env={})
    assert getattr(args, field.name) == want


def test_the_command_line_beats_the_environment_which_beats_the_file(tmp_path):
    path = toml(tmp_path, 'groups = 2\nstreams = ["from-file"]\nlog_level = "ERROR"\n')
    env = {"SHARDLESS_GROUPS": "3", "SHARDLESS_STREAMS": "from-env", "SHARDLESS_CONFIG": path}

    def parsed(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
        return cli.parse_args([*RUN, "--app", "a", *argv], env=env)

    assert parsed(["--groups", "4", "--stream", "s"], env).groups == 4
    assert parsed(["--groups", "0"], env).groups == 0  # given, though equal to the default
    assert parsed([], env).groups == 3
    assert parsed([], {"SHARDLESS_CONFIG": path}).groups == 2
    assert parsed(["--stream", "s"], {}).groups == 0
    # a repeated flag replaces the environment's list, which replaces the file's
    assert parsed(["--stream", "s", "--stream", "t"], env).streams == ["s", "t"]
    assert parsed([], env).streams == ["from-env"]
    assert parsed([], {"SHARDLESS_CONFIG": path}).streams == ["from-file"]
    # --log-level before `run` or after it, over the variable, over the file
    env["SHARDLESS_LOG_LEVEL"] = "warning"
    assert cli.parse_args(["--log-level", "debug", *RUN, "--app", "a"], env=env).log_level == (
        "DEBUG"
    )
    assert parsed(["--log-level", "debug"], env).log_level == "DEBUG"
    assert parsed([], env).log_level == "WARNING"
    assert parsed([], {"SHARDLESS_CONFIG": path}).log_level == "ERROR"
    assert cli.parse_args(["state", "ls", "--app", "a"], env=env).log_level == "WARNING"


def test_options_that_exclude_each_other_follow_the_precedence_too(tmp_path):
    env = {"SHARDLESS_TRIGGER": "5 seconds"}
    args = cli.parse_args([*RUN, *NEEDED, "--available-now"], env=env)
    assert (args.available_now, args.trigger) == (True, None)
    args = cli.parse_args(
        [*RUN, *NEEDED, "--config", toml(tmp_path, "available_now = true\n")], env=env
    )
    assert (args.available_now, args.trigger) == (False, "5 seconds")
    with pytest.raises(ConfigError, match="SHARDLESS_AVAILABLE_NOW and SHARDLESS_TRIGGER"):
        cli.parse_args([*RUN, *NEEDED], env={**env, "SHARDLESS_AVAILABLE_NOW": "1"})


# --- refusals -----------------------------------------------------------------------------------


@pytest.fixture
def nothing_runs(monkeypatch) -> list[argparse.Namespace]:
    """`shardless run`'s work replaced by a note that it was called."""
    called: list[argparse.Namespace] = []
    monkeypatch.setattr(cli, "_run", lambda args: called.append(args) or 0)
    return called


def test_an_unknown_key_in_the_file_is_refused_before_anything_runs(tmp_path, nothing_runs, capsys):
    path = toml(tmp_path, "app = 'a'\nsnapshot_evry = 16\n")
    assert cli.main([*RUN, "--stream", "s", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shardless: {path}: unknown key 'snapshot_evry'")
    assert "did you mean 'snapshot_every'?" in err
    assert "snapshot_every" in err.split("the keys are", 1)[1]  # what is allowed
    assert not nothing_runs


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"SHARDLESS_GROUPS": "eight"},
            "SHARDLESS_GROUPS: 'eight' is not an integer (the value of --groups)",
        ),
        (
            {"SHARDLESS_ON_TRIMMED": "skip"},
            "SHARDLESS_ON_TRIMMED: 'skip' is not one of fail, oldest (the value of --on-trimmed)",
        ),
        ({"SHARDLESS_ALLOW_RECOUNT": "maybe"}, "SHARDLESS_ALLOW_RECOUNT: 'maybe' is not true or"),
        (
            {"SHARDLESS_LOG_LEVEL": "loud"},
            "SHARDLESS_LOG_LEVEL: 'loud' is not one of DEBUG, INFO, WARNING, ERROR",
        ),
        ({"SHARDLESS_STREAMS": " , "}, "SHARDLESS_STREAMS: ' , ': give one or more names"),
    ],
)
def test_a_bad_variable_is_refused_naming_it_and_what_is_allowed(
    env, message, monkeypatch, nothing_runs, capsys
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main([*RUN, "--app", "a"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shardless: {message}") and err.count("\n") == 1, err
    assert not nothing_runs


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("groups = 'eight'", "groups: 'eight' is not an integer (the value of --groups)"),
        ("groups = 2.5", "groups: '2.5' is not an integer"),
        ("groups = [2]", "groups: [2] is not a single value"),
        ("on-trimmed = 'skip'", "on-trimmed: 'skip' is not one of fail, oldest"),
        ("groups = 2\ngroups_ = 3", "unknown key 'groups_'"),
        ("groups = 2\n[run]\nslices = 4", "unknown key 'run'"),
        ("snapshot_every = 2\nsnapshot-every = 3", "'snapshot_every' and 'snapshot-every' set"),
        ("groups = ", "not valid TOML"),
    ],
)
def test_a_bad_value_in_the_file_is_refused_naming_file_and_key(tmp_path, text, message):
    path = toml(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as refused:
        cli.parse_args([*RUN, *NEEDED, "--config", path], env={})
    assert path in str(refused.value)
    assert message in str(refused.value)


def test_a_missing_config_file_and_a_missing_required_option_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--config .*nope.toml: cannot read it"):
        cli.parse_args([*RUN, *NEEDED, "--config", str(tmp_path / "nope.toml")], env={})
    with pytest.raises(ConfigError, match="missing --app: give it .* as SHARDLESS_APP"):
        cli.parse_args([*RUN, "--stream", "s"], env={})


def test_a_value_jobconfig_refuses_names_the_variable_it_came_from(tmp_path, capsys):
    app = tmp_path / "app.py"
    app.write_text("def process(event, ctx):\n    pass\n")
    env = {"SHARDLESS_SNAPSHOT_EVERY": "0", "SHARDLESS_LOCAL_DIR": str(tmp_path / "stores")}
    args = cli.parse_args(["run", str(app), *NEEDED, "--checkpoint", str(tmp_path / "ck")], env)
    with pytest.raises(ConfigError) as refused:
        cli._run(args)
    assert str(refused.value).startswith("--snapshot-every 0: must be between 1 and 1000")
    assert str(refused.value).endswith("[snapshot_every set by SHARDLESS_SNAPSHOT_EVERY]")


def test_main_runs_what_the_file_and_environment_configure(tmp_path, monkeypatch):
    seen = capture_cli_starts(monkeypatch)
    app = tmp_path / "app.py"
    app.write_text("def process(event, ctx):\n    pass\n")
    path = toml(tmp_path, f'app = "clicks"\nstreams = ["s"]\ncheckpoint = "{tmp_path / "ck"}"\n')
    monkeypatch.setenv("SHARDLESS_LOCAL_DIR", str(tmp_path / "stores"))
    monkeypatch.setenv("SHARDLESS_KEEP_SNAPSHOTS", "5")
    assert cli.main(["run", str(app), "--config", path, "--groups", "4"]) == 0
    cfg = seen[-1]
    assert (cfg.app, cfg.streams, cfg.keep_snapshots, cfg.groups) == ("clicks", ("s",), 5, 4)
    assert cfg.local_dir == str(tmp_path / "stores")


# --- logging ----------------------------------------------------------------------------------


@pytest.fixture
def root_logging() -> Iterator[None]:
    """The root logger's handlers and level, and the quieted libraries' levels, put back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    quiet = {name: logging.getLogger(name).level for name in cli._NOISY}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, was in quiet.items():
        logging.getLogger(name).setLevel(was)


def json_lines(text: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in text.splitlines()]


def test_json_logs_are_one_object_a_line_with_time_level_logger_message(root_logging, capsys):
    cli.configure_logging("INFO", "json")
    log = logging.getLogger("shardless.processor.cli")
    log.debug("not at INFO")
    log.info("started %s\nsecond line", "job")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("batch %d failed", 7)
    first, second = json_lines(capsys.readouterr().err)
    assert set(first) == {"time", "level", "logger", "message"}
    assert (first["level"], first["logger"]) == ("INFO", "shardless.processor.cli")
    assert first["message"] == "started job\nsecond line"
    assert datetime.fromisoformat(first["time"]).utcoffset().total_seconds() == 0
    assert (second["level"], second["message"]) == ("ERROR", "batch 7 failed")
    assert second["exception"].startswith("Traceback (most recent call last):")
    assert second["exception"].endswith("ValueError: boom")


def test_main_sets_the_log_level_and_format_from_flags_or_the_environment(
    root_logging, monkeypatch, capsys
):
    def demo(_: argparse.Namespace) -> int:
        logging.getLogger("shardless.demo").info("info line")
        logging.getLogger("shardless.demo").warning("warning line")
        logging.getLogger("botocore").info("library chatter")
        return 0

    monkeypatch.setattr(cli, "_demo", demo)
    assert cli.main(["--log-format", "json", "--log-level", "debug", "demo"]) == 0
    lines = json_lines(capsys.readouterr().err)
    assert [(e["level"], e["message"]) for e in lines] == [
        ("INFO", "info line"),
        ("WARNING", "warning line"),
    ]
    monkeypatch.setenv("SHARDLESS_LOG_FORMAT", "json")
    monkeypatch.setenv("SHARDLESS_LOG_LEVEL", "WARNING")
    assert cli.main(["demo"]) == 0
    assert [e["message"] for e in json_lines(capsys.readouterr().err)] == ["warning line"]
    assert cli.main(["--log-format", "text", "demo"]) == 0
    err = capsys.readouterr().err
    assert "WARNING shardless.demo: warning line" in err and not err.startswith("{")
