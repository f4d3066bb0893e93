"""`bench.cpu_share`: each process's CPU in its role, JIT compiler threads apart, and what
a span between two readings adds up to."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench import cpu_share
from bench.cpu_share import ROLES, Sample, Snapshot
from shardless.processor.local.faults import procs


def java() -> str:
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home, "bin", "java")) if home else shutil.which("java")
    assert found, "java is needed (Spark needs it too)"
    return found


HOT = """
public class Hot {
    public static void main(String[] args) {
        long x = 0, end = System.nanoTime() + 20_000_000_000L;
        while (System.nanoTime() < end) {
            for (int i = 0; i < 100_000; i++) { x += (i * 31L) ^ x; }
        }
        System.out.println(x);
    }
}
"""


def test_a_busy_jvm_s_compiler_threads_are_read_and_no_other_process_has_any(
    tmp_path: Path,
) -> None:
    source = tmp_path / "Hot.java"
    source.write_text(HOT)
    jvm = subprocess.Popen([java(), str(source)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while cpu_share.jit_seconds(jvm.pid) == 0 and time.monotonic() < deadline:
            assert jvm.poll() is None, "the JVM ended before its compiler threads were seen"
            time.sleep(0.2)
        jit = cpu_share.jit_seconds(jvm.pid)
        total = procs.cpu_seconds(jvm.pid)
        assert 0 < jit <= total
    finally:
        jvm.kill()
        jvm.wait()
    assert cpu_share.jit_seconds(os.getpid()) == 0  # a Python process has none
    assert cpu_share.jit_seconds(jvm.pid) == 0  # gone


SPIN = "import time\nend = time.time() + 30\nwhile time.time() < end:\n    pass\n"
# a child that names itself an executor and starts a spinning child of its own
START = "import subprocess, sys, time\nsubprocess.Popen([sys.executable, *sys.argv[1:{}]])\n"
EXECUTOR = START.format(2) + "time.sleep(30)\n"
DRIVER = START.format("") + "time.sleep(30)\n"


def test_roles_follow_the_process_tree_and_a_span_counts_each_role(tmp_path: Path) -> None:
    """A driver whose child names itself an executor, whose child spins: the spinner's CPU
    counts as the executors' Python's; the emulator's and this process's in their roles."""
    for name, code in (("spin", SPIN), ("executor", EXECUTOR), ("driver", DRIVER)):
        (tmp_path / f"{name}.py").write_text(code)
    spin = str(tmp_path / "spin.py")
    driver = subprocess.Popen(
        [sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "executor.py"), spin,
         "CoarseGrainedExecutorBackend"]
    )  # fmt: skip
    emulator = subprocess.Popen([sys.executable, spin])
    executors: list[int] = []
    spinner: list[int] = []
    try:
        deadline = time.monotonic() + 30
        kinds: dict[int, str] = {}
        while "executor_python" not in kinds.values() and time.monotonic() < deadline:
            time.sleep(0.1)
            found = cpu_share.roles(driver.pid, [emulator.pid], os.getpid())
            kinds = {pid: role for pid, (role, _) in found.items()}
        assert kinds[driver.pid] == "driver"
        assert kinds[emulator.pid] == "emulators"
        assert kinds[os.getpid()] == "producer"
        executors = [pid for pid, role in kinds.items() if role == "executors"]
        spinner = [pid for pid, role in kinds.items() if role == "executor_python"]
        assert len(executors) == len(spinner) == 1, kinds
        before = cpu_share.take(driver.pid, [emulator.pid])
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:  # this process busy too: the producer's share
            pass
        after = cpu_share.take(driver.pid, [emulator.pid])
    finally:
        for p in (driver, emulator):
            p.kill()
            p.wait()
        for pid in [*executors, *spinner]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    used = cpu_share.spent(before, after, cpus=2)
    roles = used["roles"]
    # the two spinners and this loop each had most of a core (2 cores, three busy)
    for role in ("executor_python", "emulators", "producer"):
        assert roles[role]["cpu_s"] > 0.2, used
    assert roles["executors"]["jit_s"] == roles["driver"]["jit_s"] == 0  # no JVM here
    assert used["replacement"]["executors"] == 0  # the executor ran before the first reading
    assert 0.5 < used["host_busy_share"] <= 1.02, used  # clock ticks of 10 ms


def sample(role: str, cpu: float, jit: float = 0.0, started: int = 1) -> Sample:
    return Sample(role, started, cpu, jit)


def test_a_span_counts_new_processes_from_their_start_and_ended_ones_not_at_all() -> None:
    before = Snapshot(100.0, 50.0, {
        1: sample("driver", 10, 2),
        2: sample("executors", 20, 5),  # killed before the second reading
        3: sample("executors", 30, 6),  # the survivor
        4: sample("executor_python", 7),  # pid 4 reused by a new process later
    })  # fmt: skip
    after = Snapshot(110.0, 66.0, {
        1: sample("driver", 11, 2.5),
        3: sample("executors", 34, 6.5),
        4: sample("executor_python", 1.5, started=99),
        5: sample("executors", 8, 3),  # the replacement
        6: sample("emulators", 2),
    })  # fmt: skip
    used = cpu_share.spent(before, after, cpus=2)
    assert used["seconds"] == 10.0
    assert used["host_cpu_s"] == 16.0 and used["host_busy_share"] == 0.8
    roles = used["roles"]
    assert roles["driver"] == {"cpu_s": 1.0, "jit_s": 0.5}
    assert roles["executors"] == {"cpu_s": 12.0, "jit_s": 3.5}
    assert roles["executor_python"]["cpu_s"] == 1.5
    assert roles["emulators"]["cpu_s"] == 2.0
    assert used["replacement"] == {"executors": 1, "cpu_s": 8.0, "jit_s": 3.0}
    # a later span of the same replacement, still new against the reading before the fault
    later = Snapshot(115.0, 70.0, {**after.procs, 5: sample("executors", 10, 4)})
    again = cpu_share.spent(after, later, cpus=2, since=before)
    assert again["replacement"] == {"executors": 1, "cpu_s": 2.0, "jit_s": 1.0}
    assert cpu_share.spent(after, later, cpus=2)["replacement"]["executors"] == 0


@given(
    st.lists(
        st.tuples(st.sampled_from(ROLES), st.floats(0, 100), st.floats(0, 100), st.booleans()),
        max_size=12,
    )
)
def test_every_process_s_seconds_land_in_exactly_one_role(rows) -> None:
    before = {pid: sample(role, cpu) for pid, (role, cpu, _, kept) in enumerate(rows) if kept}
    after = {pid: sample(role, cpu + more) for pid, (role, cpu, more, _) in enumerate(rows)}
    used = cpu_share.spent(Snapshot(0, 0, before), Snapshot(5, 1, after), cpus=2)
    expected = sum(more if kept else cpu + more for _, cpu, more, kept in rows)
    assert sum(r["cpu_s"] for r in used["roles"].values()) == pytest.approx(
        expected, abs=0.01 * len(ROLES) + 1e-6
    )
    new = [r for r in rows if r[0] == "executors" and not r[3]]
    assert used["replacement"]["executors"] == len(new)


def test_the_host_s_busy_time_grows_with_work() -> None:
    first = cpu_share.host_busy_seconds()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        pass
    assert cpu_share.host_busy_seconds() - first >= 0.2
