"""Event time from the record on real Spark (kinesalite, moto): the app names its event time
(`event_time = "ts"`, epoch ms or ISO 8601 strings), Spark's watermark follows it with the
allowed lateness, late records go to the dead letters (`--on-late dead-letter`) and are
counted, records without a readable event time are set aside naming the field, and
event-time timers and event-time TTL do what a plain fold of the same input, batch by
batch, says they do: a timer fires in the first batch whose watermark passes it, also
when its group has no records in that batch. The `TestDriver` given the same batches
agrees."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import pytest

from shardless.changelog.layout import AppLocation
from shardless.processor.api.app import load_handler
from shardless.processor.api.policies import RecordPolicy
from shardless.processor.driver.job import BatchReport, parquet_sink, start
from shardless.processor.driver.metrics import figures
from shardless.processor.runtime.grouping import group_of
from shardless.processor.runtime.routing import route
from shardless.processor.testing import TestDriver
from tests.jobs import job_config

T = 1_700_000_000_000
LATENESS = 1500
WINDOW = 2000  # each record sets an event timer at its event time plus this
TTL = 9000  # each record keeps its number under `last` for this long in event time

APP = f"""
event_time = "ts"


def process(event, ctx):
    record = event.json()
    total = ctx.state.get(0) + record["v"]
    ctx.state.set(total)
    prev = ctx.state.map.get("last")
    ctx.state.map.set("last", record["n"], ttl_ms={TTL}, on="event")
    ctx.timers.set(event.event_time_ms + {WINDOW}, "event")
    ctx.emit({{"n": record["n"], "total": total, "prev": prev, "wm": ctx.watermark_ms,
               "at": event.event_time_ms}})


def on_timer(timer, ctx):
    ctx.emit({{"timer": timer.ts, "kind": timer.kind, "total": ctx.state.get(0)}})
"""


def records(count: int = 24) -> list[tuple[str, dict[str, Any]]]:
    """(partition key, data), read 6 to a batch. Event times follow the record number,
    except: n % 6 == 2 comes a little out of order (within the lateness), n % 6 == 4 comes
    9 s behind (late once the watermark has moved), every 5th is an ISO 8601 string, n = 13
    has no `ts` and n = 17 a `ts` that is not a time. Key `rare` appears seldom, so its
    TTL'd value has expired by its next record once."""
    out = []
    for n in range(count):
        at = T + n * 1000
        if n % 6 == 2:
            at -= 2000
        elif n % 6 == 4:
            at -= 9000
        data: dict[str, Any] = {"n": n, "v": n % 7 + 1}
        if n == 17:
            data["ts"] = "yesterday"
        elif n != 13:
            iso = datetime.fromtimestamp(at / 1000, tz=UTC).isoformat()
            data["ts"] = iso if n % 5 == 0 else at
        key = "rare" if n in (1, 7, 19) else f"u{n % 3}"
        out.append((key, data))
    return out


def event_ms(data: dict[str, Any]) -> int | None:
    ts = data.get("ts")
    if isinstance(ts, int):
        return ts
    try:
        return int(datetime.fromisoformat(ts).timestamp() * 1000)
    except (TypeError, ValueError):
        return None


def fold(sent: list[tuple[str, dict]], sizes: list[int]) -> dict[str, Any]:
    """What the job must do, in plain Python, given how many records each batch read: per
    batch its watermark, outputs (as a sorted list) and late records; the dead letters and
    the final totals."""
    wm, seen_max = 0, None  # Spark's watermark is 0 until a batch has seen event times
    totals: dict[str, int] = {}
    last: dict[str, tuple[int, int]] = {}  # key -> (n, expires at)
    timers: set[tuple[int, str]] = set()
    batches, letters, i = [], [], 0
    for size in sizes:
        outputs, late = [], 0
        for key, data in sent[i : i + size]:
            at = event_ms(data)
            if at is None:
                letters.append((data["n"], "event-time"))
                continue
            seen_max = at if seen_max is None else max(seen_max, at)
            if wm >= 0 and at <= wm:
                late += 1
                letters.append((data["n"], "late"))
                continue
            totals[key] = totals.get(key, 0) + data["v"]
            found = last.get(key)
            prev = found[0] if found is not None and found[1] > wm else None
            last[key] = (data["n"], max(wm, 0) + TTL)
            timers.add((at + WINDOW, key))
            outputs.append((key, {"n": data["n"], "total": totals[key], "prev": prev,
                                  "wm": wm, "at": at}))  # fmt: skip
        for ts, key in sorted(t for t in timers if t[0] <= wm):
            timers.discard((ts, key))
            outputs.append((key, {"timer": ts, "kind": "event", "total": totals[key]}))
        batches.append({"wm": wm, "outputs": sorted(map(json.dumps, outputs)), "late": late})
        i += size
        if seen_max is not None:
            wm = max(wm, seen_max - LATENESS)
    return {"batches": batches, "letters": sorted(letters), "totals": totals}


def quiet_timers(
    sent: list[tuple[str, dict]], sizes: list[int], batches: list[dict], slices: int, groups: int
) -> list[tuple[int, str]]:
    """(batch, key) of the event timers that fired in a batch without records for their
    group: only the watermark could fire them."""
    out, i = [], 0
    for b, (size, want) in enumerate(zip(sizes, batches, strict=True)):
        busy = {group_of(route(k, None, slices), slices, groups) for k, _ in sent[i : i + size]}
        i += size
        for key, o in map(json.loads, want["outputs"]):
            if "timer" in o and group_of(route(key, None, slices), slices, groups) not in busy:
                out.append((b, key))
    return out


def ttl_cases(batches: list[dict]) -> tuple[int, int]:
    """How many records found the value their key set in an earlier batch, once the
    watermark had moved (not Spark's 0 of the first batch), expired in event time, and how
    many found it kept."""
    before: dict[str, tuple[int, int]] = {}  # key -> (n, watermark when set)
    expired = kept = 0
    for want in batches:
        now: dict[str, tuple[int, int]] = {}
        found = [(k, o) for k, o in map(json.loads, want["outputs"]) if "n" in o]
        for key, o in sorted(found, key=lambda ko: ko[1]["n"]):
            if key in before and key not in now:
                n, wm = before[key]
                expired += o["prev"] is None and wm > 0
                kept += o["prev"] == n
            now[key] = (o["n"], o["wm"])
        before.update(now)
    return expired, kept


def dead_letters(location: AppLocation) -> list[dict]:
    s3 = boto3.client("s3")
    listed = s3.list_objects_v2(Bucket=location.bucket, Prefix=f"{location.prefix}/dead-letter/")
    out = []
    for obj in listed.get("Contents", []):
        body = s3.get_object(Bucket=location.bucket, Key=obj["Key"])["Body"].read().decode()
        out += [json.loads(line) for line in body.splitlines()]
    return out


@pytest.fixture
def four_groups(spark):  # noqa: ANN001, ANN201
    """The session laid out for 4 groups (the suite's has 2): key `rare` needs a group of
    its own, which its slice gets among 4 groups of 16 slices."""
    key = "spark.sql.shuffle.partitions"
    saved = spark.conf.get(key)
    spark.conf.set(key, "4")
    yield 4
    spark.conf.set(key, saved)


@pytest.mark.slow
def test_event_time_from_the_payload_drives_watermark_timers_ttl_and_late_records(
    spark, kinesis, make_stream, location, tmp_path: Path, four_groups: int
):
    stream = make_stream(1)  # one shard: each batch reads the next records in order
    sent = records()
    for key, data in sent:
        kinesis.put_record(StreamName=stream, PartitionKey=key, Data=json.dumps(data).encode())
    app = tmp_path / "sessions.py"
    app.write_text(APP)
    cfg = job_config(
        location, (stream,), tmp_path, max_records_per_shard=6, allowed_lateness_ms=LATENESS,
        on_late="dead-letter", on_decode_error="dead-letter", groups=four_groups,
    )  # fmt: skip
    reports: list[BatchReport] = []
    query = start(
        spark, load_handler(app), cfg, sink=parquet_sink(str(tmp_path / "out")),
        on_report=reports.append, available_now=True,
    )  # fmt: skip
    query.awaitTermination()
    progress = [json.loads(p.json) for p in query.recentProgress]

    sizes = [r.records for r in reports]
    assert sum(sizes) == len(sent) and len(sizes) >= 4, sizes
    expected = fold(sent, sizes)
    rows = spark.read.parquet(str(tmp_path / "out")).collect()
    for b, (report, want) in enumerate(zip(reports, expected["batches"], strict=True)):
        got = sorted(
            json.dumps((r.key, json.loads(r.value))) for r in rows if r.batch_id == report.batch_id
        )
        assert got == want["outputs"], f"batch {b} (watermark {want['wm']})"
        assert report.late_records == want["late"], b
    assert sum(b["late"] for b in expected["batches"]) >= 3  # late records were there
    # what the outputs being the fold's proves: an event timer fired in the first batch whose
    # watermark passed it though its group had no records in that batch (key `rare` is
    # alone in its group), and event-time TTL both expired and kept values across batches
    assert quiet_timers(sent, sizes, expected["batches"], cfg.slices, cfg.groups)
    expired, kept = ttl_cases(expected["batches"])
    assert expired >= 1 and kept >= 1, (expired, kept)
    late_in_progress = [figures(p["observedMetrics"]).get("late_records") for p in progress]
    assert late_in_progress == [b["late"] for b in expected["batches"]]

    letters = dead_letters(location)
    n_of = [json.loads(base64.b64decode(x["data"]))["n"] for x in letters]
    assert sorted(zip(n_of, (x["stage"] for x in letters), strict=True)) == expected["letters"]
    for x in letters:
        assert x["stream"] == stream and x["shard"] and x["sequence_number"]
        if x["stage"] == "event-time":
            assert "field 'ts'" in x["error"], x["error"]
        else:
            assert x["error"].startswith("late: event time "), x["error"]

    # The TestDriver, given the same batches, does the same.
    policy = RecordPolicy(on_late="dead-letter", on_decode_error="dead-letter")
    with TestDriver(app, slices=16, allowed_lateness_ms=LATENESS, policy=policy) as t:
        i = 0
        for size, want in zip(sizes, expected["batches"], strict=True):
            for key, data in sent[i : i + size]:
                t.send(key, data)
            i += size
            before = t.late_records
            # the driver's watermark is -1 before its first batch, Spark's 0
            got = sorted(json.dumps(o).replace('"wm": -1,', '"wm": 0,') for o in t.run_batch())
            assert got == want["outputs"]
            assert t.late_records - before == want["late"]
        assert {k: t.state(k) for k in expected["totals"]} == expected["totals"]
