"""Dead-letter targets against moto (S3) and kinesalite (Kinesis) over HTTP, and decoders."""

from __future__ import annotations

import base64
import json
import time
import uuid

import boto3
import pytest

from shardless.processor.api.decoders import decoder, describe
from shardless.processor.errors import ConfigError
from shardless.processor.local.faults.fault_proxy import FaultProxy
from shardless.processor.local.faults.rules import Rule
from shardless.processor.runtime.dead_letter import (
    DeadLetter,
    DeadLetterError,
    KinesisTarget,
    S3Target,
    target,
)


def letters(n: int) -> list[DeadLetter]:
    return [
        DeadLetter(
            stream="in",
            shard="shardId-000000000001",
            sequence_number=f"{4960 + i:056d}",
            subsequence=i % 2,
            partition_key=f"user-{i}",
            slice=i % 16,
            data=b"\xff\x00not json" + bytes([i % 256]),
            stage="decode",
            error="JSONDecodeError: Expecting value: line 1 column 1 (char 0)",
            attempts=1,
        )
        for i in range(n)
    ]


def test_s3_letters_keep_bytes_coordinates_and_error_and_a_retry_rewrites_them(aws):
    bucket = f"dl-{uuid.uuid4().hex[:8]}"
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=bucket)
    t = target(f"s3://{bucket}/dead/")
    assert isinstance(t, S3Target)
    where = t.write("query-1234-abcd", 7, 3, letters(5))
    assert where == f"s3://{bucket}/dead/query-12/000000000007/g00003.jsonl"
    key = where.split("/", 3)[3]
    rows = [json.loads(x) for x in s3.get_object(Bucket=bucket, Key=key)["Body"].iter_lines()]
    assert len(rows) == 5
    assert base64.b64decode(rows[2]["data"]) == letters(5)[2].data
    assert rows[2]["sequence_number"] == letters(5)[2].sequence_number
    assert rows[2]["stage"] == "decode" and rows[2]["error"].startswith("JSONDecodeError")
    assert (rows[2]["batch"], rows[2]["group"], rows[2]["query"]) == (7, 3, "query-1234-abcd")
    t.write("query-1234-abcd", 7, 3, letters(5))  # the batch retried: same object, same rows
    listed = s3.list_objects_v2(Bucket=bucket, Prefix="dead/")["Contents"]
    assert [o["Key"] for o in listed] == [key]


def test_s3_letters_that_cannot_be_written_fail_naming_the_object(aws):
    with pytest.raises(DeadLetterError, match="cannot write 2 dead letters to s3://no-such-"):
        S3Target(f"no-such-{uuid.uuid4().hex[:6]}", "x").write("q", 1, 0, letters(2))


def test_kinesis_letters_survive_throttling_and_carry_their_coordinates(
    aws, kinesis, make_stream, monkeypatch
):
    stream = make_stream(1)
    with FaultProxy(aws.kinesis_endpoint, seed=3) as proxy:
        proxy.add(Rule("kinesis", "PutRecords", status=400, times=2))
        monkeypatch.setenv("AWS_ENDPOINT_URL_KINESIS", proxy.url)
        monkeypatch.setattr(time, "sleep", lambda s: None)
        assert KinesisTarget(stream).write("q", 1, 0, letters(600)) == f"kinesis://{stream}"
        assert proxy.injected()[("kinesis", "PutRecords")] == 2
    shard = kinesis.list_shards(StreamName=stream)["Shards"][0]["ShardId"]
    it = kinesis.get_shard_iterator(
        StreamName=stream, ShardId=shard, ShardIteratorType="TRIM_HORIZON"
    )["ShardIterator"]
    got = kinesis.get_records(ShardIterator=it, Limit=1000)["Records"]
    assert len(got) == 600
    first = json.loads(got[0]["Data"])
    assert got[0]["PartitionKey"] == f"in/shardId-000000000001/{first['sequence_number']}/0"


def test_kinesis_letters_that_keep_failing_fail_naming_the_stream(aws, make_stream, monkeypatch):
    stream = make_stream(1)
    with FaultProxy(aws.kinesis_endpoint) as proxy:
        proxy.add(Rule("kinesis", "PutRecords", status=400))
        monkeypatch.setenv("AWS_ENDPOINT_URL_KINESIS", proxy.url)
        monkeypatch.setattr(time, "sleep", lambda s: None)
        with pytest.raises(
            DeadLetterError,
            match=f"into Kinesis stream '{stream}': 3 of 3 records still failing after 8 attempts",
        ):
            KinesisTarget(stream).write("q", 1, 0, letters(3))


@pytest.mark.parametrize("spec", ["s3://", "kinesis://a/b", "sqs://q", "bucket/prefix"])
def test_bad_targets_are_refused_with_the_forms_that_work(spec):
    with pytest.raises(ConfigError, match="use s3://bucket/prefix or kinesis://stream-name"):
        target(spec)


def test_decoders_read_what_they_can_and_raise_on_the_rest():
    assert decoder("raw")(b"\xff") == b"\xff"
    assert decoder("utf8")("é".encode()) == "é"
    assert decoder("json")(b'{"a": [1]}') == {"a": [1]}
    with pytest.raises(ValueError):
        decoder("json")(b"\xff\x00")
    with pytest.raises(UnicodeDecodeError):
        decoder("utf8")(b"\xff")
    with pytest.raises(ConfigError, match="use one of raw, utf8, json"):
        decoder("avro")
    assert describe(ValueError("a\nb")) == "ValueError: a b"
    assert len(describe(ValueError("x" * 1000))) == 300
