"""`bench.cold_start`: each arm's workers take its path, and the bench sees which."""

from __future__ import annotations

import pytest

from bench import cold_start


def _result(files: list[str]) -> dict:
    rows = [{"part": i % 2, "pid": 10 + i, "pyspark": f} for i, f in enumerate(files)]
    jobs = [{"seconds": 1.0, "rows": rows[:2]}, {"seconds": 0.2, "rows": rows[2:]}]
    return {"daemon": "d", "jobs": jobs}


INSTALLED = "/venv/site-packages/pyspark/__init__.py"
ZIPPED = "/venv/site-packages/pyspark/python/lib/pyspark.zip/pyspark/__init__.py"


def test_a_run_whose_workers_took_the_other_path_is_refused():
    cold_start.check("installed", _result([INSTALLED] * 4))
    cold_start.check("zip", _result([ZIPPED] * 4))
    with pytest.raises(RuntimeError, match="imported PySpark from"):
        cold_start.check("installed", _result([INSTALLED] * 3 + [ZIPPED]))
    with pytest.raises(RuntimeError, match="imported PySpark from"):
        cold_start.check("zip", _result([ZIPPED] * 3 + [INSTALLED]))
    with pytest.raises(RuntimeError, match="imported PySpark from"):
        cold_start.check("zip", _result([ZIPPED] * 3))  # a task that reported nothing


@pytest.mark.slow
def test_the_default_arm_runs_on_new_executors_and_takes_its_path(tmp_path):
    """One real run of the default arm: both new executors start a worker from shardless's
    daemon (two processes), the check above passes on what the tasks reported, the first
    job pays a cold start, and its parts are seen. (A real run of the `zip` arm, which
    only adds a setting PySpark reads, costs the suite another 45 s; the check's refusals
    above cover what tells the arms apart.)"""
    for arm in ("installed",):
        run = cold_start.run_once(arm, tmp_path)
        assert run["workers"] == 2
        assert run["first_s"] > run["second_s"] > 0
        # the first job's parts, from the tasks' own clocks, add up to the job
        assert set(run["first_job"]) == set(cold_start.PARTS)
        assert all(v > 0 for v in run["first_job"].values()), run["first_job"]
        assert abs(sum(run["first_job"].values()) - run["first_s"]) < 0.5
