"""Positions older than the stream's retention.

Kinesis keeps records at least 24 hours, so no emulator trims on its own within a test. Here
kinesalite runs with its clock movable: a preloaded script shifts `Date.now` forward 25 hours
on SIGUSR2, after which kinesalite genuinely drops the older records (it trims by the time
encoded in each sequence number). The reader's clock is moved by the same amount.
"""

from __future__ import annotations

import logging
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator

import boto3
import pytest

from shardless.changelog.layout import AppLocation
from shardless.processor.errors import SourceError
from shardless.processor.kinesis import positions, reader
from shardless.processor.kinesis.batch_log import BatchLog
from shardless.processor.kinesis.reader import ShardRead, read_shard
from shardless.processor.kinesis.shards import Shard, vanished
from shardless.processor.kinesis.source import KinesisStreamReader
from shardless.processor.local import emulators as local_aws

JUMP_S = 25 * 3600
TRIM_HORIZON = {"type": "TRIM_HORIZON"}

_CLOCK = """
const realNow = Date.now.bind(Date);
let offset = 0;
Date.now = () => realNow() + offset;
process.on("SIGUSR2", () => { offset += %d; });
"""
_SERVE = """
const [pkg, port, host] = process.argv.slice(1);
require(pkg + "/index.js")({createStreamMs: 5}).listen(Number(port), host);
"""


class MovableKinesalite:
    def __init__(self, proc: subprocess.Popen, endpoint: str) -> None:
        self.proc = proc
        self.client = boto3.session.Session().client(
            "kinesis",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        self.shift_s = 0.0

    def jump(self) -> None:
        """Move kinesalite's clock 25 hours forward, and wait until it has."""
        clock = self.make_stream()
        before = self._put_time(clock)
        assert before is not None
        self.proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while (self._put_time(clock) or 0.0) < before + JUMP_S - 60:
            assert time.monotonic() < deadline, "kinesalite's clock did not move"
            time.sleep(0.05)
        self.shift_s += JUMP_S

    def _put_time(self, stream: str) -> float | None:
        """kinesalite's clock as a new record's arrival time; None when that record expired
        at once (the clock moved between the put and the read)."""
        self.client.put_record(StreamName=stream, Data=b"tick", PartitionKey="tick")
        (shard,) = self.client.list_shards(StreamName=stream)["Shards"]
        it = self.client.get_shard_iterator(
            StreamName=stream, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        records = self.client.get_records(ShardIterator=it)["Records"]
        return records[-1]["ApproximateArrivalTimestamp"].timestamp() if records else None

    def make_stream(self) -> str:
        name = f"r-{uuid.uuid4().hex[:10]}"
        self.client.create_stream(StreamName=name, ShardCount=1)
        self.client.get_waiter("stream_exists").wait(
            StreamName=name, WaiterConfig={"Delay": 0.05, "MaxAttempts": 200}
        )
        return name


@pytest.fixture(scope="module")
def kinesalite_clock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MovableKinesalite]:
    node = shutil.which("node")
    package = local_aws.tools_dir() / "node_modules" / "kinesalite"
    if node is None or not package.is_dir():
        pytest.fail("node and kinesalite are needed (make setup)")
    preload = tmp_path_factory.mktemp("kinesalite-clock") / "clock.js"
    preload.write_text(_CLOCK % (JUMP_S * 1000))
    port = local_aws._free_ports(1)[0]
    proc = subprocess.Popen(
        [node, "-r", str(preload), "-e", _SERVE, str(package), str(port), local_aws.HOST],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        emulator = MovableKinesalite(proc, f"http://{local_aws.HOST}:{port}")
        deadline = time.monotonic() + 20
        while True:
            try:
                emulator.client.list_streams()
                break
            except Exception:
                assert proc.poll() is None and time.monotonic() < deadline, "no kinesalite"
                time.sleep(0.1)
        yield emulator
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def produce(kinesis, stream: str, tags: list[str]) -> list[str]:  # noqa: ANN001
    out = kinesis.put_records(
        StreamName=stream, Records=[{"Data": t.encode(), "PartitionKey": t} for t in tags]
    )
    return [r["SequenceNumber"] for r in out["Records"]]


def shard_read(
    kinesis, stream: str, run: str, n: int, start, on_trimmed: str = "fail", max_records: int = 4
):  # noqa: ANN001, ANN201, E501
    (shard,) = kinesis.list_shards(StreamName=stream)["Shards"]
    return ShardRead(
        run=run,
        n=n,
        stream=stream,
        shard_id=shard["ShardId"],
        depth=0,
        start=start,
        initial=TRIM_HORIZON,
        max_records=max_records,
        max_bytes=1 << 20,
        on_trimmed=on_trimmed,
    )


def first_batch(kinesis, stream: str, batch_log: BatchLog) -> tuple[str, positions.Position]:  # noqa: ANN001
    """Read 4 of 10 records; return the run and the shard's position after that batch."""
    produce(kinesis, stream, [f"old-{i}" for i in range(10)])
    run = uuid.uuid4().hex
    read = shard_read(kinesis, stream, run, 1, None)
    records, end = read_shard(kinesis, batch_log, read)
    assert [r["Data"] for r in records] == [f"old-{i}".encode() for i in range(4)]
    assert end["caught_up"] is False
    return run, positions.advance({}, {read.shard_key: end})[read.shard_key]


@pytest.mark.usefixtures("no_pacing")
def test_an_expired_position_fails_naming_stream_shard_and_position(
    kinesalite_clock: MovableKinesalite, location: AppLocation, monkeypatch: pytest.MonkeyPatch
) -> None:
    kinesis, batch_log = kinesalite_clock.client, BatchLog(location.table)
    stream = kinesalite_clock.make_stream()
    run, position = first_batch(kinesis, stream, batch_log)
    kinesalite_clock.jump()
    monkeypatch.setattr(reader, "_now", lambda: time.time() + kinesalite_clock.shift_s)
    produce(kinesis, stream, ["new-0", "new-1"])
    read = shard_read(kinesis, stream, run, 2, position)

    with pytest.raises(SourceError) as info:
        read_shard(kinesis, batch_log, read)

    message = str(info.value)
    assert f"stream {stream!r} shard {read.shard_id}" in message
    assert f"after sequence number {position['after']}" in message
    assert "retention of 24 h" in message and "onTrimmed=oldest" in message
    assert batch_log.recorded_end(run, 2, read.shard_key) is None


@pytest.mark.usefixtures("no_pacing")
def test_on_trimmed_oldest_goes_on_from_the_oldest_record_and_warns(
    kinesalite_clock: MovableKinesalite,
    location: AppLocation,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    kinesis, batch_log = kinesalite_clock.client, BatchLog(location.table)
    stream = kinesalite_clock.make_stream()
    run, position = first_batch(kinesis, stream, batch_log)
    kinesalite_clock.jump()
    monkeypatch.setattr(reader, "_now", lambda: time.time() + kinesalite_clock.shift_s)
    new = produce(kinesis, stream, ["new-0", "new-1"])
    # kinesalite drops expired records as a GetRecords call passes them, and each call looks
    # at no more than its Limit: a limit above the expired count reaches the new records.
    read = shard_read(kinesis, stream, run, 2, position, on_trimmed="oldest", max_records=100)

    with caplog.at_level(logging.WARNING, logger=reader.__name__):
        records, end = read_shard(kinesis, batch_log, read)

    assert [r["SequenceNumber"] for r in records] == new  # old-4..old-9 expired unread
    assert end["from_oldest"] is True and end["after"] == new[-1]
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"after sequence number {position['after']}" in warned and "onTrimmed=oldest" in warned
    again, end_again = read_shard(kinesis, batch_log, read)  # a retried task reads the same
    assert [r["SequenceNumber"] for r in again] == new and end_again == end


@pytest.mark.usefixtures("no_pacing")
def test_an_old_position_kinesis_still_holds_is_resumed_without_loss(
    kinesalite_clock: MovableKinesalite, location: AppLocation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the reader's clock moves: the position looks old, but Kinesis still holds its
    record, so nothing after it can have expired and the read goes on."""
    kinesis, batch_log = kinesalite_clock.client, BatchLog(location.table)
    stream = kinesalite_clock.make_stream()
    run, position = first_batch(kinesis, stream, batch_log)
    ahead = kinesalite_clock.shift_s + JUMP_S
    monkeypatch.setattr(reader, "_now", lambda: time.time() + ahead)
    read = shard_read(kinesis, stream, run, 2, position)

    records, end = read_shard(kinesis, batch_log, read)

    assert [r["Data"] for r in records] == [f"old-{i}".encode() for i in range(4, 8)]
    assert "from_oldest" not in end


# --- shards Kinesis no longer lists --------------------------------------------------------


def test_vanished_lists_unfinished_shards_missing_from_the_listing() -> None:
    listed = [Shard("s", "b", ("a",), "0", "9", False)]
    held = {
        "s/a": {"after": "5", "done": False},  # not listed, not done: vanished
        "s/b": {"after": "7", "done": False},  # listed
        "s/c": {"after": "9", "done": True},  # done: nothing lost
        "t/a": {"after": "1", "done": False},  # another stream
    }
    assert vanished(listed, "s", held) == ["s/a"]


def planning_reader(stream: str, location: AppLocation, **options: str) -> KinesisStreamReader:
    return KinesisStreamReader({"streams": stream, "table": location.table, **options})


@pytest.mark.parametrize("policy", ["fail", "oldest"])
def test_a_vanished_shard_fails_the_plan_or_is_passed_over_with_a_warning(
    kinesis,
    make_stream,
    location: AppLocation,
    caplog: pytest.LogCaptureFixture,
    policy: str,
) -> None:
    """The shard "vanished" is one the source was reading that the listing no longer holds
    (kinesalite never drops shards, so the position map holds a made-up one)."""
    stream = make_stream(1)
    (listed,) = kinesis.list_shards(StreamName=stream)["Shards"]
    source = planning_reader(stream, location, onTrimmed=policy)
    run = uuid.uuid4().hex
    gone = f"{stream}/shardId-000000000099"
    source._positions[(run, 1)] = {gone: {"after": "4242", "done": False}}
    start = {"run": run, "n": 1, "initial": TRIM_HORIZON}
    end = {**start, "n": 2}

    if policy == "fail":
        with pytest.raises(SourceError, match=re.escape(f"{gone} (after sequence number 4242)")):
            source.partitions(start, end)
        return
    with caplog.at_level(logging.WARNING):
        parts = source.partitions(start, end)
    assert [p.read.shard_id for p in parts] == [listed["ShardId"]]
    assert any(gone in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_on_trimmed_takes_fail_or_oldest_only(make_stream, location: AppLocation) -> None:
    with pytest.raises(Exception, match=re.escape("onTrimmed='skip': expected one of")):
        planning_reader(make_stream(1), location, onTrimmed="skip")
