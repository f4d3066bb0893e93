"""The examples, run from their files through the TestDriver, against plain-Python models."""

from __future__ import annotations

import json
import random
import runpy
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from shardless.processor.api.context import Timer
from shardless.processor.testing import TestDriver

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
START = 1_700_000_000_000


def driver(name: str, **kwargs) -> TestDriver:
    return TestDriver(str(EXAMPLES / name), start_ms=START, **kwargs)


def constant(name: str, attr: str):
    return runpy.run_path(str(EXAMPLES / name))[attr]


def by_key(outputs) -> dict[str, list]:
    """Outputs grouped by key, in emission order: the order the engine guarantees."""
    grouped = defaultdict(list)
    for key, value in outputs:
        grouped[key].append(value)
    return dict(grouped)


# -- sessionization --------------------------------------------------------------------------

GAP = constant("sessionization.py", "GAP_MS")


def session(user, start, end, pages):
    return {"user": user, "start_ms": start, "end_ms": end, "events": len(pages), "pages": pages}


def test_session_closes_exactly_once_after_the_gap_and_not_before():
    d = driver("sessionization.py")
    d.send("u1", {"user": "u1", "page": "/home"})
    d.send("u1", {"user": "u1", "page": "/cart"})
    assert d.run_batch() == []
    assert d.timers("u1") == [Timer("u1", START + GAP, "processing")]
    d.advance(GAP - 1)
    assert d.run_batch() == []
    assert d.state("u1")["events"] == 2
    d.advance(1)
    assert d.run_batch() == [("u1", session("u1", START, START, ["/home", "/cart"]))]
    assert d.state("u1") is None and d.timers("u1") == []
    d.advance(3 * GAP)
    assert d.run_batch() == []
    assert d.outputs == [("u1", session("u1", START, START, ["/home", "/cart"]))]


def test_an_event_before_the_gap_extends_the_session_and_moves_its_only_timer():
    d = driver("sessionization.py")
    d.send("u1", {"user": "u1", "page": "/a"})
    d.run_batch()
    d.advance(GAP - 1)
    d.send("u1", {"user": "u1", "page": "/b"})
    d.send("u2", {"user": "u2", "page": "/x"})
    assert d.run_batch() == []
    second = START + GAP - 1
    assert d.timers("u1") == [Timer("u1", second + GAP, "processing")]
    d.advance(GAP - 1)  # past the first event's deadline, not the second's
    assert d.run_batch() == []
    d.advance(1)
    assert by_key(d.run_batch()) == {
        "u1": [session("u1", START, second, ["/a", "/b"])],
        "u2": [session("u2", second, second, ["/x"])],
    }
    assert d.state("u1") is None and d.timers("u1") == []


def test_an_event_arriving_after_the_gap_starts_a_new_session_before_the_timer_fires():
    # The batch at the deadline has a record for the key: the record runs before the due
    # timer, so the handler itself must see that the gap passed.
    d = driver("sessionization.py")
    d.send("u1", {"user": "u1", "page": "/a"})
    d.run_batch()
    d.advance(GAP)
    d.send("u1", {"user": "u1", "page": "/b"})
    assert d.run_batch() == [("u1", session("u1", START, START, ["/a"]))]
    assert d.state("u1")["pages"] == ["/b"]
    assert d.timers("u1") == [Timer("u1", START + 2 * GAP, "processing")]
    d.advance(GAP)
    assert d.run_batch() == [("u1", session("u1", START + GAP, START + GAP, ["/b"]))]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sessions_match_a_model_on_random_input(seed):
    rng = random.Random(seed)
    users = [f"user-{i}" for i in range(20)]
    d = driver("sessionization.py", slices=4)
    now = START
    open_sessions: dict[str, dict] = {}
    deadline: dict[str, int] = {}
    sent = 0
    for _ in range(80):
        expected = []
        for _ in range(rng.randint(0, 8)):
            user, page = rng.choice(users), rng.choice(["/", "/a", "/b", "/c"])
            arrival = now - rng.randint(0, 5_000)  # Kinesis arrival, a little before the batch
            d.send(user, {"user": user, "page": page}, event_time_ms=arrival)
            sent += 1
            if user in deadline and deadline[user] <= now:
                s = open_sessions.pop(user)
                expected.append((user, session(user, s["start"], s["end"], s["pages"])))
            s = open_sessions.setdefault(user, {"start": arrival, "pages": []})
            s["end"] = arrival
            s["pages"].append(page)
            deadline[user] = now + GAP
        for user in [u for u, t in deadline.items() if t <= now]:
            del deadline[user]
            s = open_sessions.pop(user)
            expected.append((user, session(user, s["start"], s["end"], s["pages"])))
        assert by_key(d.run_batch()) == by_key(expected)
        if rng.random() < 0.1:
            d.restart()
        step = rng.choice([0, 1, 60_000, GAP // 2, GAP - 1, GAP, GAP + 1, 2 * GAP])
        d.advance(step)
        now += step
    for user in users:
        s = open_sessions.get(user)
        state = s and {
            "start_ms": s["start"],
            "end_ms": s["end"],
            "events": len(s["pages"]),
            "pages": s["pages"],
        }
        assert d.state(user) == state
        assert d.timers(user) == ([Timer(user, deadline[user], "processing")] if s else [])
    d.advance(GAP)
    d.run_batch()
    assert sum(v["events"] for _, v in d.outputs) == sent
    assert all(d.state(u) is None and d.timers(u) == [] for u in users)


# -- deduplication with a TTL ----------------------------------------------------------------

TTL = constant("dedup_ttl.py", "TTL_MS")


def test_duplicates_within_the_ttl_are_dropped_and_the_id_is_accepted_again_after_it():
    d = driver("dedup_ttl.py")
    d.send("dev-1", {"id": "a", "n": 1})
    d.send("dev-1", {"id": "a", "n": 2})
    d.send("dev-1", {"id": "b", "n": 3})
    d.send("dev-2", {"id": "a", "n": 4})  # another key remembers its own ids
    assert by_key(d.run_batch()) == {
        "dev-1": [{"id": "a", "n": 1}, {"id": "b", "n": 3}],
        "dev-2": [{"id": "a", "n": 4}],
    }
    d.advance(TTL - 1)
    d.send("dev-1", {"id": "a", "n": 5})  # dropped, and does not extend the window
    assert d.run_batch() == []
    d.advance(1)
    d.send("dev-1", {"id": "a", "n": 6})
    d.send("dev-1", {"id": "a", "n": 7})
    assert d.run_batch() == [("dev-1", {"id": "a", "n": 6})]
    d.advance(TTL - 1)
    d.send("dev-1", {"id": "a", "n": 8})
    assert d.run_batch() == []


def test_remembered_ids_are_purged_once_their_ttl_passed():
    d = driver("dedup_ttl.py")
    d.send("dev-1", {"id": "a"})
    d.send("dev-1", {"id": "b"})
    d.run_batch()
    assert set(d.map_state("dev-1")) == {"a", "b"}
    d.advance(TTL)
    d.send("dev-1", {"id": "c"})
    assert d.run_batch() == [("dev-1", {"id": "c"})]
    assert set(d.map_state("dev-1")) == {"c"}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_dedup_matches_a_model_on_random_input(seed):
    rng = random.Random(seed)
    keys = [f"dev-{i}" for i in range(20)]
    d = driver("dedup_ttl.py", slices=4)
    now = START
    accepted: dict[tuple[str, str], int] = {}
    n = 0
    for _ in range(60):
        expected = []
        for _ in range(rng.randint(0, 10)):
            key, event_id = rng.choice(keys), f"e{rng.randint(0, 12)}"
            n += 1
            event = {"id": event_id, "n": n}
            d.send(key, event)
            if (key, event_id) not in accepted or now >= accepted[key, event_id] + TTL:
                accepted[key, event_id] = now
                expected.append((key, event))
        assert by_key(d.run_batch()) == by_key(expected)
        if rng.random() < 0.1:
            d.restart()
        step = rng.choice([0, 1000, TTL // 4, TTL // 2, TTL - 1, TTL])
        d.advance(step)
        now += step
    assert len(d.outputs) < n  # the input did have duplicates
    for key in keys:
        live = {i: at for (k, i), at in accepted.items() if k == key and at + TTL > now}
        stored = {i: at for i, at in d.map_state(key).items() if at + TTL > now}
        assert stored == live


# -- running aggregates ----------------------------------------------------------------------


def test_running_count_sum_min_max_and_mean():
    d = driver("running_aggregates.py")
    rows = [(5, "books"), (7, "games"), (-2, "books"), (10.5, "food"), (3, "books")]
    for amount, category in rows:
        d.send("u1", {"user": "u1", "amount": amount, "category": category})
    d.send("u2", {"user": "u2", "amount": 100, "category": "games"})
    d.send("u3", {"user": "u3", "amount": -3, "category": "food"})
    d.send("u3", {"user": "u3", "amount": -8.5, "category": "food"})
    out = by_key(d.run_batch())
    got = [(v["count"], v["sum"], v["min"], v["max"], v["mean"]) for v in out["u1"]]
    assert got == [
        (1, 5, 5, 5, 5.0),
        (2, 12, 5, 7, 6.0),
        (3, 10, -2, 7, pytest.approx(10 / 3)),
        (4, 20.5, -2, 10.5, 5.125),
        (5, 23.5, -2, 10.5, 4.7),
    ]
    assert [v["categories"] for v in out["u1"]][-2:] == [
        {"books": 2, "games": 1, "food": 1},
        {"books": 3, "games": 1, "food": 1},
    ]
    assert out["u2"] == [
        {
            "user": "u2",
            "count": 1,
            "sum": 100,
            "min": 100,
            "max": 100,
            "mean": 100.0,
            "categories": {"games": 1},
        }
    ]
    assert [(v["min"], v["max"], v["mean"]) for v in out["u3"]] == [(-3, -3, -3), (-8.5, -3, -5.75)]
    d.send("u1", {"user": "u1", "amount": -7, "category": "food"})
    [(_, last)] = d.run_batch()
    assert (last["count"], last["min"], last["max"], last["mean"]) == (6, -7, 10.5, 16.5 / 6)
    assert d.map_state("u1") == {"books": 3, "games": 1, "food": 2}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_running_aggregates_match_a_model_on_random_input(seed):
    rng = random.Random(seed)
    users = [f"user-{i}" for i in range(20)]
    categories = ["books", "games", "food", "travel", "music"]
    d = driver("running_aggregates.py", slices=4)
    seen: dict[str, list[float]] = defaultdict(list)
    per_category: dict[str, dict[str, int]] = defaultdict(dict)
    for _ in range(40):
        expected = []
        for _ in range(rng.randint(1, 15)):
            user, category = rng.choice(users), rng.choice(categories)
            amount = rng.choice([rng.randint(-20, 500), round(rng.uniform(-50, 500), 2)])
            d.send(user, {"user": user, "amount": amount, "category": category})
            seen[user].append(amount)
            per_category[user][category] = per_category[user].get(category, 0) + 1
            amounts = seen[user]
            total = 0
            for a in amounts:
                total += a
            expected.append(
                (
                    user,
                    {
                        "user": user,
                        "count": len(amounts),
                        "sum": total,
                        "min": min(amounts),
                        "max": max(amounts),
                        "mean": pytest.approx(total / len(amounts)),
                        "categories": dict(per_category[user]),
                    },
                )
            )
        assert by_key(d.run_batch()) == by_key(expected)
        if rng.random() < 0.1:
            d.restart()
    for user in users:
        assert d.map_state(user) == per_category.get(user, {})
        agg, amounts = d.state(user), seen.get(user)
        if amounts:
            assert (agg["count"], agg["min"], agg["max"]) == (
                len(amounts),
                min(amounts),
                max(amounts),
            )
        else:
            assert agg is None


# -- enrichment ------------------------------------------------------------------------------

MAX_BUFFERED = constant("enrichment.py", "MAX_BUFFERED")


def profile(user, country, tier):
    return {"type": "profile", "user": user, "country": country, "tier": tier}


def order(user, order_id, amount=10):
    return {"type": "order", "user": user, "order_id": order_id, "amount": amount}


def joined(o, p):
    return (o["user"], {"user": o["user"], "order": o, "profile": p})


def test_early_orders_are_buffered_and_flushed_in_arrival_order_when_the_profile_arrives():
    d = driver("enrichment.py")
    early = [order("u1", f"o{i}", i) for i in range(12)]  # more than 10: ordering past "9"
    for batch in (early[:5], early[5:11], early[11:]):
        for o in batch:
            d.send("u1", o)
        assert d.run_batch() == []
    assert list(d.map_state("u1").values()) == early
    p = profile("u1", "DE", "gold")
    d.send("u1", p)
    d.send("u1", order("u1", "late"))
    assert d.run_batch() == [joined(o, p) for o in early] + [joined(order("u1", "late"), p)]
    assert d.map_state("u1") == {} and d.state("u1") == p


def test_orders_before_and_after_a_profile_in_one_batch():
    d = driver("enrichment.py")
    p = profile("u1", "FR", "silver")
    d.send("u1", order("u1", "o1"))
    d.send("u2", order("u2", "x1"))
    d.send("u1", p)
    d.send("u1", order("u1", "o2"))
    assert d.run_batch() == [joined(order("u1", "o1"), p), joined(order("u1", "o2"), p)]
    assert list(d.map_state("u2").values()) == [order("u2", "x1")]
    assert d.state("u2") is None


def test_a_later_profile_applies_to_later_orders_only():
    d = driver("enrichment.py")
    a, b = profile("u1", "DE", "gold"), profile("u1", "NL", "bronze")
    d.send("u1", a)
    d.send("u1", order("u1", "o1"))
    assert d.run_batch() == [joined(order("u1", "o1"), a)]
    d.send("u1", order("u1", "o2"))
    d.send("u1", b)
    d.send("u1", order("u1", "o3"))
    assert d.run_batch() == [joined(order("u1", "o2"), a), joined(order("u1", "o3"), b)]
    d.send("u1", order("u1", "o4"))
    assert d.run_batch() == [joined(order("u1", "o4"), b)]
    assert d.state("u1") == b and d.map_state("u1") == {}


def test_the_buffer_is_bounded_and_overflowing_orders_go_out_without_a_profile():
    d = driver("enrichment.py")
    orders = [order("u1", f"o{i}") for i in range(MAX_BUFFERED + 3)]
    for o in orders:
        d.send("u1", o)
    assert d.run_batch() == [joined(o, None) for o in orders[MAX_BUFFERED:]]
    assert len(d.map_state("u1")) == MAX_BUFFERED
    p = profile("u1", "US", "gold")
    d.send("u1", p)
    assert d.run_batch() == [joined(o, p) for o in orders[:MAX_BUFFERED]]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_enrichment_matches_a_model_on_random_input(seed):
    rng = random.Random(seed)
    users = [f"user-{i}" for i in range(20)]
    d = driver("enrichment.py", slices=4)
    profiles: dict[str, dict] = {}
    buffered: dict[str, list[dict]] = defaultdict(list)
    n = 0
    while n < 400:
        expected = []
        for _ in range(rng.randint(1, 20)):
            n += 1
            user = rng.choice(users)
            if rng.random() < 0.08:
                event = profile(user, rng.choice(["DE", "FR", "US"]), f"tier-{n}")
                profiles[user] = event
                expected += [joined(o, event) for o in buffered.pop(user, [])]
            else:
                event = order(user, f"o{n}", rng.randint(1, 100))
                if user in profiles:
                    expected.append(joined(event, profiles[user]))
                else:
                    buffered[user].append(event)
            d.send(user, event)
        assert by_key(d.run_batch()) == by_key(expected)
        if rng.random() < 0.1:
            d.restart()
    assert any(buffered.values()) and profiles  # both paths were exercised
    for user in users:
        assert d.state(user) == profiles.get(user)
        stored = d.map_state(user)
        assert [stored[k] for k in sorted(stored)] == buffered.get(user, [])


# -- each example as documented: `shardless produce`, `shardless run`, `shardless state` -------
#
# On the local emulators and real Spark, through the same command lines as the examples'
# docstrings and docs/getting-started.md, compared with plain-Python models of what the
# records read back from the stream should give.


def shardless(*argv: str) -> None:
    from shardless.processor import cli

    assert cli.main(list(argv)) == 0, argv


def stream_records(kinesis, stream: str) -> list[tuple[str, dict, int]]:  # noqa: ANN001
    """Every record of the stream as (partition key, JSON data, arrival ms), read with plain
    boto3; each shard's records in order, so each key's records are in produce order."""
    from shardless.processor.kinesis.shards import stream_records as records

    return [
        (
            r["PartitionKey"],
            json.loads(r["Data"]),
            int(r["ApproximateArrivalTimestamp"].timestamp() * 1000),
        )
        for r in records(kinesis, stream)
    ]


def run_example(
    name: str, app: str, stream: str, tmp_path: Path, *options: str, out: str = "out"
) -> None:
    """`shardless run` of an example until the stream is drained; a second call goes on
    from the first's checkpoint, with its outputs under `out`."""
    shardless(
        "run", str(EXAMPLES / name), "--app", app, "--stream", stream, "--available-now",
        "--slices", "16", "--groups", "4", "--output", str(tmp_path / out),
        "--checkpoint", str(tmp_path / "checkpoint"), "--local-dir", str(tmp_path / "stores"),
        *options,
    )  # fmt: skip


def job_outputs(tmp_path: Path, out: str = "out") -> tuple[dict[str, list], int]:
    """The job's outputs per key in emission order, and how many batches wrote them."""
    import pandas as pd

    df = pd.read_parquet(tmp_path / out)
    df["batch_id"] = df["batch_id"].astype(int)
    df = df.sort_values(["batch_id", "slice", "seq"])
    outputs = by_key((k, json.loads(v)) for k, v in zip(df["key"], df["value"], strict=True))
    return outputs, df["batch_id"].nunique()


def exported_state(app: str, tmp_path: Path) -> tuple[dict[str, object], dict[str, dict]]:
    """The application's committed state through `shardless state export`: values, maps."""
    path = tmp_path / f"state-{uuid.uuid4().hex[:6]}.jsonl"
    shardless("state", "export", "--app", app, "--format", "jsonl", "--out", str(path))
    values: dict[str, object] = {}
    maps: dict[str, dict] = defaultdict(dict)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["sub"] is None:
            values[row["key"]] = row["value"]
        else:
            maps[row["key"]][row["sub"]] = row["value"]
    return values, dict(maps)


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.mark.slow
def test_running_aggregates_on_the_emulators_equal_a_fold_of_the_stream(
    aws, spark, kinesis, tmp_path
):
    stream, app = fresh("clicks"), fresh("aggregates")
    shardless("produce", "--stream", stream, "--shards", "2", "--events", "600", "--users", "30")
    run_example("running_aggregates.py", app, stream, tmp_path, "--max-records-per-shard", "100")

    expected: dict[str, list] = defaultdict(list)
    amounts: dict[str, list] = defaultdict(list)
    categories: dict[str, dict[str, int]] = defaultdict(dict)
    for key, body, _ in stream_records(kinesis, stream):
        amounts[key].append(body["amount"])
        cats = categories[key]
        cats[body["category"]] = cats.get(body["category"], 0) + 1
        total = 0
        for a in amounts[key]:
            total += a
        seen = amounts[key]
        agg = {"count": len(seen), "sum": total, "min": min(seen), "max": max(seen)}
        expected[key].append(
            {"user": key, **agg, "mean": total / len(seen), "categories": {**cats}}
        )
    outputs, batches = job_outputs(tmp_path)
    assert batches >= 3  # the state was carried from batch to batch
    assert outputs == expected
    values, maps = exported_state(app, tmp_path)
    assert values == {
        k: {n: v[-1][n] for n in ("count", "sum", "min", "max")} for k, v in expected.items()
    }
    assert maps == categories


@pytest.mark.slow
def test_dedup_on_the_emulators_emits_each_produced_event_once(aws, spark, kinesis, tmp_path):
    stream, app = fresh("dups"), fresh("dedup")
    for _ in range(2):  # the same seed twice: every event goes into the stream twice
        shardless(
            "produce", "--stream", stream, "--shards", "2", "--events", "300", "--users", "20"
        )
    run_example("dedup_ttl.py", app, stream, tmp_path)

    records = stream_records(kinesis, stream)
    expected: dict[str, list] = defaultdict(list)
    accepted: dict[str, set] = defaultdict(set)
    for key, body, _ in records:
        if body["id"] not in accepted[key]:
            accepted[key].add(body["id"])
            expected[key].append(body)
    assert len(records) == 600 and sum(map(len, expected.values())) == 300
    outputs, _ = job_outputs(tmp_path)
    assert outputs == expected
    values, maps = exported_state(app, tmp_path)
    assert values == {}
    assert {k: set(m) for k, m in maps.items()} == accepted


@pytest.mark.slow
def test_enrichment_on_the_emulators_joins_orders_with_the_profile_in_state(
    aws, spark, kinesis, tmp_path
):
    stream, app = fresh("orders"), fresh("enrich")
    produce_orders = runpy.run_path(str(EXAMPLES / "produce_orders.py"))
    assert produce_orders["main"](["--stream", stream, "--users", "20", "--orders", "400"]) == 0
    run_example("enrichment.py", app, stream, tmp_path, "--max-records-per-shard", "60")

    profiles: dict[str, dict] = {}
    buffered: dict[str, list] = defaultdict(list)
    expected: dict[str, list] = defaultdict(list)
    for key, body, _ in stream_records(kinesis, stream):
        if body["type"] == "profile":
            profiles[key] = body
            expected[key] += [
                {"user": key, "order": o, "profile": body} for o in buffered.pop(key, [])
            ]
        elif key in profiles:
            expected[key].append({"user": key, "order": body, "profile": profiles[key]})
        else:
            buffered[key].append(body)
    assert profiles and buffered  # both paths: joined at once, and buffered
    outputs, batches = job_outputs(tmp_path)
    assert batches >= 3
    assert outputs == expected
    values, maps = exported_state(app, tmp_path)
    assert values == profiles
    assert {k: [m[s] for s in sorted(m)] for k, m in maps.items()} == dict(buffered)


@pytest.mark.slow
def test_sessionization_on_the_emulators_closes_every_session_in_the_next_run(
    aws, spark, kinesis, tmp_path, monkeypatch
):
    """The getting-started path: a first run opens sessions; a second run, after the gap
    and with records for some users only, closes all of them, by `process` for the users
    with records and by `on_timer` for the others."""
    gap_ms = 4000
    monkeypatch.setenv("SESSION_GAP_MS", str(gap_ms))
    stream, app = fresh("clicks"), fresh("sessions")
    shardless("produce", "--stream", stream, "--shards", "2", "--events", "300", "--users", "20")
    first = stream_records(kinesis, stream)
    run_example("sessionization.py", app, stream, tmp_path, out="first")

    def sessions(records) -> dict[str, dict]:  # noqa: ANN001
        found: dict[str, dict] = {}
        for key, body, arrival in records:
            s = found.setdefault(key, {"start_ms": arrival, "events": 0, "pages": []})
            s["end_ms"] = arrival
            s["events"] += 1
            s["pages"].append(body["page"])
        return found

    opened = sessions(first)
    outputs, _ = job_outputs(tmp_path, "first")
    assert outputs == {}  # nothing was due yet
    assert exported_state(app, tmp_path)[0] == opened

    time.sleep(gap_ms / 1000 + 0.5)  # every deadline (the first batch's time + gap) passes
    shardless("produce", "--stream", stream, "--events", "40", "--users", "4", "--seed", "8")
    second = [r for r in stream_records(kinesis, stream) if r not in first]
    assert 0 < len({k for k, _, _ in second}) < len(opened)
    run_example("sessionization.py", app, stream, tmp_path, out="second")

    outputs, _ = job_outputs(tmp_path, "second")
    assert outputs == {k: [{"user": k, **s}] for k, s in opened.items()}
    assert exported_state(app, tmp_path)[0] == sessions(second)
