"""Messages and progress for a person at `isr` or `isr-admin`: live bars on a terminal, plain lines elsewhere.

On a terminal (``out`` is a tty and TERM is not "dumb") the bars are drawn by rich below the messages,
with the amount done of the total, the rate and the time left (each shown once `Meter` can tell it); a
bar that ends is replaced by its summary line. Anywhere else the output is `PlainReporter`'s: lines, no
control codes. ``quiet`` shows nothing at all (errors are the caller's, on stderr).

This is the only module that knows rich.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, ProgressColumn, Task, TaskID, TextColumn
from rich.progress import Progress as RichProgress
from rich.text import Text

from .bar import Bar
from .plain import EVERY, PlainReporter

#: Redraws a second (the machine is shared; a bar needs no more).
REFRESH = 4


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
        self._live = _LiveBars(self.out) if self.interactive and not quiet else None

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
            return _LiveBar(self._live, label, total, unit)
        return self._plain.progress(label, total, unit)


class LiveView:
    """A view that is redrawn in place on a terminal (`isr stat --watch`), one line per update elsewhere.

    ``show(lines, line)`` replaces the view with ``lines`` when ``out`` is a terminal (``interactive``) and
    prints ``line`` otherwise. Use it as a context manager: leaving it keeps the last view on the screen.
    """

    def __init__(self, out: TextIO | None = None, *, interactive: bool | None = None) -> None:
        self.out = out if out is not None else sys.stdout
        self.interactive = is_terminal(self.out) if interactive is None else interactive
        self._live: Live | None = None

    def __enter__(self) -> LiveView:
        if self.interactive:
            console = Console(file=self.out, force_terminal=True, force_interactive=True, highlight=False)
            self._live = Live(Text(""), console=console, auto_refresh=False)
            self._live.start()
        return self

    def show(self, lines: list[str], line: str) -> None:
        if self._live is not None:
            self._live.update(Text("\n".join(lines)), refresh=True)
        else:
            print(line, file=self.out, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


class _LiveBars:
    """The rich display of one reporter's open bars: started with the first bar, stopped with the last."""

    def __init__(self, out: TextIO) -> None:
        self.console = Console(file=out, force_terminal=True, force_interactive=True, highlight=False,
                               markup=False, emoji=False)
        self._display: RichProgress | None = None
        self._lock = threading.RLock()

    def print(self, text: str) -> None:
        with self._lock:
            # Above the bars while they are drawn; soft_wrap: the terminal folds a long line, not rich.
            self.console.print(Text(text), soft_wrap=True)

    def add(self, bar: _LiveBar) -> TaskID:
        with self._lock:
            if self._display is None:
                self._display = RichProgress(
                    TextColumn("{task.description}", markup=False), BarColumn(), _BarText(Bar.fraction_text),
                    _BarText(Bar.amount_text), _BarText(Bar.rate_text), _BarText(Bar.eta_text),
                    console=self.console, transient=True, refresh_per_second=REFRESH,
                    redirect_stderr=is_terminal(sys.stderr))
                self._display.start()
                # A process that ends without closing its bars must still give back the cursor.
                atexit.register(self._stop)
            return self._display.add_task(bar.label, total=bar.total or None, bar=bar)

    def update(self, task: TaskID, bar: _LiveBar) -> None:
        with self._lock:
            if self._display is not None:
                self._display.update(task, completed=bar.done, total=bar.total or None)

    def remove(self, task: TaskID, summary: str) -> None:
        with self._lock:
            if self._display is not None:
                self._display.remove_task(task)
                if not self._display.tasks:
                    self._stop()
            self.print(summary)

    def _stop(self) -> None:
        with self._lock:
            if self._display is not None:
                self._display.stop()
                self._display = None
                atexit.unregister(self._stop)


class _LiveBar(Bar):
    def __init__(self, display: _LiveBars, label: str, total: int, unit: str) -> None:
        super().__init__(label, total, unit)
        self.display = display
        self.task = display.add(self)

    def _changed(self) -> None:
        self.display.update(self.task, self)

    def _ended(self, note: str) -> None:
        self.display.remove(self.task, "  " + self.summary(note))


class _BarText(ProgressColumn):
    """A column that shows one of the bar's texts (empty while there is nothing true to show)."""

    def __init__(self, text: Callable[[Bar], str]) -> None:
        super().__init__()
        self.text = text

    def render(self, task: Task) -> Text:
        bar = task.fields.get("bar")
        return Text(self.text(bar) if isinstance(bar, Bar) else "")
