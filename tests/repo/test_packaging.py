"""One import name: the project installs as `shardless` alone, and nothing in the repository
imports the folders by their own names (`processor`, `changelog`, `state`)."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
    """Built from a copy of the tracked files (setuptools builds in the source folder)."""
    src = tmp_path / "src"
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in tracked:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    out = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(src)],
        check=True,
    )
    (wheel,) = out.glob("shardless-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"shardless"}
    for module in (
        "shardless/processor/cli.py",
        "shardless/processor/runtime/group_runner.py",
        "shardless/changelog/durable.py",
        "shardless/state/store.py",
    ):
        assert module in names


def test_the_readme_and_architecture_name_every_room():
    """Each package folder has its line in README.md's Layout and docs/architecture.md."""
    readme = (ROOT / "README.md").read_text()
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    rooms = sorted(
        f"`{init.parent.relative_to(ROOT)}/`"
        for top in FOLDERS
        for init in (ROOT / top).rglob("__init__.py")
        if init.parent.parent.name in FOLDERS or init.parent.name in ("changelog", "state")
    )
    assert [r for r in rooms if r not in readme] == []
    assert [r for r in rooms if r not in architecture] == []


# Dotted names that are not modules: a file name, a logger, this file's own examples.
NOT_MODULES = {"shardless.zip", "shardless.demo", "shardless.__all__", "shardless.nope"}


def test_every_shardless_name_in_code_strings_and_docs_resolves():
    """Docs, docstrings, `-m` commands and code run in subprocesses name modules by dotted
    path; after a move, each must still name something that exists."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.py", "*.md"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    broken = []
    for f in tracked:
        if not (ROOT / f).exists():
            continue
        text = (ROOT / f).read_text()
        names = set(re.findall(r"(?<![\w.])(shardless(?:\.\w+)+)", text))
        for module, imported in re.findall(r"from (shardless[\w.]*) import ([\w, ]+)", text):
            names |= {
                f"{module}.{n.split(' as ')[0].strip()}" for n in imported.split(",") if n.strip()
            }
        for name in names:
            if name not in NOT_MODULES and not _resolves(name):
                broken.append(f"{f}: {name}")
    assert broken == []


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_tests_mirror_the_tree():
    """Unit tests sit in the folder of what they test (tests/changelog/ for changelog/, ...);
    end-to-end, benchmark-harness and repository tests each have their own folder."""
    tests = ROOT / "tests"
    own = {"e2e", "bench", "repo"}
    loose = sorted(p.name for p in tests.glob("test_*.py"))
    assert loose == [], "every test file belongs in a folder"
    for folder in sorted({p.parent for p in tests.rglob("test_*.py")}):
        room = folder.relative_to(tests)
        assert room.parts[0] in own or (ROOT / room).is_dir(), f"tests/{room} mirrors no folder"
        assert (folder / "__init__.py").exists(), f"tests/{room} has no __init__.py"


DEV_ONLY = {"moto", "pytest", "hypothesis", "aws_kinesis_agg", "matplotlib"}
# The moto fixes patch moto itself; nothing else in the product may need a dev package.
NEEDS_DEV = {"processor/local/moto_server.py"}


def test_the_product_imports_no_dev_only_package():
    import ast

    found = []
    for top in FOLDERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names = [node.module]
                if any(n.split(".")[0] in DEV_ONLY for n in names) and rel not in NEEDS_DEV:
                    found.append(f"{rel}:{node.lineno}")
    assert found == []


def test_files_the_code_finds_beside_itself_exist():
    """Paths built from a module's own place (`Path(__file__).parents[n]`) break silently
    when the module moves: each must still name what it meant."""
    from shardless.processor.local import demo
    from shardless.processor.local.faults import driver

    assert demo.APP_FILE.is_file()
    assert (driver.REPO / "pyproject.toml").is_file()
    assert driver._BATCH_LINE.search(
        'INFO shardless.processor.driver.job: batch {"batch_id": 0}'
    ), "the batch line the driver logs (its logger is the module's name)"
    from shardless.processor.driver import job

    assert job.log.name == "shardless.processor.driver.job"
