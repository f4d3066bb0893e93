"""`bench.query_start`: each arm's context takes its interpreter, every query is counted,
and the summary keeps each run's first query apart."""

from __future__ import annotations

import pytest

from bench import query_start

LAUNCHER = "/tmp/shardless-python-abc/python"
PYTHON = "/venv/bin/python"


def _query(seconds: float, records: int = 40) -> dict:
    return {"seconds": seconds, "batches": 1, "records": records}


def test_a_run_on_the_other_interpreter_or_short_of_records_is_refused():
    ok = {"python_exec": LAUNCHER, "python": PYTHON, "queries": [_query(3.0), _query(2.0)]}
    query_start.check("launcher", ok, 2, 40)
    query_start.check("direct", {**ok, "python_exec": PYTHON}, 2, 40)
    with pytest.raises(RuntimeError, match="ran Python as"):
        query_start.check("direct", ok, 2, 40)
    with pytest.raises(RuntimeError, match="ran Python as"):
        query_start.check("launcher", {**ok, "python_exec": PYTHON}, 2, 40)
    short = {**ok, "queries": [_query(3.0), _query(2.0, records=39)]}
    with pytest.raises(RuntimeError, match="delivered"):
        query_start.check("launcher", short, 2, 40)
    with pytest.raises(RuntimeError, match="delivered"):
        query_start.check("launcher", ok, 3, 40)  # a query missing


def test_the_summary_keeps_first_queries_apart_and_compares_the_later_ones():
    runs = {
        "launcher": [{"queries": [_query(20.0), _query(8.0)]}, {"queries": [_query(30.0)]}],
        "direct": [{"queries": [_query(22.0), _query(10.0), _query(11.0)]}],
    }
    out = query_start.summarize(runs)
    on, off = out["arms"]["launcher"], out["arms"]["direct"]
    assert (on["runs"], on["first_query_s"], on["query_s"]) == (2, 25.0, 8.0)
    assert (off["first_query_s"], off["query_s"]) == (22.0, 10.5)
    assert out["query_launcher_over_direct"] == round(8.0 / 10.5, 3)
    assert out["query_saved_s"] == 2.5


@pytest.mark.slow
def test_each_arm_runs_its_queries_on_its_own_interpreter(aws, tmp_path):
    """A real run of each arm on the suite's emulators: the check above passes on what the
    driver reported, and every query delivered its records in its one batch."""
    for arm, queries in (("launcher", 1), ("direct", 1)):
        result = query_start.run_once(arm, tmp_path, queries, 40)
        assert len(result["queries"]) == queries
        for q in result["queries"]:
            assert q["records"] == 40 and q["batches"] == 1 and q["seconds"] > 0, q
