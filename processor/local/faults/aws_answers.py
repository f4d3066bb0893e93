"""The answers AWS gives when it fails, per service, for the fault proxy to send.

Error answers are shaped as each service shapes them (S3 XML, DynamoDB and Kinesis JSON
with their error type names and headers), so that botocore parses and retries them as it
would real ones. `unprocessed_answer` is DynamoDB's BatchGetItem answered only in part.
"""

from __future__ import annotations

import json
import uuid
import zlib

from shardless.processor.local.faults.rules import Call

# code -> (status, message), per service; the first code listed for a status is its default.
_ERRORS: dict[str, dict[str, tuple[int, str]]] = {
    "s3": {
        "InternalError": (500, "We encountered an internal error. Please try again."),
        "SlowDown": (503, "Please reduce your request rate."),
        "ServiceUnavailable": (503, "Please reduce your request rate."),
        "RequestTimeout": (
            400,
            "Your socket connection to the server was not read from or written to within "
            "the timeout period. Idle connections will be closed.",
        ),
    },
    "dynamodb": {
        "InternalServerError": (500, "Internal server error"),
        "ServiceUnavailable": (503, "The service is currently unavailable or busy."),
        "ProvisionedThroughputExceededException": (
            400,
            "The level of configured provisioned throughput for the table was exceeded. "
            "Consider increasing your provisioning level with the UpdateTable API.",
        ),
        "ThrottlingException": (400, "Rate of requests exceeds the allowed throughput."),
        "RequestLimitExceeded": (400, "Throughput exceeds the current throughput limit."),
    },
    "kinesis": {
        "InternalFailure": (500, "Internal service failure."),
        "ServiceUnavailable": (503, "Service Unavailable"),
        "ProvisionedThroughputExceededException": (400, "Rate exceeded for shard."),
        "ExpiredIteratorException": (400, "Iterator expired."),
        "LimitExceededException": (400, "Rate exceeded for stream."),
    },
}
_DYNAMODB_TYPE_PREFIX = "com.amazonaws.dynamodb.v20120810#"


def error_answer(
    call: Call, status: int | None, error: str | None, method: str = "POST", content_type: str = ""
) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, headers and body of the error AWS would send for `call`.

    S3 answers in XML (no body to a HEAD, as S3 does); JSON services mirror the request's
    Content-Type, and DynamoDB carries the x-amz-crc32 header botocore checks.
    """
    catalogue = _ERRORS.get(call.service, {})
    if error is None:
        status = status or 500
        error = next((code for code, (s, _) in catalogue.items() if s == status), None)
        error = error or ("InternalError" if status >= 500 else "BadRequest")
    status = status or catalogue.get(error, (500, ""))[0]
    message = catalogue.get(error, (0, error))[1]
    request_id = uuid.uuid4().hex.upper()
    if call.service == "s3":
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{error}</Code><Message>{message}</Message>"
            f"<RequestId>{request_id[:16]}</RequestId><HostId>{request_id}</HostId></Error>"
        ).encode()
        headers = [("Content-Type", "application/xml"), ("x-amz-request-id", request_id[:16])]
        return status, headers, b"" if method.upper() == "HEAD" else body
    prefix = _DYNAMODB_TYPE_PREFIX if call.service == "dynamodb" else ""
    body = json.dumps({"__type": prefix + error, "message": message}).encode()
    if not content_type.startswith("application/x-amz-json"):
        content_type = "application/x-amz-json-1.0"
    headers = [("Content-Type", content_type), ("x-amzn-RequestId", request_id)]
    if call.service == "dynamodb":
        headers.append(("x-amz-crc32", str(zlib.crc32(body))))
    return status, headers, body


def unprocessed_answer(request: bytes, answer: bytes, n: int) -> bytes:
    """A BatchGetItem answer as DynamoDB gives it when a table runs out of read capacity
    partway: the request's last `n` keys (all of them when it has no more) taken out of
    `Responses` and listed in `UnprocessedKeys`, with their table's other settings from the
    request (ConsistentRead, projection), ready to be sent again as they are."""
    asked = json.loads(request)["RequestItems"]
    out = json.loads(answer)
    pairs = [(table, key) for table, spec in asked.items() for key in spec["Keys"]]
    unprocessed = out.get("UnprocessedKeys") or {}
    for table, key in pairs[max(0, len(pairs) - n) :]:
        items = out["Responses"].get(table, [])
        out["Responses"][table] = [
            item for item in items if any(item.get(k) != v for k, v in key.items())
        ]
        settings = {k: v for k, v in asked[table].items() if k != "Keys"}
        unprocessed.setdefault(table, {**settings, "Keys": []})["Keys"].append(key)
    out["UnprocessedKeys"] = unprocessed
    return json.dumps(out).encode()
