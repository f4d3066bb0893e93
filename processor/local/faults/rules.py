"""Fault rules and what they match: which requests the fault proxy breaks, and how.

A request is classified as a `Call` (service, operation, and a key to search): DynamoDB and
Kinesis from their ``X-Amz-Target`` header, anything else as path-style S3 from method,
path and query (see `classify`). A `Rule` says which calls to break and how; an
`ActiveRule` is a rule installed in a proxy, with its own remaining count and seeded RNG.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote


@dataclass(frozen=True)
class Call:
    """What a request is, as far as rules are concerned."""

    service: str  # "s3", "dynamodb", "kinesis", or another X-Amz-Target prefix, lower-cased
    op: str  # the API operation name, e.g. "PutObject", "TransactWriteItems"
    key: str  # what `Rule.key_contains` searches: S3 "bucket/key", else the JSON request body


@dataclass(frozen=True)
class Rule:
    """Which requests to break, how, and how often.

    Matching: ``service``, ``op`` and ``key_contains`` (a substring of `Call.key`) each match
    anything when None. Action, exactly one of: an error answer (``status`` and/or ``error``,
    the other filled in from the service's catalogue, e.g. S3 503 is SlowDown, DynamoDB 400 is
    ProvisionedThroughputExceededException), ``drop`` (close the connection without an answer),
    ``delay_s`` (wait, then forward normally), or ``unprocessed`` (DynamoDB BatchGetItem only:
    forward, then answer with the request's last N keys moved from ``Responses`` to
    ``UnprocessedKeys``, as a table out of read capacity answers part of a request; N larger
    than the request's keys: all of them). ``after=True`` forwards the request first and
    only then breaks the answer. Frequency: ``times`` (the next N matches), ``probability``
    (each match, from an RNG seeded by the proxy seed and the rule's position), both (at most
    N, each with probability p), or neither (always).
    """

    service: str | None = None
    op: str | None = None
    key_contains: str | None = None
    status: int | None = None
    error: str | None = None
    drop: bool = False
    delay_s: float = 0.0
    unprocessed: int = 0
    after: bool = False
    times: int | None = None
    probability: float | None = None

    def __post_init__(self) -> None:
        actions = [
            self.status is not None or self.error is not None,
            self.drop,
            self.delay_s > 0,
            self.unprocessed > 0,
        ]
        if sum(actions) != 1:
            raise ValueError(
                f"{self}: give exactly one action (status/error, drop=True, delay_s > 0 or "
                "unprocessed > 0)"
            )
        if self.unprocessed and (self.service, self.op, self.after) != (
            "dynamodb", "BatchGetItem", False
        ):  # fmt: skip
            raise ValueError(
                f"{self}: unprocessed applies to DynamoDB BatchGetItem answers only: "
                "Rule('dynamodb', 'BatchGetItem', unprocessed=N)"
            )
        if self.times is not None and self.times < 1:
            raise ValueError(f"{self}: times must be at least 1, or None for always")
        if self.probability is not None and not 0 < self.probability <= 1:
            raise ValueError(f"{self}: probability must be in (0, 1]")

    def matches(self, call: Call) -> bool:
        return (
            (self.service is None or self.service == call.service)
            and (self.op is None or self.op == call.op)
            and (self.key_contains is None or self.key_contains in call.key)
        )


class ActiveRule:
    """A rule plus its remaining count and RNG, which belong to the proxy, not the Rule."""

    def __init__(self, rule: Rule, rng: random.Random) -> None:
        self.rule = rule
        self.remaining = rule.times
        self.rng = rng

    def fires(self, call: Call) -> bool:
        if self.remaining == 0 or not self.rule.matches(call):
            return False
        if self.rule.probability is not None and self.rng.random() >= self.rule.probability:
            return False
        if self.remaining is not None:
            self.remaining -= 1
        return True


# --- classification ---------------------------------------------------------------------------

# Bucket sub-resources, as they appear in operation names (GetBucketVersioning, PutBucketCors).
_BUCKET_SUBRESOURCES = {
    "accelerate": "AccelerateConfiguration",
    "acl": "Acl",
    "cors": "Cors",
    "encryption": "Encryption",
    "lifecycle": "LifecycleConfiguration",
    "logging": "Logging",
    "notification": "NotificationConfiguration",
    "object-lock": "ObjectLockConfiguration",
    "ownershipControls": "OwnershipControls",
    "policy": "Policy",
    "publicAccessBlock": "PublicAccessBlock",
    "replication": "Replication",
    "requestPayment": "RequestPayment",
    "tagging": "Tagging",
    "versioning": "Versioning",
    "website": "Website",
}


def classify(method: str, target: str, headers: dict[str, str]) -> Call:
    """The (service, op) of a request from its method, request target and lower-cased headers.

    JSON-protocol services name the operation in ``X-Amz-Target``; the key is then filled in
    by the caller from the body. S3 is recognised path-style; recent botocore also sends the
    operation as ``?x-id=``, which wins when present.
    """
    if amz_target := headers.get("x-amz-target"):
        prefix, _, op = amz_target.partition(".")
        return Call(prefix.split("_")[0].lower(), op, "")
    path, _, query = target.partition("?")
    params = dict(parse_qsl(query, keep_blank_values=True))
    bucket, _, key = unquote(path).lstrip("/").partition("/")
    name = f"{bucket}/{key}" if key else bucket
    if "x-id" in params:
        return Call("s3", params["x-id"], name)
    return Call("s3", _s3_op(method.upper(), bucket, key, params, headers), name)


def _s3_op(
    method: str, bucket: str, key: str, params: dict[str, str], headers: dict[str, str]
) -> str:
    if not bucket:
        return "ListBuckets"
    if not key:
        return _s3_bucket_op(method, params)
    if method == "GET":
        if "uploadId" in params:
            return "ListParts"
        for sub, op in (("tagging", "GetObjectTagging"), ("acl", "GetObjectAcl")):
            if sub in params:
                return op
        return "GetObjectAttributes" if "attributes" in params else "GetObject"
    if method == "PUT":
        copy = "x-amz-copy-source" in headers
        if "uploadId" in params:
            return "UploadPartCopy" if copy else "UploadPart"
        for sub, op in (("tagging", "PutObjectTagging"), ("acl", "PutObjectAcl")):
            if sub in params:
                return op
        return "CopyObject" if copy else "PutObject"
    if method == "DELETE":
        if "uploadId" in params:
            return "AbortMultipartUpload"
        return "DeleteObjectTagging" if "tagging" in params else "DeleteObject"
    if method == "POST":
        if "uploads" in params:
            return "CreateMultipartUpload"
        if "uploadId" in params:
            return "CompleteMultipartUpload"
        return "RestoreObject" if "restore" in params else "SelectObjectContent"
    return "HeadObject" if method == "HEAD" else f"{method}Object"


def _s3_bucket_op(method: str, params: dict[str, str]) -> str:
    if method == "HEAD":
        return "HeadBucket"
    if method == "POST" and "delete" in params:
        return "DeleteObjects"
    verb = {"GET": "Get", "PUT": "Put", "DELETE": "Delete"}.get(method, method)
    sub = next((name for param, name in _BUCKET_SUBRESOURCES.items() if param in params), None)
    if sub:
        return f"{verb}Bucket{sub}"
    if method == "GET":
        for param, op in (
            ("location", "GetBucketLocation"),
            ("uploads", "ListMultipartUploads"),
            ("versions", "ListObjectVersions"),
        ):
            if param in params:
                return op
        return "ListObjectsV2" if params.get("list-type") == "2" else "ListObjects"
    return {"Put": "CreateBucket", "Delete": "DeleteBucket"}.get(verb, f"{verb}Bucket")
