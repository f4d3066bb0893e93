"""Inputs that must not reach S3, DynamoDB, Kinesis or the local disk unchecked: application
names, partition keys with a lone surrogate, and local directories."""

from __future__ import annotations

import hashlib
import os
import stat
import uuid
from pathlib import Path

import pytest

from shardless.changelog.errors import ConfigurationError
from shardless.changelog.layout import AppLocation, check_app_name
from shardless.processor import cli
from shardless.processor.driver.config import JobConfig
from shardless.processor.errors import ConfigError
from shardless.processor.kinesis import reader
from shardless.processor.kinesis.batch_log import BatchLog
from shardless.processor.kinesis.kpl import MAGIC, deaggregate
from shardless.processor.kinesis.put import chunks
from shardless.processor.kinesis.reader import ShardRead, read_shard
from shardless.processor.kinesis.rows import record_batch
from shardless.processor.kinesis.sink import record
from shardless.processor.runtime.routing import hash_key, key_text, route, shard_slices
from tests.jobs import capture_cli_starts

BAD_APPS = [
    "",
    ".",
    "..",
    "../x",
    "a/b",
    "Clicks",
    "clé",
    "点击",
    "a_b",
    "a.b",
    "a b",
    "-a",
    "a-",
    "x" * 54,
    "logs-s3alias",
    "logs--ol-s3",
    "logs--x-s3",
]
GOOD_APPS = ["a", "x", "app", "clicks", "t-0123abcd", "bench-commit-1024-99-123456789", "x" * 53]


@pytest.mark.parametrize("app", BAD_APPS)
def test_a_bad_application_name_is_refused_naming_it_and_the_rule(app):
    with pytest.raises(ConfigurationError) as raised:
        AppLocation.default(app)
    assert repr(app) in str(raised.value)
    assert "lower-case letters, digits and '-'" in str(raised.value)
    with pytest.raises(ConfigError, match="lower-case letters, digits and '-'"):
        JobConfig(app=app, streams=("s",), checkpoint="/tmp/c")


@pytest.mark.parametrize("app", GOOD_APPS)
def test_good_application_names_pass_and_make_a_valid_bucket(app):
    check_app_name(app)
    loc = AppLocation.default(app)
    assert 3 <= len(loc.bucket) <= 63 and loc.bucket == f"shardless-{app}"
    assert JobConfig(app=app, streams=("s",), checkpoint="/tmp/c").location.app == app


# --- partition keys with a lone surrogate ---------------------------------------------------

LONE = "\ud800"  # from a JSON "\ud800" or a Java string; no UTF-8 encoder takes it strictly


def md5_slice(data: bytes, n: int) -> int:
    return (int.from_bytes(hashlib.md5(data).digest(), "big") * n) >> 128


def test_a_lone_surrogate_routes_as_the_replacement_character_kinesis_hashed():
    assert key_text(LONE) == "\ufffd" and key_text("a\udc00b") == "a\ufffdb"
    assert key_text("user-1") == "user-1" and key_text("\ud83d\ude00") == "\U0001f600"
    for n in (1, 256, 1000):
        assert route(LONE, None, n) == md5_slice("\ufffd".encode(), n)
    assert hash_key("a\udc00b") == hash_key("a\ufffdb")


def test_a_record_whose_key_has_a_lone_surrogate_is_read_and_routed(
    kinesis, make_stream, location, monkeypatch
):
    """kinesalite (like any UTF-8 encoder that does not fail) hashes a lone surrogate as
    U+FFFD: the record lands in that key's shard, and the source gives it that key and its
    slice instead of failing the read."""
    monkeypatch.setattr(reader, "MIN_CALL_INTERVAL_S", 0)
    stream = make_stream(4)
    keys = [LONE, "a\udc00b", "user-1", "\ufffd"]
    for i, key in enumerate(keys):
        kinesis.put_record(StreamName=stream, Data=f"{i}".encode(), PartitionKey=key)
    rows = []
    for shard in kinesis.list_shards(StreamName=stream)["Shards"]:
        read = ShardRead(
            run=uuid.uuid4().hex, n=1, stream=stream, shard_id=shard["ShardId"], depth=0,
            start=None, initial={"type": "TRIM_HORIZON"}, max_records=100,
            max_bytes=1 << 20, closed=False,
        )  # fmt: skip
        records, _ = read_shard(kinesis, BatchLog(location.table), read)
        batch = record_batch(stream, shard["ShardId"], 0, records, 256).to_pylist()
        covered = shard_slices(*shard["HashKeyRange"].values(), 256)
        for row in batch:
            assert row["slice"] in covered  # routed where Kinesis put it
        rows += batch
    got = {row["data"]: (row["partition_key"], row["slice"]) for row in rows}
    assert got == {
        f"{i}".encode(): (key_text(key), route(key, None, 256)) for i, key in enumerate(keys)
    }
    assert got[b"0"] == ("\ufffd", md5_slice(b"\xef\xbf\xbd", 256))


def test_a_kpl_user_record_whose_key_bytes_encode_a_surrogate_is_read_and_routed():
    body = bytes([0x0A, 3, 0xED, 0xA0, 0x80])  # partition_key_table = [b"\xed\xa0\x80"]
    body += bytes([0x1A, 5, 0x08, 0x00, 0x1A, 0x01]) + b"x"  # records = [{0, data b"x"}]
    (user,) = deaggregate(MAGIC + body + hashlib.md5(body).digest())
    assert (user.partition_key, user.data) == (LONE, b"x")
    record = {
        "SequenceNumber": "1", "SubSequenceNumber": 0, "PartitionKey": user.partition_key,
        "ExplicitHashKey": None, "ApproximateArrivalTimestamp": None, "Data": user.data,
    }  # fmt: skip
    (row,) = record_batch("s", "shardId-0", 0, [record], 256).to_pylist()
    assert (row["partition_key"], row["slice"]) == ("\ufffd", route(LONE, None, 256))


def test_the_sink_puts_an_output_whose_key_has_a_lone_surrogate():
    entry = record("q", 1, 0, 0, LONE, "1")
    assert entry["PartitionKey"] == "\ufffd"
    assert [len(c) for c in chunks([entry])] == [1]


# --- local directories ----------------------------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    """A fresh home, no XDG or shardless variables, and a permissive umask."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("XDG_CACHE_HOME", "XDG_STATE_HOME", "SHARDLESS_LOCAL_DIR"):
        monkeypatch.delenv(var, raising=False)
    old = os.umask(0o002)
    yield tmp_path / "home"
    os.umask(old)


def job(**fields: object) -> JobConfig:
    return JobConfig(app="a", streams=("s",), checkpoint="/c", **fields)  # type: ignore[arg-type]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_default_local_dir_is_the_users_own_and_made_private(home, tmp_path, monkeypatch):
    cfg = job()
    assert cfg.local_dir == str(home / ".cache" / "shardless")
    assert cfg.local_dir != "/tmp/shardless-state"
    assert mode(Path(cfg.local_dir)) == 0o700
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert job().local_dir == str(tmp_path / "xdg" / "shardless")
    assert mode(tmp_path / "xdg" / "shardless") == 0o700
    monkeypatch.setenv("SHARDLESS_LOCAL_DIR", str(tmp_path / "env"))
    assert job().local_dir == str(tmp_path / "env")


def test_a_local_dir_writable_by_others_is_refused(home, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match=rf"{shared}' is writable by others \(mode 777\)"):
        job(local_dir=str(shared))
    (home / ".cache" / "shardless").mkdir(parents=True)
    (home / ".cache" / "shardless").chmod(0o757)
    with pytest.raises(ConfigError, match="writable by others"):
        job()
    shared.chmod(0o755)
    assert job(local_dir=str(shared)).local_dir == str(shared)
    assert job(local_dir=str(tmp_path / "made-by-executors")).local_dir  # need not exist


def test_a_local_dir_owned_by_another_user_is_refused(home, tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
    with pytest.raises(ConfigError, match=rf"owned by uid {uid}, not by this user"):
        job(local_dir=str(theirs))
    monkeypatch.undo()
    # a link of ours to a directory of someone else's, as planted in a shared /tmp
    link = home / ".cache" / "shardless"
    link.parent.mkdir(parents=True)
    link.symlink_to(theirs)
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
    with pytest.raises(ConfigError, match="owned by uid"):
        job()


def test_the_cli_default_checkpoint_is_the_users_own_and_private(home, tmp_path, monkeypatch):
    seen = capture_cli_starts(monkeypatch)
    app = tmp_path / "app.py"
    app.write_text("def process(event, ctx):\n    pass\n")
    assert cli.main(["run", str(app), "--app", "clicks", "--stream", "s"]) == 0
    checkpoints = home / ".local" / "state" / "shardless" / "checkpoints"
    assert seen[-1].checkpoint == str(checkpoints / "clicks")
    assert mode(checkpoints) == 0o700
    assert seen[-1].local_dir == str(home / ".cache" / "shardless")
    checkpoints.chmod(0o777)
    assert cli.main(["run", str(app), "--app", "clicks", "--stream", "s"]) == 2


def test_an_executors_store_directory_is_checked_where_it_is_made(tmp_path):
    """The stores live where executors make them, not only where the driver checked."""
    from shardless.processor.runtime.stores import cache_for, close_caches

    made = tmp_path / "fresh" / "stores"
    cache_for(str(made), "app-one", 4)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        cache_for(str(shared), "app-one", 4)
    close_caches()
