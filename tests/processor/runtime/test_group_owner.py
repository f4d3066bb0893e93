"""Group owner processes (`--group-owner process`): real owner processes over abstract
Unix sockets, real RocksDB, moto over HTTP; and under Spark `local[2]`, where groups would
otherwise move between the two Python workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from shardless.changelog.durable import DurableState
from shardless.processor.api.handlers import HandlerFactory
from shardless.processor.driver.config import JobConfig
from shardless.processor.errors import ConfigError, ProcessorError
from shardless.processor.runtime import owner
from shardless.processor.runtime.group_runner import GroupRunner, RuntimeConfig
from tests.processor.runtime.test_runtime import (
    KEYS,
    SLICES,
    count_handler,
    durable_counts,
    frame,
    metrics_of,
)

pytestmark = pytest.mark.skipif(not owner.supported(), reason="owner processes need Linux")


def _ppid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no PPid for {pid}")


def _gone(pid: int, within: float = 15.0) -> bool:
    """Whether `pid` ends (or is a zombie, an owner this process started) within `within` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


class OwnedRunner:
    """A GroupRunner whose batches run in the group's owner process, watched by this test
    process (it ends with the test run at the latest)."""

    def __init__(self, location, local_dir: Path, handler=count_handler, idle: int = 60) -> None:
        from pyspark import cloudpickle

        cfg = RuntimeConfig(
            location, SLICES, str(local_dir), group_owner="process", owner_idle_seconds=idle
        )
        self.inner = GroupRunner(HandlerFactory(handler), cfg)
        self.blob = cloudpickle.dumps(self.inner)
        self.local_dir = str(local_dir)
        self.app = location.app
        self.pending: dict = {}

    def run(self, group: int, batch: int, pdf: pd.DataFrame | None) -> pd.DataFrame:
        call = owner.BatchCall(group, "q", batch, pdf, self.pending, 1_000, -1)
        out, self.pending = owner.call(self.inner, self.blob, call, watch=os.getpid())
        return out

    def stop(self, group: int = 0) -> None:
        found = owner.stop(self.local_dir, self.app, group)
        if found is not None:
            assert _gone(found)


@pytest.fixture
def owned(location, tmp_path):
    runners: list[OwnedRunner] = []

    def make(**kw) -> OwnedRunner:
        runners.append(OwnedRunner(location, tmp_path, **kw))
        return runners[-1]

    yield make
    for r in runners:
        r.stop()


def test_an_owner_runs_every_batch_of_its_group_and_keeps_its_stores(location, owned):
    r = owned()
    seen = []
    for batch, lo in enumerate(range(0, 400, 100)):
        m = metrics_of(r.run(0, batch, frame(KEYS[lo : lo + 100], lo)))
        seen.append(m["pid"])
        if batch:  # the stores stayed open in the owner: nothing to catch up
            assert m["restores"] == [] and m["heads_read"] == 0
        assert "owner_request" in m["timings"]
    assert len(set(seen)) == 1 and seen[0] != os.getpid()
    assert owner.pid(r.local_dir, r.app, 0) == seen[0]
    assert "shardless.processor.runtime.owner" in Path(f"/proc/{seen[0]}/cmdline").read_text()
    assert durable_counts(location) == Counter(KEYS)


def test_owners_of_every_group_and_application_fork_from_one_zygote(location, tmp_path):
    """An owner is a fork of its environment's zygote, which did the owner's imports once:
    owners of other groups and applications share it, each in a session of its own."""
    apps = [
        replace(location, app=f"{location.app}-{i}", prefix=f"{location.prefix}-{i}") for i in "ab"
    ]
    first = OwnedRunner(apps[0], tmp_path)
    # groups 0 and 1 of one application, and group 1 of another
    runs = [(first, 0), (first, 1), (OwnedRunner(apps[1], tmp_path), 1)]
    try:
        pids = [metrics_of(r.run(g, 0, None))["pid"] for r, g in runs]
        assert len(set(pids)) == 3 and os.getpid() not in pids
        parents = {_ppid(p) for p in pids}
        assert len(parents) == 1 and os.getpid() not in parents
        (z,) = parents
        assert "owner_process\0zygote" in Path(f"/proc/{z}/cmdline").read_text()
        assert all(os.getsid(p) == p for p in pids)
        # the zygote has what a batch imports: its children did not import it again
        maps = Path(f"/proc/{z}/maps").read_text()
        assert "pandas" in maps and "pyarrow" in maps
    finally:
        for r, g in runs:
            r.stop(g)


def test_a_worker_and_an_owner_taking_turns_keep_every_write(location, owned, tmp_path):
    """Switching a running application between worker-run and owner-run groups is safe: each
    side catches its stores up from the other's commits."""
    r = owned()
    here = GroupRunner(
        HandlerFactory(count_handler), RuntimeConfig(location, SLICES, str(tmp_path))
    )
    r.run(0, 0, frame(KEYS[:100]))
    out, r.pending = here.run(0, "q", 1, frame(KEYS[100:200], 100), r.pending, 1_000)
    assert metrics_of(out)["pid"] == os.getpid()
    m = metrics_of(r.run(0, 2, frame(KEYS[200:], 200)))
    assert m["restores"] and all(
        (x["from_version"], x["to_version"]) == (1, 2) for x in m["restores"]
    )
    assert durable_counts(location) == Counter(KEYS)


def fails_on_seven(event, ctx):
    count_handler(event, ctx)
    if event.key == "user-7":
        raise ValueError("bad record")


def test_a_handler_error_in_the_owner_reaches_the_worker_whole(location, owned):
    r = owned(handler=fails_on_seven)
    with pytest.raises(ProcessorError, match=r"s/shardId-0/\d+\.0 \(key 'user-7', slice \d+"):
        r.run(0, 0, frame(KEYS[:100]))
    assert not any(h.committed for h in DurableState(location).heads(list(range(SLICES))).values())
    assert owner.pid(r.local_dir, r.app, 0) is not None  # the owner lives on


def test_a_killed_owner_is_replaced_and_the_next_one_continues_the_state(location, owned):
    r = owned()
    first = metrics_of(r.run(0, 0, frame(KEYS[:200])))["pid"]
    os.kill(first, signal.SIGKILL)
    assert _gone(first)
    m = metrics_of(r.run(0, 1, frame(KEYS[200:], 200)))
    assert m["pid"] != first
    assert durable_counts(location) == Counter(KEYS)


def dies_once(event, ctx):
    """Kills its own process at the first 'user-5' while a marker file is absent."""
    count_handler(event, ctx)
    marker = Path(os.environ["SHARDLESS_TEST_MARKER"])
    if event.key == "user-5" and not marker.exists():
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)


def always_dies(event, ctx):
    count_handler(event, ctx)
    if event.key == "user-5":
        os.kill(os.getpid(), signal.SIGKILL)


def test_an_owner_dying_mid_batch_is_replaced_within_the_call_and_counts_once(
    location, owned, tmp_path, monkeypatch
):
    monkeypatch.setenv("SHARDLESS_TEST_MARKER", str(tmp_path / "marker"))  # the owner inherits it
    r = owned(handler=dies_once)
    pid = metrics_of(r.run(0, 0, frame(KEYS[:100])))["pid"]  # its first owner dies at user-5
    assert pid != int((tmp_path / "marker").read_text())
    r.run(0, 1, frame(KEYS[100:300], 100))
    r.run(0, 2, frame(KEYS[300:], 300))
    assert durable_counts(location) == Counter(KEYS)


def test_an_owner_dying_twice_fails_the_call_and_commits_nothing_of_the_batch(location, owned):
    r = owned(handler=always_dies)
    with pytest.raises(owner.OwnerError, match=r"group 0's owner process ended during batch 0 tw"):
        r.run(0, 0, frame(["user-5", "user-6"]))
    assert not any(h.committed for h in DurableState(location).heads(list(range(SLICES))).values())


def test_an_owner_exits_when_idle_and_when_its_watched_process_ends(location, tmp_path):
    cfg = RuntimeConfig(location, SLICES, str(tmp_path), group_owner="process")
    from pyspark import cloudpickle

    runner = GroupRunner(HandlerFactory(count_handler), cfg)
    blob = cloudpickle.dumps(runner)
    idle = owner.connect(str(tmp_path), location.app, 1, watch=os.getpid(), idle_seconds=1)
    idle.close()
    pid = owner.pid(str(tmp_path), location.app, 1)
    assert pid is not None and _gone(pid, within=10)

    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        call = owner.BatchCall(2, "q", 0, frame(KEYS[:10]), {}, 1_000, -1)
        out, _ = owner.call(runner, blob, call, watch=watched.pid)
        pid = metrics_of(out)["pid"]
    finally:
        watched.kill()
        watched.wait()
    assert _gone(pid, within=10)


def test_workers_starting_an_owner_at_once_share_one(location, tmp_path):
    pids: list[int | None] = []

    def connect() -> None:
        sock = owner.connect(str(tmp_path), location.app, 3, watch=os.getpid(), idle_seconds=30)
        sock.close()
        pids.append(owner.pid(str(tmp_path), location.app, 3))

    threads = [threading.Thread(target=connect) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(pids) == 4 and len(set(pids)) == 1 and pids[0] is not None
    finally:
        owner.stop(str(tmp_path), location.app, 3)


@pytest.mark.parametrize("zygote", ["1", "0"])
def test_an_owner_that_cannot_start_names_its_log(location, tmp_path, monkeypatch, zygote):
    monkeypatch.setenv(owner.ZYGOTE_ENV, zygote)
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(owner.OwnerError, match=r"group 4's owner process did not start .*g00004"):
        owner.connect(str(tmp_path), location.app, 4, watch=os.getpid(), timeout=5)


def test_group_owner_settings_are_checked():
    base = {"app": "a", "streams": ("s",), "checkpoint": "/tmp/unused"}
    with pytest.raises(ConfigError, match="--group-owner 'host': use auto"):
        JobConfig(**base, group_owner="host")
    with pytest.raises(ConfigError, match="--owner-idle-seconds 0: must be between 1"):
        JobConfig(**base, group_owner="process", owner_idle_seconds=0)
    assert JobConfig(**base, group_owner="process").group_owner == "process"


@pytest.mark.slow
def test_under_local_2_each_group_stays_in_its_owner_and_outputs_equal_the_fold(
    spark, kinesis, make_stream, location, tmp_path
):
    """Spark `local[2]` hands groups to either Python worker; the default `--group-owner
    auto` runs owner processes there, so each group runs in the same process every batch,
    catches nothing up, and the outputs are the plain fold's."""
    from shardless.processor.local import demo
    from tests.e2e.test_end_to_end import produce, run_job
    from tests.jobs import job_config

    stream = make_stream(2)
    cfg = job_config(location, (stream,), tmp_path, max_records_per_shard=150, group_owner="auto")
    produce(kinesis, stream, 1200, seed=5)
    by_group: dict[int, set[int]] = {}
    try:
        reports = run_job(spark, cfg, str(tmp_path / "out"), wipe_after=set())
        assert len(reports) >= 4
        for rep in reports:
            for g, pid in rep.group_pids.items():
                by_group.setdefault(g, set()).add(pid)
        assert len(by_group) == cfg.groups
        for g, pids in by_group.items():
            assert len(pids) == 1, f"group {g} ran in {pids}"
            (pid,) = pids
            assert pid == owner.pid(cfg.local_dir, cfg.app, g)
        assert [r for rep in reports[1:] for r in rep.restored] == []
        expected, total = demo.reference_fold(kinesis, stream)
        assert sum(r.records for r in reports) == total == 1200
        assert demo.check_outputs(spark, str(tmp_path / "out"), expected) == []
    finally:
        for (
            g
        ) in by_group:  # the group keys (`shardless.processor.runtime.grouping`), not 0..groups-1
            owner.stop(cfg.local_dir, cfg.app, g)


# Only a process of the same user may sit at either end of an owner socket: what crosses it
# is pickled. These run a peer as another user, which needs root.
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs a peer as another user")
NOBODY = 65534


def _as_nobody(code: str) -> subprocess.Popen:
    """`code` in a Python child running as uid/gid 65534 (modules imported before: the
    interpreter's own files may not be readable by that user)."""
    prelude = "import os, pickle, socket, struct, sys, time\n"
    prelude += f"os.setgid({NOBODY})\nos.setuid({NOBODY})\n"
    return subprocess.Popen(
        [sys.executable, "-c", prelude + code], stdout=subprocess.PIPE, text=True
    )


@needs_root
def test_a_worker_refuses_an_owner_socket_bound_by_another_user(tmp_path) -> None:
    name = owner.address(str(tmp_path), "app", 3)
    # The squatter answers every caller, and lives on when a caller hangs up first (as
    # `connect` does once it has seen the uid): were it to die of the broken pipe, the name
    # would be free again and `pid` below would find no one there.
    squatter = _as_nobody(
        f"s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        f"s.bind('\\0' + {name!r}); s.listen(4); print('ready', flush=True)\n"
        f"while True:\n    c, _ = s.accept()\n"
        f"    try:\n        c.sendall(b'x' * 8)\n    except OSError:\n        pass\n"
    )
    try:
        assert squatter.stdout.readline().strip() == "ready"
        with pytest.raises(owner.OwnerError, match=r"runs as uid 65534, not as this process"):
            owner.connect(str(tmp_path), "app", 3, watch=os.getpid(), timeout=5)
        with pytest.raises(owner.OwnerError, match="uid 65534"):
            owner.pid(str(tmp_path), "app", 3)
    finally:
        squatter.kill()
        squatter.wait()


@needs_root
def test_an_owner_refuses_a_caller_of_another_user_and_keeps_serving(owned) -> None:  # noqa: ANN001
    runner = owned()
    runner.run(0, 1, frame(["k1"]))  # starts the owner
    pid = owner.pid(runner.local_dir, runner.app, 0)
    name = owner.address(runner.local_dir, runner.app, 0)
    caller = _as_nobody(
        f"s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect('\\0' + {name!r})\n"
        "data = pickle.dumps(('pid', None))\n"
        "try:\n"
        "    s.sendall(struct.pack('!Q', len(data)) + data)\n"
        "    got = s.recv(64)\n"
        "except (BrokenPipeError, ConnectionResetError):  # closed before or after the send\n"
        "    got = b''\n"
        "print('closed' if got == b'' else 'answered', flush=True)\n"
    )
    assert caller.stdout.readline().strip() == "closed"
    assert caller.wait(10) == 0
    assert owner.pid(runner.local_dir, runner.app, 0) == pid  # the same owner, still serving
    log_text = owner.log_path(runner.local_dir, runner.app, 0).read_text()
    assert "runs as uid 65534" in log_text


def test_an_owner_profiles_its_batches_when_asked(owned, monkeypatch, tmp_path) -> None:  # noqa: ANN001
    import pstats

    from shardless.processor.runtime.process import PROFILE_ENV

    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "prof"))  # the owner inherits it
    runner = owned()
    runner.run(0, 1, frame(["k1", "k2"]))
    pid = owner.pid(runner.local_dir, runner.app, 0)
    found = tmp_path / "prof" / f"g0-b1-p{pid}.prof"
    assert found.is_file()  # written by the owner process, named for its group and batch
    functions = {name for _file, _line, name in pstats.Stats(str(found)).stats}
    assert "run_slice" in functions


def test_without_the_zygote_an_owner_is_a_new_interpreter(location, owned, monkeypatch):
    """SHARDLESS_OWNER_ZYGOTE=0: the worker starts the owner itself, as a new interpreter."""
    monkeypatch.setenv(owner.ZYGOTE_ENV, "0")
    r = owned()
    pid = metrics_of(r.run(0, 0, frame(KEYS[:50])))["pid"]
    assert _ppid(pid) == os.getpid() and os.getsid(pid) == pid
    assert Path(f"/proc/{pid}/cmdline").read_text().split("\0")[-4:-1] == [
        owner.address(r.local_dir, r.app, 0),
        str(os.getpid()),
        "60",
    ]
    r.stop()


def test_the_zygotes_imports_include_the_models_of_the_owners_clients():
    """The zygote reads the S3 and DynamoDB models before it forks, so an owner makes its
    clients without reading them; and its imports leave no Python thread running."""
    script = (
        "import threading\n"
        "from shardless.processor.runtime import owner_process\n"
        "owner_process._preload()\n"
        "from shardless.changelog import aws\n"
        "(session,) = aws._sessions.values()\n"
        "read = {k[1] for k in session._loader._cache if k[0] == 'load_service_model'}\n"
        "print(sorted(read), threading.active_count())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['dynamodb',", "'s3']", "1"]
