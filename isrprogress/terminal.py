"""Messages and progress for a person at `isr` or `isr-admin`: live bars on a terminal, plain lines elsewhere.

On a terminal (``out`` is a tty and TERM is not "dumb") the bars are drawn by rich below the messages,
with the amount done of the total, the rate and the time left (each shown once `Meter` can tell it); a
bar that ends is replaced by its summary line. Anywhere else the output is `PlainReporter`'s: lines, no
control codes. ``quiet`` shows nothing at all (errors are the caller's, on stderr).

The drawing is `richview`'s, imported only on a terminal (rich is slow to load).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from .bar import Bar
from .plain import EVERY, PlainReporter

if TYPE_CHECKING:
    from .richview import LiveBars, LiveText


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal that can redraw a line."""
    try:
        return stream.isatty() and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):
        return False


class TerminalReporter:
    """Messages and bars on ``out`` (stdout): live bars when it is a terminal (``interactive``), plain
    lines otherwise."""

    def __init__(self, out: TextIO | None = None, *, quiet: bool = False, interactive: bool | None = None,
                 every: float = EVERY, clock: Callable[[], float] = time.monotonic) -> None:
        self.out = out if out is not None else sys.stdout
        self.quiet = quiet
        self.interactive = is_terminal(self.out) if interactive is None else interactive
        self._lock = threading.Lock()
        self._plain = PlainReporter(self._print, every=every, clock=clock)
        self._live: LiveBars | None = None
        if self.interactive and not quiet:
            from .richview import LiveBars

            self._live = LiveBars(self.out, redirect_stderr=is_terminal(sys.stderr))

    def _print(self, text: str) -> None:
        with self._lock:
            print(text, file=self.out, flush=True)

    def say(self, text: str) -> None:
        if self.quiet:
            return
        if self._live is not None:
            self._live.print(text)
        else:
            self._print(text)

    def progress(self, label: str, total: int, unit: str = "B") -> Bar:
        if self.quiet:
            return Bar(label, total, unit)
        if self._live is not None:
            return self._live.bar(label, total, unit)
        return self._plain.progress(label, total, unit)


class LiveView:
    """A view that is redrawn in place on a terminal (`isr stat --watch`), one line per update elsewhere.

    ``show(lines, line)`` replaces the view with ``lines`` when ``out`` is a terminal (``interactive``) and
    prints ``line`` otherwise. Use it as a context manager: leaving it keeps the last view on the screen.
    """

    def __init__(self, out: TextIO | None = None, *, interactive: bool | None = None) -> None:
        self.out = out if out is not None else sys.stdout
        self.interactive = is_terminal(self.out) if interactive is None else interactive
        self._live: LiveText | None = None

    def __enter__(self) -> LiveView:
        if self.interactive:
            from .richview import LiveText

            self._live = LiveText(self.out)
        return self

    def show(self, lines: list[str], line: str) -> None:
        if self._live is not None:
            self._live.show(lines)
        else:
            print(line, file=self.out, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
