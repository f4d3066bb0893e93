"""`bench.roll_over`: each arm takes its path through the roll-over batch, and a rep that
did not is refused rather than measured."""

from __future__ import annotations

import pytest

from bench import roll_over


def test_each_arm_rolls_over_on_its_own_path(aws, tmp_path):  # noqa: ANN001
    out = roll_over.measure(tmp_path, slices=32, length=6, per=2, reps=1)
    # the default takes the heads it knows; the baseline reads every one again
    assert out["settled_heads_reread"] == 0
    assert out["reread_heads_reread"] == 32
    assert out["reread_gets"] > out["settled_gets"]  # the segment indexes of the re-read
    assert out["reread_queries"] > out["settled_queries"]  # the sealed chain's links
    for arm in roll_over.ARMS:
        (rep,) = out["runs"][arm]
        assert rep["chains"] == 2 and rep["chain_s"] > rep["steady_chain_s"]


def test_a_rep_off_its_arms_path_is_refused() -> None:
    rep = {"heads_reread": 0, "chains": 2}
    roll_over.check("settled", rep, 32)
    with pytest.raises(RuntimeError, match="arm reread: 0 heads read again"):
        roll_over.check("reread", rep, 32)
    with pytest.raises(RuntimeError, match="3 chains after the run, not 2"):
        roll_over.check("settled", {"heads_reread": 0, "chains": 3}, 32)


def test_the_arm_switch_is_put_back() -> None:
    before = (roll_over.DurableState.heads, roll_over.attempt.roll_over)
    with roll_over.arm("reread"):
        assert roll_over.attempt.roll_over is not before[1]
    assert (roll_over.DurableState.heads, roll_over.attempt.roll_over) == before
