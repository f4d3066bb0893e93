"""The fault proxy: real boto3 clients, through the proxy, to moto server and kinesalite."""

from __future__ import annotations

import io
import json
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.client import BaseClient
from botocore.config import Config
from botocore.exceptions import ClientError
from botocore.retries.standard import ExponentialBackoff

from shardless.processor.local.emulators import LocalAws
from shardless.processor.local.faults.aws_answers import error_answer, unprocessed_answer
from shardless.processor.local.faults.fault_proxy import FaultProxy
from shardless.processor.local.faults.rules import Call, Rule, classify


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Standard-mode retries sleep up to 1 s, 2 s, ... after throttling; the retry decisions
    are what is under test, not the sleeps."""
    monkeypatch.setattr(ExponentialBackoff, "delay_amount", lambda self, context: 0.0)


@pytest.fixture
def proxy(aws: LocalAws) -> Iterator[FaultProxy]:
    with FaultProxy(aws.s3_endpoint) as p:  # moto serves S3 and DynamoDB on one port
        yield p


def through(proxy: FaultProxy, service: str, attempts: int = 5) -> BaseClient:
    """A client via the proxy making at most `attempts` tries in all. (botocore's
    retries["max_attempts"] counts retries only, one less than AWS_MAX_ATTEMPTS would.)"""
    config = Config(retries={"total_max_attempts": attempts, "mode": "standard"})
    return boto3.client(service, endpoint_url=proxy.url, config=config)


@pytest.fixture
def bucket(aws: LocalAws) -> str:
    name = f"fp-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


@pytest.fixture
def table(aws: LocalAws) -> str:
    name = f"fp-{uuid.uuid4().hex[:10]}"
    boto3.client("dynamodb").create_table(
        TableName=name,
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    return name


def item(pk: str, value: str = "v") -> dict[str, Any]:
    return {"pk": {"S": pk}, "value": {"S": value}}


# --- pure parts -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "target", "headers", "expected"),
    [
        ("GET", "/", {}, ("s3", "ListBuckets", "")),
        ("PUT", "/b", {}, ("s3", "CreateBucket", "b")),
        ("HEAD", "/b", {}, ("s3", "HeadBucket", "b")),
        ("GET", "/b?list-type=2&prefix=x%2F", {}, ("s3", "ListObjectsV2", "b")),
        ("GET", "/b?prefix=x", {}, ("s3", "ListObjects", "b")),
        ("GET", "/b?versioning", {}, ("s3", "GetBucketVersioning", "b")),
        ("PUT", "/b?lifecycle", {}, ("s3", "PutBucketLifecycleConfiguration", "b")),
        ("POST", "/b?delete", {}, ("s3", "DeleteObjects", "b")),
        ("PUT", "/b/dir/k%201", {}, ("s3", "PutObject", "b/dir/k 1")),
        ("PUT", "/b/k", {"x-amz-copy-source": "/b/j"}, ("s3", "CopyObject", "b/k")),
        ("PUT", "/b/k?partNumber=1&uploadId=u", {}, ("s3", "UploadPart", "b/k")),
        ("GET", "/b/k", {}, ("s3", "GetObject", "b/k")),
        ("GET", "/b/k?uploadId=u", {}, ("s3", "ListParts", "b/k")),
        ("HEAD", "/b/k", {}, ("s3", "HeadObject", "b/k")),
        ("DELETE", "/b/k", {}, ("s3", "DeleteObject", "b/k")),
        ("POST", "/b/k?uploads", {}, ("s3", "CreateMultipartUpload", "b/k")),
        ("POST", "/b/k?uploadId=u", {}, ("s3", "CompleteMultipartUpload", "b/k")),
        ("GET", "/b/k?x-id=GetObjectRetention", {}, ("s3", "GetObjectRetention", "b/k")),
        (
            "POST",
            "/",
            {"x-amz-target": "DynamoDB_20120810.TransactWriteItems"},
            ("dynamodb", "TransactWriteItems", ""),
        ),
        (
            "POST",
            "/",
            {"x-amz-target": "Kinesis_20131202.GetRecords"},
            ("kinesis", "GetRecords", ""),
        ),
    ],
)
def test_classify_names_service_and_operation(
    method: str, target: str, headers: dict[str, str], expected: tuple[str, str, str]
) -> None:
    assert classify(method, target, headers) == Call(*expected)


def test_error_answers_are_shaped_like_each_service() -> None:
    status, headers, body = error_answer(Call("s3", "PutObject", "b/k"), 503, None, "PUT")
    assert status == 503
    assert b"<Code>SlowDown</Code>" in body and ("Content-Type", "application/xml") in headers
    assert error_answer(Call("s3", "HeadObject", "b/k"), 500, None, "HEAD")[2] == b""

    status, headers, body = error_answer(Call("dynamodb", "PutItem", ""), 400, None)
    assert status == 400
    assert json.loads(body)["__type"] == (
        "com.amazonaws.dynamodb.v20120810#ProvisionedThroughputExceededException"
    )
    assert "x-amz-crc32" in dict(headers)

    status, _, body = error_answer(
        Call("kinesis", "GetRecords", ""),
        None,
        "ExpiredIteratorException",
        "POST",
        "application/x-amz-json-1.1",
    )
    assert (status, json.loads(body)["__type"]) == (400, "ExpiredIteratorException")


def test_rule_needs_exactly_one_action() -> None:
    with pytest.raises(ValueError, match="exactly one action"):
        Rule("s3", "PutObject")
    with pytest.raises(ValueError, match="exactly one action"):
        Rule("s3", "PutObject", status=500, drop=True)
    with pytest.raises(ValueError, match="BatchGetItem answers only"):
        Rule("dynamodb", "TransactWriteItems", unprocessed=3)
    with pytest.raises(ValueError, match="BatchGetItem answers only"):
        Rule("dynamodb", "BatchGetItem", unprocessed=3, after=True)


def test_an_unprocessed_answer_moves_the_last_keys_with_their_tables_settings() -> None:
    """Keys move from the end of the request, across its tables, whether or not an item was
    found; what is left is what DynamoDB answered for the others."""
    request = {
        "RequestItems": {
            "a": {"Keys": [{"pk": {"S": k}} for k in "xyz"], "ConsistentRead": True},
            "b": {"Keys": [{"pk": {"S": "p"}, "sk": {"N": "1"}}], "ProjectionExpression": "v"},
        }
    }
    answer = {
        "Responses": {
            "a": [item(k) for k in "xz"],  # y has no item
            "b": [{"pk": {"S": "p"}, "sk": {"N": "1"}, "v": {"S": "1"}}],
        },
        "UnprocessedKeys": {},
    }
    got = json.loads(
        unprocessed_answer(json.dumps(request).encode(), json.dumps(answer).encode(), 3)
    )
    assert got["Responses"] == {"a": [item("x")], "b": []}
    assert got["UnprocessedKeys"] == {
        "a": {"Keys": [{"pk": {"S": "y"}}, {"pk": {"S": "z"}}], "ConsistentRead": True},
        "b": {"Keys": [{"pk": {"S": "p"}, "sk": {"N": "1"}}], "ProjectionExpression": "v"},
    }
    everything = json.loads(
        unprocessed_answer(json.dumps(request).encode(), json.dumps(answer).encode(), 99)
    )
    assert everything["Responses"] == {"a": [], "b": []}
    assert everything["UnprocessedKeys"]["a"]["Keys"] == request["RequestItems"]["a"]["Keys"]


# --- through the proxy ------------------------------------------------------------------------


def test_objects_round_trip_byte_exact_including_ranged_get(proxy: FaultProxy, bucket: str) -> None:
    s3 = through(proxy, "s3")
    data = random.Random(1).randbytes(300_000)
    s3.put_object(Bucket=bucket, Key="dir/seg 1", Body=data)

    assert s3.get_object(Bucket=bucket, Key="dir/seg 1")["Body"].read() == data
    ranged = s3.get_object(Bucket=bucket, Key="dir/seg 1", Range="bytes=1000-70999")
    assert ranged["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert ranged["Body"].read() == data[1000:71000]
    assert s3.head_object(Bucket=bucket, Key="dir/seg 1")["ContentLength"] == len(data)
    listed = s3.list_objects_v2(Bucket=bucket, Prefix="dir/")["Contents"]
    assert [(o["Key"], o["Size"]) for o in listed] == [("dir/seg 1", len(data))]
    s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": "dir/seg 1"}]})

    assert proxy.counts() == {
        ("s3", "PutObject"): 1,
        ("s3", "GetObject"): 2,
        ("s3", "HeadObject"): 1,
        ("s3", "ListObjectsV2"): 1,
        ("s3", "DeleteObjects"): 1,
    }
    assert proxy.injected() == {}


def test_aws_chunked_streaming_upload_is_relayed(proxy: FaultProxy, bucket: str) -> None:
    """botocore only sends aws-chunked bodies with a trailing checksum over TLS; force it here
    so the proxy sees the same HTTP-chunked, aws-chunked, Expect: 100-continue upload, and
    fail the first one so the stream is rewound and sent again."""
    s3 = through(proxy, "s3")
    sent: list[dict[str, str]] = []

    def use_trailer(params: dict[str, Any], **_: Any) -> None:
        params["context"]["checksum"]["request_algorithm"]["in"] = "trailer"

    s3.meta.events.register("before-call.s3.PutObject", use_trailer)
    s3.meta.events.register(
        "before-send.s3.PutObject",
        lambda request, **_: sent.append(
            {k: v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}
        ),
    )
    data = random.Random(2).randbytes(200_000)
    proxy.add(Rule("s3", "PutObject", status=503, times=1))
    s3.put_object(Bucket=bucket, Key="chunked", Body=io.BytesIO(data))

    assert len(sent) == 2
    assert sent[1]["Transfer-Encoding"] == "chunked"
    assert "aws-chunked" in sent[1]["Content-Encoding"]
    assert sent[1]["Expect"] == "100-continue"
    assert proxy.forwarded() == {("s3", "PutObject"): 1}
    assert boto3.client("s3").get_object(Bucket=bucket, Key="chunked")["Body"].read() == data


def test_slowdown_twice_on_put_object_is_retried_then_stored(
    proxy: FaultProxy, bucket: str
) -> None:
    proxy.add(Rule("s3", "PutObject", status=503, times=2))
    reply = through(proxy, "s3").put_object(Bucket=bucket, Key="k", Body=b"payload")

    assert reply["ResponseMetadata"]["RetryAttempts"] == 2
    assert proxy.counts()[("s3", "PutObject")] == 3
    assert proxy.injected() == {("s3", "PutObject"): 2}
    assert proxy.forwarded() == {("s3", "PutObject"): 1}
    assert boto3.client("s3").get_object(Bucket=bucket, Key="k")["Body"].read() == b"payload"


def test_throughput_exceeded_twice_on_transact_write_is_retried_then_applied(
    proxy: FaultProxy, table: str
) -> None:
    proxy.add(Rule("dynamodb", "TransactWriteItems", status=400, times=2))
    ddb = through(proxy, "dynamodb")
    ddb.transact_write_items(
        TransactItems=[{"Put": {"TableName": table, "Item": item(pk)}} for pk in ("a", "b")]
    )

    assert proxy.counts()[("dynamodb", "TransactWriteItems")] == 3
    assert proxy.injected() == {("dynamodb", "TransactWriteItems"): 2}
    got = ddb.batch_get_item(
        RequestItems={table: {"Keys": [{"pk": {"S": "a"}}, {"pk": {"S": "b"}}]}}
    )
    assert sorted(i["pk"]["S"] for i in got["Responses"][table]) == ["a", "b"]


def test_a_partly_processed_batch_get_reaches_the_client_as_dynamodb_sends_it(
    proxy: FaultProxy, table: str
) -> None:
    """botocore accepts the rewritten answer (its CRC32 and length are the new body's) and
    the client sees the last two keys unprocessed, ready to send again."""
    boto3.client("dynamodb").transact_write_items(
        TransactItems=[{"Put": {"TableName": table, "Item": item(pk)}} for pk in "abcd"]
    )
    proxy.add(Rule("dynamodb", "BatchGetItem", unprocessed=2, times=1))
    ddb = through(proxy, "dynamodb")
    keys = [{"pk": {"S": pk}} for pk in "abcd"]
    got = ddb.batch_get_item(RequestItems={table: {"Keys": keys, "ConsistentRead": True}})
    assert sorted(i["pk"]["S"] for i in got["Responses"][table]) == ["a", "b"]
    again = got["UnprocessedKeys"]
    assert again == {table: {"Keys": keys[2:], "ConsistentRead": True}}
    rest = ddb.batch_get_item(RequestItems=again)
    assert sorted(i["pk"]["S"] for i in rest["Responses"][table]) == ["c", "d"]
    assert not rest["UnprocessedKeys"]
    assert proxy.injected() == {("dynamodb", "BatchGetItem"): 1}


def test_persistent_500_fails_after_exactly_max_attempts(proxy: FaultProxy, bucket: str) -> None:
    proxy.add(Rule("s3", "GetObject", status=500))
    with pytest.raises(ClientError) as raised:
        through(proxy, "s3", attempts=4).get_object(Bucket=bucket, Key="missing")

    assert raised.value.response["Error"]["Code"] == "InternalError"
    assert raised.value.response["ResponseMetadata"]["RetryAttempts"] == 3
    assert proxy.counts() == {("s3", "GetObject"): 4}
    assert proxy.forwarded() == {}


def test_error_after_forwarding_applies_the_write_the_client_saw_fail(
    proxy: FaultProxy, table: str
) -> None:
    proxy.add(Rule("dynamodb", "PutItem", status=500, after=True, times=1))
    with pytest.raises(ClientError) as raised:
        through(proxy, "dynamodb", attempts=1).put_item(TableName=table, Item=item("once"))

    assert raised.value.response["Error"]["Code"] == "InternalServerError"
    direct = boto3.client("dynamodb")
    assert direct.get_item(TableName=table, Key={"pk": {"S": "once"}})["Item"] == item("once")

    # The retried conditional write now collides with its own first, applied, attempt.
    proxy.add(Rule("dynamodb", "PutItem", key_contains='"twice"', status=500, after=True, times=1))
    with pytest.raises(ClientError) as raised:
        through(proxy, "dynamodb").put_item(
            TableName=table, Item=item("twice"), ConditionExpression="attribute_not_exists(pk)"
        )
    assert raised.value.response["Error"]["Code"] == "ConditionalCheckFailedException"
    assert proxy.forwarded() == {("dynamodb", "PutItem"): 3}


def test_probability_rules_are_deterministic_for_a_seed(aws: LocalAws, bucket: str) -> None:
    boto3.client("s3").put_object(Bucket=bucket, Key="k", Body=b"x")

    def failures(seed: int) -> list[bool]:
        rule = Rule("s3", "HeadObject", status=503, probability=0.5)
        with FaultProxy(aws.s3_endpoint, [rule], seed=seed) as proxy:
            s3 = through(proxy, "s3", attempts=1)
            pattern = []
            for _ in range(24):
                try:
                    s3.head_object(Bucket=bucket, Key="k")
                    pattern.append(False)
                except ClientError:
                    pattern.append(True)
            assert proxy.injected().get(("s3", "HeadObject"), 0) == sum(pattern)
            return pattern

    first = failures(seed=3)
    assert failures(seed=3) == first
    assert failures(seed=4) != first
    assert 0 < sum(first) < len(first)


def test_dropped_connection_is_retried_and_rules_clear_at_runtime(
    proxy: FaultProxy, table: str
) -> None:
    ddb = through(proxy, "dynamodb")
    ddb.put_item(TableName=table, Item=item("k"))
    proxy.add(Rule("dynamodb", "GetItem", drop=True, times=1))
    assert ddb.get_item(TableName=table, Key={"pk": {"S": "k"}})["Item"] == item("k")
    assert proxy.counts()[("dynamodb", "GetItem")] == 2

    proxy.add(Rule("dynamodb", "GetItem", status=500))
    with pytest.raises(ClientError):
        through(proxy, "dynamodb", attempts=1).get_item(TableName=table, Key={"pk": {"S": "k"}})
    proxy.clear()
    assert ddb.get_item(TableName=table, Key={"pk": {"S": "k"}})["Item"] == item("k")


def test_delay_holds_the_request_then_forwards_it(proxy: FaultProxy, bucket: str) -> None:
    proxy.add(Rule("s3", "PutObject", delay_s=0.3, times=1))
    started = time.monotonic()
    through(proxy, "s3").put_object(Bucket=bucket, Key="slow", Body=b"x")

    assert time.monotonic() - started >= 0.3
    assert proxy.forwarded() == {("s3", "PutObject"): 1}


def test_kinesis_errors_surface_as_the_services_own_exceptions(
    aws: LocalAws, make_stream: Any
) -> None:
    stream = make_stream(1)
    with FaultProxy(aws.kinesis_endpoint) as proxy:
        kinesis = through(proxy, "kinesis")
        proxy.add(Rule("kinesis", "PutRecord", status=400, times=1))
        kinesis.put_record(StreamName=stream, Data=b"r", PartitionKey="p")
        assert proxy.counts()[("kinesis", "PutRecord")] == 2

        shard = kinesis.list_shards(StreamName=stream)["Shards"][0]["ShardId"]
        iterator = kinesis.get_shard_iterator(
            StreamName=stream, ShardId=shard, ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        proxy.add(Rule("kinesis", "GetRecords", error="ExpiredIteratorException", times=1))
        with pytest.raises(kinesis.exceptions.ExpiredIteratorException):
            kinesis.get_records(ShardIterator=iterator)
        assert [r["Data"] for r in kinesis.get_records(ShardIterator=iterator)["Records"]] == [b"r"]
