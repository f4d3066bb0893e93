"""How a batch reaches its sink (`shardless.processor.driver.batch_reads.deliver`): a sink
marked `reads_once` runs the batch's groups once, in its own read, without a cache; any
other sink gets the batch cached, whose groups ran once in full whatever the sink reads;
a marked sink that reads nothing in a DataFrame action fails the batch, naming itself."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from shardless.processor.driver.batch_reads import SinkReadError, deliver, reads_once
from shardless.processor.driver.foreach_batch import foreach_batch_sink
from shardless.processor.driver.job import parquet_sink

GROUPS = 3
ROWS = 600  # output rows, over the groups


def batch(spark, runs: Path):  # noqa: ANN001, ANN201
    """A batch's outputs as the groups give them: each group (a partition) appends a line
    to `runs` when it runs, then yields its output rows and its one metrics row."""

    def group(frames: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        from pyspark import TaskContext

        part = TaskContext.get().partitionId()
        ids = [int(i) for frame in frames for i in frame["id"]]
        fd = os.open(runs, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{part}\n".encode())
        os.close(fd)
        yield pd.DataFrame(
            {
                "kind": ["out"] * len(ids) + ["metrics"],
                "slice": [i % 16 for i in ids] + [0],
                "batch_id": [7] * (len(ids) + 1),
                "seq": ids + [0],
                "key": [f"k{i}" for i in ids] + [None],
                "value": [str(i) for i in ids] + [json.dumps({"group": part, "records": len(ids)})],
            }
        )

    schema = "kind string, slice int, batch_id long, seq int, key string, value string"
    return spark.range(0, ROWS, 1, GROUPS).repartition(GROUPS).mapInPandas(group, schema)


def group_runs(runs: Path) -> list[int]:
    return sorted(int(line) for line in runs.read_text().split()) if runs.exists() else []


def cached_rdds(spark) -> int:  # noqa: ANN001
    return spark.sparkContext._jsc.sc().getPersistentRDDs().size()


def metrics_of(values: list[str]) -> tuple[list[int], int]:
    rows = [json.loads(v) for v in values]
    return sorted(r["group"] for r in rows), sum(r["records"] for r in rows)


def seqs(rows: list[Any]) -> list[int]:
    return sorted(r.seq for r in rows)


def test_a_sink_that_reads_once_runs_the_groups_once_without_a_cache(spark, tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "out"
    cached_during: list[int] = []
    write = parquet_sink(str(out))

    def sink(df, batch_id: int) -> None:  # noqa: ANN001
        cached_during.append(cached_rdds(spark))
        write(df, batch_id)

    values = deliver(batch(spark, runs), 7, reads_once(sink))
    assert group_runs(runs) == list(range(GROUPS))  # every group once, in the sink's write
    assert cached_during == [0]
    assert metrics_of(values) == (list(range(GROUPS)), ROWS)
    assert seqs(spark.read.parquet(str(out / "batch_id=7")).collect()) == list(range(ROWS))


@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda df: [df.count(), df.collect()], id="twice"),
        pytest.param(lambda df: df.take(1), id="partly"),
        pytest.param(lambda df: None, id="not-at-all"),
        pytest.param(lambda df: df.rdd.foreachPartition(lambda rows: None), id="rdd"),
    ],
)
def test_any_other_sink_gets_the_batch_cached_after_every_group_ran_once(
    spark, tmp_path, read: Callable[[Any], Any]
):
    runs = tmp_path / "runs"
    seen: list[list[Any]] = []

    def sink(df, batch_id: int) -> None:  # noqa: ANN001
        read(df)
        seen.append(df.collect())

    values = deliver(batch(spark, runs), 7, sink)
    assert group_runs(runs) == list(range(GROUPS))
    assert metrics_of(values) == (list(range(GROUPS)), ROWS)
    assert seqs(seen[0]) == list(range(ROWS)) and "kind" not in seen[0][0].asDict()
    assert cached_rdds(spark) == 0  # the cache is dropped with the batch


@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda df: df.rdd.foreachPartition(lambda rows: None), id="rdd"),
        pytest.param(lambda df: None, id="not-at-all"),
    ],
)
def test_a_sink_marked_reads_once_that_reads_no_dataframe_fails_the_batch(
    spark, tmp_path, read: Callable[[Any], Any]
):
    @reads_once
    def lazy(df, batch_id: int) -> None:  # noqa: ANN001
        read(df)

    with pytest.raises(SinkReadError) as err:
        deliver(batch(spark, tmp_path / "runs"), 7, lazy)
    assert "lazy is marked reads_once but read batch 7 in no DataFrame action" in str(err.value)
    assert "runs again on restart" in str(err.value)


def test_a_users_function_is_handed_the_batch_cached_even_if_it_carries_the_mark(spark, tmp_path):
    """`foreach_batch_sink` never passes the mark on: nothing can check a user's reads."""
    runs = tmp_path / "runs"
    got: list[tuple[int, int]] = []  # (rows read, RDDs cached while reading)

    @reads_once
    def marked(df, batch) -> None:  # noqa: ANN001
        got.append((df.count(), cached_rdds(spark)))
        got.append((df.count(), cached_rdds(spark)))

    values = deliver(batch(spark, runs), 7, foreach_batch_sink(marked, query_id="q"))
    assert group_runs(runs) == list(range(GROUPS))  # held: read twice, run once
    assert metrics_of(values) == (list(range(GROUPS)), ROWS)
    assert got == [(ROWS, 1), (ROWS, 1)]


def count_and_emit(event, ctx) -> None:  # noqa: ANN001
    n = ctx.state.get(0) + 1
    ctx.state.set(n)
    ctx.emit(n)


@pytest.mark.slow
@pytest.mark.parametrize("marked", [True, False], ids=["reads-once", "held"])
def test_the_job_hands_each_batch_the_way_its_sink_reads(
    spark, kinesis, make_stream, location, tmp_path, caplog, marked: bool
):
    """Through `start`: a marked sink's batches run in its own read, uncached; an unmarked
    sink's are cached before it reads, and the log says which. Either way the outputs are
    the running counts."""
    from shardless.processor.api.handlers import HandlerFactory
    from shardless.processor.driver.job import start
    from tests.jobs import job_config
    from tests.processor.driver.test_progress_metrics import put

    stream = make_stream(2)
    keys = [f"user-{i % 7}" for i in range(120)]
    put(kinesis, stream, [(k, {"i": i}) for i, k in enumerate(keys)])
    cfg = job_config(location, (stream,), tmp_path, max_records_per_shard=25)
    seen: list[tuple[int, list[Any]]] = []

    def sink(df, batch_id: int) -> None:  # noqa: ANN001
        cached = cached_rdds(spark)
        seen.append((cached, df.select("key", "value").collect()))

    caplog.set_level("INFO", logger="shardless.processor.driver.job")
    query = start(
        spark,
        HandlerFactory(count_and_emit),
        cfg,
        sink=reads_once(sink) if marked else sink,
        available_now=True,
    )
    query.awaitTermination()
    said = "in the sink's read (reads_once)" if marked else "cached for the sink, which may"
    assert any(said in r.getMessage() for r in caplog.records)
    assert len([rows for _, rows in seen if rows]) >= 3
    assert {cached for cached, rows in seen if rows} == ({0} if marked else {1})
    counts: dict[str, list[int]] = {}
    for _, rows in seen:
        for r in sorted(rows, key=lambda r: json.loads(r.value)):
            counts.setdefault(r.key, []).append(json.loads(r.value))
    assert counts == {k: list(range(1, keys.count(k) + 1)) for k in set(keys)}


@pytest.mark.slow
def test_a_sink_that_reads_partly_loses_no_state_and_the_job_goes_on(
    spark, kinesis, make_stream, location, tmp_path
):
    """An unmarked sink that peeks at one row of each batch: every group still ran and
    committed, Spark records the batches, and a later run counts on from every record."""
    from shardless.processor.api.handlers import HandlerFactory
    from shardless.processor.driver.job import start
    from tests.jobs import job_config
    from tests.processor.driver.test_progress_metrics import put

    stream = make_stream(2)
    first = [f"user-{i % 7}" for i in range(60)]
    put(kinesis, stream, [(k, {"i": i}) for i, k in enumerate(first)])
    cfg = job_config(location, (stream,), tmp_path, max_records_per_shard=25)
    peeked: list[int] = []
    seen: list[Any] = []

    def peek(df, batch_id: int) -> None:  # noqa: ANN001
        peeked.append(len(df.take(1)))

    def whole(df, batch_id: int) -> None:  # noqa: ANN001
        seen.extend(df.select("key", "value").collect())

    start(
        spark, HandlerFactory(count_and_emit), cfg, sink=peek, available_now=True
    ).awaitTermination()
    assert len(peeked) >= 2 and set(peeked) <= {0, 1}
    second = [f"user-{i % 7}" for i in range(21)]
    put(kinesis, stream, [(k, {"i": i}) for i, k in enumerate(second)])
    start(
        spark, HandlerFactory(count_and_emit), cfg, sink=whole, available_now=True
    ).awaitTermination()
    counts: dict[str, list[int]] = {}
    for r in seen:
        counts.setdefault(r.key, []).append(json.loads(r.value))
    assert {k: sorted(v) for k, v in counts.items()} == {
        k: list(range(first.count(k) + 1, first.count(k) + second.count(k) + 1))
        for k in set(second)
    }
