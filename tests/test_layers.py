"""The layering contracts of pyproject.toml ([tool.importlinter]) hold, and the checker does catch a breach.

parcels/ (the format) and isrprogress/ (progress output) import nothing of ours; isrctl/ and server/ build on
them and never import each other; tools/ may import anything. doc/README.md draws the same picture.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SOURCE_DIR

PACKAGES = ("parcels", "isrprogress", "isrctl", "server", "tools")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--config", "pyproject.toml",
                           "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_are_kept() -> None:
    proc = lint_imports(SOURCE_DIR)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " 0 broken" in proc.stdout


@pytest.mark.parametrize("module, line", [
    ("parcels/errors.py", "import isrctl.errors"),
    ("isrctl/errors.py", "import server.errors"),
    ("server/errors.py", "import tools.guest"),
    ("isrprogress/__init__.py", "import parcels.errors"),
])
def test_a_forbidden_import_breaks_a_contract(tmp_path: Path, module: str, line: str) -> None:
    for name in PACKAGES:
        shutil.copytree(SOURCE_DIR / name, tmp_path / name,
                        ignore=lambda _dir, names: [n for n in names if n == "__pycache__"
                                                    or (not n.endswith(".py") and "." in n)])
    shutil.copy(SOURCE_DIR / "pyproject.toml", tmp_path / "pyproject.toml")
    with (tmp_path / module).open("a") as f:
        f.write(f"\n{line}  # a breach planted by tests/test_layers.py\n")
    proc = lint_imports(tmp_path)
    assert proc.returncode != 0, proc.stdout
    assert "BROKEN" in proc.stdout
