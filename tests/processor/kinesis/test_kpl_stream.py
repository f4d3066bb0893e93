"""KPL aggregates through the `shardless_kinesis` source on kinesalite, Spark end to end.

Aggregates are made like the KPL makes them (`aws-kinesis-agg`): per round, the user records
bound for one shard go into one aggregate, placed by its first user record's keys. Some keys
carry explicit hash keys, which route them to other slices than their partition keys would.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aws_kinesis_agg.aggregator import RecordAggregator

from shardless.changelog.layout import AppLocation
from shardless.processor.runtime.routing import hash_key, route

pytestmark = pytest.mark.slow

SLICES = 16
KEYS = [f"user-{i}" for i in range(24)]
TIMEOUT_S = 240


def explicit_hash_key(key: str) -> str | None:
    """Every third key carries an explicit hash key unrelated to its partition key."""
    if int(key.split("-")[1]) % 3:
        return None
    return str(int.from_bytes(hashlib.md5(f"ehk:{key}".encode()).digest(), "big"))


def produce(kinesis, stream: str, rounds: int) -> dict[str, list[tuple[bytes, str | None]]]:  # noqa: ANN001
    """Per round: one aggregate per shard, then one plain record for key 1. Returns per key
    the (data, explicit hash key) sent, in order."""
    shards = kinesis.list_shards(StreamName=stream)["Shards"]

    def shard_of(key: str) -> str:
        h = hash_key(key, explicit_hash_key(key))
        return next(
            s["ShardId"]
            for s in shards
            if int(s["HashKeyRange"]["StartingHashKey"])
            <= h
            <= int(s["HashKeyRange"]["EndingHashKey"])
        )

    sent: dict[str, list[tuple[bytes, str | None]]] = defaultdict(list)
    for r in range(rounds):
        by_shard: dict[str, list[str]] = defaultdict(list)
        for key in KEYS:
            by_shard[shard_of(key)].append(key)
        for keys in by_shard.values():
            agg = RecordAggregator()
            for key in keys:
                data = f"{key}:{r}".encode()
                assert agg.add_user_record(key, data, explicit_hash_key(key)) is None
                sent[key].append((data, explicit_hash_key(key)))
            pk, ehk, data = agg.clear_and_get().get_contents()
            kinesis.put_record(
                StreamName=stream,
                Data=data,
                PartitionKey=pk,
                **({"ExplicitHashKey": ehk} if ehk else {}),
            )
        plain = f"user-1:plain-{r}".encode()
        kinesis.put_record(StreamName=stream, Data=plain, PartitionKey="user-1")
        sent["user-1"].append((plain, None))
    return sent


class Collector:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def __call__(self, df, batch_id: int) -> None:  # noqa: ANN001
        self.rows += [{**r.asDict(), "batch": batch_id} for r in df.collect()]


def test_the_source_delivers_each_user_record_once_routed_by_its_own_keys_in_order(
    spark, kinesis, make_stream: Callable[[int], str], location: AppLocation, tmp_path: Path
) -> None:
    stream = make_stream(2)
    sent = produce(kinesis, stream, rounds=4)
    sink = Collector()
    query = (
        spark.readStream.format("shardless_kinesis")
        .options(streams=stream, table=location.table, slices=str(SLICES), maxRecordsPerShard="4")
        .load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(TIMEOUT_S), "availableNow query did not finish"
    assert query.exception() is None

    copies = Counter((r["partition_key"], bytes(r["data"])) for r in sink.rows)
    assert max(copies.values()) == 1
    assert set(copies) == {(k, d) for k, items in sent.items() for d, _ in items}
    assert len({r["batch"] for r in sink.rows}) >= 2, "aggregates spread over several batches"
    per_key: dict[str, list[tuple[int, str, bytes]]] = defaultdict(list)
    subsequences: dict[str, list[int]] = defaultdict(list)
    for r in sink.rows:
        ehk = explicit_hash_key(r["partition_key"]) if b"plain" not in r["data"] else None
        assert r["explicit_hash_key"] == ehk
        assert r["slice"] == route(r["partition_key"], ehk, SLICES)
        per_key[r["partition_key"]].append((r["batch"], r["stream_order"], bytes(r["data"])))
        subsequences[r["sequence_number"]].append(r["subsequence"])
    assert any(route(k, explicit_hash_key(k), SLICES) != route(k, None, SLICES) for k in KEYS), (
        "some explicit hash key must route elsewhere than its partition key"
    )
    for key, items in per_key.items():
        assert [d for _, _, d in sorted(items)] == [d for d, _ in sent[key]], key
    for seq, subs in subsequences.items():
        assert sorted(subs) == list(range(len(subs))), seq
    assert max(len(s) for s in subsequences.values()) > 1
