"""The measurement behind a progress display: how fast a step goes, and when it will end, once that is known.

A `Meter` takes the amount done so far each time a step reports and answers two questions honestly:

- `rate`: the amount per second over the last `WINDOW` seconds, or None until `RATE_MIN_SECONDS` of the
  step have been measured (two updates a few milliseconds apart are no rate).
- `eta`: seconds left at that rate, or None until `ETA_MIN_SECONDS` have passed and the amount has grown
  in at least `ETA_MIN_ADVANCES` updates (one burst, such as chunks found in the cache at once, is no
  estimate), and None again while nothing moves (a stalled transfer has no end time).

Nothing is ever extrapolated from less than that: no figure is better than a made-up one.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

#: Seconds of history the current rate is taken over.
WINDOW = 20.0
#: No rate before the step has been measured this long.
RATE_MIN_SECONDS = 1.0
#: No time left before the step has been measured this long ...
ETA_MIN_SECONDS = 3.0
#: ... and before the amount done has grown in this many updates.
ETA_MIN_ADVANCES = 2


class Meter:
    """Samples of (time, amount done) for one step; thread-safe (one thread updates, another draws)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self._samples: deque[tuple[float, float]] = deque([(self.started, 0.0)])
        self._advances = 0
        self._lock = threading.Lock()

    @property
    def done(self) -> float:
        with self._lock:
            return self._samples[-1][1]

    def elapsed(self) -> float:
        return self.clock() - self.started

    def add(self, done: float) -> None:
        """Record the amount done now."""
        now = self.clock()
        with self._lock:
            last = self._samples[-1][1]
            if done < last:
                # Counted again from less (the step restarted): what was measured says nothing now.
                self._samples.clear()
                self._advances = 0
            elif done > last:
                self._advances += 1
            self._samples.append((now, done))
            self._trim(now)

    def _trim(self, now: float) -> None:
        # Keep the newest sample at or before the window's start as the baseline of the rate.
        while len(self._samples) > 1 and self._samples[1][0] <= now - WINDOW:
            self._samples.popleft()

    def rate(self) -> float | None:
        """Amount per second over the last `WINDOW` seconds; None while not yet measurable."""
        now = self.clock()
        with self._lock:
            self._trim(now)
            if now - self.started < RATE_MIN_SECONDS or self._advances == 0:
                return None
            since, base = self._samples[0]
            span = now - since
            return (self._samples[-1][1] - base) / span if span > 0 else None

    def eta(self, total: float) -> float | None:
        """Seconds until ``total`` is done at the current rate; None while that cannot be told."""
        if total <= 0 or self.done >= total:
            return None
        if self.elapsed() < ETA_MIN_SECONDS or self._advances < ETA_MIN_ADVANCES:
            return None
        rate = self.rate()
        if not rate or rate <= 0:
            return None
        return (total - self.done) / rate

    def average(self) -> float | None:
        """Amount per second over the whole step (for its summary); None if it was too short to tell."""
        elapsed = self.elapsed()
        if elapsed < RATE_MIN_SECONDS:
            return None
        return self.done / elapsed
