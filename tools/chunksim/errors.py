"""The exceptions of tools.chunksim: one root, `ChunksimError`; only ``__main__`` turns them into messages."""
from __future__ import annotations

from pathlib import Path


class ChunksimError(Exception):
    """Root of every error tools.chunksim raises on purpose."""


class TraceFormatError(ChunksimError):
    """A trace file cannot be read: names the file and, where there is one, the line."""

    def __init__(self, path: Path | str, message: str, line: int | None = None) -> None:
        self.path = str(path)
        self.line = line
        self.reason = message
        where = f"{self.path} line {line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


class ModelError(ChunksimError):
    """The simulator or the policy model was given parameters it cannot use (a bad size, rate or time)."""


class CaptureError(ChunksimError):
    """Capturing a trace from the test guest failed."""
