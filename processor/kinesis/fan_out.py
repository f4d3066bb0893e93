"""Enhanced fan-out: a stream consumer, and reading one shard over SubscribeToShard.

The polling reader (`reader`) pulls pages with GetRecords; here Kinesis pushes events to a
registered consumer for up to 5 minutes per SubscribeToShard call. `read` keeps the polling
reader's batch semantics so the source can use either (it does through `fan_out_batch`, with
its option `consumerName`): a fresh read starts where `ShardRead` says and stops at the first
of the record or byte bound, the shard's end, or catching up with an open shard; a replay
(`until`) reads exactly up to and including a recorded sequence number, whatever arrived since.
Records are Kinesis records as boto3 returns them (KPL aggregates not expanded; `Data` as
bytes).

Subscriptions end: Kinesis closes them after 5 minutes, a newer SubscribeToShard for the same
consumer and shard takes them over, connections drop. `read` renews a subscription before its
5 minutes are up (`RENEW_AFTER_S`) and whenever one ends early, after the last record it read,
so nothing is skipped or read twice. A subscription that was just closed is still held for a
while (AWS refuses a new one within 5 seconds of the last, with ResourceInUseException), so a
busy shard is retried for up to `BUSY_RETRY_S`.

A closed shard ends with an event whose `ChildShards` name its children (AWS). kinesis-local
0.6.2 (kinesis-mock) never sends them and never ends a closed shard's subscription, so a read
of a shard known to be closed also ends at an empty event that says it is caught up (a closed
shard gets no new records), and then takes the children from ListShards.

kinesis-local also omits the `initial-response` message that AWS sends first on every
SubscribeToShard stream and botocore insists on ("First event was not of type
initial-response"); `read` registers a hook on the client that supplies one when it is missing
(`_InitialResponse`). Streams that have it pass through unchanged.
"""

from __future__ import annotations

import binascii
import logging
import random
import struct
import time
from dataclasses import dataclass, field
from typing import Any

from botocore.eventstream import EventStreamHeaderParser
from botocore.exceptions import BotoCoreError, ClientError
from urllib3.exceptions import HTTPError as Urllib3Error

from shardless.processor.errors import SourceError
from shardless.processor.kinesis.positions import iterator_args, sequence_sort_key
from shardless.processor.kinesis.reader import ShardRead
from shardless.processor.kinesis.shards import list_shards

log = logging.getLogger(__name__)

RENEW_AFTER_S = 270.0  # Kinesis ends a subscription after 5 minutes; renew well before
BUSY_RETRY_S = 15.0  # AWS holds a subscription 5 s after the last call; kinesis-local ~3 s
MAX_BROKEN = 5  # subscriptions in a row that end in an error before delivering an event
REGISTER_TIMEOUT_S = 180.0  # AWS takes seconds to activate or delete a consumer
_BUSY = {"ResourceInUseException", "LimitExceededException"}
_TRANSIENT = {"InternalFailureException", "InternalFailure", "ServiceUnavailable"}
_HOOK_ID = "shardless-fan-out-initial-response"
_sleep = time.sleep  # a module attribute so tests can skip the waits


# --- the consumer -------------------------------------------------------------------------


@dataclass(frozen=True)
class Consumer:
    """A registered, ACTIVE stream consumer."""

    name: str
    arn: str
    stream: str
    stream_arn: str


def register_consumer(
    kinesis,  # noqa: ANN001 - boto3 client
    stream: str,
    name: str,
    timeout_s: float = REGISTER_TIMEOUT_S,
) -> Consumer:
    """The consumer `name` of `stream`, registered if it is not, once it is ACTIVE.

    An existing consumer of that name is reused (another process may have registered it, or a
    previous run); one being deleted is waited out and registered again.
    """
    stream_arn = _stream_arn(kinesis, stream)
    where = f"consumer {name!r} of stream {stream!r}"
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while True:
        found = _describe(kinesis, stream_arn, name)
        status = found["ConsumerStatus"] if found else None
        if status == "ACTIVE":
            return Consumer(name, found["ConsumerARN"], stream, stream_arn)
        last = f"it is {status}" if status else "it is not registered"
        if found is None:
            try:
                kinesis.register_stream_consumer(StreamARN=stream_arn, ConsumerName=name)
                log.info("registered %s", where)
                continue
            except ClientError as exc:
                code = exc.response["Error"]["Code"]
                if code not in _BUSY:  # ResourceInUse: registered meanwhile, or stream busy
                    raise SourceError(f"cannot register {where}: {_message(exc)}") from exc
                last = f"registering it failed: {code}: {_message(exc)}"
        if time.monotonic() > deadline:
            raise SourceError(f"{where} is not ACTIVE after {timeout_s:.0f} s: {last}")
        attempt += 1
        _sleep(min(1.0, 0.05 * 2**attempt))


def deregister_consumer(
    kinesis,  # noqa: ANN001 - boto3 client
    stream: str,
    name: str,
    *,
    wait: bool = True,
    timeout_s: float = REGISTER_TIMEOUT_S,
) -> bool:
    """Deregister the consumer `name` of `stream`; whether there was one to deregister.

    With `wait`, returns once Kinesis no longer lists it (a consumer of the same name can then
    be registered anew). Deregistering ends its subscriptions.
    """
    where = f"consumer {name!r} of stream {stream!r}"
    try:
        stream_arn = _stream_arn(kinesis, stream)
    except SourceError:
        return False  # a deleted stream's consumers are gone with it
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while True:
        try:
            kinesis.deregister_stream_consumer(StreamARN=stream_arn, ConsumerName=name)
            break
        except ClientError as exc:
            code = exc.response["Error"]["Code"]
            if code == "ResourceNotFoundException":
                return False
            if code not in _BUSY or time.monotonic() > deadline:
                raise SourceError(f"cannot deregister {where}: {_message(exc)}") from exc
        attempt += 1
        _sleep(min(1.0, 0.05 * 2**attempt))
    log.info("deregistering %s", where)
    while wait and (found := _describe(kinesis, stream_arn, name)) is not None:
        if time.monotonic() > deadline:
            raise SourceError(
                f"{where} is still {found['ConsumerStatus']} {timeout_s:.0f} s after it was "
                "deregistered"
            )
        attempt += 1
        _sleep(min(1.0, 0.05 * 2**attempt))
    return True


def _stream_arn(kinesis, stream: str) -> str:  # noqa: ANN001
    try:
        summary = kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]
    except ClientError as exc:
        if exc.response["Error"]["Code"] == "ResourceNotFoundException":
            raise SourceError(
                f"Kinesis stream {stream!r} does not exist at this endpoint: create it, or fix "
                "the stream name / AWS_ENDPOINT_URL_KINESIS / region"
            ) from exc
        raise
    return summary["StreamARN"]


def _describe(kinesis, stream_arn: str, name: str) -> dict | None:  # noqa: ANN001
    try:
        return kinesis.describe_stream_consumer(StreamARN=stream_arn, ConsumerName=name)[
            "ConsumerDescription"
        ]
    except ClientError as exc:
        if exc.response["Error"]["Code"] == "ResourceNotFoundException":
            return None
        raise


def _message(exc: ClientError) -> str:
    error = exc.response.get("Error", {})
    return error.get("Message") or error.get("Code") or str(exc)


# --- reading a shard ----------------------------------------------------------------------


@dataclass
class FanOutRead:
    """What one `read` of a shard got, and where it stopped."""

    records: list[dict] = field(default_factory=list)
    # The sequence number of the last record read; None when none was (the read's start
    # position then still holds). A replay reads up to and including it.
    after: str | None = None
    # Kinesis' ContinuationSequenceNumber of the last event whose records were all taken (AWS:
    # the shard progress, even where no record arrived); None at the shard's end, or when the
    # read stopped within an event (then `after` is where to continue).
    continuation: str | None = None
    done: bool = False  # the shard is closed and every record in it was read
    caught_up: bool = False  # nothing was left to read when the read stopped
    child_shards: list[dict] = field(default_factory=list)  # at the end: ShardId, ParentShards, ...
    behind_ms: int | None = None  # MillisBehindLatest of the last event
    peeked: dict | None = None  # the first record left unread, when an event held more
    bytes: int = 0
    subscriptions: int = 0  # SubscribeToShard calls that delivered events (renewals included)
    events: int = 0
    busy_retries: int = 0  # subscribe attempts refused because the shard's subscription was held
    read_ms: int = 0


def read(
    kinesis,  # noqa: ANN001 - boto3 client
    consumer_arn: str,
    shard: ShardRead,
    *,
    until: str | None = None,
    from_oldest: bool = False,
) -> FanOutRead:
    """Read `shard` through the consumer `consumer_arn` (see the module docstring).

    `until`: replay: read exactly the records from the start position up to and including the
    record with this sequence number, ignoring the bounds; SourceError if the shard does not
    hold it. `from_oldest`: start at the oldest record (TRIM_HORIZON) whatever the position.
    """
    _tolerate_missing_initial_response(kinesis)
    began = time.monotonic()
    out = FanOutRead()
    last_seq = None if from_oldest else (shard.start or {}).get("after")
    broken = 0  # subscriptions in a row that broke before delivering an event
    busy_since: float | None = None
    finished = False
    while not finished:
        position = _starting_position(last_seq, shard, from_oldest)
        stream = None
        opened = time.monotonic()
        delivered = False
        try:
            stream = kinesis.subscribe_to_shard(
                ConsumerARN=consumer_arn, ShardId=shard.shard_id, StartingPosition=position
            )["EventStream"]
            for event in stream:
                body = event.get("SubscribeToShardEvent")
                if body is None:
                    continue
                if not delivered:
                    delivered, broken, busy_since = True, 0, None
                    out.subscriptions += 1
                out.events += 1
                finished = _take(out, body, shard, until, consumer_arn)
                if out.after is not None:
                    last_seq = out.after
                if finished or time.monotonic() - opened >= RENEW_AFTER_S:
                    break
            # The subscription ended, or is being renewed: go on after the last record read.
            if not delivered:
                broken += 1
                _check_broken(broken, shard, consumer_arn, "it ended without an event")
        except ClientError as exc:  # EventStreamError (inside the stream) is a ClientError
            code = exc.response.get("Error", {}).get("Code")
            if code in _BUSY:
                busy_since = busy_since or time.monotonic()
                if time.monotonic() - busy_since > BUSY_RETRY_S:
                    raise SourceError(
                        f"{_where(shard, consumer_arn)}: the shard's subscription is still held "
                        f"after {BUSY_RETRY_S:.0f} s ({code}: {_message(exc)}); is another job "
                        "reading this stream with the same consumer name?"
                    ) from exc
                out.busy_retries += 1
                _sleep(random.uniform(0.5, 1.0))  # Kinesis: one call a second per shard
                continue
            if code not in _TRANSIENT:
                raise _error(exc, shard, consumer_arn, position) from exc
            broken += 0 if delivered else 1
            _check_broken(broken, shard, consumer_arn, exc)
        except (BotoCoreError, Urllib3Error) as exc:  # the connection broke or timed out
            broken += 0 if delivered else 1
            _check_broken(broken, shard, consumer_arn, exc)
        finally:
            if stream is not None:
                stream.close()
    if out.done and not out.child_shards:
        out.child_shards = _children(kinesis, shard)
    out.read_ms = round((time.monotonic() - began) * 1000)
    log.info(
        "%s: %d records, %d bytes, %s ms behind, %d subscriptions, %d events in %d ms%s",
        _where(shard, consumer_arn),
        len(out.records),
        out.bytes,
        out.behind_ms,
        out.subscriptions,
        out.events,
        out.read_ms,
        " (shard ended)" if out.done else "",
    )
    return out


def _take(out: FanOutRead, event: dict, shard: ShardRead, until: str | None, consumer: str) -> bool:
    """Add an event's records to `out`; whether the read is finished."""
    records = event.get("Records") or []
    out.behind_ms = event.get("MillisBehindLatest")
    for i, record in enumerate(records):
        seq = record["SequenceNumber"]
        if until is None and (
            len(out.records) >= shard.max_records or out.bytes >= shard.max_bytes
        ):
            out.peeked = record
            out.continuation = None
            return True
        if until is not None and sequence_sort_key(seq) > sequence_sort_key(until):
            raise SourceError(
                f"{_where(shard, consumer)}: replay read {len(out.records)} records and then "
                f"{seq}, past the recorded end {until} without finding it"
            )
        out.records.append(record)
        out.bytes += len(record["Data"])
        out.after = seq
        if until is not None and seq == until:
            out.continuation = (
                None if i + 1 < len(records) else event.get("ContinuationSequenceNumber")
            )
            return True
    out.continuation = event.get("ContinuationSequenceNumber")
    children = event.get("ChildShards") or []
    at_tip = not records and out.behind_ms in (0, None)
    if out.continuation is None or children or (shard.closed and at_tip):
        out.done = out.caught_up = True  # the shard ended (see the module docstring)
        out.child_shards = children
    elif until is None:
        full = len(out.records) >= shard.max_records or out.bytes >= shard.max_bytes
        out.caught_up = out.behind_ms in (0, None) and not shard.closed
        return full or out.caught_up
    if until is not None and (out.done or at_tip):
        raise SourceError(
            f"{_where(shard, consumer)}: replay found {len(out.records)} records without "
            f"reaching the recorded end {until}; the records may be past the stream's retention"
        )
    return out.done


def _starting_position(last_seq: str | None, shard: ShardRead, from_oldest: bool) -> dict:
    if last_seq is None and from_oldest:
        return {"Type": "TRIM_HORIZON"}
    args = iterator_args({"after": last_seq} if last_seq else None, shard.initial)
    position = {"Type": args["ShardIteratorType"]}
    if "StartingSequenceNumber" in args:
        position["SequenceNumber"] = args["StartingSequenceNumber"]
    if "Timestamp" in args:
        position["Timestamp"] = args["Timestamp"]
    return position


def _children(kinesis, shard: ShardRead) -> list[dict]:  # noqa: ANN001
    """The ended shard's children as SubscribeToShard's ChildShards names them, from ListShards."""
    return [
        {
            "ShardId": s.shard_id,
            "ParentShards": list(s.parents),
            "HashKeyRange": {
                "StartingHashKey": s.starting_hash_key,
                "EndingHashKey": s.ending_hash_key,
            },
        }
        for s in list_shards(kinesis, shard.stream)
        if shard.shard_id in s.parents
    ]


def _where(shard: ShardRead, consumer_arn: str) -> str:
    return f"{shard.where()} through consumer {consumer_arn}"


def _error(exc: ClientError, shard: ShardRead, consumer_arn: str, position: dict) -> SourceError:
    code = exc.response.get("Error", {}).get("Code")
    where = _where(shard, consumer_arn)
    if code == "ResourceNotFoundException":
        return SourceError(
            f"{where}: not found ({_message(exc)}); was the consumer deregistered, or the "
            "stream deleted?"
        )
    if code == "InvalidArgumentException":
        return SourceError(
            f"{where}: Kinesis refuses the starting position {position}: {_message(exc)}"
        )
    return SourceError(f"{where}: SubscribeToShard failed: {code}: {_message(exc)}")


def _check_broken(broken: int, shard: ShardRead, consumer_arn: str, cause: Exception | str) -> None:
    if broken >= MAX_BROKEN:
        raise SourceError(
            f"{_where(shard, consumer_arn)}: {broken} subscriptions in a row ended before "
            f"delivering an event; the last: {cause}"
        ) from (cause if isinstance(cause, Exception) else None)
    log.warning(
        "%s: subscription broke (%s); subscribing again", _where(shard, consumer_arn), cause
    )
    _sleep(min(2.0, 0.1 * 2**broken))


# --- a missing initial-response -----------------------------------------------------------


def _frame(headers: dict[str, str], payload: bytes) -> bytes:
    """One event-stream message with string headers (the AWS event stream encoding)."""
    head = b"".join(
        bytes([len(k)]) + k.encode() + b"\x07" + struct.pack(">H", len(v)) + v.encode()
        for k, v in headers.items()
    )
    prelude = struct.pack(">II", 12 + len(head) + len(payload) + 4, len(head))
    message = prelude + struct.pack(">I", binascii.crc32(prelude)) + head + payload
    return message + struct.pack(">I", binascii.crc32(message))


_INITIAL_RESPONSE = _frame({":message-type": "event", ":event-type": "initial-response"}, b"{}")


class _InitialResponse:
    """A SubscribeToShard response body that starts with an `initial-response` message: the
    raw body's own first message if it is one, else a synthetic empty one before it."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def stream(self, *args: Any, **kwargs: Any) -> Any:
        chunks = self._raw.stream(*args, **kwargs)
        head = b""
        for chunk in chunks:
            head += chunk
            if _first_headers(head) is not None:
                break
        headers = _first_headers(head)
        if headers is not None and headers.get(":event-type") != "initial-response":
            yield _INITIAL_RESPONSE
        if head:
            yield head
        yield from chunks

    def close(self) -> None:
        self._raw.close()


def _first_headers(data: bytes) -> dict | None:
    """The headers of the first message in `data`, or None while they are incomplete."""
    if len(data) < 12:
        return None
    length = struct.unpack(">I", data[4:8])[0]
    if len(data) < 12 + length:
        return None
    return EventStreamHeaderParser().parse(data[12 : 12 + length])


def _supply_initial_response(response_dict: dict, **_: Any) -> None:
    body = response_dict.get("body")
    if response_dict.get("status_code") == 200 and hasattr(body, "stream"):
        response_dict["body"] = _InitialResponse(body)


def _tolerate_missing_initial_response(kinesis) -> None:  # noqa: ANN001
    """Register the hook on this client (once: botocore ignores a repeated unique id)."""
    kinesis.meta.events.register(
        "before-parse.kinesis.SubscribeToShard", _supply_initial_response, unique_id=_HOOK_ID
    )
