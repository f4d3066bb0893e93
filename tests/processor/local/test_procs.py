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
import time
while time.process_time() < 0.5:
    pass
print("spun", flush=True)
time.sleep(30)
"""


def test_cpu_seconds_counts_a_process_busy_time_and_not_its_idle_time() -> None:
    busy = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout is not None and busy.stdout.readline() == "spun\n"
        used = cpu_seconds(busy.pid)
        assert 0.5 <= used <= 1.5  # its 0.5 s of spinning and its start
        time.sleep(0.5)
        assert cpu_seconds(busy.pid) - used < 0.05  # sleeping costs nothing
    finally:
        busy.kill()
        busy.wait()
    assert cpu_seconds(busy.pid) == 0.0  # gone
    assert cpu_seconds(None) == 0.0
    assert cpu_seconds(os.getpid()) > 0
