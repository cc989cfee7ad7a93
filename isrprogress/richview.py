"""What rich draws for `terminal` on a terminal: live bars below the messages, and a view redrawn in place.

This is the only module that knows rich. `terminal` imports it only when its output is a terminal: rich
takes about a fifth of a short `isr` command's start, and a command whose output goes to a pipe or a file
(a script, a service, the benchmarks) never draws with it.
"""
from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from typing import TextIO

from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, ProgressColumn, Task, TaskID, TextColumn
from rich.progress import Progress as RichProgress
from rich.text import Text

from .bar import Bar

#: Redraws a second (the machine is shared; a bar needs no more).
REFRESH = 4


class LiveText:
    """Lines redrawn in place on ``out`` (`terminal.LiveView`), from `__init__` until `stop`."""

    def __init__(self, out: TextIO) -> None:
        console = Console(file=out, force_terminal=True, force_interactive=True, highlight=False)
        self._live = Live(Text(""), console=console, auto_refresh=False)
        self._live.start()

    def show(self, lines: list[str]) -> None:
        self._live.update(Text("\n".join(lines)), refresh=True)

    def stop(self) -> None:
        self._live.stop()


class LiveBars:
    """The rich display of one reporter's open bars: started with the first bar, stopped with the last."""

    def __init__(self, out: TextIO, *, redirect_stderr: bool) -> None:
        self.console = Console(file=out, force_terminal=True, force_interactive=True, highlight=False,
                               markup=False, emoji=False)
        #: stderr is a terminal too: what is written to it goes above the bars (rich redirects it).
        self._redirect_stderr = redirect_stderr
        self._display: RichProgress | None = None
        self._lock = threading.RLock()

    def print(self, text: str) -> None:
        with self._lock:
            # Above the bars while they are drawn; soft_wrap: the terminal folds a long line, not rich.
            self.console.print(Text(text), soft_wrap=True)

    def bar(self, label: str, total: int, unit: str) -> Bar:
        """A new bar drawn here."""
        return _LiveBar(self, label, total, unit)

    def add(self, bar: _LiveBar) -> TaskID:
        with self._lock:
            if self._display is None:
                self._display = RichProgress(
                    TextColumn("{task.description}", markup=False), BarColumn(), _BarText(Bar.fraction_text),
                    _BarText(Bar.amount_text), _BarText(Bar.rate_text), _BarText(Bar.eta_text),
                    console=self.console, transient=True, refresh_per_second=REFRESH,
                    redirect_stderr=self._redirect_stderr)
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
    def __init__(self, display: LiveBars, label: str, total: int, unit: str) -> None:
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
