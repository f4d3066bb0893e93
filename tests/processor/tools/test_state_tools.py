"""`shardless state ...` and the `shardless_state` data source over state written by the real
job (Spark, kinesalite, moto over HTTP), compared with a plain-Python fold of the stream.

One application is built once for the module (256 slices, several batches, snapshots);
the tests that change state run last, in file order: re-slicing writes new applications,
roll-back and corruption change this one.
"""

from __future__ import annotations

import io
import json
import uuid
from collections import defaultdict
from pathlib import Path

import boto3
import pyarrow.parquet as pq
import pytest

from shardless.changelog import lease, resources
from shardless.changelog.layout import AppLocation
from shardless.processor import cli
from shardless.processor.api.app import load_handler
from shardless.processor.driver import progress
from shardless.processor.driver.config import JobConfig
from shardless.processor.driver.job import parquet_sink, start
from shardless.processor.local import demo
from shardless.processor.runtime.routing import route
from shardless.processor.tools.progress_bar import Bar, render
from shardless.processor.tools.selection import parse_slices
from tests.e2e.test_end_to_end import APP, produce
from tests.jobs import job_config

pytestmark = pytest.mark.slow


class Built:
    """The module's application: its config, outputs and expected states."""

    def __init__(self, cfg: JobConfig, stream: str, out_dir: Path, batches: list[int]):
        self.cfg = cfg
        self.stream = stream
        self.out_dir = out_dir
        self.batches = batches

    @property
    def app(self) -> str:
        return self.cfg.app

    def outputs_by_batch(self, spark) -> dict[int, list[dict]]:  # noqa: ANN001
        out: dict[int, list[dict]] = defaultdict(list)
        for row in spark.read.parquet(str(self.out_dir)).select("batch_id", "value").collect():
            out[row.batch_id].append(json.loads(row.value))
        return out

    def state_after(self, spark, batch: int) -> dict[str, dict]:  # noqa: ANN001
        """Each user's state after `batch`: its last output in batches up to it."""
        state: dict[str, dict] = {}
        for b, outs in self.outputs_by_batch(spark).items():
            if b <= batch:
                for v in outs:
                    if v["count"] > state.get(v["user"], {"count": 0})["count"]:
                        state[v["user"]] = {"count": v["count"], "last_seen": v["last_seen"]}
        return state


def run(spark, cfg: JobConfig, out_dir: Path) -> list[int]:  # noqa: ANN001
    batches: list[int] = []
    query = start(
        spark,
        load_handler(APP),
        cfg,
        sink=parquet_sink(str(out_dir)),
        on_report=lambda r: batches.append(r.batch_id) if r.records else None,
        available_now=True,
    )
    query.awaitTermination()
    return batches


@pytest.fixture(scope="module")
def built(spark, aws, tmp_path_factory) -> Built:  # noqa: ANN001
    kinesis = boto3.client("kinesis")
    tmp = tmp_path_factory.mktemp("state-tools")
    stream = f"s-{uuid.uuid4().hex[:10]}"
    kinesis.create_stream(StreamName=stream, ShardCount=2)
    kinesis.get_waiter("stream_exists").wait(
        StreamName=stream, WaiterConfig={"Delay": 0.1, "MaxAttempts": 100}
    )
    produce(kinesis, stream, 1200, seed=11)
    cfg = JobConfig(
        app=f"st-{uuid.uuid4().hex[:8]}",
        streams=(stream,),
        checkpoint=str(tmp / "checkpoint"),
        slices=256,
        groups=4,
        local_dir=str(tmp / "stores"),
        max_records_per_shard=150,
        snapshot_every=2,
        keep_snapshots=3,
    )
    resources.ensure(cfg.location, cfg.slices)
    batches = run(spark, cfg, tmp / "out")
    assert len(batches) >= 4
    return Built(cfg, stream, tmp / "out", batches)


@pytest.fixture(scope="module")
def expected(built: Built) -> dict[str, dict]:
    state, total = demo.reference_fold(boto3.client("kinesis"), built.stream)
    assert total == 1200
    return state


def state_cmd(capsys, *argv: str) -> tuple[int, dict | str, str]:  # noqa: ANN001
    code = cli.main(["state", *argv])
    out = capsys.readouterr()
    try:
        return code, json.loads(out.out), out.err
    except json.JSONDecodeError:
        return code, out.out, out.err


# ---- read-only commands -------------------------------------------------------------------


def test_ls_lists_every_slice_with_keys_that_add_up_to_the_fold(built, expected, capsys):
    code, data, err = state_cmd(capsys, "ls", "--app", built.app, "--keys", "--json")
    assert code == 0
    assert data["slices"] == 256 and len(data["heads"]) == 256
    with_state = [h for h in data["heads"] if h["version"]]
    assert sum(h["keys"] for h in data["heads"]) == len(expected)
    # every user's slice has state, and no other slice has
    assert {h["slice"] for h in with_state} == {route(u, None, 256) for u in expected}
    assert all(h["owner"] and h["size_bytes"] > 0 and h["committed_at"] for h in with_state)
    assert any(h["snapshots"] for h in with_state)
    assert "[" not in err  # no progress bar with --json
    code, text, _ = state_cmd(capsys, "ls", "--app", built.app)
    assert f"{len(with_state)} of 256 slices committed" in text


def test_get_decodes_one_key_and_reports_a_missing_one(built, expected, capsys):
    user = max(expected, key=lambda u: expected[u]["count"])
    code, data, _ = state_cmd(capsys, "get", "--app", built.app, "--key", user, "--json")
    assert code == 0 and data["found"]
    assert data["value"] == expected[user] and data["slice"] == route(user, None, 256)
    code, data, _ = state_cmd(capsys, "get", "--app", built.app, "--key", "nobody", "--json")
    assert code == 1 and not data["found"] and data["value"] is None


def test_scan_by_prefix_and_range_across_every_slice(built, expected, capsys):
    code, data, _ = state_cmd(
        capsys, "scan", "--app", built.app, "--key-prefix", "user-1", "--limit", "0", "--json"
    )
    assert code == 0
    got = {e["key"]: e["value"] for e in data["entries"]}
    assert got == {u: v for u, v in expected.items() if u.startswith("user-1")}
    code, data, _ = state_cmd(
        capsys, "scan", "--app", built.app, "--start", "user-2", "--stop", "user-3", "--json",
        "--limit", "0",
    )  # fmt: skip
    assert {e["key"] for e in data["entries"]} == {u for u in expected if "user-2" <= u < "user-3"}
    code, data, _ = state_cmd(capsys, "scan", "--app", built.app, "--limit", "5", "--json")
    assert len(data["entries"]) == 5 and data["truncated"]


def test_export_parquet_and_jsonl_hold_exactly_the_fold(built, expected, capsys, tmp_path):
    code, data, _ = state_cmd(
        capsys, "export", "--app", built.app, "--out", str(tmp_path / "pq"), "--json"
    )
    assert code == 0 and data["rows"] == len(expected)
    table = pq.read_table(tmp_path / "pq")
    got = {
        k: json.loads(v)
        for k, v in zip(table["key"].to_pylist(), table["value"].to_pylist(), strict=True)
    }
    assert got == expected
    code, data, _ = state_cmd(
        capsys, "export", "--app", built.app, "--format", "jsonl",
        "--out", str(tmp_path / "state.jsonl"), "--slice", "0-127", "--json",
    )  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "state.jsonl").read_text().splitlines()]
    assert {r["key"]: r["value"] for r in rows} == {
        u: v for u, v in expected.items() if route(u, None, 256) < 128
    }


def test_export_at_an_earlier_batch_is_a_consistent_cut(built, spark, capsys, tmp_path):
    batch = built.batches[-2]
    code, data, _ = state_cmd(
        capsys, "export", "--app", built.app, "--format", "jsonl", "--batch", str(batch),
        "--out", str(tmp_path / "cut.jsonl"), "--json",
    )  # fmt: skip
    assert code == 0, _
    rows = [json.loads(line) for line in (tmp_path / "cut.jsonl").read_text().splitlines()]
    got = {r["key"]: r["value"] for r in rows}
    want = built.state_after(spark, batch)
    assert got == want and len(want) > 0


def test_restore_materialises_a_slice_at_its_head_and_at_an_older_version(
    built, expected, capsys, tmp_path
):
    user = max(expected, key=lambda u: expected[u]["count"])
    s = route(user, None, 256)
    code, data, _ = state_cmd(
        capsys, "restore", "--app", built.app, "--slice", str(s),
        "--dest", str(tmp_path / "head"), "--json",
    )  # fmt: skip
    assert code == 0 and data["keys"] == sum(1 for u in expected if route(u, None, 256) == s)
    assert (tmp_path / "head" / "CURRENT").exists() and data["bytes"] > 0
    code, _, err = state_cmd(
        capsys, "restore", "--app", built.app, "--slice", str(s),
        "--dest", str(tmp_path / "head"), "--json",
    )  # fmt: skip
    assert code == 2 and "not empty" in err
    _, ls, _ = state_cmd(capsys, "ls", "--app", built.app, "--json")
    head = ls["heads"][s]
    older = head["snapshots"][0] if head["snapshots"] else head["version"] - 1
    assert 0 < older < head["version"]
    code, data, _ = state_cmd(
        capsys, "restore", "--app", built.app, "--slice", str(s), "--version", str(older),
        "--dest", str(tmp_path / "older"), "--json",
    )  # fmt: skip
    assert code == 0 and data["to_version"] == older
    code, data, _ = state_cmd(
        capsys, "get", "--app", built.app, "--key", user, "--slice", str(s),
        "--version", str(older), "--json",
    )  # fmt: skip
    assert code == 0 and data["version"] == older
    assert 0 < data["value"]["count"] < expected[user]["count"]


def test_verify_with_rebuild_finds_the_state_sound(built, capsys):
    code, data, _ = state_cmd(capsys, "verify", "--app", built.app, "--rebuild", "--json")
    assert code == 0 and data["ok"], data["problems"]
    assert data["slices"] > 50 and data["manifests"] > 0 and data["rebuilt"] == data["slices"]


def test_state_as_a_dataframe_equals_the_fold(built, expected, spark):
    df = (
        spark.read.format("shardless_state")
        .option("app", built.app)
        .option("slicesPerPartition", "32")
        .load()
    )
    assert df.rdd.getNumPartitions() > 1
    got = {r.key: json.loads(r.value) for r in df.where("sub IS NULL").collect()}
    assert got == expected
    cut = spark.read.format("shardless_state").option("app", built.app).option(
        "batch", str(built.batches[-2])
    )  # fmt: skip
    assert {r.key: json.loads(r.value) for r in cut.load().collect()} == built.state_after(
        spark, built.batches[-2]
    )


# ---- input errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["scan", "--slice", "300"], "outside the application's slices 0..255"),
        (["scan", "--slice", "a-b"], "use slice numbers and ranges"),
        (["scan", "--version", "2"], "--version is a single slice's version"),
        (["scan", "--key-prefix", "u", "--start", "a"], "give --key-prefix or a range"),
        (["get", "--key", "k", "--slice", "3", "--version", "99999"], "is not retained"),
        (["reslice", "--to-app", "x", "--to-slices", "100"], "multiple or a divisor"),
    ],
)
def test_bad_input_is_one_line_naming_what_was_wrong(built, capsys, argv, message):
    code = cli.main(["state", argv[0], "--app", built.app, *argv[1:]])
    err = capsys.readouterr().err
    assert code == 2 and message in err
    code, data, _ = state_cmd(capsys, argv[0], "--app", built.app, *argv[1:], "--json")
    assert code == 2 and message in data["error"] and data["exit"] == 2


def test_slice_specs_parse():
    assert parse_slices("3", 8) == [3]
    assert parse_slices("0-2,5,6-7", 8) == [0, 1, 2, 5, 6, 7]
    assert parse_slices(None, 3) == [0, 1, 2]


def test_progress_bars_show_rate_and_time_left_only_on_a_terminal():
    line = render("verifying", 64, 256, 8.0, "slices", nbytes=80_000_000)
    assert "64/256 slices" in line and "8.0 slices/s" in line and "10.0 MB/s" in line
    assert "ETA 0:00:24" in line
    stream = io.StringIO()  # not a terminal: silent unless told
    with Bar("x", 4, stream=stream) as bar:
        for _ in range(4):
            bar.update()
    assert stream.getvalue() == ""
    with Bar("x", 4, stream=stream, enabled=True, every_s=0) as bar:
        for _ in range(4):
            bar.update(nbytes=10)
    assert "4/4 slices" in stream.getvalue() and stream.getvalue().endswith("\n")


def test_a_running_job_holds_the_lease_and_releases_it_when_stopped(
    spark, kinesis, make_stream, location, tmp_path, capsys
):
    import time

    from shardless.processor.api.handlers import HandlerFactory

    stream = make_stream(1)
    kinesis.put_record(StreamName=stream, PartitionKey="k", Data=b"{}")
    cfg = job_config(location, (stream,), tmp_path, checkpoint="ck")
    query = start(
        spark,
        HandlerFactory(lambda event, ctx: ctx.state.set(1)),
        cfg,
        sink=lambda df, batch_id: None,
        processing_time="1 second",
    )
    try:
        deadline = time.monotonic() + 60
        while lease.read(location) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        held = lease.read(location)
        assert held is not None and held.query == str(query.id)
        # gc beside a running job only with a grace that covers its batches
        gc_now = ("gc", "--app", location.app, "--delete", "--quiet-s", "0", "--grace-s", "0")
        code, _, err = state_cmd(capsys, *gc_now)
        assert code == 3 and "holds the application's lease" in err
        _, data, _ = state_cmd(capsys, "ls", "--app", location.app, "--json", "--quiet-s", "0")
        assert data["running"]
    finally:
        query.stop()
    deadline = time.monotonic() + 60
    while lease.read(location) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert lease.read(location) is None


# ---- commands that change state (in this order) -----------------------------------------------


def test_reslice_256_to_512_to_128_then_the_job_continues_equal_to_the_fold(
    built, expected, spark, capsys, tmp_path
):
    a512, a128 = f"{built.app}-512", f"{built.app}-128"
    code, data, _ = state_cmd(
        capsys, "reslice", "--app", built.app, "--to-app", a512, "--to-slices", "512",
        "--json", "--quiet-s", "0",
    )  # fmt: skip
    assert code == 0 and data["dry_run"] and data["groups"] == 256
    code, data, _ = state_cmd(
        capsys, "reslice", "--app", built.app, "--to-app", a512, "--to-slices", "512",
        "--apply", "--json", "--quiet-s", "0",
    )  # fmt: skip
    assert code == 0 and data["verified"] and data["entries"] >= len(expected)
    assert {r["slice"] for r in data["slices"] if r["entries"]} == {
        route(u, None, 512) for u in expected
    }
    code, data, _ = state_cmd(
        capsys, "reslice", "--app", a512, "--to-app", a128, "--to-slices", "128",
        "--apply", "--json", "--quiet-s", "0",
    )  # fmt: skip
    assert code == 0 and data["verified"] and data["from_slices"] == 512
    code, data, _ = state_cmd(capsys, "verify", "--app", a128, "--rebuild", "--json")
    assert code == 0 and data["ok"]
    # writing into a generation that has state is refused
    code, _, err = state_cmd(
        capsys, "reslice", "--app", a512, "--to-app", a128, "--to-slices", "128", "--apply",
        "--quiet-s", "0",
    )  # fmt: skip
    assert code == 2 and "already has state" in err

    # The job continues from the 128-slice generation, over more records (a second stream).
    kinesis = boto3.client("kinesis")
    more = f"s-{uuid.uuid4().hex[:10]}"
    kinesis.create_stream(StreamName=more, ShardCount=3)
    kinesis.get_waiter("stream_exists").wait(
        StreamName=more, WaiterConfig={"Delay": 0.1, "MaxAttempts": 100}
    )
    produce(kinesis, more, 600, seed=12)
    cfg = JobConfig(
        app=a128,
        streams=(more,),
        checkpoint=str(tmp_path / "ck"),
        slices=128,
        groups=4,
        local_dir=str(tmp_path / "stores"),
    )
    run(spark, cfg, tmp_path / "out")
    later, total = demo.reference_fold(kinesis, more)
    assert total == 600
    want = {u: dict(v) for u, v in expected.items()}
    for u, v in later.items():  # the fold of both streams, in order
        w = want.setdefault(u, {"count": 0, "last_seen": 0})
        w["count"] += v["count"]
        w["last_seen"] = max(w["last_seen"], v["last_seen"])
    rebuilt, _ = demo.durable_state(cfg, tmp_path / "rebuilt")
    assert rebuilt == want
    # and its outputs continue each user's counts exactly where the old generation ended
    outs = [json.loads(r.value) for r in spark.read.parquet(str(tmp_path / "out")).collect()]
    by_user: dict[str, list[int]] = defaultdict(list)
    for v in outs:
        by_user[v["user"]].append(v["count"])
    for u, counts in by_user.items():
        start_at = expected.get(u, {"count": 0})["count"]
        assert sorted(counts) == list(range(start_at + 1, want[u]["count"] + 1)), u


def test_rollback_is_a_dry_run_refuses_while_running_and_moves_every_slice(built, spark, capsys):
    batch = built.batches[-2]
    loc = built.cfg.location
    code, data, _ = state_cmd(
        capsys, "rollback", "--app", built.app, "--batch", str(batch), "--json"
    )
    assert code == 0 and data["dry_run"] and data["slices"] > 0 and data["moved"] == 0
    # recent commits say the application is running
    code, _, err = state_cmd(
        capsys, "rollback", "--app", built.app, "--batch", str(batch), "--apply"
    )
    assert code == 3 and "looks running" in err and "slices committed" in err
    # so does a held lease, even with no recent commits
    lease.renew(loc, "driver-x", "q", ttl_s=60)
    code, _, err = state_cmd(
        capsys, "rollback", "--app", built.app, "--batch", str(batch), "--apply", "--quiet-s", "0"
    )
    assert code == 3 and "driver-x" in err
    lease.release(loc, "driver-x")
    code, data, _ = state_cmd(
        capsys, "rollback", "--app", built.app, "--batch", str(batch), "--apply", "--json",
        "--quiet-s", "0",
    )  # fmt: skip
    assert code == 0 and data["moved"] == data["slices"] > 0
    code, data, _ = state_cmd(capsys, "scan", "--app", built.app, "--limit", "0", "--json")
    got = {e["key"]: e["value"] for e in data["entries"]}
    assert got == built.state_after(spark, batch)
    found = progress.latest(loc)
    if found is not None and data.get("source_positions", True):
        assert found["batch"] == batch
    code, data, _ = state_cmd(capsys, "verify", "--app", built.app, "--json")
    assert code == 0 and data["ok"]


def test_gc_after_rollback_deletes_only_what_nothing_references(built, capsys):
    args = ["gc", "--app", built.app, "--json", "--quiet-s", "0", "--grace-s", "0"]
    code, data, _ = state_cmd(capsys, *args)
    assert code == 0 and data["dry_run"] and data["unreferenced"] > 0
    would = data["deleted"]
    code, data, _ = state_cmd(capsys, *args, "--delete")
    assert code == 0 and data["deleted"] == would > 0
    code, data, _ = state_cmd(capsys, *args)
    assert data["unreferenced"] == 0
    code, data, _ = state_cmd(capsys, "verify", "--app", built.app, "--rebuild", "--json")
    assert code == 0 and data["ok"], data["problems"]


def test_verify_names_a_corrupt_object(built, capsys):
    from shardless.changelog.durable import DurableState

    s3 = boto3.client("s3")
    loc: AppLocation = built.cfg.location
    code, data, _ = state_cmd(capsys, "verify", "--app", built.app, "--json")
    assert code == 0
    heads = DurableState(loc).heads(list(range(256)))
    entry = next(e for h in heads.values() for e in h.log)
    victim = entry.key(loc)
    body = bytearray(s3.get_object(Bucket=loc.bucket, Key=victim)["Body"].read())
    body[entry.offset + entry.length // 2] ^= 0xFF
    s3.put_object(Bucket=loc.bucket, Key=victim, Body=bytes(body))
    code, data, _ = state_cmd(capsys, "verify", "--app", built.app, "--json")
    assert code == 1 and not data["ok"]
    assert any(victim in p for p in data["problems"])
