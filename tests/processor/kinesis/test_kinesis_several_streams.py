"""One application over several streams with different shard counts: each record carries
its stream's name, and a key lands in the same slice whichever stream it came from, so a
handler can join the streams by key in its state."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardless.changelog.layout import AppLocation
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.driver.job import start
from shardless.processor.runtime.routing import route
from tests.jobs import job_config

pytestmark = pytest.mark.slow

SLICES = 16
USERS = [f"user-{i}" for i in range(40)]
TIMEOUT_S = 240


def put(kinesis, stream: str, records: list[tuple[str, dict]]) -> list[str]:  # noqa: ANN001
    out = kinesis.put_records(
        StreamName=stream,
        Records=[{"PartitionKey": k, "Data": json.dumps(v).encode()} for k, v in records],
    )
    assert out["FailedRecordCount"] == 0
    return [r["SequenceNumber"] for r in out["Records"]]


def test_the_source_reads_every_stream_tagging_rows_with_their_stream(
    spark, kinesis, make_stream: Callable[[int], str], location: AppLocation, tmp_path: Path
) -> None:
    one, three = make_stream(1), make_stream(3)
    sent = {
        one: put(kinesis, one, [(u, {"n": 0}) for u in USERS]),
        three: put(kinesis, three, [(u, {"n": n}) for n in range(3) for u in USERS]),
    }
    rows: list[dict[str, Any]] = []
    query = (
        spark.readStream.format("shardless_kinesis")
        .options(streams=f"{one},{three}", table=location.table, slices=str(SLICES))
        .load()
        .writeStream.foreachBatch(lambda df, _: rows.extend(r.asDict() for r in df.collect()))
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(TIMEOUT_S) and query.exception() is None

    got = Counter((r["stream"], r["sequence_number"]) for r in rows)
    assert max(got.values()) == 1
    assert set(got) == {(s, seq) for s, seqs in sent.items() for seq in seqs}
    shards = {s: {r["shard"] for r in rows if r["stream"] == s} for s in sent}
    assert (len(shards[one]), len(shards[three])) == (1, 3)
    slices_of: dict[str, set[int]] = defaultdict(set)
    for r in rows:
        slices_of[r["partition_key"]].add(r["slice"])
    assert {k: v for k, v in slices_of.items() if len(v) > 1} == {}
    assert all(slices_of[u] == {route(u, None, SLICES)} for u in USERS)


def test_a_job_over_two_streams_joins_them_by_key_in_state(
    spark, kinesis, make_stream: Callable[[int], str], location: AppLocation, tmp_path: Path
) -> None:
    profiles, clicks = make_stream(1), make_stream(3)

    def process(event, ctx) -> None:  # noqa: ANN001
        if event.stream == profiles:
            ctx.state.set(event.json())
        else:
            ctx.emit({"stream": event.stream, "click": event.json()["n"], **ctx.state.get({})})

    cfg = job_config(location, (profiles, clicks), tmp_path, checkpoint="ck", slices=SLICES)
    outputs: list[dict] = []

    def sink(df, batch_id: int) -> None:  # noqa: ANN001
        outputs.extend(
            {"slice": r.slice, "key": r.key, **json.loads(r.value)} for r in df.collect()
        )

    def run() -> None:
        query = start(spark, HandlerFactory(process), cfg, sink=sink, available_now=True)
        assert query.awaitTermination(TIMEOUT_S) and query.exception() is None

    put(kinesis, profiles, [(u, {"tier": f"tier-{i % 3}"}) for i, u in enumerate(USERS)])
    run()  # the profiles are in state before any click arrives
    assert outputs == []
    put(kinesis, clicks, [(u, {"n": n}) for n in range(3) for u in USERS])
    run()

    assert len(outputs) == 3 * len(USERS)
    for out in outputs:
        i = USERS.index(out["key"])
        assert out["tier"] == f"tier-{i % 3}", out  # the profile was found in the same slice
        assert out["stream"] == clicks
        assert out["slice"] == route(out["key"], None, SLICES)
    assert sorted((o["key"], o["click"]) for o in outputs) == sorted(
        (u, n) for n in range(3) for u in USERS
    )
