"""The one PutRecords loop (`shardless.processor.kinesis.put`) against kinesalite, with a
fault proxy failing single entries: calls within Kinesis' limits, only failed entries put
again, and a persistent or final failure reported with what is left and the codes seen."""

from __future__ import annotations

import json

import boto3
import pytest

from shardless.processor.kinesis.put import (
    MAX_BYTES_PER_CALL,
    MAX_RECORDS_PER_CALL,
    PutRecordsError,
    Retries,
    chunks,
    put_records,
)
from shardless.processor.kinesis.shards import stream_records
from shardless.processor.local.faults.fault_proxy import FaultProxy
from shardless.processor.local.faults.partial_failures import PartialFailure

FAST = Retries(attempts=30, base_delay_s=0.001, max_delay_s=0.01)


def entry(i: int, size: int = 8) -> dict:
    return {"PartitionKey": f"k{i % 7}", "Data": json.dumps({"i": i, "pad": "x" * size}).encode()}


def test_calls_hold_at_most_500_records_and_5_mib():
    assert [len(c) for c in chunks(entry(i) for i in range(1_201))] == [500, 500, 201]
    big = [entry(i, 400_000) for i in range(30)]
    sizes = [sum(len(e["Data"]) + len(e["PartitionKey"]) for e in c) for c in chunks(big)]
    assert len(sizes) == 3 and all(s <= MAX_BYTES_PER_CALL for s in sizes)
    assert max(len(c) for c in chunks(big)) < MAX_RECORDS_PER_CALL


@pytest.fixture
def proxy(aws):  # noqa: ANN001, ANN201
    with FaultProxy(aws.kinesis_endpoint, seed=11) as p:
        yield p


def test_only_failed_entries_are_put_again_until_all_are_in(proxy, make_stream):
    stream = make_stream(2)
    proxy.set_partial(PartialFailure(probability=0.3))
    kinesis = boto3.client("kinesis", endpoint_url=proxy.url)
    calls = put_records(kinesis, stream, [entry(i) for i in range(1_200)], FAST)
    assert proxy.entries_failed > 100
    assert calls == proxy.counts()[("kinesis", "PutRecords")] > 3  # returned = made
    got = sorted(
        json.loads(r["Data"])["i"] for r in stream_records(boto3.client("kinesis"), stream)
    )
    assert got == list(range(1_200))  # each once: a failed entry never reached the stream


def test_entries_still_failing_after_every_attempt_are_reported(proxy, make_stream):
    stream = make_stream(1)
    proxy.set_partial(PartialFailure(probability=1.0))
    kinesis = boto3.client("kinesis", endpoint_url=proxy.url)
    with pytest.raises(PutRecordsError, match="10 of 10 records still failing after 3") as raised:
        put_records(kinesis, stream, [entry(i) for i in range(10)], Retries(3, 0.001, 0.01))
    assert (raised.value.left, raised.value.final) == (10, False)
    assert raised.value.codes == {"ProvisionedThroughputExceededException": 30}
    assert proxy.counts()[("kinesis", "PutRecords")] == 3


def test_a_call_no_retry_can_mend_fails_at_once(aws):  # noqa: ANN001
    calls = []
    kinesis = boto3.client("kinesis")
    kinesis.meta.events.register("before-send.kinesis.PutRecords", lambda **kw: calls.append(1))
    with pytest.raises(PutRecordsError, match="ResourceNotFoundException") as raised:
        put_records(kinesis, "no-such-stream", [entry(0)], FAST)
    assert raised.value.final and raised.value.left == 1
    assert len(calls) == 1
