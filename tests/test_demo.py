"""README command 1 runs `python -m tools.demo`: it must keep working as the project grows."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import SOURCE_DIR


@pytest.mark.timeout(600)
def test_demo_runs_to_the_end() -> None:
    proc = subprocess.run([sys.executable, "-m", "tools.demo"], cwd=SOURCE_DIR, capture_output=True,
                          text=True, timeout=540)
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout}\n{proc.stderr}"
    assert "digest matches the one computed on the host" in proc.stdout
    assert "committed version 2 of demo" in proc.stdout
    assert "RAM token still there" in proc.stdout
    assert "committed version 3 of demo" in proc.stdout
    assert "Done." in proc.stdout
