"""A one-line progress bar on stderr for long admin operations (only when stderr is a terminal)."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``label [#####     ]  45% 1234/2711`` redrawn at most ten times a second; `close` ends the line."""

    def __init__(self, label: str, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._last = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        fraction = done / total if total else 1.0
        width = 30
        filled = int(fraction * width)
        self.stream.write(f"\r{self.label} [{'#' * filled}{' ' * (width - filled)}] {fraction:4.0%} {done}/{total}")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def human_size(n: int | None) -> str:
    """A byte count for people: ``812 B``, ``1.5 MiB``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
