"""Typed outputs: an app that declares its output schema gets its outputs as real columns
in the sink, and a value that does not fit is refused where it is emitted, before the
batch commits, naming the app, the field and the key (real Spark, emulated AWS)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

from shardless.processor.api.app import load_handler
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.api.policies import RecordPolicy
from shardless.processor.driver.job import parquet_sink, start
from shardless.processor.errors import AppError
from shardless.processor.testing import TestDriver
from tests.jobs import job_config

SCHEMA = "user STRING, events BIGINT, total DOUBLE"
DECLARED = StructType(
    [
        StructField("user", StringType()),
        StructField("events", LongType()),
        StructField("total", DoubleType()),
    ]
)
APP = f'''
output_schema = "{SCHEMA}"


def process(event, ctx):
    record = event.json()
    seen = ctx.state.get({{"events": 0, "total": 0.0}})
    seen["events"] += 1
    seen["total"] += record["amount"]
    ctx.state.set(seen)
    if record.get("bad"):  # a handler bug: the total as text
        seen["total"] = str(seen["total"])
    ctx.emit({{"user": event.key, **seen}})
'''


def write_app(tmp_path: Path) -> Path:
    path = tmp_path / "typed_app.py"
    path.write_text(APP)
    return path


def produce(kinesis, stream: str, n: int, bad_key: str | None = None) -> list[tuple[str, float]]:
    """`n` records over 12 users, amounts in quarters (exact in binary); with `bad_key`,
    that user's records ask the handler to emit a wrong type. Returns (user, amount) in
    the order put, which is each user's stream order."""
    sent = [(f"user-{i % 12}", (i % 7) * 0.25) for i in range(n)]
    for lo in range(0, n, 250):
        records = [
            {
                "PartitionKey": user,
                "Data": json.dumps({"amount": amount, "bad": user == bad_key}).encode(),
            }
            for user, amount in sent[lo : lo + 250]
        ]
        assert kinesis.put_records(StreamName=stream, Records=records)["FailedRecordCount"] == 0
    return sent


def running_fold(sent: list[tuple[str, float]]) -> dict[str, list[tuple[int, float]]]:
    """Per user, the (events, total) after each of its records: what the app emits."""
    out: dict[str, list[tuple[int, float]]] = {}
    for user, amount in sent:
        steps = out.setdefault(user, [])
        events, total = steps[-1] if steps else (0, 0.0)
        steps.append((events + 1, total + amount))
    return out


def emitted(rows) -> dict[str, list[tuple[int, float]]]:  # noqa: ANN001
    """Per user, its outputs' (events, total) in emission order: (batch_id, seq), the
    user's slice being one."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in sorted(rows, key=lambda r: (r["batch_id"], r["slice"], r["seq"])):
        assert r["key"] == r["user"]
        out.setdefault(r["user"], []).append((r["events"], r["total"]))
    return out


@pytest.mark.slow
def test_declared_schema_becomes_the_parquet_columns_holding_the_fold(
    spark, kinesis, make_stream, location, tmp_path
):
    stream = make_stream(2)
    sent = produce(kinesis, stream, 600)
    cfg = job_config(location, (stream,), tmp_path, max_records_per_shard=120)
    out = str(tmp_path / "out")
    query = start(
        spark, load_handler(write_app(tmp_path)), cfg, parquet_sink(out), available_now=True
    )
    query.awaitTermination()

    written = spark.read.parquet(out)
    fields = {f.name: f for f in written.schema.fields}
    assert [fields[f.name] for f in DECLARED.fields] == DECLARED.fields
    assert set(fields) == {"slice", "seq", "key", "batch_id", *DECLARED.fieldNames()}
    assert "value" not in fields
    rows = written.collect()
    assert len({r["batch_id"] for r in rows}) >= 3
    assert emitted(rows) == running_fold(sent)


@pytest.mark.slow
def test_a_value_that_does_not_fit_fails_the_batch_naming_app_field_and_key(
    spark, kinesis, make_stream, location, tmp_path, capsys
):
    from shardless.processor import cli

    stream = make_stream(1)
    produce(kinesis, stream, 30, bad_key="user-5")
    out = tmp_path / "out"
    code = cli.main(
        [
            "run", str(write_app(tmp_path)), "--app", location.app, "--stream", stream,
            "--slices", "16", "--groups", "4", "--available-now", "--output", str(out),
            "--checkpoint", str(tmp_path / "ck"), "--local-dir", str(tmp_path / "st"),
        ]
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert err.startswith(f"shardless: handler failed on record {stream}/shardId-000000000000/")
    assert "(key 'user-5', slice" in err
    assert (
        f"OutputSchemaError: app {location.app!r}: output for key 'user-5' does not fit the "
        "declared output schema: field 'total' must be DOUBLE, got str '1.25'" in err
    )
    # Nothing of the batch reached the sink: its write (the batch's one read) was aborted.
    assert [str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()] == []


def typed_process(event, ctx) -> None:  # noqa: ANN001
    n = ctx.state.get(0) + 1
    ctx.state.set(n)
    ctx.emit({"user": event.key, "events": n if event.json().get("ok", True) else None})


STRICT = StructType([StructField("user", StringType()), StructField("events", LongType(), False)])


def test_a_struct_type_schema_is_checked_by_the_test_driver():
    with TestDriver(HandlerFactory(typed_process, output_schema=STRICT)) as t:
        t.send("u1", {})
        assert t.run_batch() == [("u1", {"user": "u1", "events": 1})]
        t.send("u1", {"ok": False})
        with pytest.raises(
            Exception, match="key 'u1'.*field 'events' is None, but is declared NOT NULL"
        ):
            t.run_batch()


def test_a_value_that_does_not_fit_is_dead_lettered_with_its_record_undone():
    policy = RecordPolicy(on_handler_error="dead-letter")
    with TestDriver(HandlerFactory(typed_process, output_schema=STRICT), policy=policy) as t:
        t.send("u1", {})
        t.send("u2", {"ok": False})
        t.send("u1", {})
        assert t.run_batch() == [
            ("u1", {"user": "u1", "events": 1}),
            ("u1", {"user": "u1", "events": 2}),
        ]
        assert t.state("u2") is None  # its write undone with the record
        [letter] = t.dead_letters
        assert letter.partition_key == "u2" and letter.stage == "handler"
        assert letter.error.startswith("OutputSchemaError: output for key 'u2'")


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (StructType([StructField("key", StringType())]), r"\['key'\] would take"),
        (StructType([]), "declares no fields"),
        ("user STRING", None),
        (42, "must be a Spark DDL string"),
    ],
)
def test_output_schemas_are_checked_when_declared(schema, message):
    if message is None:
        assert HandlerFactory(typed_process, output_schema=schema).output_check() is None
        return
    with pytest.raises(AppError, match=message):
        HandlerFactory(typed_process, output_schema=schema)


@pytest.mark.slow
def test_the_kinesis_sink_writes_typed_fields_as_its_json_value(spark, kinesis, make_stream):
    from shardless.processor.driver.typed_outputs import shaped
    from shardless.processor.kinesis.sink import kinesis_sink
    from tests.processor.kinesis.test_kinesis_sink import read_stream

    stream = make_stream(1)
    value = json.dumps({"user": "user-1", "events": 2, "total": 0.5})
    rows = spark.createDataFrame(
        [(3, 4, 0, "user-1", value)], "slice int, batch_id long, seq int, key string, value string"
    )
    kinesis_sink(stream, query_id="q")(shaped(rows, DECLARED), 4)
    [(key, data)] = read_stream(kinesis, stream)
    assert key == "user-1"
    assert data == {
        "query": "q",
        "batch_id": 4,
        "seq": (3 << 32) | 0,
        "key": "user-1",
        "value": {"user": "user-1", "events": 2, "total": 0.5},
    }
