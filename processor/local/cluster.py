"""A Spark standalone cluster on loopback, and a packed environment for its executors.

What `docs/running-on-a-cluster.md` tells users to do, on one machine: a master and workers
started with the installed PySpark's own `bin/spark-class` (each worker with its own work
and local directories, as if on a host of its own), and shardless shipped to the executors
as EMR and Databricks users ship native dependencies: a virtual environment packed by
`venv-pack` and given to `spark-submit --archives env.tar.gz#environment`.

The environment holds shardless's wheel and its dependencies, but not PySpark: the
cluster's Spark puts its own `pyspark.zip` on its Python workers' path.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pyspark

from shardless.processor.local.emulators import HOST, _free_ports
from shardless.processor.local.faults import procs

SPARK_HOME = Path(pyspark.__file__).resolve().parent
REPO = Path(__file__).resolve().parents[2]
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
# Variables of a PySpark driver that must not leak into the cluster's JVMs or a
# spark-submit started from one (they would attach it to that driver's gateway).
_DRIVER_ONLY = ("PYSPARK_", "SPARK_HOME", "SPARK_LOCAL_DIRS", "SPARK_CONF_DIR")


class ClusterError(Exception):
    """The cluster could not be started, or a packed environment built; says why."""


@dataclass
class Node:
    """One started JVM (the master or a worker): its process and log."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"


@dataclass
class StandaloneCluster:
    """A running master and its workers; `stop()` ends every process under them."""

    master_url: str  # spark://127.0.0.1:<port>, for spark-submit --master
    web_url: str  # the master's web UI; `<web_url>/json/` is its state
    folder: Path
    master: Node
    workers: list[Node] = field(default_factory=list)

    def state(self) -> dict:
        """The master's view (`/json/`): workers, their state, cores used, applications."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"{self.web_url}/json/", timeout=2) as answer:
            return json.load(answer)

    def alive_workers(self) -> int:
        with contextlib.suppress(OSError, ValueError):
            return sum(1 for w in self.state().get("workers", []) if w.get("state") == "ALIVE")
        return 0

    def executors(self, worker: int) -> list[procs.Proc]:
        """The executor JVMs running on worker `worker` now."""
        return [p for p in procs.descendants(self.workers[worker].proc.pid) if _executor(p)]

    def kill_worker(self, worker: int) -> list[procs.Proc]:
        """kill -9 worker `worker` with everything under it (its executors, their Python
        daemons and workers): the host is gone. Returns the processes killed."""
        node = self.workers[worker]
        root = procs.read(node.proc.pid)
        tree = procs.descendants(node.proc.pid)
        hit = procs.kill9([p for p in [root, *tree] if p is not None])
        node.proc.wait(timeout=30)
        return hit

    def stop(self) -> None:
        """Kill every process the cluster started (workers first); idempotent."""
        for node in [*self.workers, self.master]:
            if node.proc.poll() is not None:
                continue
            tree = procs.descendants(node.proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGKILL)  # the session it was started in
            procs.kill9(tree)  # pyspark daemons run in process groups of their own
            node.proc.wait(timeout=30)


def _executor(p: procs.Proc) -> bool:
    return procs.EXECUTOR_MAIN in p.cmdline


def spark_class(main: str, *args: str) -> list[str]:
    """The command that runs `main` with PySpark's own launcher."""
    return [str(SPARK_HOME / "bin" / "spark-class"), main, *args]


def cluster_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) without a PySpark driver's variables,
    with SPARK_HOME set to the installed PySpark and everything bound to loopback."""
    env = {k: v for k, v in (os.environ if base is None else base).items()}
    env = {k: v for k, v in env.items() if not k.startswith(_DRIVER_ONLY)}
    return {**env, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": HOST}


def start(
    folder: Path,
    workers: int = 2,
    cores: int = 1,
    memory: str = "1g",
    env: dict[str, str] | None = None,
    timeout_s: float = 120,
) -> StandaloneCluster:
    """Start a master and `workers` workers on 127.0.0.1, each worker with `cores` cores,
    `memory` for executors and its own work and local directories under `folder`; return
    once every worker has registered. Executors inherit the workers' environment (`env`,
    default this process's), which is how they find the AWS endpoints and credentials."""
    folder.mkdir(parents=True, exist_ok=True)
    base = cluster_env(env)
    port, web_port, *worker_web_ports = _free_ports(2 + workers)
    master_cmd = spark_class(
        MASTER_CLASS, "--host", HOST, "--port", str(port), "--webui-port", str(web_port)
    )
    cluster = StandaloneCluster(
        f"spark://{HOST}:{port}",
        f"http://{HOST}:{web_port}",
        folder,
        _spawn("master", master_cmd, folder / "master.log", base),
    )
    try:
        _wait(cluster, lambda: cluster.state() is not None, "the master to answer", timeout_s)
        for i, web in enumerate(worker_web_ports):
            home = folder / f"worker-{i}"
            (home / "local").mkdir(parents=True, exist_ok=True)
            cmd = spark_class(
                WORKER_CLASS, cluster.master_url, "--host", HOST, "--webui-port", str(web),
                "--work-dir", str(home / "work"), "--cores", str(cores), "--memory", memory,
            )  # fmt: skip
            own = {**base, "SPARK_LOCAL_DIRS": str(home / "local")}
            cluster.workers.append(_spawn(f"worker-{i}", cmd, home / "worker.log", own))
        _wait(
            cluster,
            lambda: cluster.alive_workers() == workers,
            f"{workers} workers to register",
            timeout_s,
        )
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _spawn(name: str, cmd: list[str], log: Path, env: dict[str, str]) -> Node:
    with log.open("ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return Node(name, proc, log)


def _wait(cluster: StandaloneCluster, ready, what: str, timeout_s: float) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while True:
        for node in [cluster.master, *cluster.workers]:
            if node.proc.poll() is not None:
                raise ClusterError(
                    f"{node.name} exited with code {node.proc.returncode} while waiting for "
                    f"{what} (log {node.log}):\n{node.tail()}"
                )
        with contextlib.suppress(OSError, ValueError):
            if ready():
                return
        if time.monotonic() > deadline:
            raise ClusterError(
                f"no {what} after {timeout_s:.0f}s; the master's log, {cluster.master.log}:\n"
                + cluster.master.tail()
            )
        time.sleep(0.2)


_NAME = re.compile(r"[A-Za-z0-9._-]+")


def runtime_requirements(dist: str = "shardless") -> list[str]:
    """What `dist` needs at run time on an executor, PySpark aside (the cluster's Spark
    provides it), as installed here: `name==version` each."""
    out = []
    for raw in metadata.requires(dist) or []:
        if "extra ==" in raw:
            continue  # an extra's (dev, bench)
        name = _NAME.match(raw).group(0)
        if name.lower() != "pyspark":
            out.append(f"{name}=={metadata.version(name)}")
    return out


def pack_environment(
    output: Path, work: Path, project: Path = REPO, compress_level: int = 4
) -> Path:
    """Build shardless's wheel from `project`, a fresh virtual environment with it and its
    run-time dependencies at the versions installed here (PySpark left out), and pack it
    with venv-pack into `output` (`.tar.gz`): what `--archives output#environment` ships.

    The wheel is built while the environment is made and its dependencies installed, by
    this interpreter's pip (`pip --python`: the environment needs no pip of its own)."""
    import venv_pack

    work.mkdir(parents=True, exist_ok=True)
    dist, env = work / "dist", work / "env"
    building = _start([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(project),
                       "-w", str(dist)])  # fmt: skip
    try:
        _run([sys.executable, "-m", "venv", "--without-pip", str(env)])
        pip = [sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install"]
        _run([*pip, "-q", *runtime_requirements()])
    finally:
        _finish(building)
    (wheel,) = dist.glob("shardless-*.whl")
    _run([*pip, "-q", "--no-deps", str(wheel)])
    venv_pack.pack(prefix=str(env), output=str(output), force=True, compress_level=compress_level)
    return output


def _start(cmd: list[str]) -> tuple[list[str], subprocess.Popen[str]]:
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL
    )
    return cmd, proc


def _finish(started: tuple[list[str], subprocess.Popen[str]]) -> None:
    cmd, proc = started
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
