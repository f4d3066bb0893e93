"""The Python process a group's batch runs in: the garbage collector paused for the batch,
optional profiling, and whether another process is alive. Used by the group runner in a
Spark Python worker and by a group's owner process alike."""

from __future__ import annotations

import contextlib
import cProfile
import gc
import os
from collections.abc import Iterator
from pathlib import Path

PROFILE_ENV = "SHARDLESS_PROFILE_DIR"


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Python's cyclic garbage collector paused for a group's batch.

    A batch allocates a few objects per record that live until its commit (events, the
    transaction's reads and writes), so the collector would run its full pass, over every
    object of a Python worker holding pandas, Arrow and PySpark, several times a batch
    (`docs/benchmarks.md`, "Measurements behind the code"). Reference counting still frees what the
    batch drops; the cycles it leaves wait for the collector's next pass after the batch.
    The objects alive after the first batch (modules, handler, caches) are frozen out of
    later passes."""
    global _frozen
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        if not _frozen:
            gc.collect()
            gc.freeze()
            _frozen = True


_frozen = False


@contextlib.contextmanager
def profiled(group: int, batch: int) -> Iterator[None]:
    """cProfile the block into `$SHARDLESS_PROFILE_DIR/g<group>-b<batch>-p<pid>.prof` when
    that variable is set (in a Python worker or a group's owner process alike)."""
    profile_dir = os.environ.get(PROFILE_ENV)
    if not profile_dir:
        yield
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(f"{profile_dir}/g{group}-b{batch}-p{os.getpid()}.prof")
