"""The fault proxy's own per-rule counts and partial PutRecords failures, against kinesalite:
several rules on one operation counted apart, entries failed and kept out of the stream (or
written anyway with `applied`), for `times` calls, and counters reset together."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from shardless.processor.kinesis.shards import stream_records
from shardless.processor.local.emulators import LocalAws
from shardless.processor.local.faults.fault_proxy import FaultProxy
from shardless.processor.local.faults.partial_failures import PartialFailure
from shardless.processor.local.faults.rules import Rule

ONE_TRY = Config(retries={"total_max_attempts": 1, "mode": "standard"})


def entries(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [
        {"PartitionKey": f"k{i}", "Data": json.dumps({"i": i}).encode()}
        for i in range(start, start + n)
    ]


def stored(stream: str) -> list[int]:
    return sorted(
        json.loads(r["Data"])["i"] for r in stream_records(boto3.client("kinesis"), stream)
    )


def test_rules_on_one_operation_are_counted_each(aws: LocalAws, make_stream: Any) -> None:
    stream = make_stream(1)
    first = Rule("kinesis", "PutRecord", status=500, times=1)
    second = Rule("kinesis", "PutRecord", error="ProvisionedThroughputExceededException", times=2)
    with FaultProxy(aws.kinesis_endpoint, [first, second]) as proxy:
        kinesis = boto3.client("kinesis", endpoint_url=proxy.url, config=ONE_TRY)
        for _ in range(4):
            with contextlib.suppress(ClientError):
                kinesis.put_record(StreamName=stream, Data=b"r", PartitionKey="p")
        assert (proxy.fired(first), proxy.fired(second)) == (1, 2)
        assert proxy.fired(Rule("kinesis", "PutRecord", status=500, times=1)) == 1  # equal rule
        assert proxy.injected() == {("kinesis", "PutRecord"): 3}
        proxy.reset_counts()
        assert (proxy.fired(first), proxy.fired(second), proxy.counts()) == (0, 0, {})


def test_failed_entries_stay_out_of_the_stream_for_times_calls(
    aws: LocalAws, make_stream: Any
) -> None:
    stream = make_stream(1)
    partial = PartialFailure(probability=0.5, times=2)
    with FaultProxy(aws.kinesis_endpoint, seed=2, partial=partial) as proxy:
        kinesis = boto3.client("kinesis", endpoint_url=proxy.url, config=ONE_TRY)
        answers = [
            kinesis.put_records(StreamName=stream, Records=entries(20, 20 * k)) for k in range(4)
        ]

        failed = [
            i + 20 * k
            for k, a in enumerate(answers)
            for i, r in enumerate(a["Records"])
            if "ErrorCode" in r
        ]
        assert [a["FailedRecordCount"] for a in answers][2:] == [0, 0]
        assert len(failed) == sum(a["FailedRecordCount"] for a in answers) == proxy.entries_failed
        assert proxy.entries_dropped == proxy.entries_failed and proxy.calls_altered == 2
        assert stored(stream) == sorted(set(range(80)) - set(failed))
        assert proxy.counts() == proxy.forwarded() == {("kinesis", "PutRecords"): 4}

        proxy.reset_counts()
        assert (proxy.entries_failed, proxy.entries_dropped, proxy.calls_altered) == (0, 0, 0)


def test_applied_failures_are_written_and_reported_failed(aws: LocalAws, make_stream: Any) -> None:
    stream = make_stream(1)
    with FaultProxy(aws.kinesis_endpoint, seed=4) as proxy:
        proxy.set_partial(PartialFailure(probability=1.0, error="InternalFailure", applied=True))
        kinesis = boto3.client("kinesis", endpoint_url=proxy.url, config=ONE_TRY)
        answer = kinesis.put_records(StreamName=stream, Records=entries(5))
        assert answer["FailedRecordCount"] == 5
        assert {r["ErrorCode"] for r in answer["Records"]} == {"InternalFailure"}
        assert (proxy.entries_failed, proxy.entries_dropped) == (5, 0)
        assert stored(stream) == list(range(5))

        proxy.set_partial(None)
        assert (
            kinesis.put_records(StreamName=stream, Records=entries(3, 5))["FailedRecordCount"] == 0
        )
        assert stored(stream) == list(range(8))


def test_a_partial_failure_is_checked_when_made() -> None:
    with pytest.raises(ValueError, match="probability"):
        PartialFailure(probability=0)
    with pytest.raises(ValueError, match="Kinesis fails entries"):
        PartialFailure(error="SlowDown")
