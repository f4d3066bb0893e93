"""A shard read's lag figures, recorded in its batch end: the arrival time of the oldest
record it left unread (`unread_arrival_ms`), exact when the read stopped at
`maxRecordsPerShard`, and none once it caught up; the record it looked at to learn that is
left for the next batch (real GetRecords on kinesalite, batch ends in moto's DynamoDB)."""

from __future__ import annotations

import time
import uuid

import pytest

from shardless.processor.kinesis import positions
from shardless.processor.kinesis.reader import read_shard
from shardless.processor.kinesis.source import kinesis_client
from tests.processor.kinesis.test_kinesis_reader import (
    got,
    only_shard,
    shard_read,
)


def put_slowly(kinesis, stream: str, count: int) -> list[tuple[str, bytes, int]]:  # noqa: ANN001
    """Put `count` records a few ms apart; (sequence number, data, arrival ms) as Kinesis
    holds them, in shard order."""
    for i in range(count):
        kinesis.put_record(StreamName=stream, Data=f"r-{i}".encode(), PartitionKey="k")
        time.sleep(0.003)
    shard_id = only_shard(kinesis, stream)
    it = kinesis.get_shard_iterator(
        StreamName=stream, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"
    )["ShardIterator"]
    records = kinesis.get_records(ShardIterator=it, Limit=10_000)["Records"]
    assert len(records) == count
    return [
        (
            r["SequenceNumber"],
            r["Data"],
            round(r["ApproximateArrivalTimestamp"].timestamp() * 1000),
        )
        for r in records
    ]


@pytest.mark.usefixtures("no_pacing")
def test_a_bounded_read_records_the_arrival_of_the_first_record_it_left_unread(
    kinesis, make_stream, batch_log
) -> None:
    stream = make_stream(1)
    held = put_slowly(kinesis, stream, 12)
    assert len({arrival for _, _, arrival in held}) > 1, "arrivals must differ to tell them apart"
    client = kinesis_client(None)
    shard_id = only_shard(kinesis, stream)
    run = uuid.uuid4().hex
    start: positions.Position | None = None
    reads = []
    for n in (1, 2, 3):
        read = shard_read(stream, shard_id, run=run, n=n, start=start, max_records=5)
        records, end = read_shard(client, batch_log, read)
        reads.append((got(records), end))
        start = positions.advance({read.shard_key: start or {}}, {read.shard_key: end})[
            read.shard_key
        ]

    # Each batch reads the next records, none twice, none skipped, though each bounded
    # read's last call returned one record more than the batch took.
    assert [r for rs, _ in reads for r in rs] == [(s, d) for s, d, _ in held]
    assert [len(rs) for rs, _ in reads] == [5, 5, 2]
    first, second, third = (end for _, end in reads)
    assert first["unread_arrival_ms"] == held[5][2]
    assert second["unread_arrival_ms"] == held[10][2]
    assert not first["caught_up"] and not second["caught_up"]
    assert third["unread_arrival_ms"] is None and third["caught_up"]
    assert batch_log.ends(run, 1)[f"{stream}/{shard_id}"]["unread_arrival_ms"] == held[5][2]

    # A retry of a bounded batch replays it: the same records, the same recorded figures.
    again, end = read_shard(
        client, batch_log, shard_read(stream, shard_id, run=run, n=1, max_records=5)
    )
    assert (got(again), end) == reads[0]


@pytest.mark.usefixtures("no_pacing")
def test_a_read_that_takes_exactly_what_is_left_has_caught_up(
    kinesis, make_stream, batch_log
) -> None:
    stream = make_stream(1)
    held = put_slowly(kinesis, stream, 5)
    read = shard_read(stream, only_shard(kinesis, stream), max_records=5)
    records, end = read_shard(kinesis_client(None), batch_log, read)
    assert got(records) == [(s, d) for s, d, _ in held]
    assert end["caught_up"] and end["unread_arrival_ms"] is None and end["calls"] == 1
