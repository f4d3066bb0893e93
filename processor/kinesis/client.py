"""The source's Kinesis clients: boto3's credential chain and endpoint conventions, standard
retries, a cheap timestamp parser and a direct parser for GetRecords responses.

botocore turns every record's `ApproximateArrivalTimestamp` (epoch seconds in Kinesis' JSON)
into a datetime in the local time zone through dateutil, which took about a third of a
GetRecords call's client-side CPU (`docs/benchmarks.md`, "Kinesis source"). The source's
clients parse it as UTC instead: the same instant, about ten times cheaper.

botocore then walks every record through its generic, model-driven parser (a few function calls per
field, most of what was left: `docs/benchmarks.md`, "Kinesis source"). A successful GetRecords
response is parsed directly instead: `json.loads`, then per record the two fields that are not plain
JSON (`Data`, base64; the timestamp). The result has the same keys and types as botocore's (see
`tests/processor/kinesis/test_source_client.py`); every other operation, and every error response,
goes through botocore's parser. The clients have a botocore session of their own, so other clients
keep botocore's defaults.

A stream in another account is read with a role assumed for the source alone: the variables
`SHARDLESS_SOURCE_ROLE_ARN` (with `_EXTERNAL_ID`, `_SESSION_NAME`), which every process of the
source inherits, as the state's clients read `SHARDLESS_STATE_ROLE_*` (`shardless.changelog.aws`).
"""

from __future__ import annotations

import os
import threading
from binascii import a2b_base64
from datetime import UTC, datetime
from typing import Any

import boto3
from botocore.config import Config
from botocore.parsers import JSONParser, ResponseParserFactory
from botocore.utils import parse_timestamp

from shardless.changelog import aws

_clients: dict[tuple[str, bool, aws.Role | None], Any] = {}
# The variables SHARDLESS_SOURCE_ROLE_ARN, _EXTERNAL_ID and _SESSION_NAME.
SOURCE_ROLE = "SHARDLESS_SOURCE_ROLE"
_lock = threading.Lock()


def utc_timestamp(value: Any) -> datetime:
    """A response timestamp as an aware UTC datetime (epoch numbers fast, others as botocore)."""
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC)
    try:
        return datetime.fromtimestamp(float(value), UTC)
    except (TypeError, ValueError):
        return parse_timestamp(value)


class _GetRecordsParser(JSONParser):
    """botocore's parser for the `json` protocol, with a direct path for a successful
    GetRecords response (`GetRecordsOutput`)."""

    def _do_parse(self, response: dict[str, Any], shape: Any) -> dict[str, Any]:
        if shape is None or shape.name != "GetRecordsOutput" or shape.event_stream_name:
            return super()._do_parse(response, shape)
        parsed = self._parse_body_as_json(response["body"])
        for record in parsed.get("Records", ()):
            record["Data"] = a2b_base64(record["Data"])
            if "ApproximateArrivalTimestamp" in record:
                record["ApproximateArrivalTimestamp"] = utc_timestamp(
                    record["ApproximateArrivalTimestamp"]
                )
        self._inject_response_metadata(parsed, response["headers"])
        return parsed


class _ParserFactory(ResponseParserFactory):
    def create_parser(self, protocol_name: str) -> Any:
        if protocol_name == "json":
            return _GetRecordsParser(**self._defaults)
        return super().create_parser(protocol_name)


def _endpoint(endpoint: str | None) -> str:
    return (
        endpoint
        or os.environ.get("AWS_ENDPOINT_URL_KINESIS")
        or os.environ.get("AWS_ENDPOINT_URL")
        or ""
    )


def kinesis_client(  # noqa: ANN201
    endpoint: str | None = None, fail_fast: bool = False, role: aws.Role | None = None
):
    """A cached Kinesis client for `endpoint` (None: boto3's own, e.g. from
    AWS_ENDPOINT_URL_KINESIS). `fail_fast`: few retries and short timeouts, for start-up
    checks. `role`: the client signs with that role's credentials (`aws.role_session`); None:
    the source role the environment names (`source_role`), if any."""
    role = role or source_role()
    key = (_endpoint(endpoint), fail_fast, role)
    with _lock:
        found = _clients.get(key)
        if found is None:
            session = aws.role_session(role) if role else boto3.session.Session()
            parsers = _ParserFactory()
            parsers.set_parser_defaults(timestamp_parser=utc_timestamp)
            session._session.register_component("response_parser_factory", parsers)
            found = session.client(
                "kinesis",
                endpoint_url=endpoint or None,
                region_name=aws.region(session),
                config=Config(
                    retries={"max_attempts": 2 if fail_fast else 8, "mode": "standard"},
                    connect_timeout=2 if fail_fast else 5,
                    read_timeout=10 if fail_fast else 60,
                    max_pool_connections=32,
                ),
            )
            _clients[key] = found
        return found


def source_role() -> aws.Role | None:
    """The role this process's Kinesis source clients assume, or None: boto3's own credentials."""
    return aws.role_in_env(SOURCE_ROLE)
