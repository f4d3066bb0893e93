"""What the benchmarks' command lines share: running against emulators started for the run,
and printing the result as JSON or as lines a person reads."""

from __future__ import annotations

import json
import logging
import signal
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shardless.processor.local import emulators as local_aws


def quiet() -> None:
    """Warnings and worse to stderr; a SIGTERM exits through `finally` blocks, so the
    emulators a benchmark started are stopped when it is killed."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


@contextmanager
def emulated_aws(prefix: str, kind: str = "kinesalite") -> Iterator[tuple[Path, Any]]:
    """A temporary folder, and the emulators started with their logs in its `local-aws`
    and their endpoints in this process's environment; afterwards the emulators are
    stopped, the folder removed and the environment as it was."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        emulators = local_aws.start(kind, log_dir=Path(tmp, "local-aws"))
        try:
            with emulators.env_applied():
                yield Path(tmp), emulators
        finally:
            emulators.stop()


def print_result(
    out: dict[str, Any], as_json: bool, skip: Iterable[str] = ("runs", "config")
) -> None:
    """`out` as one JSON object, or one `name: value` line per key not in `skip`."""
    if as_json:
        print(json.dumps(out, indent=2))
        return
    left_out = set(skip)
    for name, value in out.items():
        if name not in left_out:
            print(f"{name}: {value}")


def print_figures(out: dict[str, Any], as_json: bool, width: int = 40, digits: int = 3) -> None:
    """`out` as one JSON object, or its numbers, its goals (`out["goals"]`: value, target,
    met) and its `config`, one per line, aligned."""
    if as_json:
        print(json.dumps(out, indent=2))
        return
    for name, value in out.items():
        if isinstance(value, int | float):
            print(f"{name:{width}} {value:>14,.{digits}f}")
    for name, goal in out["goals"].items():
        met = "met" if goal["met"] else "NOT met"
        print(
            f"goal {name:{width - 5}} {goal['value']:>14,.{digits}f}  "
            f"target {goal['target']:,}  {met}"
        )
    print("config", json.dumps(out["config"]))
