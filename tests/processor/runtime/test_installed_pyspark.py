"""Python workers import PySpark's installed package, not the zips Spark puts on their path
(`shardless.processor.runtime.installed_pyspark`): with real interpreters, real zips and
real Spark."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shardless.processor.runtime import installed_pyspark, owner

PYSPARK = Path(installed_pyspark._installed_pyspark(sys.path) or "/nonexistent")
LIB = PYSPARK / "python" / "lib"
SHIPPED = sorted(str(p) for p in LIB.glob("*.zip"))

pytestmark = pytest.mark.skipif(
    len(SHIPPED) != 2, reason="needs a pip-installed PySpark, which ships its zips"
)


def test_only_the_zips_inside_the_installed_pyspark_are_shipped_ones(tmp_path):
    """A zip of a Spark elsewhere (a cluster's distribution) and the standard library's zip
    are not PySpark's shipped ones, though the first holds the same files."""
    elsewhere = tmp_path / "spark" / "python" / "lib"
    elsewhere.mkdir(parents=True)
    copy = shutil.copy(SHIPPED[0], elsewhere / "pyspark.zip")
    stdlib_zip = f"{sys.prefix}/lib/python311.zip"
    path = [str(copy), *SHIPPED, stdlib_zip, *sys.path]
    assert installed_pyspark.shipped_zips(path) == SHIPPED
    # without an installed PySpark outside the zips, the zips are all there is: none goes
    no_package = [str(copy), *SHIPPED, str(tmp_path)]
    assert installed_pyspark.shipped_zips(no_package) == []


def _python(code: str, pythonpath: str) -> str:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_process_started_as_spark_starts_workers_imports_the_installed_package():
    """With Spark's PYTHONPATH (the shipped zips first), PySpark comes from the zip; after
    `prefer_installed` it comes from the installed package, and no importer of a dropped
    zip is left to re-read on every `importlib.invalidate_caches()` (which a new worker's
    first task calls)."""
    spark_path = os.pathsep.join(SHIPPED)
    assert ".zip" in _python("import pyspark; print(pyspark.__file__)", spark_path)
    out = _python(
        """
        import sys
        from shardless.processor.runtime.installed_pyspark import prefer_installed
        dropped = prefer_installed()
        import pyspark
        print(len(dropped), pyspark.__file__, any(k in sys.path_importer_cache for k in dropped))
        """,
        spark_path,
    )
    assert out == f"2 {PYSPARK / '__init__.py'} False"


def _environ_once_exec_is_done(pid: int, timeout: float = 30.0) -> list[bytes]:
    """`/proc/PID/environ`, read once the new program's environment is in place. Popen
    returns when exec closes its close-on-exec pipe, and Linux sets up the new
    environment after that, so a read in between finds it empty."""
    deadline = time.monotonic() + timeout
    while not (raw := Path(f"/proc/{pid}/environ").read_bytes()):
        assert time.monotonic() < deadline, f"process {pid} has no environment after exec"
        time.sleep(0.01)
    return raw.split(b"\0")


def test_an_owner_process_gets_the_path_without_the_shipped_zips(monkeypatch, tmp_path):
    """The owner a worker starts inherits the worker's path, less the shipped zips: its
    PYTHONPATH, read from the running process, names neither."""
    monkeypatch.setattr(sys, "path", [*SHIPPED, *sys.path, "/somewhere/else.zip"])
    child = owner.start(str(tmp_path), "app", 0, watch=os.getpid(), idle_seconds=5, timeout=60)
    try:
        environ = _environ_once_exec_is_done(child)
        key = b"PYTHONPATH="
        (found,) = [e[len(key) :].decode() for e in environ if e.startswith(key)]
        parts = found.split(os.pathsep)
        assert not set(SHIPPED) & set(parts)
        assert "/somewhere/else.zip" in parts
    finally:
        os.kill(child, signal.SIGKILL)


def test_the_daemon_probe_says_no_for_an_interpreter_that_cannot_import_it(tmp_path):
    assert installed_pyspark.daemon_importable()
    assert not installed_pyspark.daemon_importable("/bin/false")
    assert not installed_pyspark.daemon_importable(str(tmp_path / "no-python"))


def test_the_suites_python_workers_import_the_installed_pyspark(spark):
    """Under a local master the session starts workers from shardless's daemon, and their
    tasks find PySpark's installed package, not the zip Spark put first on their path."""

    def where(_):  # noqa: ANN001, ANN202
        import pyspark

        return pyspark.__file__, [p for p in sys.path if p.endswith(".zip")]

    conf = spark.sparkContext.getConf()
    assert conf.get("spark.python.daemon.module") == installed_pyspark.DAEMON
    found = spark.sparkContext.parallelize([0, 1], 2).map(where).collect()
    assert {f for f, _ in found} == {str(PYSPARK / "__init__.py")}
    assert not {z for _, zips in found for z in zips} & set(SHIPPED)


_DEPLOYED = """\
from shardless.processor.driver.spark import session
s = session("local[2]", groups=2, ui=False)
where = s.sparkContext.parallelize([0], 1).map(lambda _: __import__("pyspark").__file__).first()
print("RESULT", s.sparkContext.getConf().get("spark.python.daemon.module"), where)
s.stop()
"""


@pytest.mark.slow
def test_a_deployments_own_daemon_module_is_kept(tmp_path):
    """`spark.python.daemon.module` in spark-defaults.conf is the deployment's: the session
    leaves it, and the workers then import PySpark from Spark's zip as before."""
    from tests.processor.driver.test_placement import session_in_a_new_process

    defaults = "spark.python.daemon.module pyspark.daemon\n"
    daemon, where = session_in_a_new_process(tmp_path, None, defaults, _DEPLOYED)
    assert daemon == "pyspark.daemon"
    assert where.startswith(str(LIB / "pyspark.zip"))


def test_the_fault_tools_find_the_workers_shardless_daemon_forks(spark):
    """The fault harness and `bench.latency` pick an executor's Python workers (whose
    stores go with a killed executor) by their daemon's command line: the shardless
    daemon's workers are found as PySpark's were."""
    from shardless.processor.local.faults import procs

    pids = set(spark.sparkContext.parallelize([0, 1], 2).map(lambda _: os.getpid()).collect())
    found = {p.pid: p.cmdline for p in procs.python_workers(os.getpid())}
    assert pids <= set(found)
    assert all(installed_pyspark.DAEMON in found[pid] for pid in pids)


_REPORT = """\
import json, os, sys
import pyspark
print(json.dumps({"pyspark": pyspark.__file__, "path": os.environ.get("PYTHONPATH"),
                  "argv": sys.argv[1:], "stdin": sys.stdin.read(),
                  "executable": sys.executable}))
sys.exit(3)
"""


def test_the_launcher_takes_off_the_shipped_zips_however_spelled_and_keeps_the_rest(tmp_path):
    """The script Spark starts Python processes through drops the installed package's own
    zips (also through a symlinked folder) and nothing else: a copy of the zip elsewhere,
    a jar and other folders stay, in their order; arguments, input and the exit status
    pass through untouched."""
    launcher = installed_pyspark.launcher(sys.executable)
    assert launcher is not None
    linked = tmp_path / "linked-lib"
    linked.symlink_to(LIB)
    elsewhere = tmp_path / "spark" / "python" / "lib"
    elsewhere.mkdir(parents=True)
    copy = str(shutil.copy(SHIPPED[0], elsewhere / "pyspark.zip"))
    kept = ["/a folder with spaces/spark-core.jar", str(tmp_path), copy]
    given = [*SHIPPED, str(linked / "pyspark.zip"), kept[0], *reversed(SHIPPED), *kept[1:]]
    done = subprocess.run(
        [launcher, "-c", _REPORT, "an argument", "*", ""],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(given)},
        input="what the JVM sends",
        capture_output=True,
        text=True,
    )
    assert done.returncode == 3, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["path"] == os.pathsep.join(kept)
    assert out["pyspark"] == str(PYSPARK / "__init__.py")
    assert out["argv"] == ["an argument", "*", ""]
    assert out["stdin"] == "what the JVM sends"
    assert out["executable"] == sys.executable
    # a path of nothing but the shipped zips leaves no PYTHONPATH at all (an empty one
    # would put the current folder on the path)
    alone = {**os.environ, "PYTHONPATH": os.pathsep.join(SHIPPED)}
    done = subprocess.run([launcher, "-c", _REPORT], env=alone, capture_output=True, text=True)
    assert json.loads(done.stdout)["path"] is None


def test_there_is_no_launcher_without_a_pip_installed_pyspark(monkeypatch):
    monkeypatch.setattr(installed_pyspark, "_installed_pyspark", lambda path: None)
    assert installed_pyspark.launcher.__wrapped__(sys.executable) is None


def test_the_context_gets_the_launcher_only_for_this_interpreter_and_only_while_made(
    monkeypatch,
):
    """PYSPARK_PYTHON is the launcher while the context is made, where shardless's daemon
    serves the workers and the interpreter is this one; it is put back afterwards."""
    from shardless.processor.driver.spark import _python_exec

    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    with _python_exec(True):
        assert os.environ["PYSPARK_PYTHON"] == installed_pyspark.launcher(sys.executable)
    assert os.environ["PYSPARK_PYTHON"] == sys.executable
    with _python_exec(False):  # the deployment set its own daemon module
        assert os.environ["PYSPARK_PYTHON"] == sys.executable
    other = shutil.which("sh")
    monkeypatch.setenv("PYSPARK_PYTHON", other)  # the deployment's own interpreter
    with _python_exec(True):
        assert os.environ["PYSPARK_PYTHON"] == other


def test_the_suites_data_source_planners_import_the_installed_pyspark(spark):
    """A Python data source's reads are planned in a process Spark starts as `python -m`,
    not forked by the daemon: the session starts it through the launcher, so it too finds
    PySpark's installed package (its partitions carry what the planner saw)."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    class Reader(DataSourceReader):
        def partitions(self):  # noqa: ANN202 - runs in the planner process
            import pyspark

            zips = ",".join(p for p in sys.path if p.endswith(".zip"))
            return [InputPartition((pyspark.__file__, zips))]

        def read(self, partition):  # noqa: ANN001, ANN202
            yield partition.value

    class WhereSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return "shardless_test_planner_path"

        def schema(self) -> str:
            return "pyspark string, zips string"

        def reader(self, schema):  # noqa: ANN001, ANN202
            return Reader()

    spark.dataSource.register(WhereSource)
    (row,) = spark.read.format("shardless_test_planner_path").load().collect()
    assert row.pyspark == str(PYSPARK / "__init__.py")
    assert not set(row.zips.split(",")) & set(SHIPPED)
    assert spark.sparkContext.pythonExec == installed_pyspark.launcher(sys.executable)
    assert os.environ["PYSPARK_PYTHON"] == sys.executable
