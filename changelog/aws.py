"""boto3 clients shared within a process, configured for retries with jittered backoff.

Endpoints come from boto3's own conventions (`AWS_ENDPOINT_URL`, `AWS_ENDPOINT_URL_S3`,
`AWS_ENDPOINT_URL_DYNAMODB`, ...), credentials from its standard chain, or, when
`SHARDLESS_STATE_ROLE_ARN` names one, from an IAM role assumed with them (the state in
another account: `docs/kinesis-source.md`, "Cross-account streams"). The role is a variable
because every process that touches the state reads it: the driver, the sources' planning
processes, Spark's Python workers and the helper processes they start all inherit it.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import boto3
import botocore.session
from botocore.config import Config
from botocore.credentials import (
    AssumeRoleCredentialFetcher,
    CredentialProvider,
    CredentialResolver,
    DeferredRefreshableCredentials,
)
from botocore.exceptions import BotoCoreError, ClientError

from shardless.changelog.errors import ConfigurationError

# The variables SHARDLESS_STATE_ROLE_ARN, _EXTERNAL_ID and _SESSION_NAME.
STATE_ROLE = "SHARDLESS_STATE_ROLE"
# STS's limits (AssumeRole's API reference): the role ARN, session name and external id.
_ROLE_ARN = re.compile(r"arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]{1,512}")
_SESSION_NAME = re.compile(r"[\w+=,.@-]{2,64}")
_EXTERNAL_ID = re.compile(r"[\w+=,.@:/-]{2,1224}")
# An hour, the most a chained role may ask for; botocore assumes the role again once fewer
# than 15 minutes are left, so the credentials never run out under a long job.
ROLE_SECONDS = 3600

_lock = threading.Lock()
_clients: dict[tuple[str, bool, bool, str, tuple[str, ...]], object] = {}
# One boto3 session per process (per set of the variables boto3's credential chain and
# region read), as boto3's own default session: each session reads a service's model anew
# (0.07-0.15 s for DynamoDB and S3), so a session per client read them once a client.
_SESSION_VARIABLES = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
    "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
)  # fmt: skip
_sessions: dict[tuple[str | None, ...], boto3.session.Session] = {}
_role_sessions: dict[tuple[str, ...], boto3.session.Session] = {}

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


class RoleError(ConfigurationError):
    """A role to assume is malformed, or STS refused to let this process assume it."""


@dataclass(frozen=True)
class Role:
    """An IAM role whose temporary credentials a set of clients uses. `option` names where the
    role was configured, for error messages."""

    arn: str
    external_id: str | None = None
    session_name: str = "shardless"
    seconds: int = ROLE_SECONDS
    option: str = field(default="--state-role-arn", compare=False)

    def __post_init__(self) -> None:
        if not _ROLE_ARN.fullmatch(self.arn):
            raise RoleError(
                f"{self.option} {self.arn!r}: expected an IAM role ARN such as "
                "arn:aws:iam::123456789012:role/shardless-state"
            )
        if not _SESSION_NAME.fullmatch(self.session_name):
            raise RoleError(
                f"{self.option} {self.arn}: session name {self.session_name!r}: expected 2 to 64 "
                "letters, digits or +=,.@_-"
            )
        if self.external_id is not None and not _EXTERNAL_ID.fullmatch(self.external_id):
            raise RoleError(
                f"{self.option} {self.arn}: external id {self.external_id!r}: expected 2 to 1224 "
                "letters, digits or +=,.@:/_-"
            )
        if not 900 <= self.seconds <= 43200:
            raise RoleError(f"{self.option} {self.arn}: {self.seconds} s: use 900 to 43200")


class _Assumed(CredentialProvider):
    METHOD = "assume-role"

    def __init__(self, credentials: DeferredRefreshableCredentials) -> None:
        self._credentials = credentials

    def load(self) -> DeferredRefreshableCredentials:
        return self._credentials


# STS through the regional endpoint of the clients' region, retried like the other clients.
_STS = Config(retries={"max_attempts": 8, "mode": "standard"}, connect_timeout=5, read_timeout=30)


def role_session(role: Role, region_name: str | None = None) -> boto3.session.Session:
    """A new boto3 session whose clients use `role`'s credentials: assumed with this process's
    own (boto3's chain) at the first request, through the STS endpoint of `region_name` (else
    `region()`; `AWS_ENDPOINT_URL_STS` as boto3 reads it), and assumed again by botocore before
    they expire, so a job running for days never signs with stale ones. A refusal raises
    `RoleError` naming the role and where it was configured."""
    base = boto3.session.Session()
    where = region_name or region(base)
    source = base.get_credentials()
    if source is None:
        raise RoleError(
            f"{role.option} {role.arn}: no AWS credentials to assume the role with (boto3's "
            "chain found none: environment, profile, container or instance role)"
        )
    extra: dict[str, Any] = {"RoleSessionName": role.session_name, "DurationSeconds": role.seconds}
    if role.external_id is not None:
        extra["ExternalId"] = role.external_id
    fetcher = AssumeRoleCredentialFetcher(
        functools.partial(base.client, region_name=where, config=_STS),
        source,
        role.arn,
        extra_args=extra,
    )

    def fetch() -> dict[str, Any]:
        try:
            return fetcher.fetch_credentials()
        except ClientError as exc:
            raise RoleError(
                f"{role.option} {role.arn}: STS refused to let this job assume the role: {exc}. "
                "The role's trust policy must allow this job's identity (with the external id "
                "when it asks for one), and that identity needs sts:AssumeRole on the role "
                '(docs/kinesis-source.md, "Cross-account streams")'
            ) from exc
        except BotoCoreError as exc:
            raise RoleError(
                f"{role.option} {role.arn}: cannot assume the role: {exc} (STS in {where}; "
                "AWS_ENDPOINT_URL_STS sets another endpoint)"
            ) from exc

    credentials = DeferredRefreshableCredentials(fetch, _Assumed.METHOD)
    session = botocore.session.Session()
    session.register_component("credential_provider", CredentialResolver([_Assumed(credentials)]))
    return boto3.session.Session(botocore_session=session, region_name=where)


def role_in_env(prefix: str) -> Role | None:
    """The role the variables `<prefix>_ARN` (with `_EXTERNAL_ID` and `_SESSION_NAME`) name,
    or None."""
    values = _role_values(prefix)
    return _role_of(prefix, values) if values else None


def share_role(prefix: str, role: Role | None) -> dict[str, str]:
    """Set the variables `<prefix>_ARN`, `_EXTERNAL_ID` and `_SESSION_NAME` to `role` in this
    process, so that its clients and every process it starts from now on assume it; returns
    them, for processes started elsewhere (Spark's executors). None changes nothing."""
    if role is None:
        return {}
    env = {
        f"{prefix}_ARN": role.arn,
        f"{prefix}_EXTERNAL_ID": role.external_id or "",
        f"{prefix}_SESSION_NAME": role.session_name,
    }
    os.environ.update(env)
    return env


def state_role() -> Role | None:
    """The role this process's state clients assume, or None: boto3's own credentials."""
    return role_in_env(STATE_ROLE)


def session() -> boto3.session.Session:
    """The session the state's clients are made from: the state role's (one per process, its
    credentials shared by every client) or a plain one."""
    values = _role_values(STATE_ROLE)
    if not values:
        return boto3.session.Session()
    with _lock:
        return _role_session(STATE_ROLE, values)


def _role_values(prefix: str) -> tuple[str, ...]:
    """A role's variables, () when none is set: one lookup on the default path."""
    arn = os.environ.get(f"{prefix}_ARN")
    if not arn:
        return ()
    return (
        arn,
        os.environ.get(f"{prefix}_EXTERNAL_ID", ""),
        os.environ.get(f"{prefix}_SESSION_NAME", ""),
    )


def _role_of(prefix: str, values: tuple[str, ...]) -> Role:
    arn, external_id, session_name = values
    flag = "--" + prefix.removeprefix("SHARDLESS_").lower().replace("_", "-") + "-arn"
    return Role(
        arn, external_id or None, session_name or "shardless", option=f"{flag} ({prefix}_ARN)"
    )


def _role_session(prefix: str, values: tuple[str, ...]) -> boto3.session.Session:
    found = _role_sessions.get(values)
    if found is None:
        found = _role_sessions[values] = role_session(_role_of(prefix, values))
    return found


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


def _session() -> boto3.session.Session:
    """This process's session for the variables boto3 reads now (call with `_lock` held)."""
    key = tuple(os.environ.get(name) for name in _SESSION_VARIABLES)
    found = _sessions.get(key)
    if found is None:
        found = _sessions[key] = boto3.session.Session()
    return found


def warm(services: tuple[str, ...] = ("s3", "dynamodb")) -> None:
    """Read `services`' models into this process's session, with no request and no
    credentials looked up: a process forked from this one makes those clients without
    reading them (the group owners' zygote)."""
    with _lock:
        session = _session()
        for service in services:
            session.client(
                service, region_name="us-east-1", aws_access_key_id="-", aws_secret_access_key="-"
            )


def client(service: str, *, fail_fast: bool = False, validated: bool = True):  # noqa: ANN201
    """A cached client (boto3's clients are untyped); the cache key includes the endpoint and
    the state role, so tests may switch emulators and roles. `validated=False`: a client that
    sends requests without botocore's parameter check, for the commit path's requests built by
    shardless itself."""
    role = _role_values(STATE_ROLE)
    key = (service, fail_fast, validated, endpoint_for(service) or "", role)
    with _lock:
        found = _clients.get(key)
        if found is None:
            session = _role_session(STATE_ROLE, role) if role else _session()
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
