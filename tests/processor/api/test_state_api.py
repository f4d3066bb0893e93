"""The handler API through the test driver: keyed, map and slice-wide state, class
handlers, timers, TTL and value formats, on the production state code."""

from __future__ import annotations

import msgpack
import pytest

from shardless.processor.errors import AppError, ProcessorError
from shardless.processor.testing import TestDriver
from shardless.state import encoding, keys
from shardless.state.errors import EncodingError


def counter(event, ctx):
    n = ctx.state.get(0) + 1
    ctx.state.set(n)
    ctx.emit(n)


def test_keyed_state_counts_per_key_and_reads_its_own_writes():
    seen = []

    def handler(event, ctx):
        assert ctx.state.exists() == (ctx.state.get() is not None)
        counter(event, ctx)
        seen.append(ctx.state.get())

    d = TestDriver(handler)
    for k in ["a", "b", "a", "a"]:
        d.send(k, b"")
    out = d.run_batch()
    assert sorted(out) == [("a", 1), ("a", 2), ("a", 3), ("b", 1)]
    assert [n for k, n in out if k == "a"] == [1, 2, 3]  # per key, in record order
    assert (d.state("a"), d.state("b"), d.state("c", "none")) == (3, 1, "none")
    assert sorted(seen) == [1, 1, 2, 3]


def test_delete_removes_a_keys_value():
    def handler(event, ctx):
        if event.data == b"del":
            ctx.state.delete()
            ctx.emit(ctx.state.exists())
        else:
            ctx.state.set("x")

    d = TestDriver(handler)
    d.send("k", b"set")
    d.send("k", b"del")
    assert d.run_batch() == [("k", False)]
    assert d.state("k") is None


def test_map_state_iterates_sub_keys_in_order_with_ranges():
    def handler(event, ctx):
        for sub in ["b", "a", "d", "c"]:
            ctx.state.map.set(sub, sub.upper())
        ctx.state.map.delete("d")
        ctx.state.set("main")
        ctx.emit(
            {
                "all": list(ctx.state.map.items()),
                "range": list(ctx.state.map.items("b", "c")),
                "has_a": "a" in ctx.state.map,
            }
        )

    d = TestDriver(handler)
    d.send("u", b"")
    [(_, out)] = d.run_batch()
    assert out["all"] == [["a", "A"], ["b", "B"], ["c", "C"]]
    assert out["range"] == [["b", "B"]] and out["has_a"] is True
    assert d.map_state("u") == {"a": "A", "b": "B", "c": "C"} and d.state("u") == "main"


def test_map_clear_removes_only_that_keys_entries():
    def handler(event, ctx):
        ctx.state.map.set("x", 1)
        if event.key == "a":
            ctx.state.map.clear()

    d = TestDriver(handler, slices=1)
    d.send("a", b"")
    d.send("ab", b"")
    d.run_batch()
    assert d.map_state("a") == {} and d.map_state("ab") == {"x": 1}


def test_slice_state_scans_values_in_key_order_including_this_batch():
    def handler(event, ctx):
        ctx.state.set(event.key.upper())
        ctx.state.map.set("ignored-by-scans", 1)
        if event.key == "zz":
            ctx.slice_state.put("idx:2", "two")
            ctx.slice_state.put("idx:1", "one")
            ctx.slice_state.delete("b")
            ctx.emit(
                {
                    "all": [k for k, _ in ctx.slice_state.range()],
                    "prefix": list(ctx.slice_state.prefix("idx:")),
                    "range": [k for k, _ in ctx.slice_state.range("a", "c")],
                    "get": ctx.slice_state.get("a"),
                }
            )

    d = TestDriver(handler, slices=1)
    for k in ["b", "a", "c", "zz"]:
        d.send(k, b"")
    [(_, out)] = d.run_batch()
    assert out["all"] == ["a", "c", "idx:1", "idx:2", "zz"]
    assert out["prefix"] == [["idx:1", "one"], ["idx:2", "two"]]
    assert out["range"] == ["a"] and out["get"] == "A"


class Sessions:
    """A class handler: opens once per slice, closes a session on a processing-time timer."""

    opened: list[int] = []
    closed = 0

    def open(self, slice_id):
        Sessions.opened.append(slice_id)

    def process(self, event, ctx):
        n = ctx.state.get(0) + 1
        ctx.state.set(n)
        for t in ctx.timers.list():
            ctx.timers.delete(t.ts, t.kind)
        ctx.timers.set(ctx.now_ms + 1000)

    def on_timer(self, timer, ctx):
        ctx.emit({"session_events": ctx.state.get(), "at": timer.ts, "kind": timer.kind})
        ctx.state.delete()

    def close(self):
        Sessions.closed += 1


def test_class_handler_opens_once_per_slice_and_fires_timers_once_in_order():
    Sessions.opened, Sessions.closed = [], 0
    d = TestDriver(Sessions, slices=4)
    start = d.now_ms
    d.send("u1", b"")
    d.send("u2", b"")
    d.run_batch()
    d.advance(500)
    d.send("u1", b"")  # moves u1's timer to now + 1000
    d.run_batch()
    assert d.run_batch() == []
    d.advance(600)
    assert d.run_batch() == [
        ("u2", {"session_events": 1, "at": start + 1000, "kind": "processing"})
    ]
    d.advance(1000)
    assert d.run_batch() == [
        ("u1", {"session_events": 2, "at": start + 1500, "kind": "processing"})
    ]
    assert d.run_batch() == [] and d.timers("u1") == []
    assert len(Sessions.opened) == len(set(Sessions.opened))
    d.restart()
    assert Sessions.closed == len(Sessions.opened)


def test_timers_survive_a_restart():
    def process(event, ctx):
        ctx.timers.set(ctx.now_ms + 10)

    def on_timer(timer, ctx):
        ctx.emit("fired")

    from shardless.processor.api.handlers import HandlerFactory

    d = TestDriver(HandlerFactory(process, on_timer=on_timer))
    d.send("k", b"")
    d.run_batch()
    d.restart()
    d.advance(10)
    assert d.run_batch() == [("k", "fired")]


def test_event_time_timers_fire_when_the_watermark_passes_them():
    def process(event, ctx):
        ctx.timers.set(event.arrival_ms + 100, kind="event")

    def on_timer(timer, ctx):
        ctx.emit((timer.kind, timer.ts))

    from shardless.processor.api.handlers import HandlerFactory

    d = TestDriver(HandlerFactory(process, on_timer=on_timer), allowed_lateness_ms=50)
    d.send("k", b"", event_time_ms=1000)
    assert d.run_batch() == []
    d.send("j", b"", event_time_ms=1120)
    assert d.run_batch() == []  # as in Spark, a batch runs with the previous batches' watermark
    assert d.watermark_ms == 1070
    d.send("j", b"", event_time_ms=1160)
    assert d.run_batch() == []
    assert d.run_batch() == [("k", ["event", 1100])]  # watermark 1110 passed 1100


def test_timers_fire_in_timestamp_order_across_keys():
    def process(event, ctx):
        ctx.timers.set(int(event.data))

    def on_timer(timer, ctx):
        ctx.emit(timer.ts)

    from shardless.processor.api.handlers import HandlerFactory

    d = TestDriver(HandlerFactory(process, on_timer=on_timer), slices=1, start_ms=0)
    for k, ts in [("a", 30), ("b", 10), ("c", 20), ("a", 5)]:
        d.send(k, str(ts))
    d.advance(100)
    assert [v for _, v in d.run_batch()] == [5, 10, 20, 30]


def test_expired_values_are_never_returned_and_are_purged():
    def handler(event, ctx):
        if event.data == b"write":
            ctx.state.set("v", ttl_ms=1000)
            ctx.state.map.set("m", "w", ttl_ms=1000)
        ctx.emit([ctx.state.get("gone"), ctx.state.map.get("m", "gone")])

    d = TestDriver(handler)
    d.send("k", b"write")
    assert d.run_batch() == [("k", ["v", "w"])]
    entries = d.stored_entries()
    d.advance(999)
    d.send("k", b"read")
    assert d.run_batch() == [("k", ["v", "w"])]
    d.advance(1)
    d.send("k", b"read")
    assert d.run_batch() == [("k", ["gone", "gone"])]
    assert entries == 4 and d.stored_entries() == 0


def test_rewriting_without_ttl_keeps_the_value_past_the_old_expiry():
    def handler(event, ctx):
        ctx.state.set(event.data.decode(), ttl_ms=10 if event.data == b"a" else None)

    d = TestDriver(handler)
    d.send("k", b"a")
    d.run_batch()
    d.send("k", b"b")
    d.run_batch()
    d.advance(100)
    d.run_batch()
    assert d.state("k") == "b"


def test_a_value_that_cannot_be_encoded_names_the_key_and_type():
    def handler(event, ctx):
        ctx.state.set({1, 2})

    d = TestDriver(handler)
    d.send("user-9", b"")
    with pytest.raises(ProcessorError, match="key 'user-9'.*type set"):
        d.run_batch()


def test_json_format_stores_json_and_pickle_needs_opting_in(tmp_path):
    def handler(event, ctx):
        ctx.state.set({"a": 1})

    d = TestDriver(handler, value_format="json", directory=tmp_path / "j")
    d.send("k", b"")
    d.run_batch()
    assert d.state("k") == {"a": 1}

    p = TestDriver(handler, value_format="pickle", directory=tmp_path / "p")
    p.send("k", b"")
    p.run_batch()
    p.restart()
    plain = TestDriver(counter, directory=tmp_path / "p")
    with pytest.raises(EncodingError, match="pickled.*does not allow pickle"):
        plain.state("k")


def test_timer_time_must_be_epoch_milliseconds():
    def handler(event, ctx):
        ctx.timers.set(-5)

    d = TestDriver(handler)
    d.send("k", b"")
    with pytest.raises(ProcessorError, match="epoch milliseconds"):
        d.run_batch()


def test_a_handler_class_without_process_is_refused():
    class NoProcess:
        pass

    with pytest.raises(AppError, match="must define process"):
        TestDriver(NoProcess)


def test_each_view_follows_the_record_key_across_interleaved_keys_of_one_slice():
    def handler(event, ctx):
        ctx.state.set(ctx.state.get(0) + 1)
        ctx.state.map.set(event.data.decode(), ctx.key)
        ctx.timers.set(ctx.now_ms + 1_000)
        ctx.emit(ctx.key)

    d = TestDriver(handler, slices=1)
    for i, k in enumerate(["a", "b", "a", "c", "b", "a"]):
        d.send(k, str(i))
    assert [k == v for k, v in d.run_batch()] == [True] * 6
    assert [d.state(k) for k in "abc"] == [3, 2, 1]
    assert d.map_state("a") == {"0": "a", "2": "a", "5": "a"}
    assert d.map_state("b") == {"1": "b", "4": "b"} and d.map_state("c") == {"3": "c"}
    assert [[t.key for t in d.timers(k)] for k in "abc"] == [["a"], ["b"], ["c"]]


def test_a_value_over_the_size_limit_names_the_key_and_is_not_stored():
    def handler(event, ctx):
        ctx.state.set(b"x" * (encoding.MAX_VALUE_BYTES + 1) if event.data == b"big" else 1)

    d = TestDriver(handler)
    d.send("small", b"")
    d.send("user-7", b"big")
    with pytest.raises(ProcessorError, match="key 'user-7'.*over the limit"):
        d.run_batch()
    assert d.state("user-7") is None and d.state("small") is None  # the batch left nothing


@pytest.mark.parametrize(
    ("stored", "why"),
    [
        (b"\x01\xc1", "msgpack"),  # 0xc1 is never used by msgpack
        (b"\x01" + msgpack.packb(msgpack.ExtType(5, b"x")), "extension type 5"),
        (b"\x01\x92\x01", "msgpack"),  # an array of two with one element
    ],
)
def test_a_stored_value_that_cannot_be_read_names_the_key(stored, why):
    d = TestDriver(counter)
    store = d._store(d._slice("user-3"))
    store.commit([(keys.data_key("user-3"), stored)], store.version + 1)
    d.send("user-3", b"")
    with pytest.raises(ProcessorError, match=f"key 'user-3'.*{why}") as caught:
        d.run_batch()
    assert isinstance(caught.value.__cause__, EncodingError)


def test_a_failing_handler_names_its_record_and_key_and_the_batch_leaves_nothing():
    def handler(event, ctx):
        ctx.state.set(1)
        if event.data == b"bad":
            raise KeyError("no field 'amount'")

    d = TestDriver(handler, slices=1)
    d.send("a", b"")
    d.send("user-5", b"bad")
    d.send("c", b"")
    with pytest.raises(ProcessorError) as caught:
        d.run_batch()
    text = str(caught.value)
    assert text.startswith("handler failed on record test/shardId-000000000000/2.0 (key 'user-5'")
    assert "KeyError" in text and "--on-handler-error dead-letter" in text
    assert isinstance(caught.value.__cause__, KeyError)
    assert [d.state(k) for k in ("a", "user-5", "c")] == [None, None, None]
