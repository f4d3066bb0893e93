"""The source's Kinesis client parses GetRecords itself: the same answers as botocore's."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC

import boto3
import pytest
from botocore.exceptions import ClientError
from botocore.parsers import JSONParser

from shardless.processor.kinesis.client import kinesis_client


def first_iterator(kinesis, stream: str) -> str:  # noqa: ANN001
    shard = kinesis.list_shards(StreamName=stream)["Shards"][0]["ShardId"]
    return kinesis.get_shard_iterator(
        StreamName=stream, ShardId=shard, ShardIteratorType="TRIM_HORIZON"
    )["ShardIterator"]


def test_get_records_parses_to_what_botocore_gives(
    kinesis, make_stream: Callable[[int], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = make_stream(1)
    payloads = [b"", b"\x00\xff binary \n", "ünïcode".encode(), bytes(range(256)) * 40]
    for i, data in enumerate(payloads):
        kinesis.put_record(StreamName=stream, PartitionKey=f"key-{i}", Data=data)
    ours, stock = kinesis_client(), boto3.client("kinesis")

    want = stock.get_records(ShardIterator=first_iterator(stock, stream), Limit=100)
    iterator = first_iterator(ours, stream)
    with monkeypatch.context() as patch:  # the direct path: botocore's model walk is not used

        def refuse(*_: object) -> None:
            raise AssertionError("botocore's generic parser parsed GetRecords")

        patch.setattr(JSONParser, "_parse_shape", refuse)
        got = ours.get_records(ShardIterator=iterator, Limit=100)

    assert [r["Data"] for r in got["Records"]] == payloads
    assert len(got["Records"]) == len(want["Records"])
    for mine, theirs in zip(got["Records"], want["Records"], strict=True):
        assert set(mine) == set(theirs)
        for name, value in theirs.items():
            assert type(mine[name]) is type(value), name
            assert mine[name] == value, name  # datetimes: the same instant
        assert mine["ApproximateArrivalTimestamp"].tzinfo is UTC
    assert got["MillisBehindLatest"] == want["MillisBehindLatest"]
    assert isinstance(got["NextShardIterator"], str)
    assert got["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert got["ResponseMetadata"]["RequestId"] == got["ResponseMetadata"]["HTTPHeaders"].get(
        "x-amzn-requestid"
    )


def test_errors_and_other_operations_go_through_botocore(
    kinesis, make_stream: Callable[[int], str]
) -> None:
    stream = make_stream(1)
    ours = kinesis_client()
    assert (
        ours.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]["StreamName"]
        == stream
    )
    with pytest.raises(ClientError) as caught:
        ours.get_records(ShardIterator="not-an-iterator" * 10)
    assert caught.value.response["Error"]["Code"] in (
        "InvalidArgumentException",
        "ValidationException",
    )
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
