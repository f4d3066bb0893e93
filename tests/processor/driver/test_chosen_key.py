"""An app that chooses its key: records put with the device as partition key (some with an
explicit hash key), state kept per user (`key = "user"`), on real Spark with kinesalite and
moto. The state per user is a plain fold by user; `state get --key`, `export`, `reslice`
and the `TestDriver` find every user in the same slice; per user, each shard's records run
in shard order; a record without the field goes where `--on-decode-error` says."""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from pathlib import Path

import boto3
import pytest

from shardless.changelog.layout import AppLocation
from shardless.processor import cli
from shardless.processor.api.policies import RecordPolicy
from shardless.processor.runtime.routing import route
from shardless.processor.testing import TestDriver

APP = """
key = "user"


def process(event, ctx):
    record = event.json()
    seen = ctx.state.get({"events": 0, "amount": 0, "devices": []})
    seen["events"] += 1
    seen["amount"] += record["amount"]
    if event.partition_key not in seen["devices"]:
        seen["devices"] = sorted([*seen["devices"], event.partition_key])
    ctx.state.set(seen)
    ctx.emit({"user": event.key, "n": record["n"], "shard": event.shard})
"""

FUNCTION_APP = """
def key(record):
    return record.json()["user"]


def process(event, ctx):
    ctx.state.set(ctx.state.get(0) + 1)
"""


def write(tmp_path: Path, text: str, name: str = "per_user.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def produce(kinesis, stream: str, n: int) -> list[tuple[str, dict]]:  # noqa: ANN001
    """`n` records from 9 devices over 13 users (every 50th has no user); every 7th record
    carries an explicit hash key, which must not route it. Returns (device, data) as put."""
    sent = []
    for i in range(n):
        data: dict = {"n": i, "amount": i % 5}
        if i % 50 != 49:
            data["user"] = f"user-{(i * 7) % 13:02d}"
        sent.append((f"dev-{i % 9}", data))
    for lo in range(0, n, 200):
        records = []
        for j, (device, data) in enumerate(sent[lo : lo + 200], lo):
            record = {"PartitionKey": device, "Data": json.dumps(data).encode()}
            if j % 7 == 0:
                record["ExplicitHashKey"] = str((j * 2**120) % 2**128)
            records.append(record)
        assert kinesis.put_records(StreamName=stream, Records=records)["FailedRecordCount"] == 0
    return sent


def fold(sent: list[tuple[str, dict]]) -> dict[str, dict]:
    """Per user, the state the app keeps, in plain Python."""
    out: dict[str, dict] = {}
    for device, data in sent:
        if "user" not in data:
            continue
        seen = out.setdefault(data["user"], {"events": 0, "amount": 0, "devices": []})
        seen["events"] += 1
        seen["amount"] += data["amount"]
        seen["devices"] = sorted({*seen["devices"], device})
    return out


def run(app: Path, stream: str, name: str, tmp_path: Path, *more: str) -> int:
    return cli.main(
        [
            "run", str(app), "--app", name, "--stream", stream, "--slices", "16",
            "--groups", "4", "--available-now", "--max-records-per-shard", "150",
            "--checkpoint", str(tmp_path / f"ck-{name}"), "--local-dir", str(tmp_path / "st"),
            *more,
        ]
    )  # fmt: skip


def state(capsys, *argv: str) -> tuple[int, dict]:  # noqa: ANN001
    capsys.readouterr()
    code = cli.main(["state", *argv, "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(lines[-1]) if lines else {}


@pytest.mark.slow
def test_state_per_chosen_key_is_the_fold_by_user_wherever_it_is_read(
    spark, kinesis, make_stream, location, tmp_path, capsys
):
    stream = make_stream(3)
    sent = produce(kinesis, stream, 900)
    app = write(tmp_path, APP)
    out = tmp_path / "out"
    assert run(app, stream, location.app, tmp_path, "--output", str(out),
               "--on-decode-error", "dead-letter") == 0  # fmt: skip
    expected = fold(sent)
    assert len(expected) == 13

    # state get --key <user>: each user's value, in the slice of its MD5
    for user, value in expected.items():
        code, got = state(capsys, "get", "--app", location.app, "--key", user)
        assert code == 0 and got["value"] == value, user
        assert got["slice"] == route(user, None, 16)
    code, got = state(capsys, "get", "--app", location.app, "--key", "dev-1")
    assert not got["found"]  # nothing is kept under a partition key

    # export lists the users, each in its MD5 slice
    exported = tmp_path / "export.jsonl"
    code, _ = state(capsys, "export", "--app", location.app, "--format", "jsonl",
                    "--out", str(exported))  # fmt: skip
    rows = [json.loads(line) for line in exported.read_text().splitlines()]
    assert {r["key"]: r["value"] for r in rows} == expected
    assert all(r["slice"] == route(r["key"], None, 16) for r in rows)

    # per user, the records of each shard ran in shard (produce) order, over several batches
    outputs = spark.read.parquet(str(out)).collect()
    assert len({r.batch_id for r in outputs}) >= 3
    by_user_shard: dict[tuple[str, str], list[int]] = defaultdict(list)
    for r in sorted(outputs, key=lambda r: (r.batch_id, r.slice, r.seq)):
        value = json.loads(r.value)
        assert r.key == value["user"] and r.slice == route(r.key, None, 16)
        by_user_shard[(r.key, value["shard"])].append(value["n"])
    assert sum(len(v) for v in by_user_shard.values()) == sum(
        e["events"] for e in expected.values()
    )
    assert all(ns == sorted(ns) for ns in by_user_shard.values())

    # the records without a user were set aside, with their partition key and why
    letters = dead_letters(location)
    assert sorted(json.loads(base64_decode(x["data"]))["n"] for x in letters) == [
        i for i in range(900) if i % 50 == 49
    ]
    assert {x["stage"] for x in letters} == {"key"}
    assert all(x["error"] == "no key: it has no field 'user'" for x in letters)
    assert all(x["partition_key"] == f"dev-{json.loads(base64_decode(x['data']))['n'] % 9}"
               for x in letters)  # fmt: skip

    # the TestDriver, given the same app and records, keeps the same state in the same slices
    with TestDriver(app, slices=16, policy=RecordPolicy(on_decode_error="dead-letter")) as t:
        for device, data in sent:
            t.send(device, data)
        t.run_batch()
        assert {user: t.state(user) for user in expected} == expected
        assert len(t.dead_letters) == len(letters)

    # reslice routes each user by its MD5 too: the new generation finds every one
    target = AppLocation.default(f"t-{uuid.uuid4().hex[:10]}")
    code, report = state(capsys, "reslice", "--app", location.app, "--to-app", target.app,
                         "--to-slices", "32", "--apply", "--force")  # fmt: skip
    assert code == 0, report
    for user, value in expected.items():
        code, got = state(capsys, "get", "--app", target.app, "--key", user)
        assert code == 0 and got["value"] == value and got["slice"] == route(user, None, 32)


def base64_decode(text: str) -> bytes:
    import base64

    return base64.b64decode(text)


def dead_letters(location: AppLocation) -> list[dict]:
    s3 = boto3.client("s3")
    listed = s3.list_objects_v2(Bucket=location.bucket, Prefix=f"{location.prefix}/dead-letter/")
    out = []
    for obj in listed.get("Contents", []):
        body = s3.get_object(Bucket=location.bucket, Key=obj["Key"])["Body"].read().decode()
        out += [json.loads(line) for line in body.splitlines()]
    return out


@pytest.mark.slow
def test_a_record_without_the_key_of_a_key_function_fails_the_batch_naming_it(
    spark, kinesis, make_stream, location, tmp_path, capsys
):
    stream = make_stream(1)
    records = [{"user": "u1"}, {"user": "u2"}, {"nobody": 1}]
    for r in records:
        kinesis.put_record(StreamName=stream, PartitionKey="dev-1", Data=json.dumps(r).encode())
    app = write(tmp_path, FUNCTION_APP, "by_function.py")
    assert run(app, stream, location.app, tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"record {stream}/shardId-000000000000/" in err
    assert "has no key: key function key() raised KeyError: 'user'" in err
    assert "(partition key 'dev-1'" in err and "--on-decode-error dead-letter" in err
