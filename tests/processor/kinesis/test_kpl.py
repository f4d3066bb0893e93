"""KPL de-aggregation: the hand-written decoder against aggregates made by `aws-kinesis-agg`
(the KPL format's reference Python library), then through the reader on kinesalite."""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from collections.abc import Callable

import pytest
from aws_kinesis_agg.aggregator import RecordAggregator
from hypothesis import given, settings
from hypothesis import strategies as st

from shardless.changelog.layout import AppLocation
from shardless.processor.errors import SourceError
from shardless.processor.kinesis import reader
from shardless.processor.kinesis.batch_log import BatchLog
from shardless.processor.kinesis.kpl import (
    MAGIC,
    CorruptAggregate,
    UserRecord,
    deaggregate,
    is_aggregated,
)
from shardless.processor.kinesis.reader import ShardRead, read_shard

TOP = 2**128 - 1


def aggregate(users: list[UserRecord]) -> tuple[str, str | None, bytes]:
    """One KPL aggregate of `users`: (its partition key, explicit hash key, data)."""
    agg = RecordAggregator()
    for u in users:
        assert agg.add_user_record(u.partition_key, u.data, u.explicit_hash_key) is None
    return agg.clear_and_get().get_contents()


def framed(body: bytes) -> bytes:
    """An aggregate around a hand-made protobuf body, with a correct MD5 trailer."""
    return MAGIC + body + hashlib.md5(body).digest()


# --- the decoder --------------------------------------------------------------------------


def test_an_aggregate_yields_its_user_records_in_order_with_their_own_keys() -> None:
    users = [
        UserRecord("user-1", None, b'{"n": 1}'),
        UserRecord("user-2", str(TOP), b""),
        UserRecord("user-1", None, b"x" * 5000),
        UserRecord("ключ-ü", "0", bytes(range(256))),
        UserRecord("user-3", "12345678901234567890", b"\xf3\x89\x9a\xc2 not nested"),
    ]
    _, _, data = aggregate(users)
    assert is_aggregated(data)
    assert deaggregate(data) == users


keys = st.text(min_size=1, max_size=20)
hash_keys = st.none() | st.integers(min_value=0, max_value=TOP).map(str)
user_records = st.builds(UserRecord, keys, hash_keys, st.binary(max_size=300))


@settings(max_examples=60, deadline=None)
@given(st.lists(user_records, min_size=1, max_size=40))
def test_deaggregate_inverts_the_reference_aggregator(users: list[UserRecord]) -> None:
    assert deaggregate(aggregate(users)[2]) == users


def test_plain_records_are_not_aggregates() -> None:
    assert not is_aggregated(b'{"user": "a"}')
    assert not is_aggregated(b"")
    assert not is_aggregated(MAGIC[:3])


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        pytest.param(MAGIC + b"\x00" * 10, "shorter than its framing", id="too-short"),
        pytest.param(MAGIC + b"\x0a\x01a" + b"\x00" * 16, "MD5", id="bad-md5"),
        pytest.param(framed(b"\x0a\x05ab"), "past its end", id="truncated-field"),
        pytest.param(framed(b"\x0a\x01a\x1a\x01\x08"), "varint runs past", id="truncated-varint"),
        pytest.param(framed(b"\x0b"), "wire type 3", id="group-wire-type"),
        pytest.param(
            framed(b"\x0a\x01a\x1a\x04\x08\x01\x1a\x00"), "partition key index 1", id="pk-index"
        ),
        pytest.param(
            framed(b"\x0a\x01a\x1a\x06\x08\x00\x10\x00\x1a\x00"),
            "explicit hash key index 0",
            id="ehk-index",
        ),
        pytest.param(
            framed(b"\x0a\x01a\x12\x03abc\x1a\x06\x08\x00\x10\x00\x1a\x00"),
            "explicit hash key 'abc'",
            id="ehk-not-a-number",
        ),
        pytest.param(framed(b"\x0a\x01a\x1a\x02\x08\x00"), "lacks", id="no-data"),
        pytest.param(framed(b"\x0a\x02\xff\xfe\x1a\x04\x08\x00\x1a\x00"), "UTF-8", id="bad-key"),
    ],
)
def test_a_corrupt_aggregate_is_refused_with_the_reason(data: bytes, reason: str) -> None:
    assert is_aggregated(data)
    with pytest.raises(CorruptAggregate, match=re.escape(reason)):
        deaggregate(data)


def test_a_flipped_bit_anywhere_in_the_body_is_caught_by_the_md5() -> None:
    _, _, data = aggregate([UserRecord("a", None, b"hello"), UserRecord("b", None, b"world")])
    for i in range(len(MAGIC), len(data) - 16):
        broken = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]
        with pytest.raises(CorruptAggregate, match="MD5"):
            deaggregate(broken)


def test_unknown_fields_and_tags_are_skipped() -> None:
    record = b"\x08\x00\x1a\x01z"  # partition key index 0, data "z"
    fixed = b"\x29" + b"\x00" * 8 + b"\x35" + b"\x00" * 4  # a fixed64 and a fixed32 field
    tag = b"\x22\x04\x0a\x02tg"  # Tag {key: "tg"} inside the record
    with_fixed = fixed + b"\x0a\x01k\x1a\x05" + record
    with_tag = b"\x0a\x01k\x1a\x0b" + record + tag
    assert deaggregate(framed(with_fixed)) == [UserRecord("k", None, b"z")]
    assert deaggregate(framed(with_tag)) == [UserRecord("k", None, b"z")]


# --- through the reader on kinesalite ------------------------------------------------------


def one_shard_read(kinesis, stream: str, on_corrupt: str = "fail") -> ShardRead:  # noqa: ANN001
    (shard,) = kinesis.list_shards(StreamName=stream)["Shards"]
    return ShardRead(
        run=uuid.uuid4().hex,
        n=1,
        stream=stream,
        shard_id=shard["ShardId"],
        depth=0,
        start=None,
        initial={"type": "TRIM_HORIZON"},
        max_records=100,
        max_bytes=10 * 1024 * 1024,
        on_corrupt=on_corrupt,
    )


def put(kinesis, stream: str, data: bytes, pk: str = "agg", ehk: str | None = None) -> str:  # noqa: ANN001
    entry = {"Data": data, "PartitionKey": pk, **({"ExplicitHashKey": ehk} if ehk else {})}
    return kinesis.put_record(StreamName=stream, **entry)["SequenceNumber"]


def user_view(records: list[dict]) -> list[tuple]:
    return [
        (
            r["SequenceNumber"],
            r["SubSequenceNumber"],
            r["PartitionKey"],
            r["ExplicitHashKey"],
            r["Data"],
        )
        for r in records
    ]


@pytest.mark.usefixtures("no_pacing")
def test_reader_expands_aggregates_between_plain_records_and_replays_them_alike(
    kinesis, make_stream: Callable[[int], str], location: AppLocation
) -> None:
    stream = make_stream(1)
    first = [UserRecord(f"k{i}", None, f"a{i}".encode()) for i in range(5)]
    second = [UserRecord("k0", str(2**127), b"b0"), UserRecord("k9", None, b"b1")]
    s1 = put(kinesis, stream, b"plain-1", pk="p")
    pk, ehk, data = aggregate(first)
    s2 = put(kinesis, stream, data, pk, ehk)
    s3 = put(kinesis, stream, aggregate(second)[2], pk="k0", ehk=str(2**127))
    s4 = put(kinesis, stream, b"plain-2", pk="q")
    read = one_shard_read(kinesis, stream)
    batch_log = BatchLog(location.table)

    records, end = read_shard(kinesis, batch_log, read)

    expected = (
        [(s1, 0, "p", None, b"plain-1")]
        + [(s2, i, u.partition_key, None, u.data) for i, u in enumerate(first)]
        + [(s3, i, u.partition_key, u.explicit_hash_key, u.data) for i, u in enumerate(second)]
        + [(s4, 0, "q", None, b"plain-2")]
    )
    assert user_view(records) == expected
    assert (end["count"], end["user_records"], end["after"]) == (4, 9, s4)
    again, end_again = read_shard(kinesis, batch_log, read)  # a retried task
    assert user_view(again) == expected
    assert end_again == end


@pytest.mark.usefixtures("no_pacing")
def test_a_corrupt_aggregate_fails_the_read_naming_stream_shard_and_sequence_number(
    kinesis, make_stream: Callable[[int], str], location: AppLocation
) -> None:
    stream = make_stream(1)
    put(kinesis, stream, aggregate([UserRecord("k", None, b"ok")])[2])
    _, _, data = aggregate([UserRecord("k", None, b"lost")])
    bad = put(kinesis, stream, data[:-1] + bytes([data[-1] ^ 0xFF]))
    read = one_shard_read(kinesis, stream)
    batch_log = BatchLog(location.table)

    with pytest.raises(SourceError) as info:
        read_shard(kinesis, batch_log, read)

    message = str(info.value)
    assert f"stream {stream!r} shard {read.shard_id} sequence number {bad}" in message
    assert "MD5" in message and "onCorruptAggregate=skip" in message
    assert batch_log.recorded_end(read.run, read.n, read.shard_key) is None


@pytest.mark.usefixtures("no_pacing")
def test_skip_drops_only_the_corrupt_aggregate_and_logs_it(
    kinesis,
    make_stream: Callable[[int], str],
    location: AppLocation,
    caplog: pytest.LogCaptureFixture,
) -> None:
    stream = make_stream(1)
    good = put(kinesis, stream, aggregate([UserRecord("k", None, b"ok")])[2])
    bad = put(kinesis, stream, MAGIC + b"\x0a\x05ab" + b"\x00" * 16)
    after = put(kinesis, stream, b"plain", pk="p")
    read = one_shard_read(kinesis, stream, on_corrupt="skip")

    with caplog.at_level(logging.WARNING, logger=reader.__name__):
        records, end = read_shard(kinesis, BatchLog(location.table), read)

    assert user_view(records) == [(good, 0, "k", None, b"ok"), (after, 0, "p", None, b"plain")]
    assert end["skipped_aggregates"] == 1
    assert (end["count"], end["user_records"], end["after"]) == (3, 2, after)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"sequence number {bad}" in m and "MD5" in m for m in warned), warned
