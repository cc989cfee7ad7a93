"""What every reporter offers long work: `say` a line, open a `progress` bar. `NullReporter` shows nothing."""
from __future__ import annotations

from types import TracebackType
from typing import Protocol

from .bar import Bar


class Progress(Protocol):
    """One long step: call `update` with the amount done so far, then `close` (or leave its block)."""

    def update(self, done: int, total: int | None = None) -> None: ...

    def close(self, note: str = "") -> None: ...

    def __enter__(self) -> Progress: ...

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...


class Reporter(Protocol):
    """Where messages and progress of long steps go."""

    def say(self, text: str) -> None: ...

    def progress(self, label: str, total: int, unit: str = "B") -> Progress: ...


class NullReporter:
    """Reports nothing (for library callers that do not want output)."""

    def say(self, text: str) -> None:
        pass

    def progress(self, label: str, total: int, unit: str = "B") -> Bar:
        return Bar(label, total, unit)
