"""The docs keep up with the code.

- every option of `shardless run` (with its default), of the other commands, every
  `JobConfig` field (with its default) and every source option is in docs/configuration.md;
- every `shardless state` command and its options are in docs/operations.md;
- the error messages an operator meets are in docs/troubleshooting.md, and still printed
  by the code as the page quotes them;
- the README links every page of docs/, and its "How fast" table quotes the recorded
  bench/results/vs_spark.json.

Adding an option, a field or a command without documenting it fails here.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from shardless.processor import cli
from shardless.processor.driver.config import JobConfig
from shardless.processor.kinesis import source

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CONFIGURATION = (DOCS / "configuration.md").read_text()
OPERATIONS = (DOCS / "operations.md").read_text()
TROUBLESHOOTING = (DOCS / "troubleshooting.md").read_text()
README = (ROOT / "README.md").read_text()
CODE = "\n".join(
    path.read_text()
    for pkg in ("processor", "changelog", "state")
    for path in (ROOT / pkg).rglob("*.py")
)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> dict[str, object]:
    """A command's long options and their defaults (help left out)."""
    return {
        name: action.default
        for action in parser._actions
        for name in action.option_strings
        if name.startswith("--") and name != "--help"
    }


def named(text: str, option: str) -> bool:
    """Whether `option` appears in the text in backticks, as itself (`--slices`, not a
    longer option that starts with it)."""
    return re.search(rf"`{re.escape(option)}(?![\w-])", text) is not None


def shown(default: object) -> str:
    """A default as the docs write it."""
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


COMMANDS = subcommands(cli.parser())
RUN = options(COMMANDS["run"])
STATE = subcommands(COMMANDS["state"])


@pytest.mark.parametrize("option", sorted(RUN))
def test_every_run_option_is_in_configuration_with_its_default(option):
    rows = [line for line in CONFIGURATION.splitlines() if line.startswith(f"| `{option}")]
    assert rows, f"docs/configuration.md has no table row for `shardless run {option}`"
    default = RUN[option]
    if default not in (None, False):
        assert shown(default) in rows[0], f"{option}: default {default!r} not in {rows[0]!r}"


@pytest.mark.parametrize(
    "command, option",
    [
        (f"{name} {sub}" if sub else name, option)
        for name, sub, parser in (
            ("local", "up", subcommands(COMMANDS["local"])["up"]),
            ("local", "down", subcommands(COMMANDS["local"])["down"]),
            ("produce", "", COMMANDS["produce"]),
        )
        for option in sorted(options(parser))
    ],
)
def test_every_option_of_the_other_commands_is_in_configuration(command, option):
    assert f"shardless {command}" in CONFIGURATION
    assert named(CONFIGURATION, option), f"`shardless {command} {option}` is not documented"


def test_every_command_is_documented():
    for name in COMMANDS:
        where = OPERATIONS if name == "state" else CONFIGURATION
        assert f"shardless {name}" in where, name


@pytest.mark.parametrize("field", dataclasses.fields(JobConfig), ids=lambda f: f.name)
def test_every_jobconfig_field_is_in_configuration_with_its_default(field):
    rows = [line for line in CONFIGURATION.splitlines() if line.startswith(f"| `{field.name}` |")]
    assert rows, f"docs/configuration.md has no table row for JobConfig.{field.name}"
    if field.default is not dataclasses.MISSING:
        assert shown(field.default) in rows[0], f"{field.name}: default {field.default!r}"


def source_options_in_docstring() -> list[str]:
    """The option names listed under "Options:" in processor/kinesis/source.py."""
    block = source.__doc__.split("Options:", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^  (\w+)\s", block, flags=re.MULTILINE)


def test_every_source_option_is_in_configuration():
    listed = source_options_in_docstring()
    everything = JobConfig(
        app="a", streams=("s",), checkpoint="/tmp/c", kinesis_endpoint="http://127.0.0.1:1"
    ).source_options()
    assert set(everything) <= set(listed), "the source's docstring misses an option"
    for name in listed:
        assert re.search(rf"^\| `{name}` \|", CONFIGURATION, re.MULTILINE), name


@pytest.mark.parametrize("command", sorted(STATE))
def test_every_state_command_and_option_is_in_operations(command):
    assert re.search(rf"shardless state {command}\b", OPERATIONS), command
    rows = [line for line in OPERATIONS.splitlines() if line.startswith(f"| `{command}` |")]
    common = {"--app", "--bucket", "--table", "--prefix", "--json"}
    for option in sorted(set(options(STATE[command])) - common):
        assert rows and named(rows[0], option), f"`shardless state {command} {option}`"
    for option in common:
        assert named(OPERATIONS, option)


# The start of each message as the code prints it (a piece of one string literal): the
# errors an operator is most likely to meet, from the Makefile's to the state tools'.
MESSAGES = [
    "handler failed on record ",
    "on_timer failed for key ",
    " decoder cannot read record ",
    "cannot reach Kinesis at ",
    "emulators (`shardless local up`) or fix AWS_ENDPOINT_URL_S3",
    " does not exist at this endpoint: create it, or ",
    " keeps its state in ",
    " does not exist and this role may not create",
    "no access to bucket s3://",
    "no access to DynamoDB table ",
    "cannot encode a value of type ",
    ": encoded value is ",
    ": stored value is pickled, and this application does not ",
    "; the checkpoint is older than the state",
    " lost to another writer (a retried, speculative, ",
    ": section checksum mismatch; refusing to load",
    " is referenced by committed state but missing from the bucket",
    "refusing to restore a ",
    " is gone (stream deleted, or the position ",
    "than the stream's retention of ",
    ": replay found ",
    "corrupt KPL aggregate at ",
    "Kinesis no longer lists shards the source had not finished",
    "Kinesis refuses the source's position (after ",
    " (this checkpoint) may no longer work on application ",
    "this checkpoint is stale; start a NEW checkpoint ",
    " looks running: ",
    " has no recorded progress ",
    ": importing the app failed: ",
    "define a function `process(event, ctx)`",
    " dead letters to s3://",
    " could not be put into ",
    " has no state: table ",
    " is not retained (restorable: ",
    "node not found on PATH: install Node 18+",
    "emulators may be running; run 'shardless local down' first",
    " unprocessed after ",
]


@pytest.mark.parametrize("message", MESSAGES)
def test_troubleshooting_quotes_the_messages_the_code_prints(message):
    assert message in CODE, f"the code no longer prints {message!r}: update troubleshooting.md"
    assert message in TROUBLESHOOTING, f"docs/troubleshooting.md has no entry for {message!r}"


def test_the_readme_links_every_doc():
    for page in sorted(DOCS.glob("*.md")):
        assert f"docs/{page.name}" in README, f"README.md does not link docs/{page.name}"


def test_the_readme_gives_the_two_commands_and_the_prerequisites():
    for text in ("make demo", "make test", "Python 3.11+", "Java 17+", "Node 18+"):
        assert text in README, text


def test_the_readmes_figures_are_the_recorded_benchmarks():
    """README.md's "How fast" table quotes bench/results/vs_spark.json: a rerun of
    `make bench` that is committed without the README fails here."""
    import json

    result = json.loads((ROOT / "bench" / "results" / "vs_spark.json").read_text())
    assert "also_batch" in result, "vs_spark.json was not run as `make bench` runs it"
    rows = {
        "shardless, a Python handler per record": "shardless",
        "`applyInPandasWithState`": "apply_in_pandas_with_state",
        "`transformWithStateInPandas`": "transform_with_state_in_pandas",
        "Spark SQL `groupBy(key).count()` (JVM, no Python)": "spark_sql_count",
        "floor: the same records carried to a Python function that does nothing": "python_floor",
    }
    workloads = ("uniform_1m", "zipf_1m", "small_1k")
    table = {
        cells[0]: cells[1:]
        for line in README.splitlines()
        if line.startswith("| ") and (cells := [c.strip() for c in line.strip("|").split("|")])
    }
    for label, contender in rows.items():
        assert label in table, f"README.md's How fast table has no row {label!r}"
        for cell, w in zip(table[label], workloads, strict=True):
            want = (
                f"{result['workloads'][w][contender]:,} / "
                f"{result['also_batch']['workloads'][w][contender]:,}"
            )
            assert cell.strip("*") == want, f"README.md: {label} on {w}: {cell}, recorded {want}"
