"""Fixtures shared by the whole pytest suite.

Area-specific fixtures live in the test modules (or in a tests/<area>_fixtures.py module they import);
this file holds only what every area needs.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

SOURCE_DIR = Path(__file__).resolve().parent.parent

T = TypeVar("T")


def wait_until(probe: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``probe`` until it returns something truthy (returned); fail the test after ``timeout`` s.

    The one way tests wait for a condition: never a bare sleep.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def _build_dir() -> Path:
    return Path(os.environ.get("ISR_BUILD_DIR", SOURCE_DIR / "build")).resolve()


def pytest_report_header(config):
    """Print the versions of the real components the suite runs against (as curl's tests do)."""
    lines = [f"isr build dir: {_build_dir()}", f"kernel: {platform.release()}"]
    for cmd in (["qemu-system-x86_64", "--version"], ["fusermount3", "--version"], ["openssl", "version"]):
        if shutil.which(cmd[0]):
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            lines.append((out.stdout or out.stderr).splitlines()[0].strip())
    return lines


@pytest.fixture(scope="session")
def build_dir() -> Path:
    """The meson build directory holding vulpes and its tools; the suite fails if it is not built."""
    path = _build_dir()
    if not (path / "build.ninja").exists():
        pytest.fail(f"no meson build in {path}: run ./bootstrap setup first")
    return path


@pytest.fixture(scope="session")
def source_dir() -> Path:
    return SOURCE_DIR
