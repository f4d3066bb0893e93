"""`FaultProxy` plus two things the harness and the sink tests need.

- Per-rule counts (`fired(rule)`): several faults of a schedule may target the same
  operation, and the proxy's own counters are per (service, op).
- Partial PutRecords failures (`PartialFailure`): Kinesis accepts a PutRecords call and
  fails some of its entries (`ErrorCode` ProvisionedThroughputExceededException or
  InternalFailure in the answer, `FailedRecordCount` > 0). The chosen entries are taken out
  of the request before it is forwarded and their error results put back in place, so what
  the emulator stores is exactly what the client is told succeeded; with `applied=True`
  they are forwarded too and only reported failed (a client that retries them writes them
  twice, as after a lost answer).

Both hook `FaultProxy` where it decides a rule and where it opens its upstream connection;
the forwarding itself is the proxy's.
"""

from __future__ import annotations

import http.client
import json
import random
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shardless.processor.local.faults.fault_proxy import Call, FaultProxy, Rule

PUT_RECORDS_TARGET = "Kinesis_20131202.PutRecords"
_MESSAGES = {
    "ProvisionedThroughputExceededException": "Rate exceeded for shard {shard} in stream "
    "{stream} under account 000000000000.",
    "InternalFailure": "Internal service failure.",
}


@dataclass(frozen=True)
class PartialFailure:
    """Fail each entry of a PutRecords call with `probability` (seeded by the proxy's seed),
    for the next `times` calls (None: every call). `applied=True`: write the entry anyway."""

    probability: float = 0.3
    error: str = "ProvisionedThroughputExceededException"
    applied: bool = False
    times: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.probability <= 1:
            raise ValueError(f"{self}: probability must be in (0, 1]")
        if self.error not in _MESSAGES:
            raise ValueError(f"{self}: Kinesis fails entries with one of {sorted(_MESSAGES)}")


class Proxy(FaultProxy):
    def __init__(
        self,
        upstream: str,
        rules: Iterable[Rule] = (),
        seed: int = 0,
        partial: PartialFailure | None = None,
    ) -> None:
        self._fired: Counter[Rule] = Counter()
        self._partial: PartialFailure | None = None
        self._partial_left: int | None = None
        self._partial_rng = random.Random(f"{seed}/partial")
        self._partial_lock = threading.Lock()
        self.entries_failed = 0  # entries reported failed so far
        self.entries_dropped = 0  # of those, entries not forwarded to the emulator
        self.calls_altered = 0
        super().__init__(upstream, rules, seed)
        self.set_partial(partial)

    def set_partial(self, partial: PartialFailure | None) -> None:
        with self._partial_lock:
            self._partial = partial
            self._partial_left = None if partial is None else partial.times

    def start(self) -> str:
        """As `FaultProxy.start`; a client killed mid-request (the harness kills drivers,
        executors and Python workers) resets its connection: expected, not logged."""
        url = super().start()
        server = self._server
        assert server is not None
        default = server.handle_error

        def handle_error(request: Any, client_address: Any) -> None:
            if isinstance(sys.exc_info()[1], ConnectionResetError | BrokenPipeError):
                return
            default(request, client_address)

        server.handle_error = handle_error  # type: ignore[method-assign]
        return url

    def fired(self, rule: Rule) -> int:
        """How often `rule` (an equal rule) broke a request since the last `reset_counts`."""
        with self._lock:
            return self._fired[rule]

    def reset_counts(self) -> None:
        super().reset_counts()
        with self._lock:
            self._fired.clear()
        with self._partial_lock:
            self.entries_failed = self.entries_dropped = self.calls_altered = 0

    def _decide(self, call: Call) -> Rule | None:
        rule = super()._decide(call)
        if rule is not None:
            with self._lock:
                self._fired[rule] += 1
        return rule

    def _connect(self) -> http.client.HTTPConnection:
        return _Connection(self, self._upstream_host, self._upstream_port, timeout=60)

    def _choose_failures(self, n: int) -> tuple[list[int], PartialFailure | None]:
        """Which of n entries fail in this call (and how), or none."""
        with self._partial_lock:
            partial = self._partial
            if partial is None or self._partial_left == 0:
                return [], None
            failed = [i for i in range(n) if self._partial_rng.random() < partial.probability]
            if failed and self._partial_left is not None:
                self._partial_left -= 1
            if failed:
                self.calls_altered += 1
                self.entries_failed += len(failed)
                if not partial.applied:
                    self.entries_dropped += len(failed)
            return failed, partial


class _Canned:
    """What `FaultProxy` reads from an upstream answer, for an answer built here."""

    def __init__(self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes):
        self.status = status
        self.reason = reason
        self._headers = [*headers, ("Content-Length", str(len(body)))]
        self._body = body

    def getheader(self, name: str, default: str | None = None) -> str | None:
        return next((v for k, v in self._headers if k.lower() == name.lower()), default)

    def getheaders(self) -> list[tuple[str, str]]:
        return list(self._headers)

    def read(self, amt: int | None = None) -> bytes:
        n = len(self._body) if amt is None else amt
        out, self._body = self._body[:n], self._body[n:]
        return out


class _Connection(http.client.HTTPConnection):
    """An upstream connection that holds a PutRecords request back until its answer is
    wanted, to rewrite both; anything else goes straight through."""

    def __init__(self, proxy: Proxy, host: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._proxy = proxy
        self._held: list[tuple[str, tuple[Any, ...], dict[str, Any]]] | None = []
        self._body: list[bytes] = []

    def putrequest(self, *args: Any, **kwargs: Any) -> None:
        if self._held is None:
            super().putrequest(*args, **kwargs)
        else:
            self._held.append(("putrequest", args, kwargs))

    def putheader(self, header: str, *values: Any) -> None:
        if self._held is None:
            super().putheader(header, *values)
        else:
            self._held.append(("putheader", (header, *values), {}))

    def endheaders(self, message_body: Any = None, *, encode_chunked: bool = False) -> None:
        held, self._held = self._held, None
        if held is not None and not self._intercepts(held):
            self._replay(held)
            super().endheaders(message_body, encode_chunked=encode_chunked)
            return
        self._held = held
        if message_body:
            self._body.append(message_body)

    def send(self, data: Any) -> None:
        if self._held is None:
            super().send(data)
        else:
            self._body.append(data)

    def _intercepts(self, held: list) -> bool:
        if self._proxy._partial is None:
            return False
        return any(
            name == "putheader"
            and str(args[0]).lower() == "x-amz-target"
            and args[1] == PUT_RECORDS_TARGET
            for name, args, _ in held
        )

    def _replay(self, held: list, body_length: int | None = None) -> None:
        for name, args, kwargs in held:
            if (
                name == "putheader"
                and body_length is not None
                and args[0].lower() == "content-length"
            ):
                args = (args[0], str(body_length))
            getattr(super(), name)(*args, **kwargs)

    def getresponse(self) -> Any:
        if self._held is None:
            return super().getresponse()
        held, self._held = self._held, None
        request = json.loads(b"".join(self._body))
        entries = request.get("Records", [])
        failed, partial = self._proxy._choose_failures(len(entries))
        if partial is None:
            return self._forward(held, b"".join(self._body))
        keep = (
            list(range(len(entries)))
            if partial.applied
            else [i for i in range(len(entries)) if i not in set(failed)]
        )
        results: dict[int, dict] = {}
        if keep:
            body = json.dumps({**request, "Records": [entries[i] for i in keep]}).encode()
            answer = self._forward(held, body)
            if answer.status != 200:
                return answer
            upstream = json.loads(answer.read())["Records"]
            results = dict(zip(keep, upstream, strict=True))
        stream = request.get("StreamName", "")
        for i in failed:
            results[i] = {
                "ErrorCode": partial.error,
                "ErrorMessage": _MESSAGES[partial.error].format(
                    shard="shardId-000000000000", stream=stream
                ),
            }
        merged = [results[i] for i in range(len(entries))]
        body = json.dumps(
            {
                "FailedRecordCount": sum(1 for r in merged if "ErrorCode" in r),
                "Records": merged,
            }
        ).encode()
        headers = [
            ("Content-Type", "application/x-amz-json-1.1"),
            ("x-amzn-RequestId", str(uuid.uuid4())),
        ]
        return _Canned(200, "OK", headers, body)

    def _forward(self, held: list, body: bytes) -> _Canned:
        self._replay(held, len(body))
        super().endheaders(body)
        answer = super().getresponse()
        data = answer.read()
        headers = [
            (k, v)
            for k, v in answer.getheaders()
            if k.lower() not in ("content-length", "transfer-encoding", "connection")
        ]
        return _Canned(answer.status, answer.reason, headers, data)
