"""boto3 clients shared within a process, configured for retries with jittered backoff.

Endpoints come from boto3's own conventions (`AWS_ENDPOINT_URL`, `AWS_ENDPOINT_URL_S3`,
`AWS_ENDPOINT_URL_DYNAMODB`, ...), credentials from its standard chain.
"""

from __future__ import annotations

import os
import threading

import boto3
from botocore.config import Config

_lock = threading.Lock()
_clients: dict[tuple[str, bool, bool, str], object] = {}

# Standard mode retries throttling and 5xx with exponential backoff and full jitter.
# Every object shardless reads back carries its own checksum, checked against what the
# commit or the manifest recorded (segment sections, manifests, SST files), so botocore's
# own CRC of each response (which cannot cover a ranged read anyway) would only repeat it;
# the garbage collector's pending list, which has none, asks for it (ChecksumMode).
# Uploads keep botocore's checksum: S3 then refuses a body damaged on its way.
_STEADY = Config(
    retries={"max_attempts": 8, "mode": "standard"},
    connect_timeout=5,
    read_timeout=60,
    max_pool_connections=32,
    response_checksum_validation="when_required",
)
# For the per-batch commit: the same, without botocore checking each request against the
# service model first. Those requests are built by shardless's own code from typed values
# (head items, progress records), never from user input, and the service validates them
# anyway; the check cost about 25 ms of CPU per 128-slice commit (a tenth of it) in
# `bench.vs_spark`. Tools and anything a user's input reaches keep the check.
_COMMIT = _STEADY.merge(Config(parameter_validation=False))
# For start-up checks: a wrong endpoint should fail in seconds, not minutes.
_FAIL_FAST = Config(
    retries={"max_attempts": 2, "mode": "standard"}, connect_timeout=2, read_timeout=10
)


def endpoint_for(service: str) -> str | None:
    """The endpoint boto3 will use for `service` when one is configured, else None."""
    env_name = {"dynamodb": "DYNAMODB", "s3": "S3", "kinesis": "KINESIS"}[service]
    return os.environ.get(f"AWS_ENDPOINT_URL_{env_name}") or os.environ.get("AWS_ENDPOINT_URL")


def region(session: boto3.session.Session | None = None) -> str:
    """AWS_REGION, else boto3's own choice (AWS_DEFAULT_REGION, then the profile's region in
    ~/.aws/config), else us-east-1."""
    found = os.environ.get("AWS_REGION")
    if not found:
        found = (session or boto3.session.Session()).region_name
    return found or "us-east-1"


def client(service: str, *, fail_fast: bool = False, validated: bool = True):  # noqa: ANN201
    """A cached client (boto3's clients are untyped); the cache key includes the endpoint,
    so tests may switch emulators. `validated=False`: a client that sends requests without
    botocore's parameter check, for the commit path's requests built by shardless itself."""
    key = (service, fail_fast, validated, endpoint_for(service) or "")
    with _lock:
        found = _clients.get(key)
        if found is None:
            session = boto3.session.Session()
            found = session.client(
                service,
                region_name=region(session),
                config=_FAIL_FAST if fail_fast else _STEADY if validated else _COMMIT,
            )
            _clients[key] = found
        return found


def where(service: str) -> str:
    """A human description of the endpoint, for error messages."""
    return endpoint_for(service) or f"AWS {service} (default endpoint)"
