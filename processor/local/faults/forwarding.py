"""The fault proxy's HTTP side: one request read, forwarded or broken, and answered.

`Server` listens on loopback and asks the proxy (`Decisions`, which `FaultProxy` is) what
to do with each request. Requests are forwarded verbatim (method, path, query, headers with
Host rewritten, body; chunked and aws-chunked uploads relayed frame by frame) and answers
streamed back, so ranged GETs and large objects behave as they do without the proxy. Bodies
of JSON-protocol requests (DynamoDB, Kinesis) are read whole first, so rules can match on
them and PutRecords calls can fail some of their entries.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import urlsplit

from shardless.processor.local.faults.aws_answers import error_answer, unprocessed_answer
from shardless.processor.local.faults.partial_failures import (
    PUT_RECORDS_TARGET,
    Canned,
    PartialFailure,
    put_records,
)
from shardless.processor.local.faults.rules import Call, Rule, classify

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
_COPY_BYTES = 64 * 1024
# Headers that describe one hop, not the request; the proxy manages its own connections.
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "upgrade", "expect", "host"}
)
# Headers that describe an answer's body, set anew when the proxy rewrites one.
_REWRITTEN = frozenset({"transfer-encoding", "content-length", "x-amz-crc32"})


class Decisions(Protocol):
    """What the server asks the proxy it serves (`FaultProxy`) about each request."""

    @property
    def partial(self) -> PartialFailure | None: ...

    def decide(self, call: Call) -> Rule | None: ...

    def count_forwarded(self, call: Call) -> None: ...

    def choose_failures(self, n: int) -> tuple[list[int], PartialFailure | None]: ...


class Server(ThreadingHTTPServer):
    """Listens on a free loopback port and serves each request in a thread (`_Handler`):
    the proxy decides, then the request is forwarded to `upstream` (http://host:port) or
    broken."""

    daemon_threads = True

    def __init__(self, upstream: str, proxy: Decisions) -> None:
        super().__init__((HOST, 0), _Handler)
        parts = urlsplit(upstream)
        self.upstream = upstream
        self.upstream_netloc = parts.netloc
        self._upstream_host = parts.hostname or HOST
        self._upstream_port = parts.port or 80
        self.proxy = proxy
        self._clients: set[socket.socket] = set()
        self._clients_lock = threading.Lock()

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self._upstream_host, self._upstream_port, timeout=60)

    def track(self, conn: socket.socket, open_: bool) -> None:
        with self._clients_lock:
            (self._clients.add if open_ else self._clients.discard)(conn)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client killed mid-request (the harness kills drivers, executors and Python
        workers) resets its connection: expected, not logged."""
        if isinstance(sys.exc_info()[1], ConnectionResetError | BrokenPipeError):
            return
        super().handle_error(request, client_address)

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
    server: Server

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
        rule = proxy.decide(call)
        if rule is not None and not rule.after and not rule.unprocessed:
            if rule.delay_s:
                time.sleep(rule.delay_s)
            else:
                if body is None:
                    self._copy_body(lambda _: None)
                self._break(rule, call, headers)
                return
        upstream = self.server.connect()
        try:
            proxy.count_forwarded(call)
            try:
                response = self._send(upstream, body)
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

    def _send(
        self, upstream: http.client.HTTPConnection, body: bytes | None
    ) -> http.client.HTTPResponse | Canned:
        """Forward the request; a PutRecords call while partial failures are set goes
        through `put_records`, which may fail some of its entries."""
        proxy = self.server.proxy
        targets = self.headers.get_all("X-Amz-Target", [])
        if body is None or proxy.partial is None or PUT_RECORDS_TARGET not in targets:
            return self._forward(upstream, body)
        return put_records(
            body,
            proxy.choose_failures,
            lambda data: Canned.buffered(self._forward(upstream, data)),
        )

    def _forward(
        self, upstream: http.client.HTTPConnection, body: bytes | None
    ) -> http.client.HTTPResponse:
        """Send the request upstream, with `body` if buffered (or rewritten) else as it is
        read from the client; the upstream's answer."""
        upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        upstream.putheader("Host", self.server.upstream_netloc)
        for name, value in self.headers.items():
            if name.lower() not in _HOP_BY_HOP:
                if body is not None and name.lower() == "content-length":
                    value = str(len(body))
                upstream.putheader(name, value)
        upstream.endheaders()
        if body is None:
            self._copy_body(upstream.send)
        else:
            upstream.send(body)
        return upstream.getresponse()

    def _relay(self, response: http.client.HTTPResponse | Canned) -> None:
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

    def _partly_processed(
        self, response: http.client.HTTPResponse | Canned, request: bytes, n: int
    ) -> None:
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
        body = f"fault proxy: upstream {self.server.upstream} failed: {exc}\n".encode()
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
