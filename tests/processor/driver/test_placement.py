"""`--group-owner auto` (the default): owner processes where an executor runs several tasks
at once on Linux, the Python worker everywhere else, and the reason said. `--groups 0`
(the default): one group per task slot where Spark's configuration tells, else 8."""

from __future__ import annotations

import json
import logging

import pytest

from shardless.processor.driver.config import JobConfig
from shardless.processor.driver.placement import (
    DEFAULT_GROUPS,
    choose_group_owner,
    choose_groups,
    no_locality_wait,
    task_slots,
    tasks_per_executor,
)
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


@pytest.mark.parametrize(
    ("master", "conf", "slots"),
    [
        ("local", {}, 1),
        ("local[2]", {}, 2),
        ("local[*]", {}, 6),
        ("local[4]", {"spark.task.cpus": "2"}, 2),
        ("local-cluster[2,1,1024]", {}, 2),
        ("local-cluster[3, 2, 1024]", {}, 6),
        ("yarn", {}, 2),  # two executors of one core unless told
        ("k8s://https://api:6443", {"spark.executor.cores": "4"}, 8),
        ("yarn", {"spark.executor.instances": "10", "spark.executor.cores": "4"}, 40),
        ("spark://host:7077", {"spark.executor.instances": "3", "spark.executor.cores": "2"}, 6),
        ("spark://host:7077", {}, None),  # as many executors as the workers have room for
        ("yarn", {"spark.dynamicAllocation.enabled": "true"}, None),
        (
            "yarn",
            {
                "spark.dynamicAllocation.enabled": "true",
                "spark.dynamicAllocation.maxExecutors": "5",
            },
            5,
        ),
        (
            "yarn",
            {
                "spark.dynamicAllocation.enabled": "true",
                "spark.dynamicAllocation.maxExecutors": "2147483647",  # Spark's default
                "spark.executor.instances": "4",
            },
            None,
        ),
    ],
)
def test_task_slots_are_executors_times_their_tasks(master, conf, slots):
    assert task_slots(master, conf, cpus=6) == slots


def test_groups_are_one_per_task_slot_else_eight_and_say_why():
    two = choose_groups("local-cluster[2,1,1024]", {})
    assert two.groups == 2 and "runs 2 tasks at once" in two.why
    unknown = choose_groups("spark://host:7077", {})
    assert unknown.groups == DEFAULT_GROUPS == 8
    assert "spark.executor.instances or --groups" in unknown.why
    many = choose_groups("yarn", {"spark.executor.instances": "5000"})
    assert many.groups == 4096  # at most MAX_GROUPS; the job then keeps it to the slices


@pytest.mark.parametrize("bad", ["0", "two"])
def test_a_bad_executor_count_is_named(bad):
    with pytest.raises(ConfigError, match=f"spark.executor.instances={bad!r}"):
        task_slots("yarn", {"spark.executor.instances": bad})


def test_groups_default_to_zero_and_a_bad_count_is_refused():
    base = dict(app="app", streams=("s",), checkpoint="/tmp/c", slices=16)
    assert JobConfig(**base).groups == 0
    assert JobConfig(**base, groups=16).groups == 16
    for bad in (-1, 17, True):
        with pytest.raises(ConfigError, match=r"--groups .*use 0 \(one per task slot"):
            JobConfig(**base, groups=bad)


def test_the_session_lays_out_one_group_per_slot_and_the_job_keeps_it_to_the_slices(
    spark, tmp_path, caplog
):
    """`session()` with `--groups 0` sets the shuffle partitions from its cluster (local[2]:
    2); a job with `--groups 0` takes the session's count, at most one group per slice."""
    from shardless.processor.driver.job import partitions_for
    from shardless.processor.driver.spark import session

    key = "spark.sql.shuffle.partitions"
    before = spark.conf.get(key)
    try:
        spark.conf.set(key, "5")  # session() must size it again, not find it so
        assert session("local[2]", groups=0, ui=False) is spark
        # made with 2 groups on local[2]'s 2 slots: a group goes to a free executor at once
        assert spark.sparkContext.getConf().get("spark.locality.wait") == "0"
        assert spark.conf.get(key) == "2"
        base = dict(app="app", streams=("s",), checkpoint=str(tmp_path / "new"))
        with caplog.at_level("WARNING"):
            assert partitions_for(spark, JobConfig(**base, slices=16)) == (2, None)
        warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert not warned  # the job's own choice is no mismatch
        spark.conf.set(key, "64")
        assert partitions_for(spark, JobConfig(**base, slices=16)) == (16, None)
        assert spark.conf.get(key) == "16"  # Spark lays a new checkpoint out with it too
        assert "more than the 16 slices" in caplog.text
        # 16 groups queue on the 2 slots, where the session skipped the locality wait
        assert "16 groups on 2 task slots with spark.locality.wait=0" in caplog.text
    finally:
        spark.conf.set(key, before)


def test_tasks_skip_the_locality_wait_only_where_every_group_has_a_slot():
    """After an executor loss its groups must be free to move to the replacement; with
    more groups than slots, a queued group must wait for its own executor instead."""
    assert no_locality_wait(2, 2) and no_locality_wait(1, 4)
    assert not no_locality_wait(8, 2)
    assert not no_locality_wait(2, None)  # slots unknown: Spark's wait


def test_the_command_sizes_its_session_by_a_local_checkpoints_own_groups(tmp_path):
    from shardless.processor.driver.recorder import local_checkpoint_partitions

    checkpoint = tmp_path / "checkpoint"
    assert local_checkpoint_partitions(str(checkpoint)) is None  # new
    offsets = checkpoint / "offsets"
    offsets.mkdir(parents=True)
    meta = {"batchWatermarkMs": 0, "conf": {"spark.sql.shuffle.partitions": "8"}}
    (offsets / "0").write_text('v1\n{"conf": {}}\n{}\n')
    (offsets / "1").write_text(f"v1\n{json.dumps(meta)}\n{{}}\n{{}}\n")
    (offsets / ".1.crc").write_text("")
    assert local_checkpoint_partitions(str(checkpoint)) == 8  # the newest entry's
    assert local_checkpoint_partitions(f"file://{checkpoint}") == 8
    assert local_checkpoint_partitions("s3://bucket/checkpoint") is None  # Spark reads it
    (offsets / "2").write_text("v1\n{not json\n")  # damaged: a hint only, not a crash here
    assert local_checkpoint_partitions(str(checkpoint)) is None


_SESSION_SCRIPT = """\
from shardless.processor.driver.spark import session
s = session(groups=0, ui=False)
print("RESULT", s.sparkContext.getConf().get("spark.locality.wait", "unset"),
      s.conf.get("spark.sql.shuffle.partitions"))
s.stop()
"""


def session_in_a_new_process(
    tmp_path, submit_master: str | None, defaults: str, script: str = _SESSION_SCRIPT
) -> list[str]:
    """What `script` (by default: what `session(groups=0)` makes) prints on its `RESULT`
    line in a process of its own: run by Python, or by spark-submit with `--master
    submit_master`, with `defaults` as spark-defaults.conf."""
    import os
    import subprocess
    import sys

    from shardless.processor.local.cluster import SPARK_HOME

    script_file, conf_dir = tmp_path / "session.py", tmp_path / "conf"
    conf_dir.mkdir(parents=True)
    script_file.write_text(script)
    (conf_dir / "spark-defaults.conf").write_text(defaults)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    env.update(
        SPARK_CONF_DIR=str(conf_dir), SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
    )  # fmt: skip
    command = [sys.executable, str(script_file)]
    if submit_master is not None:
        command = [
            str(SPARK_HOME / "bin" / "spark-submit"),
            "--master",
            submit_master,
            *command[1:],
        ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    found = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert done.returncode == 0 and found, done.stderr[-3000:]
    return found[0]


@pytest.mark.slow
def test_the_session_reads_the_deployments_master_and_settings_before_it_starts(tmp_path):
    """`--groups 0` and the locality rule are decided before Spark starts, from what the
    deployment configured: spark-submit's `--master`, and spark-defaults.conf, whose
    `spark.locality.wait` is the deployment's to keep. (PySpark's SparkConf sees neither
    before its JVM is up: then this read local[2] under `--master local[3]` and set the
    wait to 0 over the file's.)"""
    assert session_in_a_new_process(tmp_path / "a", None, "spark.locality.wait 5s\n") == [
        "5s",
        "2",
    ]
    assert session_in_a_new_process(tmp_path / "b", "local[3]", "") == ["0", "3"]
