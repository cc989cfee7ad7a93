"""Progress across processes: a `JsonReporter` writes what a reporter is told as JSON lines, and a `Replayer`
feeds such lines into a local reporter, where they show as if the work ran there.

A detached `isr` session reports its start to the `isr resume` that spawned it, and a suspend to the
`isr suspend` that asked for it, this way (doc/isrctl.md, the control socket). The lines are
``{"say": TEXT}`` and ``{"progress": {"id", "label", "total", "unit", "done", "end", "note"}}`` (label and
unit in the first line of a bar, end and note in its last).
"""
from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from .bar import Bar
from .reporter import Progress, Reporter

#: Seconds between two progress lines of one bar (the replaying side draws as often as it likes).
SEND_EVERY = 0.1


class JsonReporter:
    """Sends messages and progress as JSON lines through ``write`` (which must not raise; a reader that
    went away is the writer's business)."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self._write = write
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        with self._lock:
            self._write(json.dumps(message) + "\n")

    def say(self, text: str) -> None:
        self.send({"say": text})

    def progress(self, label: str, total: int, unit: str = "B") -> Bar:
        return _JsonBar(self, next(self._ids), label, total, unit)


class _JsonBar(Bar):
    def __init__(self, reporter: JsonReporter, ident: int, label: str, total: int, unit: str) -> None:
        super().__init__(label, total, unit)
        self.reporter = reporter
        self.ident = ident
        self._sent = 0.0
        reporter.send({"progress": {"id": ident, "label": label, "total": total, "unit": unit, "done": 0}})

    def _changed(self) -> None:
        now = time.monotonic()
        if now - self._sent < SEND_EVERY and self.done < self.total:
            return
        self._sent = now
        self.reporter.send({"progress": {"id": self.ident, "done": self.done, "total": self.total}})

    def _ended(self, note: str) -> None:
        self.reporter.send({"progress": {"id": self.ident, "done": self.done, "total": self.total, "end": True,
                                         "note": note}})


class Replayer:
    """Feeds the JSON lines of a `JsonReporter` into a local reporter. Lines that are not reports are
    left to the caller (for example a final result)."""

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self._bars: dict[int, Progress] = {}

    def feed(self, message: dict[str, Any]) -> bool:
        """Handle one decoded line; True if it was a report."""
        if "say" in message:
            self.reporter.say(str(message["say"]))
            return True
        if "progress" in message:
            p = message["progress"]
            ident = int(p.get("id", 0))
            bar = self._bars.get(ident)
            if bar is None:
                bar = self._bars[ident] = self.reporter.progress(str(p.get("label", "")), int(p.get("total", 0)),
                                                                 str(p.get("unit", "B")))
            bar.update(int(p.get("done", 0)), int(p["total"]) if "total" in p else None)
            if p.get("end"):
                bar.close(str(p.get("note", "")))
                del self._bars[ident]
            return True
        return False

    def close(self) -> None:
        """Close the bars whose end never came (the other side went away)."""
        for bar in self._bars.values():
            bar.close("interrupted")
        self._bars.clear()
