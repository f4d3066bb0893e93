"""The state's boto3 clients (`shardless.changelog.aws.client`): one session per process and
credential set, so each service's model is read once a process, and `warm()` reads them
before a fork (the group owners' zygote)."""

from __future__ import annotations

import botocore.loaders
import pytest

from shardless.changelog import aws


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The model files botocore reads from disk, counted from now; the module's clients and
    sessions start empty and are put back afterwards."""
    monkeypatch.setattr(aws, "_clients", {})
    monkeypatch.setattr(aws, "_sessions", {})
    found: list[str] = []
    real = botocore.loaders.JSONFileLoader.load_file

    def load_file(self, file_path):  # noqa: ANN001, ANN202
        found.append(file_path)
        return real(self, file_path)

    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file", load_file)
    return found


def test_clients_of_one_credential_set_read_each_model_once(reads, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_DYNAMODB", "http://127.0.0.1:9")
    aws.client("dynamodb")
    first = len(reads)
    assert first > 0 and any("dynamodb" in r for r in reads)
    aws.client("dynamodb", validated=False)
    aws.client("dynamodb", fail_fast=True)
    monkeypatch.setenv("AWS_ENDPOINT_URL_DYNAMODB", "http://127.0.0.1:10")
    aws.client("dynamodb")  # another endpoint: another client, the same model
    assert len(reads) == first and len(aws._sessions) == 1
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "another-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "another-secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL_DYNAMODB", "http://127.0.0.1:11")
    other = aws.client("dynamodb")
    assert len(aws._sessions) == 2 and len(reads) > first
    assert other._request_signer._credentials.access_key == "another-key"


def test_warm_reads_the_models_so_that_clients_made_after_read_none(monkeypatch):
    monkeypatch.setattr(aws, "_clients", {})
    monkeypatch.setattr(aws, "_sessions", {})
    aws.warm()
    assert aws._clients == {}  # warm makes no client of the cache (nor looks up credentials)
    found: list[str] = []
    real = botocore.loaders.JSONFileLoader.load_file
    monkeypatch.setattr(
        botocore.loaders.JSONFileLoader,
        "load_file",
        lambda self, path: found.append(path) or real(self, path),
    )
    for kw in ({}, {"validated": False}, {"fail_fast": True}):
        aws.client("dynamodb", **kw)
        aws.client("s3", **kw)
    assert found == []
