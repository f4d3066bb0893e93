"""bench.remember's arms take their paths, and its counts see every log encoded whole."""

from __future__ import annotations

import pytest

from bench import remember
from shardless.changelog import log_encoder


def test_each_arm_encodes_the_logs_its_way(aws):  # noqa: ANN001
    encode, continues = log_encoder.LogEncoder.encode, log_encoder.continues
    out = remember.measure(slices=8, history=10, batches=4, per=2)
    assert out["batches_per_arm"] == {"carried": 2, "whole": 2}
    # the whole arm encoded each slice's log in each of its batches; carried none whole
    assert out["logs_encoded_whole"] == {"carried": 0, "whole": 2 * 8}
    assert out["log_entries"]["min"] >= 10
    # both switches put back
    assert log_encoder.LogEncoder.encode is encode and log_encoder.continues is continues
    assert all(len(a["remember_s_each"]) == 2 for a in out["arms"].values())
    # the hint read back as another worker reads it: every slice's head
    assert out["hint"]["heads"] == 8 and out["hint"]["decode_s"] > 0 < out["hint"]["bytes"]


def test_a_carried_arm_that_encodes_logs_whole_is_refused(aws, monkeypatch):  # noqa: ANN001
    monkeypatch.setattr(log_encoder, "continues", lambda old, new: None)
    with pytest.raises(RuntimeError, match="arm carried encoded"):
        remember.measure(slices=4, history=6, batches=2, per=2)


def test_a_whole_arm_that_encodes_nothing_is_refused(aws, monkeypatch):  # noqa: ANN001
    monkeypatch.setattr(remember, "encode_log", lambda log: b"")
    monkeypatch.setattr(remember, "whole_logs", lambda counted: remember.carried_counted([0]))
    with pytest.raises(RuntimeError, match="arm whole encoded 0 logs"):
        remember.measure(slices=4, history=6, batches=2, per=2)


def test_a_hint_read_back_without_every_head_is_refused(aws, monkeypatch):  # noqa: ANN001
    monkeypatch.setattr(remember, "QUERY", "another-query")  # its hint names another query
    with pytest.raises(RuntimeError, match="the hint read back holds 0 heads of 4"):
        remember.measure(slices=4, history=6, batches=2, per=2)
