"""`--group-owner auto` (the default): owner processes where an executor runs several tasks
at once on Linux, the Python worker everywhere else, and the reason said."""

from __future__ import annotations

import pytest

from shardless.processor.driver.config import JobConfig
from shardless.processor.driver.placement import choose_group_owner, tasks_per_executor
from shardless.processor.errors import ConfigError


@pytest.mark.parametrize(
    ("master", "conf", "tasks"),
    [
        ("local", {}, 1),
        ("local[1]", {}, 1),
        ("local[2]", {}, 2),
        ("local[8, 3]", {}, 8),  # local[N, maxFailures]
        ("local[*]", {}, 6),  # this host's cores (6 in the test)
        ("local[4]", {"spark.task.cpus": "2"}, 2),
        ("local-cluster[2,1,1024]", {}, 1),
        ("local-cluster[2, 4, 1024]", {}, 4),
        ("yarn", {}, 1),  # YARN's default spark.executor.cores
        ("k8s://https://api:6443", {}, 1),
        ("yarn", {"spark.executor.cores": "4"}, 4),
        ("yarn", {"spark.executor.cores": "4", "spark.task.cpus": "4"}, 1),
        ("yarn", {"spark.executor.cores": "4", "spark.task.cpus": "3"}, 1),
        ("spark://host:7077", {}, 2),  # standalone: every core of the worker
        ("spark://host:7077", {"spark.executor.cores": "1"}, 1),
    ],
)
def test_tasks_per_executor_follows_the_master_and_the_executor_cores(master, conf, tasks):
    assert tasks_per_executor(master, conf, cpus=6) == tasks


@pytest.mark.parametrize("bad", ["0", "-1", "two", ""])
def test_a_bad_core_count_is_named(bad):
    with pytest.raises(ConfigError, match=f"spark.executor.cores={bad!r}"):
        tasks_per_executor("yarn", {"spark.executor.cores": bad})
    with pytest.raises(ConfigError, match=f"spark.task.cpus={bad!r}"):
        tasks_per_executor("local[2]", {"spark.task.cpus": bad})


def test_auto_runs_owner_processes_only_where_tasks_share_an_executor_on_linux():
    several = choose_group_owner("auto", 2, platform="linux")
    assert several.owner == "process"
    assert "2 tasks at once" in several.why
    one = choose_group_owner("auto", 1, platform="linux")
    assert one.owner == "worker"
    assert "one task at a time" in one.why
    mac = choose_group_owner("auto", 4, platform="darwin")
    assert mac.owner == "worker"
    assert "need Linux and this is darwin" in mac.why
    assert mac.fallback and not one.fallback and not several.fallback


@pytest.mark.parametrize("choice", ["worker", "process"])
def test_an_explicit_owner_is_kept_whatever_the_executors(choice):
    for tasks in (1, 2, 16):
        assert choose_group_owner(choice, tasks, platform="linux").owner == choice


def test_auto_is_the_default_and_unknown_owners_are_refused():
    base = dict(app="app", streams=("s",), checkpoint="/tmp/c")
    assert JobConfig(**base).group_owner == "auto"
    with pytest.raises(ConfigError, match="use auto"):
        choose_group_owner("host", 2)


def test_the_runtime_is_never_handed_an_unresolved_auto():
    from shardless.processor.driver.job import runtime_config

    cfg = JobConfig(app="app", streams=("s",), checkpoint="/tmp/c")
    with pytest.raises(ValueError, match="resolve --group-owner auto first"):
        runtime_config(cfg, 4)
    assert runtime_config(cfg, 4, "process").group_owner == "process"
