"""Local emulators: real processes, real HTTP, boto3 configured only through LocalAws.env()."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from botocore.client import BaseClient

from shardless.processor.local.emulators import LocalAws, LocalAwsError, start

# Variables that could steer boto3 away from the emulators on a developer's machine.
_STRAY_AWS_VARS = (
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
)


@pytest.fixture(scope="module")
def local_aws(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalAws]:
    aws = start("kinesalite", log_dir=tmp_path_factory.mktemp("local-aws-logs"))
    try:
        yield aws
    finally:
        aws.stop()


@pytest.fixture
def session(
    local_aws: LocalAws, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> boto3.session.Session:
    """A fresh boto3 session that knows the emulators only through environment variables."""
    return _env_session(local_aws, monkeypatch, tmp_path)


def _env_session(
    aws: LocalAws, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> boto3.session.Session:
    for name in _STRAY_AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for name, value in aws.env().items():
        monkeypatch.setenv(name, value)
    return boto3.session.Session()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_active(kinesis: BaseClient, stream: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        summary = kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]
        if summary["StreamStatus"] == "ACTIVE":
            return
        assert time.monotonic() < deadline, f"{stream} still {summary['StreamStatus']}"
        time.sleep(0.1)


def test_env_points_at_local_endpoints(local_aws: LocalAws) -> None:
    env = local_aws.env()
    for name in ("AWS_ENDPOINT_URL_KINESIS", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_DYNAMODB"):
        assert env[name].startswith("http://127.0.0.1:")
    assert env["AWS_ACCESS_KEY_ID"] == env["AWS_SECRET_ACCESS_KEY"] == "testing"
    assert env["AWS_DEFAULT_REGION"] == env["AWS_REGION"] == "us-east-1"
    assert local_aws.kinesis_flavour == "kinesalite"
    assert len(local_aws.pids) == 2 and all(_alive(pid) for pid in local_aws.pids)


def test_s3_put_and_get(session: boto3.session.Session) -> None:
    s3 = session.client("s3")
    s3.create_bucket(Bucket="shardless-test")
    s3.put_object(Bucket="shardless-test", Key="a/b.txt", Body=b"hello")
    assert s3.get_object(Bucket="shardless-test", Key="a/b.txt")["Body"].read() == b"hello"


def test_dynamodb_put_and_get(session: boto3.session.Session) -> None:
    dynamodb = session.client("dynamodb")
    dynamodb.create_table(
        TableName="shardless-test",
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    dynamodb.put_item(TableName="shardless-test", Item={"pk": {"S": "k"}, "v": {"N": "42"}})
    item = dynamodb.get_item(TableName="shardless-test", Key={"pk": {"S": "k"}})["Item"]
    assert item == {"pk": {"S": "k"}, "v": {"N": "42"}}


def test_kinesis_put_and_get(session: boto3.session.Session) -> None:
    kinesis = session.client("kinesis")
    kinesis.create_stream(StreamName="shardless-test", ShardCount=1)
    _wait_active(kinesis, "shardless-test")
    put = kinesis.put_record(StreamName="shardless-test", Data=b"payload", PartitionKey="pk")
    iterator = kinesis.get_shard_iterator(
        StreamName="shardless-test", ShardId=put["ShardId"], ShardIteratorType="TRIM_HORIZON"
    )["ShardIterator"]
    records = kinesis.get_records(ShardIterator=iterator)["Records"]
    assert [(r["Data"], r["PartitionKey"]) for r in records] == [(b"payload", "pk")]
    assert records[0]["SequenceNumber"] == put["SequenceNumber"]


def test_apply_env_updates_os_environ(local_aws: LocalAws, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in local_aws.env():
        monkeypatch.setenv(name, "placeholder")  # so monkeypatch restores the originals
    local_aws.apply_env()
    assert {name: os.environ[name] for name in local_aws.env()} == local_aws.env()


def test_env_applied_sets_the_variables_for_a_block_and_puts_them_back(
    local_aws: LocalAws, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = sorted(local_aws.env())
    monkeypatch.setenv(names[0], "before")
    for name in names[1:]:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError), local_aws.env_applied():
        assert {name: os.environ[name] for name in names} == local_aws.env()
        raise RuntimeError("the block fails: the variables still come back")
    assert os.environ[names[0]] == "before"
    assert not any(name in os.environ for name in names[1:])


def test_stop_kills_exactly_the_started_pids(local_aws: LocalAws, tmp_path: Path) -> None:
    other = start("kinesalite", log_dir=tmp_path)
    pids = list(other.pids)
    try:
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        assert not set(pids) & set(local_aws.pids)
        assert (tmp_path / "moto.log").exists() and (tmp_path / "kinesalite.log").exists()
    finally:
        other.stop()
    assert not any(_alive(pid) for pid in pids)
    assert all(_alive(pid) for pid in local_aws.pids)  # the other instance is untouched
    other.stop()  # second stop is harmless
    assert other.pids == []


def test_json_round_trip(local_aws: LocalAws) -> None:
    copy = LocalAws.from_json(local_aws.to_json())
    assert copy == local_aws
    assert copy.env() == local_aws.env()


def test_missing_tools_dir_says_run_make_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARDLESS_TOOLS_DIR", str(tmp_path))
    with pytest.raises(LocalAwsError) as error:
        start("kinesalite", log_dir=tmp_path / "logs")
    assert str(tmp_path) in str(error.value) and "make setup" in str(error.value)
    assert not (tmp_path / "logs").exists()  # failed before starting anything


def test_missing_node_says_install_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LocalAwsError, match="node not found on PATH: install Node 18"):
        start("kinesalite")


def test_unknown_flavour_is_rejected() -> None:
    with pytest.raises(LocalAwsError, match="kinesis-local"):
        start("kinesis-mock")


@pytest.mark.slow
def test_kinesis_local_update_shard_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    aws = start("kinesis-local", log_dir=tmp_path / "logs", timeout_s=120)
    try:
        assert aws.kinesis_flavour == "kinesis-local"
        kinesis = _env_session(aws, monkeypatch, tmp_path).client("kinesis")
        kinesis.create_stream(StreamName="resharded", ShardCount=2)
        _wait_active(kinesis, "resharded")
        before = {s["ShardId"] for s in kinesis.list_shards(StreamName="resharded")["Shards"]}
        assert len(before) == 2

        kinesis.update_shard_count(
            StreamName="resharded", TargetShardCount=4, ScalingType="UNIFORM_SCALING"
        )
        _wait_active(kinesis, "resharded", timeout_s=120)

        shards = kinesis.list_shards(StreamName="resharded")["Shards"]
        open_ids = {
            s["ShardId"] for s in shards if "EndingSequenceNumber" not in s["SequenceNumberRange"]
        }
        assert len(open_ids) == 4
        assert not open_ids & before  # all four are new children of the two parents
    finally:
        pids = list(aws.pids)
        aws.stop()
    assert not any(_alive(pid) for pid in pids)


def _child_pids() -> set[int]:
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            children.add(int(stat.parent.name))
    return children


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_crashing_emulator_reports_its_log_and_stops_moto(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "tools" / "node_modules" / "kinesalite" / "index.js"
    fake.parent.mkdir(parents=True)
    fake.write_text('console.error("boom: fake kinesalite"); process.exit(3)\n')
    monkeypatch.setenv("SHARDLESS_TOOLS_DIR", str(tmp_path / "tools"))
    children_before = _child_pids()
    with pytest.raises(LocalAwsError) as error:
        start("kinesalite", log_dir=tmp_path / "logs")
    message = str(error.value)
    assert "exited with code 3" in message and "boom: fake kinesalite" in message
    assert str(tmp_path / "logs" / "kinesalite.log") in message
    # moto, started first, was stopped again. Only new children count: a child an
    # earlier test left (an owner zygote on its idle timer) may exit meanwhile.
    assert _child_pids() - children_before == set()


def test_the_region_comes_from_the_environment_then_the_profile_then_us_east_1(
    monkeypatch, tmp_path
):
    from shardless.changelog import aws as aws_mod

    config = tmp_path / "config"
    config.write_text("[default]\nregion = eu-west-3\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    assert aws_mod.region() == "eu-west-3"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    assert aws_mod.region() == "ap-south-1"
    monkeypatch.setenv("AWS_REGION", "sa-east-1")
    assert aws_mod.region() == "sa-east-1"
    config.write_text("")
    monkeypatch.delenv("AWS_REGION")
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    assert aws_mod.region() == "us-east-1"
