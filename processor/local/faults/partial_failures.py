"""Partial PutRecords failures: Kinesis accepting a call and failing some of its entries.

Kinesis answers PutRecords with 200 and fails entries one by one (`ErrorCode`
ProvisionedThroughputExceededException or InternalFailure, `FailedRecordCount` > 0); a
client must retry exactly those. The fault proxy does the same with a `PartialFailure`:
the chosen entries are taken out of the request before it is forwarded and their error
results put back in place, so what the emulator stores is exactly what the client is told
succeeded; with `applied=True` they are forwarded too and only reported failed (a client
that retries them writes them twice, as after a lost answer).
"""

from __future__ import annotations

import http.client
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass

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


class Canned:
    """An answer read in full (or built here), with what the proxy reads from an upstream
    answer to relay it."""

    def __init__(self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes):
        self.status = status
        self.reason = reason
        self._headers = [*headers, ("Content-Length", str(len(body)))]
        self._body = body

    @classmethod
    def buffered(cls, answer: http.client.HTTPResponse) -> Canned:
        """`answer`, read to its end."""
        data = answer.read()
        headers = [
            (k, v)
            for k, v in answer.getheaders()
            if k.lower() not in ("content-length", "transfer-encoding", "connection")
        ]
        return cls(answer.status, answer.reason, headers, data)

    def getheader(self, name: str, default: str | None = None) -> str | None:
        return next((v for k, v in self._headers if k.lower() == name.lower()), default)

    def getheaders(self) -> list[tuple[str, str]]:
        return list(self._headers)

    def read(self, amt: int | None = None) -> bytes:
        n = len(self._body) if amt is None else amt
        out, self._body = self._body[:n], self._body[n:]
        return out


def put_records(
    body: bytes,
    choose: Callable[[int], tuple[list[int], PartialFailure | None]],
    forward: Callable[[bytes], Canned],
) -> Canned:
    """The answer to the PutRecords request `body`: `choose(n)` says which of its n entries
    fail (and how, or None to pass the call through as it is); `forward(body)` sends a
    request body upstream and returns the answer."""
    request = json.loads(body)
    entries = request.get("Records", [])
    failed, partial = choose(len(entries))
    if partial is None:
        return forward(body)
    keep = (
        list(range(len(entries)))
        if partial.applied
        else [i for i in range(len(entries)) if i not in set(failed)]
    )
    results: dict[int, dict] = {}
    if keep:
        answer = forward(json.dumps({**request, "Records": [entries[i] for i in keep]}).encode())
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
    return Canned(200, "OK", headers, body)
