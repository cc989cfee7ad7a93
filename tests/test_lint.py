"""ruff and mypy pass over the Python code (pyproject.toml [tool.ruff.lint] and [tool.mypy]), and both do catch
what they are there for.

../shared/STYLE.md asks for type hints, checked. ruff finds unused imports and names, undefined names and
syntax errors; mypy checks the annotations, and that every function has them. tests/ itself is not checked
(pytest's fixtures look like redefinitions to pyflakes), but mypy follows bench/'s imports into it.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SOURCE_DIR

CHECKED = ("isrctl", "server", "parcels", "isrprogress", "tools", "bench")


def ruff(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).with_name("ruff")), "check", "--no-cache", "--output-format",
                           "concise", *CHECKED], cwd=root, capture_output=True, text=True, timeout=120)


def mypy(root: Path, cache_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).with_name("mypy")), "--cache-dir", str(cache_dir),
                           "--no-error-summary", *CHECKED], cwd=root, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def mypy_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mypy's cache, kept between runs in pytest's cache directory when there is one (a cold run takes a few
    seconds, a warm one well under a second)."""
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("mypy") if cache is not None else tmp_path_factory.mktemp("mypy")


def test_ruff_finds_nothing() -> None:
    proc = ruff(SOURCE_DIR)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_finds_nothing(mypy_cache: Path) -> None:
    proc = mypy(SOURCE_DIR, mypy_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr


PLANTED = '''

import os as planted_unused_import  # planted by tests/test_lint.py: ruff F401


def planted_without_annotations(x):  # planted by tests/test_lint.py: mypy no-untyped-def
    return x


def planted_type_error() -> int:
    return "not an int"  # planted by tests/test_lint.py: mypy return-value
'''


@pytest.mark.parametrize("module", ["isrctl/errors.py", "server/errors.py", "parcels/errors.py",
                                    "isrprogress/units.py", "tools/chunksim/units.py", "bench/vulpes_common.py"])
def test_planted_errors_are_found(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, module: str) -> None:
    """In a copy of the tree with errors planted in one module of each checked folder (so a folder dropped from
    the checks shows here)."""
    for name in (*CHECKED, "tests"):
        shutil.copytree(SOURCE_DIR / name, tmp_path / name,
                        ignore=lambda _dir, names: [n for n in names if n == "__pycache__"
                                                    or (not n.endswith(".py") and "." in n)])
    shutil.copy(SOURCE_DIR / "pyproject.toml", tmp_path / "pyproject.toml")
    with (tmp_path / module).open("a") as f:
        f.write(PLANTED)
    found = ruff(tmp_path)
    assert found.returncode != 0, found.stdout
    assert f"{module}:" in found.stdout and "F401" in found.stdout, found.stdout
    # One cache for every copy: only the planted module and what imports it are checked again.
    checked = mypy(tmp_path, tmp_path_factory.getbasetemp() / "mypy-planted")
    assert checked.returncode != 0, checked.stdout
    errors = [line for line in checked.stdout.splitlines() if line.startswith(f"{module}:")]
    assert any("[no-untyped-def]" in line for line in errors), checked.stdout
    assert any("[return-value]" in line for line in errors), checked.stdout
    assert len(errors) == 2, checked.stdout
