"""`bench.state_loop`'s arguments: a count it cannot run is refused by name, and
`--timers 0` leaves the timer figures out instead of failing."""

from __future__ import annotations

import json

import pytest

from bench import state_loop

SMALL = ["--json", "--records", "4000", "--keys", "500", "--batch", "1000"]


def test_timers_0_runs_the_loop_without_the_timer_figures(capsys):
    state_loop.main([*SMALL, "--timers", "0"])
    out = json.loads(capsys.readouterr().out)
    assert out["zipf_records_per_s"] > 0 and out["uniform_records_per_s"] > 0
    assert not [k for k in out if k.startswith("timers_")]
    assert out["config"]["timers"] == 0


def test_timers_are_measured_when_asked(capsys):
    state_loop.main([*SMALL, "--timers", "300"])
    out = json.loads(capsys.readouterr().out)
    assert out["timers_per_s"] > 0 and out["timers_fired_per_s"] > 0


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--timers", "-1"], "--timers must be 0 (none) or more, not -1"),
        (["--records", "1"], "--records must be 2 or more (a warm-up batch, then one), not 1"),
        (["--keys", "0"], "--keys must be 1 or more, not 0"),
        (["--batch", "0"], "--batch must be 1 or more, not 0"),
    ],
)
def test_a_count_it_cannot_run_is_refused_by_name(args, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        state_loop.main(args)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err
