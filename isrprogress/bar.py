"""One long step as the person waiting sees it: a label, how much of how much is done, the rate and the ETA.

A `Bar` keeps the state and makes the text; the reporter that made it decides when and where it shows
(`_changed` after each update, `_ended` once at the close). The base class shows nothing, which is what
`NullReporter` hands out.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from types import TracebackType

from .meter import Meter
from .units import human_amount, human_duration, human_rate


class Bar:
    """Call `update` with the amount done so far (and the total when it changes), then `close` once.

    Also a context manager: leaving the block closes the bar, noting an error or an interrupt.
    ``update`` fits where a ``progress(done, total)`` callback is wanted (`parcels.parcel`, `server.ops`).
    """

    def __init__(self, label: str, total: int, unit: str = "B", clock: Callable[[], float] = time.monotonic) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self.meter = Meter(clock)
        self.closed = False

    def update(self, done: int, total: int | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        self.meter.add(done)
        self._changed()

    def close(self, note: str = "") -> None:
        if self.closed:
            return
        self.closed = True
        self._ended(note)

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self.close("interrupted" if issubclass(kind, KeyboardInterrupt) else "failed")

    # --- what a reporter shows ------------------------------------------------------------------

    def fraction(self) -> float | None:
        """Share done, or None while the total is not known."""
        return min(1.0, self.done / self.total) if self.total > 0 else None

    def fraction_text(self) -> str:
        """'45%', or '' while the total is not known."""
        fraction = self.fraction()
        return "" if fraction is None else f"{fraction:.0%}"

    def amount_text(self) -> str:
        """'12.0 MiB of 30.0 MiB', or '12.0 MiB' while the total is not known."""
        done = human_amount(self.done, self.unit)
        return f"{done} of {human_amount(self.total, self.unit)}" if self.total > 0 else done

    def rate_text(self) -> str:
        """'2.1 MiB/s', or '' while the rate is not measurable."""
        rate = self.meter.rate()
        return "" if rate is None else human_rate(rate, self.unit)

    def eta_text(self) -> str:
        """'ETA 9s', or '' while it cannot be told (see `Meter.eta`)."""
        eta = self.meter.eta(self.total)
        # Rounded up: a step that is not done does not have 0 s left.
        return "" if eta is None else f"ETA {human_duration(math.ceil(eta))}"

    def line(self) -> str:
        """The state as one plain line: 'hoarding: 45% 12.0 MiB of 30.0 MiB, 2.1 MiB/s, ETA 9s'."""
        parts = [f"{self.fraction_text()} {self.amount_text()}".strip(), self.rate_text(), self.eta_text()]
        return f"{self.label}: " + ", ".join(p for p in parts if p)

    def summary(self, note: str = "") -> str:
        """The closed step as one line: 'hoarding: 30.0 MiB in 12.3 s (2.4 MiB/s), 240 chunks'."""
        text = f"{self.label}: {human_amount(self.done, self.unit)} in {self.meter.elapsed():.1f} s"
        average = self.meter.average()
        if average is not None and self.done:
            text += f" ({human_rate(average, self.unit)})"
        return text + (f", {note}" if note else "")

    # --- hooks of the reporters -----------------------------------------------------------------

    def _changed(self) -> None:
        """After each update."""

    def _ended(self, note: str) -> None:
        """Once, at the close."""
