"""A fault-injecting HTTP reverse proxy for S3, DynamoDB and Kinesis emulators.

Exactly-once claims are only as good as the failures they were tested against. This proxy sits
between real boto3 clients and an emulator (moto server, kinesalite) and makes chosen requests
fail the way AWS fails: throttling and 5xx answers with the service's own error bodies, dropped
connections, slow answers, and the nasty case where the upstream *applied* a request but the
client is told it failed (``after=True``), which a retried conditional write then trips over.

    with FaultProxy(aws.s3_endpoint, seed=7) as proxy:
        proxy.add(Rule("s3", "PutObject", status=503, times=2))
        s3 = boto3.client("s3", endpoint_url=proxy.url)
        s3.put_object(Bucket="b", Key="k", Body=b"x")  # two SlowDowns, retried, then stored
        assert proxy.counts()[("s3", "PutObject")] == 3

Requests are forwarded verbatim (method, path, query, headers with Host rewritten, body; chunked
and aws-chunked uploads are relayed frame by frame) and answers are streamed back, so ranged GETs
and large objects behave as they do without the proxy. Each request is classified as
``(service, op)``: DynamoDB and Kinesis from their ``X-Amz-Target`` header, anything else as
path-style S3 from method, path and query (see `classify`). Rules are tried in the order they
were added and at most one fires per request. Clients must address S3 path-style, which boto3
does for an IP endpoint such as ``proxy.url``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import random
import socket
import threading
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import parse_qsl, unquote, urlsplit

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
_COPY_BYTES = 64 * 1024
# Headers that describe one hop, not the request; the proxy manages its own connections.
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "upgrade", "expect", "host"}
)
# Headers that describe an answer's body, set anew when the proxy rewrites one.
_REWRITTEN = frozenset({"transfer-encoding", "content-length", "x-amz-crc32"})


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


# --- error answers ----------------------------------------------------------------------------

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


# --- the proxy --------------------------------------------------------------------------------


class _ActiveRule:
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


class FaultProxy:
    """Reverse proxy to `upstream` on 127.0.0.1 that breaks requests according to its rules.

    Thread-safe: rules may be added or cleared while clients run. Counters are keyed by
    (service, op): `counts` is every request received, `forwarded` those sent upstream and
    `injected` those a rule fired on (delays included).
    """

    def __init__(self, upstream: str, rules: Iterable[Rule] = (), seed: int = 0) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream {upstream!r}: expected http://host:port")
        self.upstream = upstream
        self._upstream_host = parts.hostname
        self._upstream_port = parts.port or 80
        self._upstream_netloc = parts.netloc
        self._seed = seed
        self._lock = threading.Lock()
        self._rules: list[_ActiveRule] = []
        self._added = 0  # rules ever added: a rule's RNG stream depends on its position only
        self._counts: Counter[tuple[str, str]] = Counter()
        self._forwarded: Counter[tuple[str, str]] = Counter()
        self._injected: Counter[tuple[str, str]] = Counter()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""
        for rule in rules:
            self.add(rule)

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            rng = random.Random(f"{self._seed}/{self._added}")
            self._added += 1
            self._rules.append(_ActiveRule(rule, rng))
        return rule

    def clear(self) -> None:
        """Remove every rule; counters are kept (see `reset_counts`)."""
        with self._lock:
            self._rules.clear()

    def reset_counts(self) -> None:
        with self._lock:
            self._counts.clear()
            self._forwarded.clear()
            self._injected.clear()

    def counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)

    def forwarded(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._forwarded)

    def injected(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._injected)

    def start(self) -> str:
        """Listen on a free loopback port; returns (and sets) `url`."""
        if self._server is not None:
            return self.url
        server = _Server((HOST, 0), _Handler)
        server.proxy = self
        self._server = server
        self.url = f"http://{HOST}:{server.server_address[1]}"
        self._thread = threading.Thread(
            target=server.serve_forever,
            args=(0.05,),  # shutdown() waits up to one poll interval
            name=f"fault-proxy-{self.url}",
            daemon=True,
        )
        self._thread.start()
        return self.url

    def stop(self) -> None:
        """Stop listening and cut open client connections; idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        server.close_clients()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _decide(self, call: Call) -> Rule | None:
        """Count the request and pick the first rule that fires on it, counting that too."""
        with self._lock:
            self._counts[call.service, call.op] += 1
            for active in self._rules:
                if active.fires(call):
                    self._injected[call.service, call.op] += 1
                    return active.rule
            return None

    def _count_forwarded(self, call: Call) -> None:
        with self._lock:
            self._forwarded[call.service, call.op] += 1

    def _connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self._upstream_host, self._upstream_port, timeout=60)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    proxy: FaultProxy

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._clients: set[socket.socket] = set()
        self._clients_lock = threading.Lock()

    def track(self, conn: socket.socket, open_: bool) -> None:
        with self._clients_lock:
            (self._clients.add if open_ else self._clients.discard)(conn)

    def close_clients(self) -> None:
        """Keep-alive connections outlive serve_forever; cut them so `stop` really stops."""
        with self._clients_lock:
            clients = list(self._clients)
        for conn in clients:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _DropConnection(Exception):
    """Raised to end a request with no answer at all."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as AWS endpoints do
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, True)

    def finish(self) -> None:
        self.server.track(self.connection, False)
        super().finish()

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _handle(self) -> None:
        try:
            self._serve()
        except _DropConnection:
            self.close_connection = True
        except (OSError, http.client.HTTPException) as exc:
            log.debug("fault proxy: %s %s failed: %s", self.command, self.path, exc)
            self.close_connection = True

    def _serve(self) -> None:
        proxy = self.server.proxy
        headers = {name.lower(): value for name, value in self.headers.items()}
        call = classify(self.command, self.path, headers)
        body: bytes | None = None
        if call.service != "s3":  # small JSON bodies: buffer them so rules can match on keys
            chunks: list[bytes] = []
            self._copy_body(chunks.append)
            body = b"".join(chunks)
            call = Call(call.service, call.op, body.decode("utf-8", "replace"))
        rule = proxy._decide(call)
        if rule is not None and not rule.after and not rule.unprocessed:
            if rule.delay_s:
                time.sleep(rule.delay_s)
            else:
                if body is None:
                    self._copy_body(lambda _: None)
                self._break(rule, call, headers)
                return
        upstream = proxy._connect()
        try:
            proxy._count_forwarded(call)
            try:
                response = self._forward(upstream, body)
            except (OSError, http.client.HTTPException) as exc:
                self._bad_gateway(exc)
                return
            if rule is not None and rule.unprocessed:
                self._partly_processed(response, body or b"", rule.unprocessed)
                return
            if rule is not None and rule.after and rule.delay_s:
                time.sleep(rule.delay_s)
            elif rule is not None and rule.after:
                response.read()
                self._break(rule, call, headers)
                return
            self._relay(response)
        finally:
            upstream.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = _handle

    def _copy_body(self, sink: Callable[[bytes], object]) -> None:
        """Pass the request body to `sink` exactly as received, chunked framing included."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                line = self.rfile.readline(_COPY_BYTES)
                sink(line)
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    break
                self._copy_exact(size, sink)
                sink(self.rfile.readline(_COPY_BYTES))  # the CRLF closing the chunk
            while (line := self.rfile.readline(_COPY_BYTES)) not in (b"\r\n", b"\n", b""):
                sink(line)  # trailers
            sink(line)
        else:
            self._copy_exact(int(self.headers.get("Content-Length") or 0), sink)

    def _copy_exact(self, size: int, sink: Callable[[bytes], object]) -> None:
        while size > 0:
            data = self.rfile.read(min(size, _COPY_BYTES))
            if not data:
                raise ConnectionError("client closed the connection mid-body")
            sink(data)
            size -= len(data)

    def _forward(
        self, upstream: http.client.HTTPConnection, body: bytes | None
    ) -> http.client.HTTPResponse:
        upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        upstream.putheader("Host", self.server.proxy._upstream_netloc)
        for name, value in self.headers.items():
            if name.lower() not in _HOP_BY_HOP:
                upstream.putheader(name, value)
        upstream.endheaders()
        if body is None:
            self._copy_body(upstream.send)
        else:
            upstream.send(body)
        return upstream.getresponse()

    def _relay(self, response: http.client.HTTPResponse) -> None:
        """Stream the upstream answer back: status, headers, then the body as it arrives."""
        self.send_response_only(response.status, response.reason)
        length = response.getheader("Content-Length")
        no_body = self.command == "HEAD" or response.status in (204, 304)
        chunked = length is None and not no_body
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP and name.lower() != "transfer-encoding":
                self.send_header(name, value)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if no_body:
            return
        while data := response.read(_COPY_BYTES):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _partly_processed(self, response: http.client.HTTPResponse, request: bytes, n: int) -> None:
        """Relay a BatchGetItem answer with `n` of its keys left unprocessed (an error
        answer is relayed as it is)."""
        body = response.read()
        if response.status == 200:
            body = unprocessed_answer(request, body, n)
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP and name.lower() not in _REWRITTEN:
                self.send_header(name, value)
        self.send_header("x-amz-crc32", str(zlib.crc32(body)))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _bad_gateway(self, exc: Exception) -> None:
        """The upstream could not be reached or answered garbage: say so, then hang up."""
        body = f"fault proxy: upstream {self.server.proxy.upstream} failed: {exc}\n".encode()
        self.send_response_only(502)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _break(self, rule: Rule, call: Call, headers: dict[str, str]) -> None:
        if rule.drop:
            raise _DropConnection
        status, answer_headers, body = error_answer(
            call, rule.status, rule.error, self.command, headers.get("content-type", "")
        )
        self.send_response_only(status)
        for name, value in answer_headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
