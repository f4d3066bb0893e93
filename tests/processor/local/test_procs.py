"""`procs.cpu_seconds`: the CPU a process has used, which `bench.latency` and
`bench.vs_spark` report for the emulators and the producer."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardless.processor.local.faults.procs import cpu_seconds

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


SPIN = """\
import os, time
while os.times().user < 0.3:  # user time: arithmetic between the checks
    sum(range(100_000))
with open("/dev/zero", "rb", buffering=0) as zero:
    while os.times().system < 0.2:  # system time: the kernel fills the buffer
        zero.read(1 << 20)
t = os.times()
print(t.user, t.system, flush=True)
time.sleep(30)
"""


def test_cpu_seconds_counts_a_process_user_and_system_time_and_not_its_idle_time() -> None:
    busy = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout is not None
        user, system = map(float, busy.stdout.readline().split())
        assert user >= 0.3 and system >= 0.2
        used = cpu_seconds(busy.pid)
        # the kernel's own count of the same process, read the same way: dropping
        # either user or system time misses by 0.2 s or more
        assert abs(used - (user + system)) <= 0.03
        time.sleep(0.5)
        assert cpu_seconds(busy.pid) - used < 0.05  # sleeping costs nothing
    finally:
        busy.kill()
        busy.wait()
    assert cpu_seconds(busy.pid) == 0.0  # gone
    assert cpu_seconds(None) == 0.0
    assert cpu_seconds(os.getpid()) > 0
