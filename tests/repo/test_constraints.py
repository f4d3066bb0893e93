"""constraints.txt pins what a fresh clone installs: it must agree with pyproject.toml and
cover every package the project and its dev extra pull in (`make lock` regenerates it)."""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def constraints(text: str) -> dict[str, str]:
    """name -> version of each `name==version` line; anything else is an error naming it."""
    pins: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        if not sep or not name or not version:
            raise ValueError(f"constraints.txt line {n}: {line!r} is not `name==version`")
        pins[canonicalize_name(name)] = version
    return pins


def closure(root: str, extras: set[str]) -> dict[str, str]:
    """name -> installed version of every distribution `root[extras]` requires, transitively
    (markers evaluated here, as pip does)."""
    found: dict[str, str] = {}
    todo = [(root, extras)]
    while todo:
        name, wanted = todo.pop()
        dist = metadata.distribution(name)
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is not None and not any(
                req.marker.evaluate({"extra": e}) for e in (wanted or {""})
            ):
                continue
            key = canonicalize_name(req.name)
            if key in found:
                continue
            found[key] = metadata.version(req.name)
            todo.append((req.name, set(req.extras)))
    return found


def test_constraints_parse_and_refuse_what_is_not_a_pin() -> None:
    assert constraints("# c\nFoo_Bar==1.0\n\nbaz==2\n") == {"foo-bar": "1.0", "baz": "2"}
    with pytest.raises(ValueError, match=r"line 2: 'foo>=1' is not"):
        constraints("a==1\nfoo>=1\n")


def test_every_pin_in_pyproject_is_the_locked_version() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    locked = constraints((ROOT / "constraints.txt").read_text())
    declared = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        declared += extra
    for raw in declared:
        req = Requirement(raw)
        key = canonicalize_name(req.name)
        assert key in locked, f"{req.name} is in pyproject.toml but not in constraints.txt"
        pinned = [s.version for s in req.specifier if s.operator == "=="]
        if pinned:
            assert locked[key] == pinned[0], (
                f"pyproject.toml pins {req.name}=={pinned[0]}, constraints.txt has "
                f"{locked[key]}: run `make lock`"
            )
        else:
            assert req.specifier.contains(locked[key]), (
                f"constraints.txt has {req.name}=={locked[key]}, outside pyproject.toml's "
                f"{req.specifier}: run `make lock`"
            )


def test_the_suite_runs_on_exactly_the_locked_versions() -> None:
    text = (ROOT / "constraints.txt").read_text()
    made = re.search(r"\(Python (\d+)\.(\d+)", text)
    assert made, "constraints.txt does not say which Python `make lock` ran on"
    if (int(made[1]), int(made[2])) != sys.version_info[:2]:
        pytest.skip(f"constraints.txt was made on Python {made[1]}.{made[2]}: markers may differ")
    locked = constraints(text)
    installed = closure("shardless", {"dev"})
    assert installed, "shardless is not installed with its dev extra"
    missing = sorted(set(installed) - set(locked))
    assert not missing, f"not in constraints.txt (run `make lock`): {missing}"
    differ = {k: (v, locked[k]) for k, v in installed.items() if v != locked[k]}
    assert not differ, f"installed differs from constraints.txt (installed, locked): {differ}"
