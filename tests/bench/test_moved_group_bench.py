"""bench.moved_group counts the slices that take the rebuild path: every slice of the
move's own batch does; none of a group's steady batches, whether it stayed on the host
that claimed its slices or moved."""

from __future__ import annotations

import pytest

from bench import moved_group


def test_the_rebuild_count_sees_the_move_and_the_steady_batches(aws):  # noqa: ANN001
    out = moved_group.measure(slices=8, history=3, reps=2, per=2)
    assert out["move_batch"]["rebuilt_slices"] == 8  # the new host builds every slice
    assert out["move_batch"]["restored_slices"] == 8
    stayed = out["arms"]["stayed"]
    assert stayed["rebuilt_slices"] == 0 and stayed["restored_slices"] == 0
    # the moved group finds its open stores ready on its new host, though its heads still
    # name the host it left (tests/processor/runtime/test_runtime.py has the runtime's test)
    assert out["arms"]["moved"]["rebuilt_slices"] == 0
    assert len(stayed["seconds_each"]) == len(out["arms"]["moved"]["seconds_each"]) == 2


def test_counts_it_cannot_run_are_refused_by_name(capsys):  # noqa: ANN001
    with pytest.raises(SystemExit):
        moved_group.main(["--reps", "0"])
    assert "--reps must be 1 or more, not 0" in capsys.readouterr().err
