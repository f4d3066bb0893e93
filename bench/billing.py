"""What AWS bills for the S3 and DynamoDB calls of this process: every call counted by type,
DynamoDB read and write units computed from the real request and answer sizes, and the
list prices that turn them into dollars.

`Requests` wraps botocore's `BaseClient._make_api_call`, so it sees every client (the
shared clients of `shardless.changelog.aws` come in several configurations, commits go
through their own) from every thread. Unit rules, from DynamoDB's documentation:

- an item's size is the UTF-8 length of its attribute names plus its values (strings by
  UTF-8 length, binaries by length, numbers 1 byte per two digits plus 1, lists and maps 3
  bytes plus 1 per element, booleans and nulls 1);
- a plain write bills 1 write unit per started KB, a transactional write 2; a
  transaction's ConditionCheck bills as a transactional read (2 read units per started
  4 KB of the checked item, which the request does not show: the fence item is taken as
  under 4 KB);
- a read bills 1 read unit per started 4 KB strongly consistent, half that eventually
  consistent, at least one 4 KB step per item asked for; a Query or Scan rounds the sum of
  its items' sizes.

A Put replacing a larger item bills the larger size; the counter sees only the new one,
which for head items of a steady job is the same size to within a few entries.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from botocore.client import BaseClient

KB = 1024
READ_STEP = 4 * KB


@dataclass(frozen=True)
class Prices:
    """On-demand list prices in US dollars, us-east-1, and the date they were read."""

    as_of: str = "2024-11 list prices, us-east-1 (DynamoDB on demand after its 2024-11 cut)"
    dynamodb_write_unit: float = 0.625 / 1e6
    dynamodb_read_unit: float = 0.125 / 1e6
    s3_put: float = 0.005 / 1000  # PUT, COPY, POST, LIST
    s3_get: float = 0.0004 / 1000  # GET, HEAD and the rest; DELETE is free
    s3_gb_month: float = 0.023


PRICES = Prices()
SECONDS_PER_MONTH = 30 * 24 * 3600
S3_PUT_LIKE = {"PutObject", "CopyObject", "CreateMultipartUpload", "UploadPart"}
S3_PUT_LIKE |= {"CompleteMultipartUpload", "ListObjectsV2", "ListObjects"}
S3_FREE = {"DeleteObject", "DeleteObjects", "AbortMultipartUpload"}


def value_bytes(value: dict[str, Any]) -> int:
    """The size DynamoDB counts for one attribute value (its name not included)."""
    ((kind, raw),) = value.items()
    if kind == "S":
        return len(raw.encode())
    if kind == "B":
        return len(raw)
    if kind == "N":
        return _number_bytes(raw)
    if kind in ("BOOL", "NULL"):
        return 1
    if kind == "SS":
        return sum(len(s.encode()) for s in raw)
    if kind == "BS":
        return sum(len(b) for b in raw)
    if kind == "NS":
        return sum(_number_bytes(n) for n in raw)
    if kind == "L":
        return 3 + sum(1 + value_bytes(v) for v in raw)
    if kind == "M":
        return 3 + sum(1 + len(k.encode()) + value_bytes(v) for k, v in raw.items())
    raise ValueError(f"unknown DynamoDB attribute type {kind!r}")


def _number_bytes(raw: str) -> int:
    digits = raw.lstrip("-").replace(".", "").strip("0") or "0"
    return math.ceil(len(digits) / 2) + 1


def item_bytes(item: dict[str, dict[str, Any]]) -> int:
    """An item's size as DynamoDB bills it: attribute names plus values."""
    return sum(len(name.encode()) + value_bytes(v) for name, v in item.items())


def write_units(item_size: int, transactional: bool = False) -> int:
    return (2 if transactional else 1) * max(1, math.ceil(item_size / KB))


def read_units(size: int, consistent: bool, transactional: bool = False) -> float:
    steps = max(1, math.ceil(size / READ_STEP))
    return steps * (2 if transactional else 1 if consistent else 0.5)


def _update_bytes(params: dict[str, Any]) -> int:
    """An update's key and new values: what the request shows of the item it writes."""
    return item_bytes(params.get("Key", {})) + sum(
        value_bytes(v) for v in params.get("ExpressionAttributeValues", {}).values()
    )


def dynamodb_units(
    operation: str, params: dict[str, Any], answer: dict[str, Any]
) -> tuple[float, float]:
    """(write units, read units) one DynamoDB call bills."""
    if operation == "PutItem":
        return write_units(item_bytes(params["Item"])), 0.0
    if operation in ("UpdateItem", "DeleteItem"):
        return write_units(_update_bytes(params)), 0.0
    if operation == "BatchWriteItem":
        sizes = [
            item_bytes(r["PutRequest"]["Item"]) if "PutRequest" in r else 0
            for requests in params["RequestItems"].values()
            for r in requests
        ]
        return sum(write_units(n) for n in sizes), 0.0
    if operation == "TransactWriteItems":
        writes, reads = 0, 0.0
        for entry in params["TransactItems"]:
            ((kind, body),) = entry.items()
            if kind == "ConditionCheck":
                reads += read_units(0, consistent=True, transactional=True)
            elif kind == "Put":
                writes += write_units(item_bytes(body["Item"]), transactional=True)
            else:
                writes += write_units(_update_bytes(body), transactional=True)
        return writes, reads
    if operation == "GetItem":
        size = item_bytes(answer.get("Item", {}))
        return 0, read_units(size, bool(params.get("ConsistentRead")))
    if operation == "BatchGetItem":
        reads = 0.0
        for table, found in answer.get("Responses", {}).items():
            consistent = bool(params["RequestItems"][table].get("ConsistentRead"))
            asked = len(params["RequestItems"][table]["Keys"])
            reads += sum(read_units(item_bytes(i), consistent) for i in found)
            reads += (asked - len(found)) * read_units(0, consistent)  # misses bill a step
        return 0, reads
    if operation == "TransactGetItems":
        found = [r.get("Item", {}) for r in answer.get("Responses", [])]
        return 0, sum(read_units(item_bytes(i), True, transactional=True) for i in found)
    if operation in ("Query", "Scan"):
        size = sum(item_bytes(i) for i in answer.get("Items", []))
        return 0, read_units(size, bool(params.get("ConsistentRead")))
    return 0, 0.0  # control plane: CreateTable, DescribeTable, ... are not billed per call


class Requests:
    """Every S3 and DynamoDB call this process makes, by type, with DynamoDB's billed units,
    from construction until `close`. S3 PUTs are split into changelog segments and snapshot
    objects (SSTs and manifests)."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()
        self.units: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._real = BaseClient._make_api_call
        real, count = self._real, self._count

        def counted(client: Any, operation: str, params: dict) -> Any:
            service = client.meta.service_model.service_name
            answer = real(client, operation, params)
            if service in ("s3", "dynamodb"):
                count(service, operation, params, answer)
            return answer

        BaseClient._make_api_call = counted

    def close(self) -> None:
        BaseClient._make_api_call = self._real

    def _count(self, service: str, name: str, params: dict, answer: dict) -> None:
        writes, reads = dynamodb_units(name, params, answer) if service == "dynamodb" else (0, 0)
        if name == "PutObject":
            name = "PutObject:segment" if "changelog/" in params["Key"] else "PutObject:snapshot"
        with self._lock:
            self.calls[(service, name)] += 1
            self.units["dynamodb_write_units"] += writes
            self.units["dynamodb_read_units"] += reads

    def take(self) -> tuple[Counter[tuple[str, str]], Counter[str]]:
        """The calls and units since the last take."""
        with self._lock:
            out = self.calls, self.units
            self.calls, self.units = Counter(), Counter()
        return out


def s3_requests(calls: Counter[tuple[str, str]]) -> tuple[int, int]:
    """(PUT-priced, GET-priced) S3 requests among `calls`; deletes are free."""
    put = get = 0
    for (service, name), n in calls.items():
        if service != "s3" or name in S3_FREE:
            continue
        if name.split(":")[0] in S3_PUT_LIKE:
            put += n
        else:
            get += n
    return put, get


def dollars_per_month(
    per_batch: dict[str, float], trigger_s: float, prices: Prices = PRICES
) -> dict[str, float]:
    """Request dollars a month for a job whose every batch costs `per_batch` (keys
    `dynamodb_write_units`, `dynamodb_read_units`, `s3_puts`, `s3_gets`), one batch per
    `trigger_s`."""
    batches = SECONDS_PER_MONTH / trigger_s
    parts = {
        "dynamodb": batches
        * (
            per_batch["dynamodb_write_units"] * prices.dynamodb_write_unit
            + per_batch["dynamodb_read_units"] * prices.dynamodb_read_unit
        ),
        "s3": batches
        * (per_batch["s3_puts"] * prices.s3_put + per_batch["s3_gets"] * prices.s3_get),
    }
    return parts | {"total": parts["dynamodb"] + parts["s3"]}
