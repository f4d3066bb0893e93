"""The TestDriver's own abilities: seeding committed state, moving the watermark, and
closing its stores as a context manager."""

from __future__ import annotations

import pytest

from shardless import TestDriver
from shardless.processor.api.context import Timer
from shardless.processor.api.handlers import HandlerFactory
from shardless.state import keys
from shardless.state.errors import EncodingError

START = 1_700_000_000_000


def counter(event, ctx):
    n = ctx.state.get(0) + 1
    ctx.state.set(n)
    ctx.emit(n)


# -- seeding ---------------------------------------------------------------------------------


def test_a_seeded_value_is_what_the_handler_reads_in_the_first_batch():
    with TestDriver(counter) as d:
        d.set_state("k", 41)
        assert d.state("k") == 41
        d.send("k", b"")
        d.send("other", b"")
        assert sorted(d.run_batch()) == [("k", 42), ("other", 1)]
        assert d.state("k") == 42


def test_seeded_map_entries_are_what_the_handler_reads_and_add_to_the_keys_map():
    def handler(event, ctx):
        ctx.state.map.set("c", 3)
        ctx.emit({"items": list(ctx.state.map.items()), "has_b": "b" in ctx.state.map})

    with TestDriver(handler) as d:
        d.set_map_state("k", {"b": {"n": [1, 2]}, "a": "x"})
        d.set_map_state("k", {"b": 2})  # replaces b, keeps a
        assert d.map_state("k") == {"a": "x", "b": 2}
        d.send("k", b"")
        assert d.run_batch() == [("k", {"items": [["a", "x"], ["b", 2], ["c", 3]], "has_b": True})]
        assert d.map_state("k") == {"a": "x", "b": 2, "c": 3}
        assert d.state("k") is None  # map entries are not the key's value


@pytest.mark.parametrize("value_format", ["msgpack", "json", "pickle"])
def test_seeded_and_handler_written_values_are_stored_and_read_alike(value_format):
    value = {"t": (1, 2), "s": "é", "n": None, "f": 1.5}

    def handler(event, ctx):
        ctx.state.set(value)
        ctx.state.map.set("m", value)

    with TestDriver(handler, slices=1, value_format=value_format) as d:
        d.set_state("seeded", value)
        d.set_map_state("seeded", {"m": value})
        d.send("written", b"")
        d.run_batch()
        store = d._store(0)
        for db_key in (keys.data_key, lambda k: keys.map_key(k, "m")):
            assert store.get(db_key("seeded")) == store.get(db_key("written"))
        read = value if value_format == "pickle" else {**value, "t": [1, 2]}
        assert d.state("seeded") == d.state("written") == read
        assert d.map_state("seeded") == d.map_state("written")


def test_seeding_refuses_what_a_handler_could_not_store():
    with TestDriver(counter) as d:
        with pytest.raises(EncodingError, match="key 'k': cannot encode a value of type set"):
            d.set_state("k", {1, 2})
        assert d.state("k") is None


def test_a_seeded_ttl_and_timer_behave_as_a_handlers():
    def on_timer(timer, ctx):
        ctx.emit([timer.ts, ctx.state.get("gone")])

    with TestDriver(HandlerFactory(counter, on_timer=on_timer), start_ms=0) as d:
        d.set_state("k", "v", ttl_ms=100)
        d.set_timer("k", 100)
        assert d.timers("k") == [Timer("k", 100, "processing")]
        d.advance(99)
        assert d.run_batch() == [] and d.state("k") == "v"
        d.advance(1)
        assert d.run_batch() == [("k", [100, "gone"])]  # expired when the timer fires
        assert d.timers("k") == []


# -- event time ------------------------------------------------------------------------------


def event_timers() -> HandlerFactory:
    def process(event, ctx):
        ctx.timers.set(event.arrival_ms + 1000, kind="event")

    def on_timer(timer, ctx):
        ctx.emit([timer.kind, timer.ts, ctx.watermark_ms])

    return HandlerFactory(process, on_timer=on_timer)


def test_an_event_timer_fires_only_once_the_watermark_is_advanced_past_it():
    with TestDriver(event_timers(), start_ms=START) as d:
        d.send("k", b"", event_time_ms=START)
        assert d.run_batch() == []
        assert d.timers("k") == [Timer("k", START + 1000, "event")]
        d.advance(10 * 60_000)  # processing time does not fire event timers
        assert d.run_batch() == []
        d.advance_watermark(START + 999)
        assert d.run_batch() == []
        d.advance_watermark(START + 1000)
        assert d.run_batch() == [("k", ["event", START + 1000, START + 1000])]
        assert d.timers("k") == [] and d.watermark_ms == START + 1000


def test_an_advanced_watermark_holds_against_older_records_and_never_moves_back():
    with TestDriver(event_timers(), start_ms=START) as d:
        d.advance_watermark(START + 5000)
        d.send("k", b"", event_time_ms=START)  # late: its timer is already due
        assert d.run_batch() == [("k", ["event", START + 1000, START + 5000])]
        assert d.watermark_ms == START + 5000
        with pytest.raises(ValueError, match="only moves forward"):
            d.advance_watermark(START + 4999)
        d.send("j", b"", event_time_ms=START + 9000)  # records still move it, next batch
        d.run_batch()
        assert d.watermark_ms == START + 9000


def test_an_event_ttl_expires_when_the_watermark_is_advanced():
    def handler(event, ctx):
        ctx.emit(ctx.state.get("gone"))

    with TestDriver(handler, start_ms=START) as d:
        d.advance_watermark(START)
        d.set_state("k", "v", ttl_ms=500, on="event")
        d.advance_watermark(START + 499)
        d.send("k", b"")
        assert d.run_batch() == [("k", "v")]
        d.advance_watermark(START + 500)
        d.send("k", b"")
        assert d.run_batch() == [("k", "gone")] and d.state("k") is None


# -- a context manager -----------------------------------------------------------------------


class Closing:
    closed = 0

    def process(self, event, ctx):
        counter(event, ctx)

    def close(self):
        Closing.closed += 1


def test_leaving_the_with_block_on_an_exception_closes_stores_handlers_and_temp_dir():
    Closing.closed = 0
    with pytest.raises(RuntimeError, match="boom"), TestDriver(Closing, slices=4) as d:
        d.send("a", b"")
        d.send("b", b"")
        d.run_batch()
        directory = d.directory
        assert directory.exists() and Closing.closed == 0
        raise RuntimeError("boom")
    assert not directory.exists()
    assert Closing.closed == len({d._slice("a"), d._slice("b")})
    for use in (lambda: d.state("a"), d.run_batch):
        with pytest.raises(RuntimeError, match="this TestDriver is closed"):
            use()
    d.close()  # twice is harmless


def test_a_given_directory_is_kept_and_its_stores_are_released_on_an_exception(tmp_path):
    with pytest.raises(KeyError), TestDriver(counter, directory=tmp_path / "s") as d:
        d.send("k", b"")
        d.run_batch()
        raise KeyError("x")
    # RocksDB refuses a second open of a store this process still holds
    with TestDriver(counter, directory=tmp_path / "s") as again:
        assert again.state("k") == 1
        again.send("k", b"")
        assert again.run_batch() == [("k", 2)]
    assert (tmp_path / "s").exists()


def test_stores_close_even_when_a_handlers_close_raises(tmp_path):
    class Failing:
        def process(self, event, ctx):
            counter(event, ctx)

        def close(self):
            if not hasattr(self, "failed"):  # once: atexit calls it again
                self.failed = True
                raise OSError("close failed")

    with pytest.raises(OSError, match="close failed"):  # noqa: SIM117 - the exit raises
        with TestDriver(Failing, directory=tmp_path / "s") as d:
            d.send("k", b"")
            d.run_batch()
    with TestDriver(counter, directory=tmp_path / "s") as again:
        assert again.state("k") == 1
