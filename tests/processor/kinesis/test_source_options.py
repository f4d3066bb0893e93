"""The source options a job passes: JobConfig validation, `source_options()`, the `shardless
run` flags, and their effect (an endpoint of its own for Kinesis, corrupt KPL aggregates
skipped through the whole job)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from shardless.changelog.layout import AppLocation
from shardless.processor import cli
from shardless.processor.driver.config import JobConfig
from shardless.processor.errors import ConfigError
from shardless.processor.kinesis.kpl import MAGIC
from shardless.processor.kinesis.source import KinesisStreamReader
from tests.jobs import capture_cli_starts, job_config


def config(**fields: object) -> JobConfig:
    return JobConfig(app="app", streams=("a", "b"), checkpoint="/tmp/ck", **fields)


def test_defaults_pass_every_source_option_but_an_endpoint():
    assert config().source_options() == {
        "streams": "a,b",
        "table": "shardless-app",
        "slices": "256",
        "startingPosition": "TRIM_HORIZON",
        "maxRecordsPerShard": "10000",
        "maxBytesPerShard": str(10 * 1024 * 1024),
        "idlePollMs": "1000",
        "onTrimmed": "fail",
        "onCorruptAggregate": "fail",
    }


def test_set_options_reach_the_source_reader():
    cfg = config(
        starting_position="COMMITTED",
        max_records_per_shard=500,
        max_bytes_per_shard=65536,
        idle_poll_ms=250,
        on_trimmed="oldest",
        on_corrupt_aggregate="skip",
        kinesis_endpoint="http://127.0.0.1:4567",
        consumer_name="clicks-efo",
    )
    options = cfg.source_options()
    assert options["kinesisEndpoint"] == "http://127.0.0.1:4567"
    assert options["consumerName"] == "clicks-efo"
    assert KinesisStreamReader(options).consumer_name == "clicks-efo"
    source = KinesisStreamReader(options)
    assert (source.starting, source.max_records, source.max_bytes, source.idle_poll_s) == (
        "COMMITTED",
        500,
        65536,
        0.25,
    )
    assert (source.on_trimmed, source.on_corrupt, source.endpoint) == (
        "oldest",
        "skip",
        "http://127.0.0.1:4567",
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"on_trimmed": "skip"}, "--on-trimmed 'skip': use fail"),
        ({"on_corrupt_aggregate": "oldest"}, "--on-corrupt-aggregate 'oldest': use fail"),
        ({"kinesis_endpoint": "localhost:4567"}, "--kinesis-endpoint 'localhost:4567': expected"),
        ({"kinesis_endpoint": "ftp://host"}, "expected an http:// or https:// URL"),
        ({"consumer_name": "my consumer"}, "--consumer-name 'my consumer': a Kinesis consumer"),
        ({"starting_position": "EARLIEST"}, "--starting-position: startingPosition 'EARLIEST'"),
        ({"starting_position": "AT_TIMESTAMP:soon"}, "AT_TIMESTAMP:<epoch seconds or ISO"),
        ({"max_records_per_shard": 0}, "--max-records-per-shard 0: must be a positive"),
        ({"max_bytes_per_shard": -1}, "--max-bytes-per-shard -1: must be a positive"),
        ({"idle_poll_ms": 0}, "--idle-poll-ms 0: must be a positive"),
    ],
)
def test_bad_source_options_are_refused_naming_the_flag(fields: dict, message: str):
    with pytest.raises(ConfigError) as info:
        config(**fields)
    assert message in str(info.value)


def test_committed_and_the_other_positions_are_accepted():
    for spec in ("COMMITTED", "committed", "LATEST", "TRIM_HORIZON", "AT_TIMESTAMP:1700000000"):
        assert config(starting_position=spec).source_options()["startingPosition"] == spec


def test_the_run_command_passes_its_source_flags_into_the_job(tmp_path, monkeypatch, capsys):
    seen = capture_cli_starts(monkeypatch)
    app = tmp_path / "app.py"
    app.write_text("def process(event, ctx):\n    pass\n")
    base = ["run", str(app), "--app", "x", "--stream", "s", "--checkpoint", str(tmp_path)]
    assert cli.main(base) == 0
    assert seen[-1].source_options() == {
        **config().source_options(),
        "streams": "s",
        "table": "shardless-x",
    }
    flags = [
        "--starting-position", "COMMITTED", "--max-bytes-per-shard", "1024",
        "--idle-poll-ms", "200", "--on-trimmed", "oldest", "--on-corrupt-aggregate", "skip",
        "--kinesis-endpoint", "https://kinesis.eu-west-1.amazonaws.com",
    ]  # fmt: skip
    assert cli.main(base + flags) == 0
    cfg = seen[-1]
    assert (cfg.starting_position, cfg.max_bytes_per_shard, cfg.idle_poll_ms) == (
        "COMMITTED",
        1024,
        200,
    )
    assert (cfg.on_trimmed, cfg.on_corrupt_aggregate, cfg.kinesis_endpoint) == (
        "oldest",
        "skip",
        "https://kinesis.eu-west-1.amazonaws.com",
    )
    # a bad value is one line naming the flag, exit code 2
    assert cli.main([*base, "--kinesis-endpoint", "kinesis:443"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "--kinesis-endpoint 'kinesis:443': expected an http:// or https:// URL such as "
            "http://127.0.0.1:4567"
        )
    )
    with pytest.raises(SystemExit):
        cli.main([*base, "--on-trimmed", "later"])
    assert "invalid choice: 'later'" in capsys.readouterr().err


def test_prepare_reaches_kinesis_at_the_configured_endpoint(
    aws, make_stream, location, tmp_path, monkeypatch
):
    from shardless.processor.driver.job import prepare

    stream = make_stream(1)
    monkeypatch.setenv("AWS_ENDPOINT_URL_KINESIS", "http://127.0.0.1:9")
    cfg = JobConfig(
        app=location.app,
        streams=(stream,),
        checkpoint=str(tmp_path),
        slices=16,
        kinesis_endpoint=aws.kinesis_endpoint,
    )
    prepare(cfg)  # finds the stream through the option, not the environment
    monkeypatch.setenv("AWS_ENDPOINT_URL_KINESIS", aws.kinesis_endpoint)
    dead = JobConfig(
        app=location.app,
        streams=(stream,),
        checkpoint=str(tmp_path),
        slices=16,
        kinesis_endpoint="http://127.0.0.1:9",
    )
    with pytest.raises(ConfigError, match="cannot reach Kinesis at http://127.0.0.1:9.*--kinesis"):
        prepare(dead)


@pytest.mark.slow
def test_a_job_with_on_corrupt_aggregate_skip_drops_only_the_corrupt_record(
    spark, kinesis, make_stream: Callable[[int], str], location: AppLocation, tmp_path: Path
):
    from shardless.processor.api.handlers import HandlerFactory
    from shardless.processor.driver.job import start

    stream = make_stream(1)
    keys = [f"k{i}" for i in range(20)]
    kinesis.put_records(
        StreamName=stream, Records=[{"PartitionKey": k, "Data": b"{}"} for k in keys[:10]]
    )
    kinesis.put_record(
        StreamName=stream, PartitionKey="agg", Data=MAGIC + b"\x0a\x05ab" + bytes(16)
    )
    kinesis.put_records(
        StreamName=stream, Records=[{"PartitionKey": k, "Data": b"{}"} for k in keys[10:]]
    )

    def process(event, ctx) -> None:  # noqa: ANN001
        ctx.emit({"key": event.key})

    seen: list[str] = []

    def sink(df, batch_id: int) -> None:  # noqa: ANN001
        seen.extend(json.loads(r.value)["key"] for r in df.collect())

    def run(policy: str, name: str):  # noqa: ANN202
        cfg = job_config(
            location,
            (stream,),
            tmp_path,
            checkpoint=name,
            on_corrupt_aggregate=policy,
            kinesis_endpoint=kinesis.meta.endpoint_url,
        )
        query = start(spark, HandlerFactory(process), cfg, sink=sink, available_now=True)
        with contextlib.suppress(Exception):  # a failed query raises here; asked below
            query.awaitTermination(240)
        return query

    failed = run("fail", "ck-fail")
    assert failed.exception() is not None
    assert "corrupt KPL aggregate" in str(failed.exception()) and seen == []
    run("skip", "ck-skip")
    assert sorted(seen) == sorted(keys)
