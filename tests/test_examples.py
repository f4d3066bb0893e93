"""The examples, run from their files through the TestDriver, against plain-Python models."""

from __future__ import annotations

import random
import runpy
from collections import defaultdict
from pathlib import Path

import pytest

from processor.api import Timer
from processor.testing import TestDriver

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
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
