"""isrprogress: the one progress and output layer of ISR, for every long step of `isr` and `isr-admin`.

Long work reports through a `Reporter`: `say` a line, or open a `progress` bar and `update` it with the
amount done, then `close` it. Which reporter decides how that shows:

- `TerminalReporter`: rich bars with amount, rate and ETA on a terminal; plain lines when stdout is not one;
  nothing with ``quiet``.
- `PlainReporter` / `LogReporter`: plain lines through a function / a logger (a service's log).
- `JsonReporter` / `Replayer`: across processes as JSON lines (a detached `isr` session).
- `NullReporter`: nothing.

`LiveView` redraws a few lines in place on a terminal (a live status), one line per update elsewhere.

A rate and an ETA are shown only once `Meter` has measured enough to tell them. `human_bytes` is the
project's one byte-count formatter. This package imports nothing else of ISR (the layering in
doc/README.md), so the client and the server both build on it. More in README.md beside this file.
"""
from __future__ import annotations

from .bar import Bar
from .meter import Meter
from .plain import LogReporter, PlainReporter
from .relay import JsonReporter, Replayer
from .reporter import NullReporter, Progress, Reporter
from .terminal import LiveView, TerminalReporter, is_terminal
from .units import human_amount, human_bytes, human_duration, human_rate

__all__ = ["Bar", "JsonReporter", "LiveView", "LogReporter", "Meter", "NullReporter", "PlainReporter", "Progress", "Replayer",
           "Reporter", "TerminalReporter", "human_amount", "human_bytes", "human_duration", "human_rate",
           "is_terminal"]
