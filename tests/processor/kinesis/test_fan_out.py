"""Enhanced fan-out (`fan_out`): the consumer, and reading one shard over SubscribeToShard.

The emulator tests run against kinesis-local over real HTTP, through the source's own Kinesis
client: it is the one local emulator that serves SubscribeToShard (moto answers 500, kinesalite
has no consumers). It does not send `ChildShards` nor end a closed shard's subscription, so the
tests without an emulator script the events AWS sends (shard end, a subscription that ends, one
taken over) through a stand-in client.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from botocore.exceptions import EventStreamError
from botocore.hooks import HierarchicalEmitter
from botocore.loaders import Loader
from botocore.model import ServiceModel
from botocore.parsers import create_parser

from shardless.processor.errors import SourceError
from shardless.processor.kinesis import fan_out
from shardless.processor.kinesis.reader import ShardRead
from shardless.processor.kinesis.source import kinesis_client
from tests.processor.kinesis import test_reshard
from tests.processor.kinesis.test_kinesis_reader import (
    got,
    only_shard,
    produce,
    shard_read,
    split_in_half,
)

kinesis_local = test_reshard.kinesis_local  # its fixture: a kinesis-local for this module


@pytest.fixture
def no_waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The reader's sleeps, recorded instead of slept."""
    slept: list[float] = []
    monkeypatch.setattr(fan_out, "_sleep", slept.append)
    return slept


# --- against kinesis-local ----------------------------------------------------------------


@pytest.fixture
def kinesis(kinesis_local: str) -> Any:
    return kinesis_client(kinesis_local)


@pytest.fixture
def stream(kinesis: Any) -> str:
    return test_reshard.create_stream(kinesis, f"fan-out-{uuid.uuid4().hex[:12]}", 1)


@pytest.fixture
def consumer(kinesis: Any, stream: str) -> fan_out.Consumer:
    # A name of its own: kinesis-local finishes a deregistration on whichever stream it finds
    # a consumer of that name on (sometimes another stream's, which then vanishes instead).
    return fan_out.register_consumer(kinesis, stream, f"consumer-{stream}")


@pytest.mark.slow
def test_a_consumer_is_registered_reused_and_deregistered(kinesis: Any, stream: str) -> None:
    name = f"app-{stream}"
    first = fan_out.register_consumer(kinesis, stream, name)
    again = fan_out.register_consumer(kinesis, stream, name)

    assert again == first
    assert first.stream == stream and first.name == name
    described = kinesis.describe_stream_consumer(ConsumerARN=first.arn)["ConsumerDescription"]
    assert described["ConsumerStatus"] == "ACTIVE"

    assert fan_out.deregister_consumer(kinesis, stream, name) is True
    assert kinesis.list_stream_consumers(StreamARN=first.stream_arn)["Consumers"] == []
    assert fan_out.deregister_consumer(kinesis, stream, name) is False
    assert fan_out.deregister_consumer(kinesis, "no-such-stream", name) is False


@pytest.mark.slow
def test_shardless_consumer_deregister_removes_the_consumer_from_each_stream(
    kinesis: Any, stream: str, kinesis_local: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardless.processor import cli

    name = f"cli-{stream}"
    registered = fan_out.register_consumer(kinesis, stream, name)
    other = test_reshard.create_stream(kinesis, f"fan-out-{uuid.uuid4().hex[:12]}", 1)
    argv = ["consumer", "deregister", "--stream", stream, "--stream", other,
            "--consumer-name", name, "--kinesis-endpoint", kinesis_local]  # fmt: skip

    assert cli.main(argv) == 0

    assert capsys.readouterr().out.splitlines() == [
        f"{stream}: deregistered {name}",
        f"{other}: had no consumer named {name}",
    ]
    assert kinesis.list_stream_consumers(StreamARN=registered.stream_arn)["Consumers"] == []


@pytest.mark.slow
def test_registering_a_consumer_being_deleted_waits_and_registers_it_anew(
    kinesis: Any, stream: str
) -> None:
    name = f"again-{stream}"
    fan_out.register_consumer(kinesis, stream, name)
    assert fan_out.deregister_consumer(kinesis, stream, name, wait=False) is True

    anew = fan_out.register_consumer(kinesis, stream, name)

    consumers = kinesis.list_stream_consumers(StreamARN=anew.stream_arn)["Consumers"]
    assert [(c["ConsumerARN"], c["ConsumerStatus"]) for c in consumers] == [(anew.arn, "ACTIVE")]


@pytest.mark.slow
def test_registering_on_a_missing_stream_names_it(kinesis: Any) -> None:
    with pytest.raises(SourceError, match="'no-such-stream' does not exist"):
        fan_out.register_consumer(kinesis, "no-such-stream", "app")


@pytest.mark.slow
def test_consecutive_bounded_reads_get_every_record_once_in_order(
    kinesis: Any, stream: str, consumer: fan_out.Consumer
) -> None:
    shard_id = only_shard(kinesis, stream)
    produced = produce(kinesis, stream, 10)

    first = fan_out.read(kinesis, consumer.arn, shard_read(stream, shard_id, max_records=6))
    second = fan_out.read(
        kinesis,
        consumer.arn,
        shard_read(stream, shard_id, start={"after": first.after}, max_records=6),
    )

    assert got(first.records) == produced[:6]
    assert first.after == produced[5][0]
    assert (first.caught_up, first.done) == (False, False)
    assert first.peeked is not None and first.peeked["SequenceNumber"] == produced[6][0]
    assert first.bytes == sum(len(data) for _, data in produced[:6])
    assert got(second.records) == produced[6:]
    assert (second.caught_up, second.done) == (True, False)
    assert second.behind_ms == 0
    assert second.continuation == produced[-1][0]
    assert second.subscriptions == 1


@pytest.mark.slow
def test_reads_start_at_a_timestamp_and_stop_at_the_byte_bound(
    kinesis: Any, stream: str, consumer: fan_out.Consumer
) -> None:
    shard_id = only_shard(kinesis, stream)
    produce(kinesis, stream, 3, tag="old")
    time.sleep(0.3)
    since = time.time()
    time.sleep(0.3)
    produced = produce(kinesis, stream, 5, tag="new")
    read = ShardRead(
        run="r",
        n=1,
        stream=stream,
        shard_id=shard_id,
        depth=0,
        start=None,
        initial={"type": "AT_TIMESTAMP", "ts": since},
        max_records=100,
        max_bytes=len(produced[0][1]) * 2,  # two records reach it
    )

    out = fan_out.read(kinesis, consumer.arn, read)

    assert got(out.records) == produced[:2]
    assert out.peeked is not None and not out.caught_up


@pytest.mark.slow
def test_a_replay_reads_exactly_the_recorded_records_whatever_arrived_since(
    kinesis: Any, stream: str, consumer: fan_out.Consumer
) -> None:
    shard_id = only_shard(kinesis, stream)
    produced = produce(kinesis, stream, 10)
    read = shard_read(stream, shard_id, start={"after": produced[1][0]}, max_records=4)
    fresh = fan_out.read(kinesis, consumer.arn, read)
    produce(kinesis, stream, 5, tag="later")

    replay = fan_out.read(kinesis, consumer.arn, read, until=fresh.after)

    assert got(fresh.records) == produced[2:6]
    assert got(replay.records) == got(fresh.records)
    assert replay.after == fresh.after


@pytest.mark.slow
def test_a_replay_that_passes_its_recorded_end_fails_naming_shard_and_consumer(
    kinesis: Any, stream: str, consumer: fan_out.Consumer
) -> None:
    shard_id = only_shard(kinesis, stream)
    produced = produce(kinesis, stream, 6)
    read = shard_read(stream, shard_id, start={"after": produced[3][0]})

    with pytest.raises(SourceError) as raised:
        fan_out.read(kinesis, consumer.arn, read, until=produced[1][0])

    message = str(raised.value)
    assert f"stream {stream!r} shard {shard_id}" in message
    assert consumer.arn in message and "past the recorded end" in message


@pytest.mark.slow
def test_a_split_parent_is_read_to_its_end_renewing_and_its_children_hold_the_rest(
    kinesis: Any, stream: str, consumer: fan_out.Consumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = only_shard(kinesis, stream)
    before = produce(kinesis, stream, 6, tag="before")
    children = split_in_half(kinesis, stream, parent)
    after = produce(kinesis, stream, 12, tag="after")
    # Renew after every event: the parent's records come in one event, its end in a second
    # subscription that starts after the last of them.
    with monkeypatch.context() as patched:
        patched.setattr(fan_out, "RENEW_AFTER_S", 0)
        ended = fan_out.read(kinesis, consumer.arn, shard_read(stream, parent, closed=True))

    assert got(ended.records) == before
    assert ended.done and ended.caught_up
    assert ended.subscriptions == 2
    assert sorted(c["ShardId"] for c in ended.child_shards) == sorted(children)
    assert all(c["ParentShards"] == [parent] for c in ended.child_shards)
    in_children = [
        record
        for child in children
        for record in fan_out.read(kinesis, consumer.arn, shard_read(stream, child)).records
    ]
    assert sorted(got(in_children)) == sorted(after)


@pytest.mark.slow
def test_a_held_subscription_is_waited_for_and_then_reported(
    kinesis: Any, stream: str, consumer: fan_out.Consumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    shard_id = only_shard(kinesis, stream)
    produced = produce(kinesis, stream, 3)
    fan_out._tolerate_missing_initial_response(kinesis)
    held = kinesis.subscribe_to_shard(
        ConsumerARN=consumer.arn, ShardId=shard_id, StartingPosition={"Type": "TRIM_HORIZON"}
    )["EventStream"]
    next(iter(held))
    # released 1 s into the second read: that read finds the shard held, waits, then reads
    release = threading.Timer(1.0, held.close)
    try:
        with monkeypatch.context() as patched, pytest.raises(SourceError) as raised:
            patched.setattr(fan_out, "BUSY_RETRY_S", 1.5)
            fan_out.read(kinesis, consumer.arn, shard_read(stream, shard_id))
        assert "subscription is still held" in str(raised.value)
        assert consumer.arn in str(raised.value) and shard_id in str(raised.value)

        release.start()
        out = fan_out.read(kinesis, consumer.arn, shard_read(stream, shard_id))
    finally:
        release.cancel()
        held.close()

    assert got(out.records) == produced
    assert out.busy_retries > 0  # refused while held: waited for, not reported


@pytest.mark.slow
def test_reading_through_a_deregistered_consumer_names_it(
    kinesis: Any, stream: str, consumer: fan_out.Consumer
) -> None:
    shard_id = only_shard(kinesis, stream)
    fan_out.deregister_consumer(kinesis, stream, consumer.name)

    with pytest.raises(SourceError, match="not found") as raised:
        fan_out.read(kinesis, consumer.arn, shard_read(stream, shard_id))

    assert consumer.arn in str(raised.value) and f"stream {stream!r}" in str(raised.value)


# --- AWS's events, scripted ---------------------------------------------------------------


def record(seq: int, data: bytes = b"x") -> dict:
    return {"SequenceNumber": f"{seq:056d}", "Data": data, "PartitionKey": "k"}


def event(records: list[dict], behind: int = 0, cont: str | None = "auto", **extra: Any) -> dict:
    if cont == "auto":
        cont = records[-1]["SequenceNumber"] if records else f"{0:056d}"
    body = {"Records": records, "MillisBehindLatest": behind, **extra}
    if cont is not None:
        body["ContinuationSequenceNumber"] = cont
    return {"SubscribeToShardEvent": body}


class Subscription:
    """An event stream: its events, then its end or an error."""

    def __init__(self, events: list[dict], error: Exception | None = None) -> None:
        self.events, self.error, self.closed = events, error, False

    def __iter__(self) -> Iterator[dict]:
        yield from self.events
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.closed = True


class ScriptedKinesis:
    """Answers each SubscribeToShard with the next scripted subscription (or error)."""

    def __init__(self, *script: Subscription | Exception) -> None:
        self.script = list(script)
        self.positions: list[dict] = []
        self.meta = SimpleNamespace(events=HierarchicalEmitter())

    def subscribe_to_shard(self, **kwargs: Any) -> dict:
        self.positions.append(kwargs["StartingPosition"])
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        return {"EventStream": item}


def taken_over() -> EventStreamError:
    error = {"Error": {"Code": "ResourceInUseException", "Message": "taken over"}}
    return EventStreamError(error, "SubscribeToShard")


def test_the_events_child_shards_end_the_shard_without_listing_shards(no_waits: list) -> None:
    children = [{"ShardId": "shardId-2", "ParentShards": ["shardId-1"], "HashKeyRange": {}}]
    kinesis = ScriptedKinesis(
        Subscription(
            [event([record(1), record(2)], behind=5), event([], cont=None, ChildShards=children)]
        )
    )

    out = fan_out.read(kinesis, "arn:consumer", shard_read("s", "shardId-1", closed=True))

    assert [r["SequenceNumber"] for r in out.records] == [f"{1:056d}", f"{2:056d}"]
    assert out.done and out.child_shards == children and out.continuation is None


def test_an_ended_subscription_is_renewed_after_the_last_record_read(no_waits: list) -> None:
    first = Subscription([event([record(1), record(2)], behind=100)])  # ends: 5 minutes up
    second = Subscription([event([record(3)], behind=0)])
    kinesis = ScriptedKinesis(first, second)

    out = fan_out.read(kinesis, "arn:consumer", shard_read("s", "shardId-1"))

    assert [int(r["SequenceNumber"]) for r in out.records] == [1, 2, 3]
    assert kinesis.positions == [
        {"Type": "TRIM_HORIZON"},
        {"Type": "AFTER_SEQUENCE_NUMBER", "SequenceNumber": f"{2:056d}"},
    ]
    assert out.subscriptions == 2 and out.caught_up and first.closed and second.closed


def test_a_subscription_taken_over_is_subscribed_again_where_it_stopped(no_waits: list) -> None:
    kinesis = ScriptedKinesis(
        Subscription([event([record(7)], behind=50)], error=taken_over()),
        taken_over(),  # the other subscriber still holds it: wait and try again
        Subscription([event([record(8), record(9)], behind=0)]),
    )
    start = {"after": f"{6:056d}"}

    out = fan_out.read(kinesis, "arn:consumer", shard_read("s", "shardId-1", start=start))

    assert [int(r["SequenceNumber"]) for r in out.records] == [7, 8, 9]
    assert kinesis.positions[0] == {"Type": "AFTER_SEQUENCE_NUMBER", "SequenceNumber": f"{6:056d}"}
    assert (
        kinesis.positions[1:]
        == [{"Type": "AFTER_SEQUENCE_NUMBER", "SequenceNumber": f"{7:056d}"}] * 2
    )
    assert out.busy_retries == 2


def test_subscriptions_that_keep_breaking_fail_the_read(no_waits: list) -> None:
    kinesis = ScriptedKinesis(*[Subscription([]) for _ in range(fan_out.MAX_BROKEN)])

    with pytest.raises(SourceError, match="subscriptions in a row ended"):
        fan_out.read(kinesis, "arn:consumer", shard_read("s", "shardId-1"))


def test_a_replay_that_finds_its_end_missing_fails(no_waits: list) -> None:
    kinesis = ScriptedKinesis(Subscription([event([record(1)], behind=0), event([])]))

    with pytest.raises(SourceError, match="without reaching the recorded end"):
        fan_out.read(kinesis, "arn:consumer", shard_read("s", "shardId-1"), until=f"{2:056d}")


def test_a_replay_stops_within_an_event_at_its_recorded_end(no_waits: list) -> None:
    kinesis = ScriptedKinesis(Subscription([event([record(1), record(2), record(3)], behind=9)]))
    bounded = shard_read("s", "shardId-1", max_records=1)  # the bound is the recorded end's

    out = fan_out.read(kinesis, "arn:consumer", bounded, until=f"{2:056d}")

    assert [int(r["SequenceNumber"]) for r in out.records] == [1, 2]
    assert out.after == f"{2:056d}" and out.continuation is None


# --- the missing initial-response ---------------------------------------------------------


class RawBody:
    """A urllib3 response body as botocore's EventStream reads it, in awkward chunk sizes."""

    def __init__(self, data: bytes, chunk: int) -> None:
        self.data, self.chunk, self.closed = data, chunk, False

    def stream(self) -> Iterator[bytes]:
        for i in range(0, len(self.data), self.chunk):
            yield self.data[i : i + self.chunk]

    def close(self) -> None:
        self.closed = True


def parse(body: Any) -> tuple[dict, list[dict]]:
    """SubscribeToShard's response as botocore parses it."""
    model = ServiceModel(Loader().load_service_model("kinesis", "service-2"), "kinesis")
    output = model.operation_model("SubscribeToShard").output_shape
    response = {"status_code": 200, "headers": {}, "body": body, "context": {}}
    parsed = create_parser("json").parse(response, output)
    return parsed, list(parsed["EventStream"])


EVENT = fan_out._frame(
    {":message-type": "event", ":event-type": "SubscribeToShardEvent"},
    b'{"Records":[{"SequenceNumber":"1","Data":"eA==","PartitionKey":"k"}],'
    b'"ContinuationSequenceNumber":"1","MillisBehindLatest":0}',
)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_a_stream_without_initial_response_gets_one(chunk: int) -> None:
    response = {"status_code": 200, "body": RawBody(EVENT * 2, chunk)}
    fan_out._supply_initial_response(response)

    _, events = parse(response["body"])

    assert [e["SubscribeToShardEvent"]["Records"][0]["Data"] for e in events] == [b"x", b"x"]


def test_a_stream_with_its_initial_response_is_left_as_it_is() -> None:
    initial = fan_out._frame({":message-type": "event", ":event-type": "initial-response"}, b"{}")
    raw = RawBody(initial + EVENT, 5)
    response = {"status_code": 200, "body": raw}
    fan_out._supply_initial_response(response)

    assert b"".join(response["body"].stream()) == initial + EVENT
    assert len(parse(RawBody(initial + EVENT, 5))[1]) == 1
    response["body"].close()
    assert raw.closed


def test_without_the_hook_botocore_refuses_such_a_stream() -> None:
    with pytest.raises(Exception, match="initial-response"):
        parse(RawBody(EVENT, 64))
