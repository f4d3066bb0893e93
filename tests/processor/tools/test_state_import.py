"""`shardless state import` over moto over HTTP and real RocksDB: values from JSON lines and
Parquet become a new application's committed state, read back by `state get`, the
`shardless_state` source, the task runtime and a real Spark job; and every refusal."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from pathlib import Path

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardless.changelog import lease
from shardless.changelog.durable import DurableState
from shardless.changelog.inspect import entries, opened
from shardless.changelog.layout import AppLocation
from shardless.processor import cli
from shardless.processor.driver import takeover
from shardless.processor.driver.config import JobConfig
from shardless.processor.driver.imports import IMPORT_SK, check_import_done
from shardless.processor.driver.imports import read_import as _read_claim
from shardless.processor.errors import ConfigError, ProcessorError
from shardless.processor.local import demo
from shardless.processor.runtime.routing import route
from shardless.processor.tools.state_import import claim
from shardless.processor.tools.state_source import read_state
from tests.processor.runtime.test_runtime import KEYS, SLICES, frame, runner


def state_cmd(capsys, *argv: str) -> tuple[int, dict, str]:  # noqa: ANN001
    code = cli.main(["state", *argv])
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    return code, json.loads(lines[-1]) if lines else {}, out.err


def write_jsonl(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def new_app() -> AppLocation:
    """An application whose bucket and table do not exist yet."""
    return AppLocation.default(f"imp-{uuid.uuid4().hex[:10]}")


def nothing_committed(loc: AppLocation, slices: int = SLICES) -> bool:
    heads = DurableState(loc).heads(list(range(slices)))
    return not any(h.committed for h in heads.values()) and _read_claim(loc) is None


def durable_values(loc: AppLocation, slices: int = SLICES) -> dict[str, object]:
    """Each key's own value (not its map entries), rebuilt from S3 and DynamoDB alone."""
    durable = DurableState(loc)
    found = {}
    for s, head in durable.heads(list(range(slices))).items():
        with opened(durable, head, slices) as store:
            found.update({e.key: e.value for e in entries(store, s) if e.sub is None})
    return found


def do_import(capsys, loc: AppLocation, *argv: str) -> tuple[int, dict, str]:  # noqa: ANN001
    return state_cmd(capsys, "import", "--app", loc.app, "--json", *argv)


# ---- imports read back ----------------------------------------------------------------------


def test_jsonl_import_is_what_state_get_and_a_handler_read_for_each_key(location, tmp_path, capsys):
    values = {f"user-{i}": 100 * i for i in range(37)}  # KEYS are user-0 .. user-36
    rows = [{"user": k, "n": v} for k, v in values.items()]
    rows += [{"user": "user-1", "tag": "a", "n": {"first": True}}]  # a map entry
    src = write_jsonl(tmp_path / "start.jsonl", rows)
    argv = ("--input", str(src), "--key-field", "user", "--value-field", "n", "--sub-field", "tag")

    code, data, _ = do_import(capsys, location, *argv)  # a dry run writes nothing
    assert code == 0 and data["dry_run"] and data["keys"] == 37 and data["map_entries"] == 1
    assert nothing_committed(location)

    code, data, _ = do_import(capsys, location, *argv, "--apply")
    assert code == 0 and data["verified"] and data["slices"] == SLICES
    per_slice = Counter(route(k, None, SLICES) for k in values)
    assert {r["slice"]: r["keys"] for r in data["per_slice"]} == dict(per_slice)
    assert _read_claim(location)["status"] == "done"

    code, got, _ = state_cmd(capsys, "get", "--app", location.app, "--key", "user-1", "--json")
    assert code == 0 and got["value"] == 100 and got["map"] == {"a": {"first": True}}
    assert got["slice"] == route("user-1", None, SLICES) and got["version"] == 1
    code, got, _ = state_cmd(capsys, "verify", "--app", location.app, "--rebuild", "--json")
    assert code == 0 and got["ok"] and got["slices"] == len(per_slice)

    # the task runtime's handler finds the imported value as its key's ctx.state
    r = runner(location, tmp_path / "stores")
    r.run(0, "q", 0, frame(KEYS[:200]))
    want = {k: values[k] + n for k, n in Counter(KEYS[:200]).items()}
    assert durable_values(location) == {**values, **want}


def test_a_state_export_imports_into_another_application_unchanged(location, tmp_path, capsys):
    rows = [{"key": f"k{i}", "value": {"b": None, "i": i, "tags": ["x", i % 3]}} for i in range(60)]
    rows += [{"key": "k1", "sub": f"s{j}", "value": j} for j in range(5)]
    src = write_jsonl(tmp_path / "a.jsonl", rows)
    code, first, _ = do_import(
        capsys, location, "--input", str(src), "--sub-field", "sub", "--apply"
    )
    assert code == 0
    out = tmp_path / "export.jsonl"
    code, _, _ = state_cmd(
        capsys, "export", "--app", location.app, "--format", "jsonl", "--out", str(out), "--json"
    )
    assert code == 0
    other = new_app()
    code, second, _ = do_import(
        capsys, other, "--input", str(out), "--sub-field", "sub", "--slices", "16", "--apply"
    )
    assert code == 0 and second["verified"]
    # the same entries, byte for byte (object keys in sorted order, as export writes them)
    assert second["per_slice"] == first["per_slice"]


@pytest.mark.slow
def test_parquet_import_is_what_the_state_source_reads(spark, tmp_path, capsys):
    users = [f"u{i:03d}" for i in range(120)]
    table = pa.table(
        {
            "id": users,
            "profile": [{"visits": i, "plan": "pro" if i % 2 else "free"} for i in range(120)],
        }
    )
    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(table.slice(0, 70), folder / "part-0.parquet")
    pq.write_table(table.slice(70), folder / "part-1.parquet")
    loc = new_app()
    code, data, _ = do_import(
        capsys, loc, "--input", str(folder), "--key-field", "id", "--value-field", "profile",
        "--slices", "32", "--apply",
    )  # fmt: skip
    assert code == 0 and data["keys"] == 120 and len(data["inputs"]) == 2
    code, got, _ = state_cmd(capsys, "get", "--app", loc.app, "--key", "u007", "--json")
    assert got["value"] == {"visits": 7, "plan": "pro"}
    rows = read_state(spark, loc.app).collect()
    assert {r.key: json.loads(r.value) for r in rows} == {
        u: {"visits": i, "plan": "pro" if i % 2 else "free"} for i, u in enumerate(users)
    }
    assert {r.slice for r in rows} == {route(u, None, 32) for u in users}


# ---- refusals: nothing is committed ---------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"key": "a", "value": 1}', '{"key": "b", "value": 2', "x"], "line 2: not a JSON value"),
        (['{"key": "a", "value": 1}', "", '{"value": 3}'], "line 3: no key field 'key'"),
        (['{"key": "a"}'], "line 1: no value field 'value'"),
        (['{"key": 7, "value": 1}'], "line 1: the key 'key' is 7, a int"),
        (['{"key": "a", "value": 1}', '{"key": "a", "value": 2}'], "line 2: key 'a' is given a "
         "second time (first at"),
        (['{"key": "a", "value": 18446744073709551616}'], "line 1: key 'a': cannot encode"),
        (['[1, 2]'], "line 1: expected a JSON object"),
    ],
)  # fmt: skip
def test_a_bad_line_is_named_and_nothing_is_committed(location, tmp_path, capsys, lines, message):
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n")
    code, data, err = do_import(capsys, location, "--input", str(src), "--apply")
    assert code == 2 and f"{src}:{message}" in data["error"], data
    assert nothing_committed(location)
    good = write_jsonl(tmp_path / "good.jsonl", [{"key": "a", "value": 1}])
    code, _, _ = do_import(capsys, location, "--input", str(good), "--apply")
    assert code == 0  # the refused import left nothing behind


def test_a_parquet_value_msgpack_cannot_encode_names_its_row(tmp_path, capsys):
    from datetime import UTC, datetime

    path = tmp_path / "t.parquet"
    when = [datetime(2026, 1, 1, tzinfo=UTC)] * 3
    pq.write_table(pa.table({"key": ["a", "b", "c"], "value": when}), path)
    loc = new_app()
    code, data, _ = do_import(capsys, loc, "--input", str(path), "--apply")
    assert (
        code == 2
        and f"{path}:row 1: key 'a': cannot encode a value of type datetime" in (data["error"])
    )
    code, data, _ = do_import(capsys, loc, "--input", str(path), "--key-field", "id")
    assert code == 2 and "no column 'id' (its columns: key, value)" in data["error"]
    assert boto3.client("dynamodb").list_tables()["TableNames"].count(loc.table) == 0


def test_importing_twice_is_refused_naming_the_first_import(location, tmp_path, capsys):
    src = write_jsonl(tmp_path / "v.jsonl", [{"key": f"k{i}", "value": i} for i in range(20)])
    code, first, _ = do_import(capsys, location, "--input", str(src), "--apply")
    assert code == 0
    for argv in (("--apply",), ()):  # a dry run is refused too
        code, data, _ = do_import(capsys, location, "--input", str(src), *argv)
        assert code == 2
        assert f"application {location.app!r} is not new" in data["error"]
        assert "slices with committed state" in data["error"]
        assert f"an import done ({first['query']}" in data["error"]


def test_an_application_with_committed_state_is_refused(location, tmp_path, capsys):
    runner(location, tmp_path / "stores").run(0, "q", 0, frame(KEYS[:40]))
    src = write_jsonl(tmp_path / "v.jsonl", [{"key": "user-1", "value": 5}])
    code, data, _ = do_import(capsys, location, "--input", str(src), "--apply")
    assert code == 2 and f"application {location.app!r} is not new" in data["error"]
    assert "slices with committed state" in data["error"] and _read_claim(location) is None
    code, got, _ = state_cmd(capsys, "get", "--app", location.app, "--key", "user-1", "--json")
    assert got["value"] == Counter(KEYS[:40])["user-1"]  # untouched


def test_an_import_is_refused_while_a_job_holds_the_lease(location, tmp_path, capsys):
    lease.renew(location, "vm:1:job", "query-running")  # as a running driver does
    src = write_jsonl(tmp_path / "v.jsonl", [{"key": "a", "value": 1}])
    code, data, _ = do_import(capsys, location, "--input", str(src), "--apply")
    assert code == 3 and "looks running" in data["error"]
    assert "holds the application's lease" in data["error"]
    assert nothing_committed(location)
    assert IMPORT_SK == "import"


def test_slices_other_than_the_applications_are_refused(location, tmp_path, capsys):
    src = write_jsonl(tmp_path / "v.jsonl", [{"key": "a", "value": 1}])
    code, data, _ = do_import(capsys, location, "--input", str(src), "--slices", "32")
    assert code == 2 and "exists with 16 slices" in data["error"]


# ---- what a job makes of an import ----------------------------------------------------------


def test_a_new_checkpoint_starts_on_imported_state_after_a_query_that_committed_nothing(
    location, tmp_path, capsys
):
    """The imported state is no stream's records: a first job that began and committed
    nothing does not make the next checkpoint at its own starting position a recount."""
    src = write_jsonl(tmp_path / "v.jsonl", [{"key": f"k{i}", "value": i} for i in range(20)])
    assert do_import(capsys, location, "--input", str(src), "--apply")[0] == 0
    takeover.register(location, "q-first", 0, None, streams=("s",))  # began, then died
    takeover.check_new_start(location, ("s",))  # not refused
    assert takeover.register(location, "q-second", 0, None, streams=("s",)) == ["q-first"]


def test_no_job_starts_on_an_application_whose_import_is_not_done(location, tmp_path):
    claim(location, "import:x:1", ["in.jsonl"])  # an import that died before it was done
    with pytest.raises(ConfigError, match="its import \\(import:x:1\\) is in progress"):
        check_import_done(location)
    with pytest.raises(ProcessorError, match="no job may run on it"):
        takeover.register(location, "q1", 0, None, streams=("s",))


# ---- a real job continues from the imported values ----------------------------------------


@pytest.mark.slow
def test_a_job_started_after_an_import_continues_each_users_state(
    spark, kinesis, make_stream, tmp_path, capsys
):
    from tests.e2e.test_end_to_end import produce, run_job

    stream = make_stream(2)
    produce(kinesis, stream, 1500, seed=21)  # users user-0 .. user-199, Zipf
    start = {f"user-{u}": {"count": 1000 + u, "last_seen": 500_000} for u in range(0, 300, 2)}
    src = write_jsonl(tmp_path / "start.jsonl", [{"key": k, "value": v} for k, v in start.items()])
    loc = new_app()
    code, data, _ = do_import(capsys, loc, "--input", str(src), "--slices", "16", "--apply")
    assert code == 0 and data["keys"] == len(start)

    cfg = JobConfig(
        app=loc.app,
        streams=(stream,),
        checkpoint=str(tmp_path / "ck"),
        slices=16,
        groups=4,
        local_dir=str(tmp_path / "stores"),
        max_records_per_shard=400,
    )
    run_job(spark, cfg, str(tmp_path / "out"), wipe_after={0})

    want = {u: dict(v) for u, v in start.items()}  # the fold, from the imported values
    read, total = demo.reference_fold(kinesis, stream)
    assert total == 1500
    for u, v in read.items():
        w = want.setdefault(u, {"count": 0, "last_seen": 0})
        w["count"] += v["count"]
        w["last_seen"] = max(w["last_seen"], v["last_seen"])
    rebuilt, _ = demo.durable_state(cfg, tmp_path / "rebuilt")
    assert rebuilt == want
    outs = [json.loads(r.value) for r in spark.read.parquet(str(tmp_path / "out")).collect()]
    last = {}
    for v in outs:
        last[v["user"]] = max(last.get(v["user"], 0), v["count"])
    assert last == {u: want[u]["count"] for u in read}  # outputs count on from the import
