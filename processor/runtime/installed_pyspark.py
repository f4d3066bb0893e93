"""Python workers that import PySpark's installed, compiled package, not Spark's zip of it.

Spark puts `$SPARK_HOME/python/lib/pyspark.zip` and py4j's zip at the front of the path of
every Python process it starts. Python keeps no compiled code for modules in a zip, so each
new worker compiles the source of every PySpark module it imports (`docs/benchmarks.md`,
"A new executor's first Python tasks"). Where those zips are the
ones shipped inside the PySpark package the process would import anyway (Spark installed
by pip), they hold the same files, and leaving them off the path changes nothing but the
time. Zips anywhere else (a cluster's own Spark distribution) are left alone.

`DAEMON` is the daemon module that does this before PySpark's own daemon starts; the
session sets it as `spark.python.daemon.module` where executors run this interpreter
(`shardless.processor.driver.spark.session`).
"""

from __future__ import annotations

import functools
import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

DAEMON = "shardless.processor.runtime.worker_daemon"


def _installed_pyspark(path: list[str]) -> Path | None:
    """The PySpark package directory found on `path` outside any zip, if any."""
    outside = [p for p in path if not p.endswith(".zip")]
    spec = importlib.machinery.PathFinder.find_spec("pyspark", outside)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def shipped_zips(path: list[str]) -> list[str]:
    """The entries of `path` that are zips in the `python/lib` folder of the PySpark
    package installed on `path` (what a pip-installed Spark's SPARK_HOME puts there)."""
    package = _installed_pyspark(path)
    if package is None:
        return []
    lib = package / "python" / "lib"
    return [p for p in path if p.endswith(".zip") and Path(p).resolve().parent == lib]


def prefer_installed() -> list[str]:
    """Take the shipped zips off `sys.path` (and drop their cached importers), before
    anything imports PySpark; the entries taken off."""
    dropped = shipped_zips(sys.path)
    for entry in dropped:
        while entry in sys.path:
            sys.path.remove(entry)
        sys.path_importer_cache.pop(entry, None)
    return dropped


def child_path() -> str:
    """A PYTHONPATH for a child process: this process's path without the shipped zips."""
    dropped = set(shipped_zips(sys.path))
    return os.pathsep.join(p for p in sys.path if p and p not in dropped)


@functools.lru_cache(maxsize=8)
def daemon_importable(python: str = sys.executable) -> bool:
    """Whether a new `python` with this process's environment can import `DAEMON` (Spark
    starts the daemon before a task's `--py-files` are on the path, so shardless must be
    installed where the workers run). Asked once per interpreter and process."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({DAEMON!r}) is None)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0
