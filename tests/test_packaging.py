"""One import name: the project installs as `shardless` alone, and nothing in the repository
imports the folders by their own names (`processor`, `changelog`, `state`)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("processor", "changelog", "state")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
BARE = re.compile(r"^\s*(?:from|import)\s+(?:processor|changelog|state)\b", re.M)


def test_every_package_folder_installs_under_shardless():
    folders = {"shardless"} | {
        "shardless." + ".".join(init.parent.relative_to(ROOT).parts)
        for top in FOLDERS
        for init in (ROOT / top).rglob("__init__.py")
    }
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert set(setuptools["packages"]) == folders
    assert setuptools["package-dir"] == {"shardless": "shardless"} | {
        f"shardless.{top}": top for top in FOLDERS
    }
    assert PYPROJECT["project"]["scripts"]["shardless"].startswith("shardless.")


def test_nothing_imports_the_folders_by_their_own_names():
    """A bare `import processor` works only from the repository root (the folder is on the
    path there) and would load a second copy of every module beside `shardless.processor`."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.py", "*.md"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    found = [
        f"{f}:{src[: m.start()].count(chr(10)) + 1}"
        for f in tracked
        if (ROOT / f).exists()
        for src in [(ROOT / f).read_text()]
        for m in BARE.finditer(src)
    ]
    assert found == []


def test_the_front_door_names_what_users_touch():
    import shardless

    for name in shardless.__all__:
        assert getattr(shardless, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        shardless.nope  # noqa: B018


def test_the_state_package_imports_without_spark():
    code = (
        "import sys, shardless.state.store, shardless.changelog.durable;"
        "print('pyspark' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.slow
def test_the_wheel_holds_shardless_alone(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("shardless-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"shardless"}
    for module in (
        "shardless/processor/cli.py",
        "shardless/changelog/durable.py",
        "shardless/state/store.py",
    ):
        assert module in names
