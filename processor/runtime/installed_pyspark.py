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
(`shardless.processor.driver.spark.session`). The daemon serves tasks only: the processes
that plan a Python data source's reads and run a streaming source (two at every query
start, and more for each `load()`) are started by Spark as `python -m ...`, from the zips.
`launcher` is a script for them to be started through instead, which takes the shipped
zips off their path and runs this interpreter.
"""

from __future__ import annotations

import atexit
import functools
import importlib.machinery
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
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


# The launcher keeps every entry of the PYTHONPATH Spark gives but the shipped zips: an entry
# named like one whose folder is the installed package's `python/lib` (compared resolved, as
# `shipped_zips` does). Spark's path has no empty entries, and the launcher keeps none.
_LAUNCHER = """\
#!/bin/sh
# Written by shardless (shardless.processor.runtime.installed_pyspark.launcher): runs
# {python} with PySpark's shipped zips taken off PYTHONPATH, so that the processes Spark
# starts import PySpark's installed, compiled package rather than compile the zip's.
lib={lib}
kept=
set -f
IFS=:
for entry in $PYTHONPATH; do
  case $entry in
    */pyspark.zip|*/py4j-*.zip)
      [ "$(cd -P -- "${{entry%/*}}" 2>/dev/null && pwd)" = "$lib" ] && continue ;;
  esac
  kept=${{kept:+$kept:}}$entry
done
unset IFS
if [ -n "$kept" ]; then export PYTHONPATH="$kept"; else unset PYTHONPATH; fi
exec {python} "$@"
"""


@functools.lru_cache(maxsize=8)
def launcher(python: str = sys.executable) -> str | None:
    """A script that runs `python` as Spark would, less the shipped zips on its path: for
    `sc.pythonExec` under a local master (`shardless.processor.driver.spark.session`), where
    every Python process Spark starts runs on this host. None where there is nothing to
    drop (PySpark not pip-installed) or no POSIX shell. Written once per process into a
    folder of its own, removed when the process exits."""
    package = _installed_pyspark(sys.path)
    shell = shutil.which("sh")
    if package is None or shell is None or not (package / "python" / "lib").is_dir():
        return None
    folder = Path(tempfile.mkdtemp(prefix="shardless-python-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    script = folder / "python"
    text = _LAUNCHER.format(
        python=shlex.quote(python), lib=shlex.quote(str(package / "python" / "lib"))
    )
    script.write_text(text.replace("#!/bin/sh", f"#!{shell}", 1))
    script.chmod(0o700)
    return str(script)
