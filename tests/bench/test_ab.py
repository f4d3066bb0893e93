"""bench.ab runs each side with its own code: a base tree with the one import name gets its
own `shardless.processor`, `.changelog` and `.state`, not this checkout's (which the
editable install would hand it), and a side that would not is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import ab

PYPROJECT = """
[tool.setuptools.package-dir]
"shardless" = "shardless"
"shardless.processor" = "processor"
"shardless.changelog" = "changelog"
"shardless.state" = "state"
"""


def fake_tree(root: Path) -> Path:
    """A tree with the one import name whose packages say where they are."""
    (root / "shardless").mkdir(parents=True)
    (root / "shardless" / "__init__.py").write_text("")
    for name in ("processor", "changelog", "state"):
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(f"TREE = {str(root)!r}\n")
    (root / "pyproject.toml").write_text(PYPROJECT)
    return root


def imported_from(tree: Path) -> list[str]:
    code = (
        "import shardless.processor as p, shardless.changelog as c, shardless.state as s; "
        "print(p.TREE, c.TREE, s.TREE)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.split() if done.returncode == 0 else [done.stderr[-300:]]


def test_a_base_tree_with_the_one_import_name_runs_its_own_packages(tmp_path):
    tree = fake_tree(tmp_path / "base")
    # as checked out, its subpackages would come from this checkout's editable install
    with pytest.raises(SystemExit, match="not from the tree"):
        ab.check_own_code(tree)
    ab.own_code(tree)
    ab.check_own_code(tree)
    assert imported_from(tree) == [str(tree)] * 3
    ab.own_code(tree)  # again: the links are there already


def test_this_checkout_runs_its_own_code():
    ab.check_own_code(ab.ROOT)


def test_a_ratio_to_a_zero_base_is_none():
    assert ab.ratio(3.0, 0.0) is None
    assert ab.ratio(3.0, 2.0) == 1.5
