#!/usr/bin/env python3
"""Regenerate the screenshots in this directory from the real pages.

Runs tests/test_web_browser.py (a real isr-server and headless Chromium) with ISR_UPDATE_SCREENSHOTS=1,
which copies the test's screenshots here under the same names. Run from anywhere after ./bootstrap setup.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TOP = Path(__file__).resolve().parents[2]


def main() -> int:
    python = TOP / ".venv" / "bin" / "python"
    if not python.exists():
        print(f"make.py: {python} is missing: run ./bootstrap setup first", file=sys.stderr)
        return 1
    env = dict(os.environ, ISR_UPDATE_SCREENSHOTS="1")
    return subprocess.run([str(python), "-m", "pytest", "-q", "tests/test_web_browser.py"], cwd=TOP, env=env,
                          timeout=600).returncode


if __name__ == "__main__":
    sys.exit(main())
