"""The state's clients under an assumed IAM role (`SHARDLESS_STATE_ROLE_*`), against moto's
STS over HTTP. moto keeps each account's resources apart and puts a request in the account of
the role whose credentials signed it, so where a table lands shows whose credentials the
clients used."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator

import boto3
import pytest

from shardless.changelog import aws, resources
from shardless.changelog.layout import AppLocation

STATE_ACCOUNT = "111111111111"


def role_arn(name: str, account: str = STATE_ACCOUNT) -> str:
    return f"arn:aws:iam::{account}:role/{name}-{uuid.uuid4().hex[:8]}"


def key_of(session: boto3.session.Session) -> str:
    return session.get_credentials().get_frozen_credentials().access_key


def plain_dynamodb():  # noqa: ANN201
    """A client with the process's own credentials (moto's default account)."""
    return boto3.session.Session().client("dynamodb")


def test_state_clients_work_in_the_roles_account(sts):
    arn = role_arn("state")
    sts.setenv("SHARDLESS_STATE_ROLE_ARN", arn)
    sts.setenv("SHARDLESS_STATE_ROLE_SESSION_NAME", "job-7")
    loc = AppLocation.default(f"r-{uuid.uuid4().hex[:10]}")

    resources.ensure(loc, 16)  # the bucket and table a job starts with
    aws.client("s3").put_object(Bucket=loc.bucket, Key="k", Body=b"v")

    identity = aws.session().client("sts").get_caller_identity()
    role_name = arn.rsplit("/", 1)[1]
    assert identity["Arn"] == f"arn:aws:sts::{STATE_ACCOUNT}:assumed-role/{role_name}/job-7"
    assert loc.table in aws.client("dynamodb").list_tables()["TableNames"]
    assert loc.table not in plain_dynamodb().list_tables()["TableNames"]
    assert aws.client("s3").get_object(Bucket=loc.bucket, Key="k")["Body"].read() == b"v"
    # every state client shares the role's one set of credentials
    assert key_of(aws.session()).startswith("ASIA")


def test_without_a_role_the_clients_use_boto3s_credentials(sts):
    assert aws.state_role() is None
    assert aws.client("dynamodb") is aws.client("dynamodb")
    assert aws.session().get_credentials().method == "env"
    identity = aws.session().client("sts").get_caller_identity()
    assert ":assumed-role/" not in identity["Arn"]


def test_the_role_is_assumed_once_for_many_requests(sts):
    sts.setenv("SHARDLESS_STATE_ROLE_ARN", role_arn("state"))
    ddb = aws.client("dynamodb", validated=False)
    ddb.list_tables()
    first = key_of(aws.session())
    for _ in range(20):
        ddb.list_tables()
        aws.client("s3").list_buckets()
    assert key_of(aws.session()) == first
    assert aws.client("dynamodb", validated=False) is ddb


def test_credentials_are_assumed_again_before_they_expire(sts):
    """botocore assumes the role again once fewer than 15 minutes are left; credentials for
    the shortest duration STS grants (15 minutes) are due at every request."""
    arn = role_arn("state")
    session = aws.role_session(aws.Role(arn, seconds=900))
    ddb = session.client("dynamodb")
    ddb.list_tables()
    first = key_of(session)
    ddb.list_tables()
    second = key_of(session)
    assert first != second
    identity = session.client("sts").get_caller_identity()
    assert identity["Arn"].startswith(f"arn:aws:sts::{STATE_ACCOUNT}:assumed-role/")
    # and an hour's credentials are kept
    steady = aws.role_session(aws.Role(arn))
    steady.client("dynamodb").list_tables()
    kept = key_of(steady)
    steady.client("dynamodb").list_tables()
    assert key_of(steady) == kept


def test_a_malformed_role_is_refused_naming_the_variable(sts):
    sts.setenv("SHARDLESS_STATE_ROLE_ARN", "arn:aws:iam::12345:role/short-account")
    with pytest.raises(aws.RoleError) as caught:
        aws.client("dynamodb")
    message = str(caught.value)
    assert "--state-role-arn (SHARDLESS_STATE_ROLE_ARN)" in message
    assert "arn:aws:iam::12345:role/short-account" in message


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def strict_sts() -> Iterator[str]:
    """A moto server of its own that checks IAM permissions after its first three requests
    (the user, its policy and its key below), so that STS refuses a role as AWS does."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={"INITIAL_NO_AUTH_ACTION_COUNT": "3", "PATH": "/usr/bin:/bin"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1)  # noqa: S310
                break
            time.sleep(0.05)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_role_sts_refuses_fails_naming_the_option_and_the_role(
    sts, strict_sts: str, monkeypatch: pytest.MonkeyPatch
):
    allowed = "arn:aws:iam::222222222222:role/allowed"
    iam = boto3.session.Session().client("iam", endpoint_url=strict_sts)
    iam.create_user(UserName="job")
    iam.put_user_policy(
        UserName="job",
        PolicyName="assume",
        PolicyDocument=json.dumps(
            {
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole", "Resource": allowed}],
            }
        ),
    )
    key = iam.create_access_key(UserName="job")["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", strict_sts)

    monkeypatch.setenv("SHARDLESS_STATE_ROLE_ARN", allowed)
    assert key_of(aws.session()).startswith("ASIA")  # this user may assume that one

    refused = "arn:aws:iam::222222222222:role/not-this-one"
    monkeypatch.setenv("SHARDLESS_STATE_ROLE_ARN", refused)
    with pytest.raises(aws.RoleError) as caught:
        aws.client("dynamodb").list_tables()
    message = str(caught.value)
    assert message.startswith(f"--state-role-arn (SHARDLESS_STATE_ROLE_ARN) {refused}: ")
    assert "AccessDenied" in message and "not authorized to perform: sts:AssumeRole" in message
    assert "STS refused to let this job assume the role" in message and "trust policy" in message
