"""Reading one shard for one batch: real GetRecords against kinesalite, batch ends in moto's
DynamoDB. `ShardRead`s are built by hand, as the source's planner would build them."""

from __future__ import annotations

import http.client
import http.server
import re
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable

import pytest

from shardless.processor.errors import SourceError
from shardless.processor.kinesis import positions, reader
from shardless.processor.kinesis.batch_log import BatchLog
from shardless.processor.kinesis.reader import ShardRead, read_shard
from shardless.processor.kinesis.shards import list_shards, readable
from shardless.processor.kinesis.source import kinesis_client

TRIM_HORIZON = {"type": "TRIM_HORIZON"}
MAX_BYTES = 10 * 1024 * 1024


def only_shard(kinesis, stream: str) -> str:  # noqa: ANN001
    shards = kinesis.list_shards(StreamName=stream)["Shards"]
    assert len(shards) == 1, shards
    return shards[0]["ShardId"]


def produce(kinesis, stream: str, count: int, tag: str = "a") -> list[tuple[str, bytes]]:  # noqa: ANN001
    """Put `count` records; return (sequence number, data) in sequence order."""
    out: list[tuple[str, bytes]] = []
    for first in range(0, count, 500):
        batch = [
            {"Data": f"{tag}-{i}".encode(), "PartitionKey": f"pk-{i % 7}"}
            for i in range(first, min(count, first + 500))
        ]
        resp = kinesis.put_records(StreamName=stream, Records=batch)
        assert resp["FailedRecordCount"] == 0
        out += [
            (r["SequenceNumber"], b["Data"]) for r, b in zip(resp["Records"], batch, strict=True)
        ]
    return sorted(out, key=lambda x: positions.sequence_sort_key(x[0]))


def got(records: list[dict]) -> list[tuple[str, bytes]]:
    return [(r["SequenceNumber"], r["Data"]) for r in records]


def shard_read(
    stream: str,
    shard_id: str,
    *,
    run: str | None = None,
    n: int = 1,
    start: positions.Position | None = None,
    max_records: int = 100,
    closed: bool = False,
) -> ShardRead:
    return ShardRead(
        run=run or uuid.uuid4().hex,
        n=n,
        stream=stream,
        shard_id=shard_id,
        depth=0,
        start=start,
        initial=TRIM_HORIZON,
        max_records=max_records,
        max_bytes=MAX_BYTES,
        closed=closed,
    )


def wait_active(kinesis, stream: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 30
    while True:
        summary = kinesis.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]
        if summary["StreamStatus"] == "ACTIVE":
            return
        assert time.monotonic() < deadline, f"{stream} still {summary['StreamStatus']}"
        time.sleep(0.05)


def split_in_half(kinesis, stream: str, shard_id: str) -> tuple[str, str]:  # noqa: ANN001
    """Split the shard at the middle of its hash range; return the two children's ids."""
    shard = next(
        s for s in kinesis.list_shards(StreamName=stream)["Shards"] if s["ShardId"] == shard_id
    )
    lo, hi = (int(shard["HashKeyRange"][k]) for k in ("StartingHashKey", "EndingHashKey"))
    kinesis.split_shard(
        StreamName=stream, ShardToSplit=shard_id, NewStartingHashKey=str((lo + hi) // 2 + 1)
    )
    wait_active(kinesis, stream)
    children = [
        s["ShardId"]
        for s in kinesis.list_shards(StreamName=stream)["Shards"]
        if s.get("ParentShardId") == shard_id
    ]
    assert len(children) == 2, children
    return children[0], children[1]


# --- fresh reads --------------------------------------------------------------------------


@pytest.mark.usefixtures("no_pacing")
def test_fresh_read_is_bounded_by_max_records_and_records_its_end(
    kinesis, make_stream: Callable[[int], str], batch_log: BatchLog
) -> None:
    stream = make_stream(1)
    shard_id = only_shard(kinesis, stream)
    produced = produce(kinesis, stream, 250)
    read = shard_read(stream, shard_id, max_records=100)

    records, end = read_shard(kinesis, batch_log, read)

    assert got(records) == produced[:100]
    assert end["after"] == produced[99][0]
    assert end["count"] == 100
    assert end["bytes"] == sum(len(data) for _, data in produced[:100])
    assert end["caught_up"] is False
    assert end["done"] is False
    assert batch_log.recorded_end(read.run, read.n, read.shard_key) == end


@pytest.mark.usefixtures("no_pacing")
def test_consecutive_batches_read_every_record_once_in_order(
    kinesis, make_stream: Callable[[int], str], batch_log: BatchLog
) -> None:
    stream = make_stream(1)
    shard_id = only_shard(kinesis, stream)
    produced = produce(kinesis, stream, 250)
    run, pos = uuid.uuid4().hex, {}
    key = f"{stream}/{shard_id}"
    seen: list[tuple[str, bytes]] = []
    ends = []
    for n in (1, 2, 3):
        read = shard_read(stream, shard_id, run=run, n=n, start=pos.get(key))
        records, end = read_shard(kinesis, batch_log, read)
        seen += got(records)
        ends.append(end)
        pos = positions.advance(pos, batch_log.ends(run, n))

    assert seen == produced
    assert [e["count"] for e in ends] == [100, 100, 50]
    assert [e["caught_up"] for e in ends] == [False, False, True]
    since = pos[key].pop("since")
    assert pos == {key: {"after": produced[-1][0], "done": False}}
    assert time.time() - 30 < since <= time.time(), "the last batch saw the tip just now"


# --- retries ------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_pacing")
def test_retry_of_a_bounded_batch_returns_the_same_records(
    kinesis, make_stream: Callable[[int], str], batch_log: BatchLog
) -> None:
    stream = make_stream(1)
    shard_id = only_shard(kinesis, stream)
    produced = produce(kinesis, stream, 250)
    read = shard_read(stream, shard_id, max_records=100)
    first, end = read_shard(kinesis, batch_log, read)
    produce(kinesis, stream, 50, tag="later")

    again, end_again = read_shard(kinesis, batch_log, read)

    assert got(again) == got(first) == produced[:100]
    assert end_again == end
    assert batch_log.ends(read.run, read.n) == {read.shard_key: end}


@pytest.mark.usefixtures("no_pacing")
def test_retry_of_a_caught_up_batch_lets_no_new_record_in(
    kinesis, make_stream: Callable[[int], str], batch_log: BatchLog
) -> None:
    stream = make_stream(1)
    shard_id = only_shard(kinesis, stream)
    produced = produce(kinesis, stream, 30)
    read = shard_read(stream, shard_id, max_records=100)
    first, end = read_shard(kinesis, batch_log, read)
    assert got(first) == produced and end["caught_up"] is True
    produce(kinesis, stream, 40, tag="later")

    again, end_again = read_shard(kinesis, batch_log, read)

    assert got(again) == produced
    assert end_again == end
    assert batch_log.recorded_end(read.run, read.n, read.shard_key) == end


@pytest.mark.usefixtures("no_pacing")
def test_retry_of_a_batch_whose_recorded_end_is_empty_reads_nothing(
    kinesis, make_stream: Callable[[int], str], batch_log: BatchLog
) -> None:
    stream = make_stream(1)
    shard_id = only_shard(kinesis, stream)
    read = shard_read(stream, shard_id)
    records, end = read_shard(kinesis, batch_log, read)  # the shard is empty
    assert records == []
    assert end["count"] == 0 and end["after"] is None and end["caught_up"] is True
    produce(kinesis, stream, 20)

    again, end_again = read_shard(kinesis, batch_log, read)

    assert again == []
    assert end_again == end


@pytest.mark.usefixtures("no_pacing")
def test_recorded_end_with_count_zero_returns_nothing_whatever_the_shard_holds(
    kinesis, make_stream: Callable[[int], str], batch_log: BatchLog
) -> None:
    stream = make_stream(1)
    shard_id = only_shard(kinesis, stream)
    produce(kinesis, stream, 20)
    read = shard_read(stream, shard_id)
    recorded = {"after": None, "done": False, "caught_up": True, "count": 0, "bytes": 0}
    assert batch_log.record_end(read.run, read.n, read.shard_key, recorded) == recorded

    records, end = read_shard(kinesis, batch_log, read)

    assert records == []
    assert end == recorded


# --- closed shards ------------------------------------------------------------------------


@pytest.mark.usefixtures("no_pacing")
def test_closed_shard_is_read_to_its_end_in_one_batch(
    kinesis, make_stream: Callable[[int], str], batch_log: BatchLog
) -> None:
    stream = make_stream(1)
    parent = only_shard(kinesis, stream)
    produced = produce(kinesis, stream, 30)
    children = split_in_half(kinesis, stream, parent)
    read = shard_read(stream, parent, max_records=100, closed=True)

    records, end = read_shard(kinesis, batch_log, read)

    assert got(records) == produced
    assert end["after"] == produced[-1][0]
    assert end["done"] is True
    shards = list_shards(kinesis, stream)
    assert {s.shard_id for s in readable(shards, {read.shard_key})} == set(children)


@pytest.mark.usefixtures("no_pacing")
def test_empty_closed_shard_is_done_in_its_first_batch(
    kinesis, make_stream: Callable[[int], str], batch_log: BatchLog
) -> None:
    stream = make_stream(1)
    parent = only_shard(kinesis, stream)
    split_in_half(kinesis, stream, parent)
    key = f"{stream}/{parent}"
    records, end = read_shard(kinesis, batch_log, shard_read(stream, parent, closed=True))
    assert records == []
    assert positions.advance({}, {key: end})[key]["done"] is True


# --- errors and pacing --------------------------------------------------------------------


@pytest.mark.usefixtures("no_pacing")
def test_reading_a_shard_of_a_deleted_stream_raises_source_error(
    kinesis, make_stream: Callable[[int], str], batch_log: BatchLog
) -> None:
    stream = make_stream(1)
    shard_id = only_shard(kinesis, stream)
    produce(kinesis, stream, 5)
    kinesis.delete_stream(StreamName=stream)
    deadline = time.monotonic() + 30
    # gone for every call, not just from ListStreams (a stream DELETING may still be read)
    while True:
        try:
            kinesis.describe_stream_summary(StreamName=stream)
        except kinesis.exceptions.ResourceNotFoundException:
            break
        assert time.monotonic() < deadline, f"{stream} not deleted"
        time.sleep(0.05)
    read = shard_read(stream, shard_id)

    with pytest.raises(SourceError, match=re.escape(f"{stream}/{shard_id}")):
        read_shard(kinesis, batch_log, read)
    assert batch_log.recorded_end(read.run, read.n, read.shard_key) is None


def test_get_records_calls_on_one_shard_are_paced(
    kinesis, make_stream: Callable[[int], str]
) -> None:
    stream = make_stream(1)
    shard = reader._Shard(kinesis, shard_read(stream, only_shard(kinesis, stream)))

    began = time.monotonic()
    for _ in range(3):
        shard.next(10)
    elapsed = time.monotonic() - began

    assert elapsed >= 0.4  # two waits of 0.2 s between three calls


# --- per-shard metrics ----------------------------------------------------------------------


class ThrottlingProxy:
    """An HTTP proxy in front of kinesalite that refuses the first `refuse` GetRecords calls
    with ProvisionedThroughputExceededException, as Kinesis does over its read quota."""

    def __init__(self, upstream: str, refuse: int) -> None:
        self.refuse = refuse
        self.refused = 0
        target = urllib.parse.urlsplit(upstream)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("X-Amz-Target", "").endswith(".GetRecords") and (
                    proxy.refused < proxy.refuse
                ):
                    proxy.refused += 1
                    self._answer(
                        400,
                        b'{"__type": "ProvisionedThroughputExceededException", '
                        b'"message": "Rate exceeded for shard"}',
                    )
                    return
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                conn.request("POST", self.path, body=body, headers=headers)
                upstream_answer = conn.getresponse()
                self._answer(upstream_answer.status, upstream_answer.read())
                conn.close()

            def _answer(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-amz-json-1.1")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.usefixtures("no_pacing")
def test_the_recorded_end_holds_the_reads_metrics_and_counts_throttled_calls(
    aws, make_stream: Callable[[int], str], batch_log: BatchLog
) -> None:
    proxy = ThrottlingProxy(aws.kinesis_endpoint, refuse=2)
    try:
        kinesis = kinesis_client(proxy.endpoint)  # the source's own client, through the proxy
        stream = make_stream(1)
        shard_id = only_shard(kinesis, stream)
        produced = produce(kinesis, stream, 30)
        read = shard_read(stream, shard_id, max_records=100)

        records, end = read_shard(kinesis, batch_log, read)
    finally:
        proxy.close()

    assert got(records) == produced
    assert proxy.refused == 2
    assert end["throttles"] == 2, "botocore's own retries are counted too"
    assert end["calls"] == 1 and end["behind_ms"] == 0
    assert (end["count"], end["user_records"]) == (30, 30)
    assert end["bytes"] == sum(len(data) for _, data in produced)
    assert end["read_ms"] >= 0
    assert batch_log.ends(read.run, read.n)[read.shard_key] == end
