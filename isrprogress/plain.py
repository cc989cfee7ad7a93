"""Progress as plain lines, for output that is not a terminal (a pipe, a file, a service's log).

No control codes and no redrawing: a message is a line; a bar is a line every `every` seconds while it
runs (so a short step shows only its summary) and its summary line when it ends.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .bar import Bar

#: Seconds between two lines of a running bar.
EVERY = 10.0


class PlainReporter:
    """Messages and bars as lines through ``write`` (one call a line, without its newline)."""

    def __init__(self, write: Callable[[str], None], *, every: float = EVERY, indent: str = "  ",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.write = write
        self.every = every
        self.indent = indent
        self.clock = clock

    def say(self, text: str) -> None:
        self.write(text)

    def progress(self, label: str, total: int, unit: str = "B") -> Bar:
        return _PlainBar(self, label, total, unit)


class _PlainBar(Bar):
    def __init__(self, reporter: PlainReporter, label: str, total: int, unit: str) -> None:
        super().__init__(label, total, unit, reporter.clock)
        self.reporter = reporter
        self._written = self.meter.started
        self._lock = threading.Lock()

    def _changed(self) -> None:
        now = self.reporter.clock()
        with self._lock:
            if now - self._written < self.reporter.every:
                return
            self._written = now
        self.reporter.write(self.reporter.indent + self.line())

    def _ended(self, note: str) -> None:
        self.reporter.write(self.reporter.indent + self.summary(note))


class LogReporter(PlainReporter):
    """Messages and progress as log records at INFO, for a service's log (`isr schedule run`)."""

    def __init__(self, logger: logging.Logger, every: float = EVERY) -> None:
        super().__init__(lambda text: logger.info("%s", text.strip()), every=every, indent="")
        self.logger = logger
