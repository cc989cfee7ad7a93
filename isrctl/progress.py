"""What long steps tell the person waiting: messages and progress bars with rate and ETA.

Every long step reports through a `Reporter`:

- `TerminalReporter` prints messages on stdout and draws bars on stderr (only when stderr is a terminal;
  otherwise each bar becomes a single summary line when it ends, so logs and tests stay readable).
- `LogReporter` writes both to a logger, a bar as a line every few seconds (a service's log).
- `JsonReporter` turns the same calls into JSON lines for another process (a detached session reports to
  the `isr resume` that started it; a session reports a suspend to the `isr suspend` that asked), and
  `replay` feeds such lines into a local reporter, where they are drawn as if they were local.
"""
from __future__ import annotations

import itertools
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TextIO

_REDRAW = 0.1
_WIDTH = 24


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _amount(n: float, unit: str) -> str:
    return human_bytes(n) if unit == "B" else f"{n:.0f} {unit}"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"


class Progress(Protocol):
    """One long step: call `update` with the amount done so far, then `close`."""

    def update(self, done: int, total: int | None = None) -> None: ...

    def close(self, note: str = "") -> None: ...


class Reporter(Protocol):
    """Where messages and progress of long steps go."""

    def say(self, text: str) -> None: ...

    def progress(self, label: str, total: int, unit: str = "B") -> Progress: ...


class _TerminalBar:
    def __init__(self, reporter: TerminalReporter, label: str, total: int, unit: str) -> None:
        self.reporter = reporter
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self.started = time.monotonic()
        self._drawn = 0.0
        self._closed = False

    def update(self, done: int, total: int | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        if not self.reporter.interactive:
            return
        now = time.monotonic()
        if now - self._drawn < _REDRAW and done < self.total:
            return
        self._drawn = now
        self.reporter.draw(self.line(now))

    def line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-6)
        fraction = min(1.0, self.done / self.total) if self.total else 1.0
        filled = int(fraction * _WIDTH)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 and self.done < self.total else 0.0
        rate_text = f"{_amount(rate, self.unit)}/s"
        return (f"{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] {fraction:4.0%} "
                f"{_amount(self.done, self.unit)}/{_amount(self.total, self.unit)} {rate_text} ETA {_duration(eta)}")

    def close(self, note: str = "") -> None:
        if self._closed:
            return
        self._closed = True
        elapsed = time.monotonic() - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        summary = f"{self.label}: {_amount(self.done, self.unit)} in {elapsed:.1f} s"
        if self.unit == "B" and self.done:
            summary += f" ({human_bytes(rate)}/s)"
        if note:
            summary += f", {note}"
        self.reporter.end_bar(summary)


class TerminalReporter:
    """Messages on ``out`` (stdout), bars on ``err`` (stderr) when it is a terminal."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None, *, quiet: bool = False,
                 interactive: bool | None = None) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.quiet = quiet
        self.interactive = self.err.isatty() if interactive is None else interactive
        self._lock = threading.Lock()
        self._bar_shown = False

    def say(self, text: str) -> None:
        if self.quiet:
            return
        with self._lock:
            self._clear()
            print(text, file=self.out, flush=True)

    def progress(self, label: str, total: int, unit: str = "B") -> Progress:
        return _TerminalBar(self, label, total, unit)

    def draw(self, line: str) -> None:
        with self._lock:
            self.err.write("\r\033[K" + line)
            self.err.flush()
            self._bar_shown = True

    def end_bar(self, summary: str) -> None:
        with self._lock:
            self._clear()
            if not self.quiet:
                print("  " + summary, file=self.out, flush=True)

    def _clear(self) -> None:
        if self._bar_shown:
            self.err.write("\r\033[K")
            self.err.flush()
            self._bar_shown = False


class LogReporter(TerminalReporter):
    """Messages and progress as log records, for a service's log (`isr schedule run`): a bar becomes a
    line every ``every`` seconds and its summary when it ends."""

    def __init__(self, logger: logging.Logger, every: float = 10.0) -> None:
        super().__init__(interactive=True)
        self.logger = logger
        self.every = every
        self._logged = 0.0

    def say(self, text: str) -> None:
        self.logger.info("%s", text.strip())

    def draw(self, line: str) -> None:
        now = time.monotonic()
        if now - self._logged >= self.every:
            self._logged = now
            self.logger.info("%s", line)

    def end_bar(self, summary: str) -> None:
        self.logger.info("%s", summary)


class NullReporter:
    """Reports nothing (for library callers that do not want output)."""

    def say(self, text: str) -> None:
        pass

    def progress(self, label: str, total: int, unit: str = "B") -> Progress:
        return _NullProgress()


class _NullProgress:
    def update(self, done: int, total: int | None = None) -> None:
        pass

    def close(self, note: str = "") -> None:
        pass


class _JsonBar:
    def __init__(self, reporter: JsonReporter, ident: int, label: str, total: int, unit: str) -> None:
        self.reporter = reporter
        self.ident = ident
        self.total = total
        self.done = 0
        self._sent = 0.0
        self._closed = False
        reporter.send({"progress": {"id": ident, "label": label, "total": total, "unit": unit, "done": 0}})

    def update(self, done: int, total: int | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        now = time.monotonic()
        if now - self._sent < _REDRAW and done < self.total:
            return
        self._sent = now
        self.reporter.send({"progress": {"id": self.ident, "done": done, "total": self.total}})

    def close(self, note: str = "") -> None:
        if not self._closed:
            self._closed = True
            self.reporter.send({"progress": {"id": self.ident, "done": self.done, "total": self.total, "end": True,
                                             "note": note}})


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

    def progress(self, label: str, total: int, unit: str = "B") -> Progress:
        return _JsonBar(self, next(self._ids), label, total, unit)


class Replayer:
    """Feeds the JSON lines of a `JsonReporter` into a local reporter. Lines that are not reports are
    returned to the caller (for example a final result)."""

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
        for bar in self._bars.values():
            bar.close("interrupted")
        self._bars.clear()
