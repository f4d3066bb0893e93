"""Records a job cannot process: the decoder's and the handler's error policies.

A record the decoder cannot read fails the batch, goes to the dead-letter target, or reaches
the handler raw; a handler that raises fails the batch, is run again, or has its record set
aside with its writes and outputs undone. Compared with a plain-Python fold that skips the
records set aside; nothing is dropped without a dead letter.
"""

from __future__ import annotations

import base64
import json
import uuid

import boto3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardless.processor.api.policies import RecordPolicy
from shardless.processor.driver.config import JobConfig
from shardless.processor.errors import ConfigError, ProcessorError
from shardless.processor.testing import TestDriver
from tests.jobs import job_config


def counting(event, ctx) -> None:  # noqa: ANN001
    """Counts and sums `n` per key; a record with `"boom"` raises after writing, emitting
    (and with `"timer"` setting a timer), so a failed attempt leaves something to undo."""
    body = event.value
    total = ctx.state.get({"count": 0, "sum": 0})
    total = {"count": total["count"] + 1, "sum": total["sum"] + body["n"]}
    ctx.state.set(total)
    ctx.emit(total)
    if body.get("timer"):
        ctx.timers.set(ctx.now_ms + 1_000_000)
    if body.get("boom"):
        raise ValueError(f"poison {body['n']}")


def driver(**policy: object) -> TestDriver:
    return TestDriver(counting, slices=16, policy=RecordPolicy(decoder="json", **policy))


# -- the decoder -------------------------------------------------------------------------


def test_a_record_the_decoder_cannot_read_fails_the_batch_naming_it():
    d = driver()
    d.send("a", {"n": 1})
    d.send("a", b"\xff not json")
    with pytest.raises(ProcessorError, match=r"json decoder cannot read record test/\S+/2\.0 "):
        d.run_batch()


def test_dead_letter_sets_an_unreadable_record_aside_with_its_bytes_and_coordinates(caplog):
    d = driver(on_decode_error="dead-letter")
    d.send("a", {"n": 1})
    d.send("a", b"\xff not json")
    d.send("a", {"n": 2})
    assert d.run_batch() == [("a", {"count": 1, "sum": 1}), ("a", {"count": 2, "sum": 3})]
    (letter,) = d.dead_letters
    assert (letter.stage, letter.data, letter.sequence_number) == ("decode", b"\xff not json", "2")
    assert letter.error.startswith("UnicodeDecodeError") or "JSONDecodeError" in letter.error
    assert d.state("a") == {"count": 2, "sum": 3}
    assert "record test/shardId-000000000000/2.0 (key 'a') set aside" in caplog.text


def test_raw_passes_an_unreadable_record_to_the_handler_with_why():
    seen = []

    def handler(event, ctx) -> None:  # noqa: ANN001
        seen.append((event.value, event.decode_error))

    d = TestDriver(handler, policy=RecordPolicy(decoder="json", on_decode_error="raw"))
    d.send("a", {"n": 1})
    d.send("a", b"{broken")
    d.run_batch()
    assert seen[0] == ({"n": 1}, None)
    assert seen[1][0] == b"{broken" and seen[1][1].startswith("JSONDecodeError")


def test_the_default_decoder_hands_over_the_bytes():
    seen = []
    d = TestDriver(lambda event, ctx: seen.append(event.value))
    d.send("a", b"\x00\x01")
    d.run_batch()
    assert seen == [b"\x00\x01"]


# -- the handler -------------------------------------------------------------------------


def test_a_failing_handler_fails_the_batch_by_default_and_says_how_to_go_on():
    d = driver()
    d.send("a", {"n": 1, "boom": True})
    with pytest.raises(ProcessorError, match="--on-handler-error dead-letter"):
        d.run_batch()


def test_a_handler_that_fails_then_succeeds_is_retried_and_counts_once():
    failures = {"left": 2}

    def flaky(event, ctx) -> None:  # noqa: ANN001
        ctx.state.set(ctx.state.get(0) + 1)
        ctx.emit(ctx.state.get())
        if failures["left"]:
            failures["left"] -= 1
            raise ConnectionError("lookup service down")

    d = TestDriver(flaky, policy=RecordPolicy(handler_retries=2))
    d.send("a", b"x")
    assert d.run_batch() == [("a", 1)]
    assert d.state("a") == 1


def test_retries_run_out_then_the_policy_applies():
    d = driver(handler_retries=3)
    d.send("a", {"n": 1, "boom": True})
    with pytest.raises(ProcessorError, match="after 4 attempt"):
        d.run_batch()
    d = driver(handler_retries=3, on_handler_error="dead-letter")
    d.send("a", {"n": 1, "boom": True})
    assert d.run_batch() == []
    assert [(x.stage, x.attempts, x.error) for x in d.dead_letters] == [
        ("handler", 4, "ValueError: poison 1")
    ]


records = st.lists(
    st.tuples(st.sampled_from("abcd"), st.integers(0, 9), st.sampled_from(["ok", "boom", "bad"])),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(records, st.integers(0, 2))
def test_records_set_aside_leave_no_trace_and_the_rest_equal_a_fold(batch, retries):
    d = driver(
        on_decode_error="dead-letter", on_handler_error="dead-letter", handler_retries=retries
    )
    expected_out, state, aside = [], {}, []
    for i, (key, n, kind) in enumerate(batch, start=1):
        if kind == "bad":
            d.send(key, b"\xfe" + bytes([n]))
            aside.append((str(i), "decode", 1))
            continue
        d.send(key, {"n": n, "boom": kind == "boom", "timer": True})
        if kind == "boom":
            aside.append((str(i), "handler", retries + 1))
            continue
        total = state.get(key, {"count": 0, "sum": 0})
        state[key] = {"count": total["count"] + 1, "sum": total["sum"] + n}
        expected_out.append((key, state[key]))
    out = d.run_batch()
    assert sorted(out, key=str) == sorted(expected_out, key=str)  # slices run in slice order
    for key in "abcd":
        assert d.state(key) == state.get(key)
    assert sorted((x.sequence_number, x.stage, x.attempts) for x in d.dead_letters) == sorted(aside)
    # the timers of failed attempts are undone too: one per key that has state
    assert {k: len(d.timers(k)) for k in "abcd"} == {k: int(k in state) for k in "abcd"}


# -- configuration -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"decoder": "xml"}, "--decoder 'xml'"),
        ({"on_decode_error": "skip"}, "--on-decode-error 'skip'"),
        ({"on_handler_error": "raw"}, "--on-handler-error 'raw'"),
        ({"handler_retries": -1}, "--handler-retries -1"),
        ({"dead_letter": "gs://x"}, "--dead-letter 'gs://x'"),
    ],
)
def test_bad_policies_are_refused_naming_the_option(fields, message):
    with pytest.raises(ConfigError, match=message):
        JobConfig(app="a", streams=("s",), checkpoint="/tmp/x", **fields)


# -- the real job ------------------------------------------------------------------------


def _put(kinesis, stream: str, payloads: list[tuple[str, bytes]]) -> None:  # noqa: ANN001
    out = kinesis.put_records(
        StreamName=stream, Records=[{"PartitionKey": k, "Data": d} for k, d in payloads]
    )
    assert out["FailedRecordCount"] == 0


def _run(spark, cfg: JobConfig, tmp_path, handler) -> None:  # noqa: ANN001
    from shardless.processor.api.handlers import HandlerFactory
    from shardless.processor.driver.job import parquet_sink, start

    query = start(
        spark,
        HandlerFactory(handler),
        cfg,
        sink=parquet_sink(str(tmp_path / "out")),
        available_now=True,
    )
    query.awaitTermination()


@pytest.mark.slow
def test_the_job_sets_poison_records_aside_in_s3_and_counts_the_rest_once(
    spark, kinesis, make_stream, location, tmp_path
):
    stream = make_stream(2)
    payloads: list[tuple[str, bytes]] = []
    for i in range(300):
        key = f"user-{i % 23}"
        if i % 37 == 5:
            payloads.append((key, b"\x80 not json %d" % i))
        else:
            payloads.append((key, json.dumps({"n": i, "boom": i % 41 == 7}).encode()))
    _put(kinesis, stream, payloads)
    cfg = job_config(
        location,
        (stream,),
        tmp_path,
        max_records_per_shard=100,
        decoder="json",
        on_decode_error="dead-letter",
        on_handler_error="dead-letter",
        handler_retries=1,
    )
    _run(spark, cfg, tmp_path, counting)

    expected: dict[str, dict] = {}
    bad, boom = set(), set()
    for i, (key, data) in enumerate(payloads):
        if i % 37 == 5:
            bad.add(data)
            continue
        if i % 41 == 7:
            boom.add(data)
            continue
        t = expected.get(key, {"count": 0, "sum": 0})
        expected[key] = {"count": t["count"] + 1, "sum": t["sum"] + i}
    from shardless.processor.local import demo

    rebuilt, _ = demo.durable_state(cfg, tmp_path / "verify")
    assert rebuilt == expected

    s3 = boto3.client("s3")
    prefix = f"{location.prefix}/dead-letter/"
    letters = []
    for obj in s3.list_objects_v2(Bucket=location.bucket, Prefix=prefix).get("Contents", []):
        body = s3.get_object(Bucket=location.bucket, Key=obj["Key"])["Body"].read()
        letters += [json.loads(line) for line in body.decode().splitlines()]
    got = {(x["stage"], base64.b64decode(x["data"])) for x in letters}
    assert got == {("decode", d) for d in bad} | {("handler", d) for d in boom}
    assert len(letters) == len(bad) + len(boom)  # one letter each, though batches retry
    assert all(x["stream"] == stream and x["shard"].startswith("shardId-") for x in letters)
    assert all(x["attempts"] == 2 for x in letters if x["stage"] == "handler")


@pytest.mark.slow
def test_the_job_fails_on_an_unreadable_record_by_default_and_commits_nothing_of_it(
    spark, kinesis, make_stream, location, tmp_path
):
    stream = make_stream(1)
    _put(kinesis, stream, [("k", b'{"n": 1}'), ("k", b"garbage-" + uuid.uuid4().hex.encode())])
    cfg = job_config(location, (stream,), tmp_path, decoder="json")
    with pytest.raises(Exception, match=rf"json decoder cannot read record {stream}/"):
        _run(spark, cfg, tmp_path, counting)
    from shardless.changelog.durable import DurableState

    heads = DurableState(location).heads(list(range(16)))
    assert all(h is None or h.version == 0 for h in heads.values())
