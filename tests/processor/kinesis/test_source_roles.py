"""Cross-account streams: the source's Kinesis clients under the source role and the state's
under the state role, independent of each other, configured as flags, variables or TOML keys,
and reaching Spark's Python processes.

moto serves STS and Kinesis over the same HTTP endpoint as S3 and DynamoDB, and puts each
request in the account of the role whose credentials signed it: a stream or a table is found
only by clients signing as a role of its account. (kinesalite, the suite's Kinesis, ignores
credentials, so these tests read streams from moto.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from shardless.changelog import aws as clients
from shardless.changelog.layout import AppLocation
from shardless.processor import cli
from shardless.processor.driver.config import JobConfig
from shardless.processor.errors import ConfigError
from shardless.processor.kinesis.client import kinesis_client, source_role
from tests.changelog.test_aws_roles import STATE_ACCOUNT, role_arn
from tests.jobs import ROLE_VARIABLES, capture_cli_starts

STREAM_ACCOUNT = "222222222222"


def in_account(account: str) -> boto3.session.Session:
    """A session signing as some role of `account` (another role than the job's)."""
    return clients.role_session(clients.Role(role_arn("setup", account)))


def streams_of(session: boto3.session.Session, endpoint: str) -> list[str]:
    return session.client("kinesis", endpoint_url=endpoint).list_streams()["StreamNames"]


def tables_of(session: boto3.session.Session) -> list[str]:
    return session.client("dynamodb").list_tables()["TableNames"]


def test_the_source_reads_as_its_role_and_the_state_as_its_own(sts, aws):  # noqa: ANN001
    moto = aws.s3_endpoint
    sts.setenv("SHARDLESS_SOURCE_ROLE_ARN", role_arn("reader", STREAM_ACCOUNT))
    sts.setenv("SHARDLESS_STATE_ROLE_ARN", role_arn("state", STATE_ACCOUNT))
    stream, table = f"s-{uuid.uuid4().hex[:8]}", f"t-{uuid.uuid4().hex[:8]}"

    source = kinesis_client(moto)
    source.create_stream(StreamName=stream, ShardCount=1)
    clients.client("dynamodb").create_table(
        TableName=table,
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )

    assert kinesis_client(moto) is source  # cached per endpoint and role
    assert stream in streams_of(in_account(STREAM_ACCOUNT), moto)
    assert table in tables_of(in_account(STATE_ACCOUNT))
    # neither role reaches the other's account, and neither is the process's own
    assert stream not in streams_of(clients.session(), moto)
    assert table not in tables_of(clients.role_session(source_role()))
    plain = boto3.session.Session()
    assert stream not in streams_of(plain, moto) and table not in tables_of(plain)


def test_roles_come_from_flags_variables_and_the_config_file(sts, tmp_path, monkeypatch):
    seen = capture_cli_starts(monkeypatch)
    app = tmp_path / "app.py"
    app.write_text("def process(event, ctx):\n    pass\n")
    toml = tmp_path / "job.toml"
    toml.write_text('source_role_external_id = "ext-from-file"\n')
    reader, state = role_arn("reader", STREAM_ACCOUNT), role_arn("state", STATE_ACCOUNT)
    sts.setenv("SHARDLESS_STATE_ROLE_ARN", state)
    sts.setenv("SHARDLESS_STATE_ROLE_SESSION_NAME", "nightly")
    argv = ["run", str(app), "--app", "orders", "--stream", "s", "--checkpoint", str(tmp_path)]
    assert cli.main([*argv, "--source-role-arn", reader, "--config", str(toml)]) == 0
    cfg = seen[-1]
    assert cfg.source_role == clients.Role(reader, "ext-from-file", "shardless-orders")
    assert cfg.state_role == clients.Role(state, None, "nightly")
    cfg.share_roles()  # what `start()` does first: the variables every process reads
    assert source_role() == cfg.source_role and clients.state_role() == cfg.state_role


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"state_role_arn": "arn:aws:iam::1234:role/x"},
            "--state-role-arn 'arn:aws:iam::1234:role/x': expected an IAM role ARN",
        ),
        (
            {"source_role_arn": "arn:aws:iam::123456789012:user/me"},
            "--source-role-arn 'arn:aws:iam::123456789012:user/me': expected an IAM role ARN",
        ),
        (
            {"source_role_external_id": "abc"},
            "--source-role-external-id without --source-role-arn",
        ),
        (
            {
                "state_role_arn": "arn:aws:iam::123456789012:role/x",
                "state_role_session_name": "a b",
            },
            "--state-role-arn arn:aws:iam::123456789012:role/x: session name 'a b'",
        ),
    ],
)
def test_a_bad_role_is_refused_naming_the_flag(fields: dict, message: str):
    with pytest.raises(ConfigError) as info:
        JobConfig(app="app", streams=("s",), checkpoint="/tmp/ck", **fields)
    assert message in str(info.value)


def test_a_bad_role_in_a_variable_names_the_variable(sts, tmp_path, monkeypatch, capsys):
    capture_cli_starts(monkeypatch)
    app = tmp_path / "app.py"
    app.write_text("def process(event, ctx):\n    pass\n")
    sts.setenv("SHARDLESS_STATE_ROLE_ARN", "role/state")
    argv = ["run", str(app), "--app", "orders", "--stream", "s", "--checkpoint", str(tmp_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--state-role-arn 'role/state': expected an IAM role ARN" in err
    assert err.endswith("[state_role_arn set by SHARDLESS_STATE_ROLE_ARN]")


def make_moto_stream(moto: str, keys: list[str]) -> str:
    """A two-shard stream in the source role's account on moto's Kinesis, holding `keys`."""
    stream = f"s-{uuid.uuid4().hex[:8]}"
    producer = in_account(STREAM_ACCOUNT).client("kinesis", endpoint_url=moto)
    producer.create_stream(StreamName=stream, ShardCount=2)
    for _ in range(100):
        summary = producer.describe_stream_summary(StreamName=stream)
        if summary["StreamDescriptionSummary"]["StreamStatus"] == "ACTIVE":
            break
        time.sleep(0.05)
    for lo in range(0, len(keys), 20):
        producer.put_records(
            StreamName=stream,
            Records=[{"PartitionKey": k, "Data": b"{}"} for k in keys[lo : lo + 20]],
        )
    return stream


@pytest.fixture
def restored_spark(spark, aws) -> Iterator:  # noqa: ANN001
    """The suite's session, with STS at moto in its Python processes too (as a deployment's
    STS is where its executors reach it); its environment and sources as they were after the
    test (a job with roles adds its variables to both)."""
    from shardless.processor.driver.timer_source import TimerDataSource
    from shardless.processor.kinesis.source import KinesisDataSource

    saved = dict(spark.sparkContext.environment)
    spark.sparkContext.environment["AWS_ENDPOINT_URL_STS"] = aws.s3_endpoint
    yield spark
    spark.sparkContext.environment.clear()
    spark.sparkContext.environment.update(saved)
    for source in (KinesisDataSource, TimerDataSource):
        spark.dataSource.register(source)


@pytest.mark.slow
def test_a_job_reads_a_stream_in_one_account_and_keeps_its_state_in_another(
    sts, aws, restored_spark, tmp_path: Path
):
    """The whole job on Spark with nothing but the JobConfig's roles: the stream exists only in
    the source role's account and the state only in the state role's, so a driver or executor
    process signing with any other credentials fails the job."""
    from shardless.processor.api.handlers import HandlerFactory
    from shardless.processor.driver.job import parquet_sink, start

    moto = aws.s3_endpoint
    keys = [f"user-{i % 7}" for i in range(60)]
    stream = make_moto_stream(moto, keys)

    def count(event, ctx) -> None:  # noqa: ANN001
        total = (ctx.state.get() or 0) + 1
        ctx.state.set(total)
        ctx.emit(total)

    loc = AppLocation.default(f"x-{uuid.uuid4().hex[:10]}")
    cfg = JobConfig(
        app=loc.app,
        streams=(stream,),
        checkpoint=str(tmp_path / "ck"),
        slices=16,
        groups=4,
        local_dir=str(tmp_path / "stores"),
        kinesis_endpoint=moto,
        source_role_arn=role_arn("reader", STREAM_ACCOUNT),
        state_role_arn=role_arn("state", STATE_ACCOUNT),
        state_role_external_id="shardless-test",
    )
    out = tmp_path / "out"
    query = start(
        restored_spark,
        HandlerFactory(count),
        cfg,
        sink=parquet_sink(str(out)),
        available_now=True,
    )
    query.awaitTermination()

    rows = restored_spark.read.parquet(str(out)).collect()
    finals: dict[str, int] = {}
    for row in rows:
        finals[row.key] = max(finals.get(row.key, 0), json.loads(row.value))
    assert finals == {k: keys.count(k) for k in set(keys)}
    assert loc.table in tables_of(in_account(STATE_ACCOUNT))
    assert loc.table not in tables_of(boto3.session.Session())


@pytest.mark.slow
def test_shardless_run_with_role_flags_reads_and_commits_across_accounts(sts, aws, tmp_path: Path):
    """`shardless run` in a process of its own, the roles given as flags only: the Spark it
    starts, its sources' processes and its Python workers get them from its environment."""
    import pyarrow.parquet as pq

    keys = [f"user-{i % 5}" for i in range(40)]
    stream = make_moto_stream(aws.s3_endpoint, keys)
    app = tmp_path / "count.py"
    app.write_text(
        "def process(event, ctx):\n"
        "    total = (ctx.state.get() or 0) + 1\n"
        "    ctx.state.set(total)\n"
        "    ctx.emit(total)\n"
    )
    loc = AppLocation.default(f"x-{uuid.uuid4().hex[:10]}")
    env = {**os.environ, "AWS_ENDPOINT_URL_STS": aws.s3_endpoint}
    for name in ROLE_VARIABLES:
        env.pop(name, None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardless",
            "run",
            str(app),
            "--app",
            loc.app,
            "--stream",
            stream,
            "--master",
            "local[1]",
            "--slices",
            "16",
            "--groups",
            "2",
            "--available-now",
            "--checkpoint",
            str(tmp_path / "ck"),
            "--local-dir",
            str(tmp_path / "stores"),
            "--output",
            str(tmp_path / "out"),
            "--kinesis-endpoint",
            aws.s3_endpoint,
            "--source-role-arn",
            role_arn("reader", STREAM_ACCOUNT),
            "--state-role-arn",
            role_arn("state", STATE_ACCOUNT),
        ],  # fmt: skip
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    finals: dict[str, int] = {}
    for row in pq.read_table(tmp_path / "out").to_pylist():
        finals[row["key"]] = max(finals.get(row["key"], 0), json.loads(row["value"]))
    assert finals == {k: keys.count(k) for k in set(keys)}
    assert loc.table in tables_of(in_account(STATE_ACCOUNT))
    assert loc.table not in tables_of(boto3.session.Session())
