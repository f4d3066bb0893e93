"""Start and stop local AWS emulators (moto for S3 + DynamoDB, a Node Kinesis emulator).

Tests, the demo and the CLI all need the same three services without an AWS account, so this
module owns the fiddly parts once: free ports, readiness polling, log files, clean shutdown.
Everything listens on and is contacted at 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

HOST = "127.0.0.1"
REGION = "us-east-1"
KINESIS_FLAVOURS = ("kinesalite", "kinesis-local")

# Emulators are told to finish stream state changes almost at once, so tests do not wait on
# the real-AWS-like 500 ms defaults.
_KINESIS_LOCAL_ENV = {
    "CREATE_STREAM_DURATION": "50ms",
    "DELETE_STREAM_DURATION": "50ms",
    "SPLIT_SHARD_DURATION": "50ms",
    "MERGE_SHARDS_DURATION": "50ms",
    "UPDATE_SHARD_COUNT_DURATION": "50ms",
    # INFO logs every request; WARN keeps handled errors (bad requests), which help debugging.
    "LOG_LEVEL": "WARN",
}
# Substrings of the command lines we start; stop() signals a pid only if it still matches, so
# a stale JSON file (pid reused after a reboot) cannot make us kill an unrelated process.
_OUR_COMMANDS = (b"moto_server", b"kinesalite", b"kinesis-local")


class LocalAwsError(Exception):
    """An emulator could not be found, started or reached; the message says what to do."""


@dataclass
class LocalAws:
    """Endpoints of running emulators, plus the pids this object is responsible for stopping."""

    kinesis_endpoint: str
    s3_endpoint: str
    dynamodb_endpoint: str
    kinesis_flavour: str
    pids: list[int]
    # Popen handles of processes started in this Python process; kept so they are reaped.
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False, compare=False)

    def env(self) -> dict[str, str]:
        """Variables that point any boto3/AWS SDK client at the emulators, with dummy creds.

        SDKs honour AWS_ENDPOINT_URL_<SERVICE>, so code under test needs no endpoint plumbing.
        """
        return {
            "AWS_ENDPOINT_URL_KINESIS": self.kinesis_endpoint,
            "AWS_ENDPOINT_URL_S3": self.s3_endpoint,
            "AWS_ENDPOINT_URL_DYNAMODB": self.dynamodb_endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": REGION,
            "AWS_REGION": REGION,
        }

    def kinesis_client(self) -> Any:
        """A boto3 Kinesis client straight to the emulator (not through any proxy)."""
        return boto3.session.Session().client(
            "kinesis",
            endpoint_url=self.kinesis_endpoint,
            region_name=REGION,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def apply_env(self) -> None:
        """Point this process (and children started afterwards) at the emulators."""
        os.environ.update(self.env())

    @contextlib.contextmanager
    def env_applied(self) -> Iterator[LocalAws]:
        """`apply_env` for a with block; afterwards the variables are as they were."""
        saved = {name: os.environ.get(name) for name in self.env()}
        self.apply_env()
        try:
            yield self
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def stop(self) -> None:
        """SIGTERM our processes, SIGKILL whatever is left after a grace period; idempotent.

        kinesis-local, once it has served requests, ignores SIGTERM for many seconds
        and keeps nothing worth flushing, so it only gets a short grace. Pids are forgotten
        afterwards, so a second call does nothing.
        """
        grace_s = 0.5 if self.kinesis_flavour == "kinesis-local" else 5.0
        live = [pid for pid in self.pids if _alive(pid) and _is_ours(pid)]
        for pid in live:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while live and time.monotonic() < deadline:
            time.sleep(0.05)
            live = [pid for pid in live if _alive(pid)]
        for pid in live:
            _signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while live and time.monotonic() < deadline:
            time.sleep(0.02)
            live = [pid for pid in live if _alive(pid)]
        for proc in self._procs:
            proc.poll()  # records the exit status, so Popen does not warn "still running"
        self._procs.clear()
        self.pids = []

    def to_json(self) -> str:
        """Serialise so another process (e.g. `shardless local stop`) can use or stop these."""
        names = ("kinesis_endpoint", "s3_endpoint", "dynamodb_endpoint", "kinesis_flavour", "pids")
        return json.dumps({name: getattr(self, name) for name in names}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> LocalAws:
        """Rebuild from `to_json`; stop() then works from any process, pids permitting."""
        data = json.loads(text)
        return cls(
            kinesis_endpoint=data["kinesis_endpoint"],
            s3_endpoint=data["s3_endpoint"],
            dynamodb_endpoint=data["dynamodb_endpoint"],
            kinesis_flavour=data["kinesis_flavour"],
            pids=[int(pid) for pid in data["pids"]],
        )


def tools_dir() -> Path:
    """Where the npm emulators live: $SHARDLESS_TOOLS_DIR if set, else the first `.tools` folder
    containing node_modules found walking up from the current working directory, else from this
    file's location.

    Walking up from the working directory lets a checkout's own `.tools` win when the package is
    installed elsewhere; the file-based fallback covers running from any directory.
    """
    if override := os.environ.get("SHARDLESS_TOOLS_DIR"):
        return Path(override)
    here = Path(__file__).resolve()
    for start_dir in (Path.cwd().resolve(), here.parent):
        for folder in (start_dir, *start_dir.parents):
            if (folder / ".tools" / "node_modules").is_dir():
                return folder / ".tools"
    return here.parents[2] / ".tools"  # does not exist; named in the "run make setup" error


_KINESALITE_LOOPBACK = """
const [pkg, port, host] = process.argv.slice(1);
const options = {createStreamMs: 20, updateStreamMs: 20, deleteStreamMs: 20, shardLimit: 100};
require(pkg + "/index.js")(options).listen(Number(port), host, () =>
  console.log("Listening at http://" + host + ":" + port));
"""


def start(
    kinesis: str = "kinesalite", *, log_dir: Path | None = None, timeout_s: float = 60
) -> LocalAws:
    """Start moto server (S3 + DynamoDB; one process serves both) and the chosen Kinesis emulator.

    Both start in parallel and are polled until they answer. On any failure, whatever was
    already started is stopped before the error is raised, so callers never leak processes.
    """
    if kinesis not in KINESIS_FLAVOURS:
        raise LocalAwsError(f"unknown Kinesis emulator {kinesis!r}: use one of {KINESIS_FLAVOURS}")
    node = shutil.which("node")
    if node is None:
        raise LocalAwsError("node not found on PATH: install Node 18+")
    package = tools_dir() / "node_modules" / kinesis
    main_file = package / ("index.js" if kinesis == "kinesalite" else "main.js")
    if not main_file.is_file():
        raise LocalAwsError(f"{kinesis} not found under {tools_dir()}: run `make setup`")

    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="shardless-local-"))
    logs.mkdir(parents=True, exist_ok=True)
    moto_port, kinesis_port, tls_port = _free_ports(3)
    aws = LocalAws(
        kinesis_endpoint=f"http://{HOST}:{kinesis_port}",
        s3_endpoint=f"http://{HOST}:{moto_port}",
        dynamodb_endpoint=f"http://{HOST}:{moto_port}",
        kinesis_flavour=kinesis,
        pids=[],
    )
    if kinesis == "kinesalite":
        # kinesalite's cli.js listens on every interface; its library lets us bind loopback.
        kinesis_cmd = [node, "-e", _KINESALITE_LOOPBACK, str(package), str(kinesis_port), HOST]
        kinesis_env: dict[str, str] = {}
    else:
        kinesis_cmd = [node, str(main_file)]
        kinesis_env = {
            **_KINESIS_LOCAL_ENV,
            "KINESIS_MOCK_CERT_PATH": str(package / "server.json"),  # it dies without one
            "KINESIS_MOCK_PLAIN_PORT": str(kinesis_port),
            "KINESIS_MOCK_TLS_PORT": str(tls_port),
        }
    moto_cmd = [
        sys.executable,
        "-m",
        "shardless.processor.local.moto_server",
        "-H",
        HOST,
        "-p",
        str(moto_port),
    ]
    try:
        moto_log, kinesis_log = logs / "moto.log", logs / f"{kinesis}.log"
        moto = _spawn(aws, moto_cmd, moto_log, {})
        emulator = _spawn(aws, kinesis_cmd, kinesis_log, kinesis_env)
        deadline = time.monotonic() + timeout_s
        moto_probe = _moto_probe(aws.s3_endpoint)
        _wait_ready("moto server", moto, moto_log, aws.s3_endpoint, moto_probe, deadline)
        kinesis_probe = _kinesis_probe(aws.kinesis_endpoint)
        _wait_ready(kinesis, emulator, kinesis_log, aws.kinesis_endpoint, kinesis_probe, deadline)
    except BaseException:  # including Ctrl-C: never leave half a set of emulators behind
        aws.stop()
        raise
    return aws


def _free_ports(count: int) -> list[int]:
    """Ports the OS says are free now; sockets stay open together so the ports are distinct."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((HOST, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _spawn(
    aws: LocalAws, cmd: list[str], log_path: Path, extra_env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """Start one emulator in its own session (a terminal Ctrl-C must not kill it half-way)."""
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **extra_env},
            start_new_session=True,
        )
    aws._procs.append(proc)
    aws.pids.append(proc.pid)
    return proc


def _wait_ready(
    name: str,
    proc: subprocess.Popen[bytes],
    log_path: Path,
    endpoint: str,
    probe: Callable[[], bool],
    deadline: float,
) -> None:
    """Poll `probe` every 0.1 s; fail fast with the log tail if the process dies."""
    while True:
        if proc.poll() is not None:
            raise LocalAwsError(
                f"{name} exited with code {proc.returncode} during startup "
                f"(log {log_path}):\n{_tail(log_path)}"
            )
        if probe():
            return
        if time.monotonic() > deadline:
            raise LocalAwsError(
                f"{name} did not answer on {endpoint} in time; raise timeout_s or read "
                f"{log_path}:\n{_tail(log_path)}"
            )
        time.sleep(0.1)


def _moto_probe(endpoint: str) -> Callable[[], bool]:
    # An empty ProxyHandler: an HTTP(S)_PROXY in the environment must not see local traffic.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def probe() -> bool:
        try:
            with opener.open(f"{endpoint}/moto-api/", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True  # any HTTP answer means the server is up
        except OSError:
            return False

    return probe


def _kinesis_probe(endpoint: str) -> Callable[[], bool]:
    client = boto3.session.Session().client(
        "kinesis",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(
            connect_timeout=0.5,
            read_timeout=2,
            retries={"total_max_attempts": 1},
            proxies={},
        ),
    )

    def probe() -> bool:
        try:
            client.list_streams()
            return True
        except (BotoCoreError, ClientError):
            return False

    return probe


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(log unreadable: {exc})"


def _alive(pid: int) -> bool:
    """True while `pid` exists; reaps it first if it is our exited child (else it'd linger)."""
    with contextlib.suppress(ChildProcessError):  # not our child: nothing to reap
        os.waitpid(pid, os.WNOHANG)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # someone else's process now; certainly not ours to stop
    return True


def _is_ours(pid: int) -> bool:
    """Whether `pid` still runs an emulator command line (Linux; assumed elsewhere)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return not Path("/proc/self").exists()
    except OSError:
        return False
    return any(marker in cmdline for marker in _OUR_COMMANDS)


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
