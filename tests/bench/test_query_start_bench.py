"""`bench.query_start`: each arm's context takes its interpreter and its owners are started
its way, every query is counted, and the summary keeps each run's first query apart."""

from __future__ import annotations

import pytest

from bench import query_start

LAUNCHER = "/tmp/shardless-python-abc/python"
PYTHON = "/venv/bin/python"


def _query(seconds: float, records: int = 40) -> dict:
    return {"seconds": seconds, "batches": 1, "records": records}


ZYGOTE = "/venv/bin/python -m shardless.processor.runtime.owner_process zygote shardless-z 7 600 "
WORKER = "/venv/bin/python -m shardless.processor.runtime.worker_daemon pyspark.worker "


def test_a_run_on_the_other_interpreter_or_owners_or_short_of_records_is_refused():
    ok = {
        "python_exec": LAUNCHER,
        "python": PYTHON,
        "queries": [_query(3.0), _query(2.0)],
        "owner_parents": [ZYGOTE, ZYGOTE],
    }
    query_start.check("default", ok, 2, 40)
    query_start.check("direct", {**ok, "python_exec": PYTHON}, 2, 40)
    query_start.check("spawn", {**ok, "owner_parents": [WORKER, WORKER]}, 2, 40)
    with pytest.raises(RuntimeError, match="ran Python as"):
        query_start.check("direct", ok, 2, 40)
    with pytest.raises(RuntimeError, match="ran Python as"):
        query_start.check("default", {**ok, "python_exec": PYTHON}, 2, 40)
    for arm, parents in (
        ("spawn", [ZYGOTE, WORKER]),
        ("default", [WORKER, ZYGOTE]),
        ("default", []),
    ):
        with pytest.raises(RuntimeError, match="owners were started by"):
            query_start.check(arm, {**ok, "owner_parents": parents}, 2, 40)
    short = {**ok, "queries": [_query(3.0), _query(2.0, records=39)]}
    with pytest.raises(RuntimeError, match="delivered"):
        query_start.check("default", short, 2, 40)
    with pytest.raises(RuntimeError, match="delivered"):
        query_start.check("default", ok, 3, 40)  # a query missing


def test_the_summary_keeps_first_queries_apart_and_compares_the_later_ones():
    runs = {
        "default": [{"queries": [_query(20.0), _query(8.0)]}, {"queries": [_query(30.0)]}],
        "direct": [{"queries": [_query(22.0), _query(10.0), _query(11.0)]}],
        "spawn": [{"queries": [_query(21.0), _query(9.0)]}],
    }
    out = query_start.summarize(runs)
    on, off = out["arms"]["default"], out["arms"]["direct"]
    assert (on["runs"], on["first_query_s"], on["query_s"]) == (2, 25.0, 8.0)
    assert (off["first_query_s"], off["query_s"]) == (22.0, 10.5)
    assert out["query_default_over_direct"] == round(8.0 / 10.5, 3)
    assert out["query_saved_s_against_direct"] == 2.5
    assert out["query_default_over_spawn"] == round(8.0 / 9.0, 3)
    assert out["query_saved_s_against_spawn"] == 1.0


@pytest.mark.slow
def test_the_spawn_arm_runs_its_queries_its_own_way(aws, tmp_path):
    """A real run of the `spawn` arm on the suite's emulators: the variable reaches the
    workers through the driver, the check above passes on what the driver reported (the
    owners' parent is a worker, not a zygote), and the query delivered its records in its
    one batch. (The default arm's owners are zygote forks in every query the suite runs,
    tests/processor/runtime/test_group_owner.py checks them; `direct` differs from it in
    the context's interpreter only, which tests/processor/runtime/test_installed_pyspark.py
    checks on real processes. A real run of each costs the suite about 45 s.)"""
    result = query_start.run_once("spawn", tmp_path, 1, 40)
    assert len(result["queries"]) == 1
    for q in result["queries"]:
        assert q["records"] == 40 and q["batches"] == 1 and q["seconds"] > 0, q
