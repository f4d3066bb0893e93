"""The TestDriver with a chosen key: state per chosen key in its MD5 slice, and records
without one handled as `--on-decode-error` says (no Spark)."""

from __future__ import annotations

import pytest

from shardless.processor.api.app import load_handler
from shardless.processor.api.policies import RecordPolicy
from shardless.processor.driver.config import JobConfig
from shardless.processor.errors import AppError, ConfigError, ProcessorError
from shardless.processor.testing import TestDriver


def count(event, ctx) -> None:  # noqa: ANN001
    ctx.state.set(ctx.state.get(0) + 1)
    ctx.emit({"pk": event.partition_key, "why": event.decode_error})


def test_a_record_without_the_field_fails_the_batch_naming_it_and_the_path() -> None:
    with TestDriver(count, key="order.id") as t:
        t.send("dev-1", {"order": {"id": "o-1"}})
        t.send("dev-1", {"order": {"id": 7}})
        with pytest.raises(ProcessorError) as err:
            t.run_batch()
    assert "record test/shardId-000000000000/2.0 has no key: its field 'order.id' is a " \
        "number, not a string (partition key 'dev-1'" in str(err.value)  # fmt: skip


def test_raw_passes_a_keyless_record_on_keyed_by_its_partition_key() -> None:
    with TestDriver(count, key="user", policy=RecordPolicy(on_decode_error="raw")) as t:
        t.send("dev-1", b"not json")
        t.send("dev-1", {"user": "ann"})
        out = sorted(t.run_batch(), key=str)
        assert out == [
            ("ann", {"pk": "dev-1", "why": None}),
            ("dev-1", {"pk": "dev-1", "why": "no key: its data is not a JSON object"}),
        ]
        assert t.state("ann") == 1 and t.state("dev-1") == 1


def test_dead_letter_sets_it_aside_with_its_partition_key_and_stage_key() -> None:
    policy = RecordPolicy(on_decode_error="dead-letter")
    with TestDriver(count, key=lambda r: r.json()["user"], policy=policy) as t:
        t.send("dev-9", {"nobody": 1})
        assert t.run_batch() == []
        (letter,) = t.dead_letters
        assert (letter.stage, letter.partition_key, letter.key) == ("key", "dev-9", None)
        assert letter.error == "no key: key function <lambda>() raised KeyError: 'user'"


def test_an_app_files_key_is_read_and_a_bad_one_refused(tmp_path) -> None:  # noqa: ANN001
    good = tmp_path / "good.py"
    good.write_text("key = 'user'\n\ndef process(event, ctx):\n    ctx.state.set(event.key)\n")
    with TestDriver(good) as t:
        t.send("dev-1", {"user": "ann"})
        t.run_batch()
        assert t.state("ann") == "ann"
    bad = tmp_path / "bad.py"
    bad.write_text("key = 3\n\ndef process(event, ctx):\n    pass\n")
    with pytest.raises(AppError, match="key must be a JSON field path"):
        load_handler(bad)


def test_key_field_is_checked_before_anything_starts(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match="--key-field"):
        JobConfig(app="a", streams=("s",), checkpoint=str(tmp_path), key_field="user..id")
