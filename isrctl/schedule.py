"""Hoard scheduling from calendars: be ready before the user sits down at this PC.

The fully proactive and eager working-set policies (seed 003) only pay off if the hoard has finished when
the user arrives. This module turns calendars into hoard start times:

1. **Which events mean "here"**: site rules (`SiteRule`) match an event's LOCATION (substring), one of its
   CATEGORIES (equal) or its SUMMARY (regular expression), case-insensitively.
2. **How long a hoard takes**: the bytes this PC still lacks for the parcel's newest version (or only its
   working set), divided by the throughput measured by recent hoards to the server (or an assumed one until
   a hoard has been measured), times ``1 + margin``, plus a fixed ``overhead`` for starting up.
3. **When to start**: ``event start - lead - duration``. If that is already past, start now; if even
   starting now would finish after the event starts, the plan says so ("not enough time").

For one parcel only its earliest upcoming matching event gets a hoard: once that is done, later events need
only what changed since, and the runner re-plans whenever a calendar or the parcel's newest version
changes. `Runner` keeps its state (done hoards, throughput samples) in a JSON file, so it survives restarts.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import re
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from zoneinfo import ZoneInfo

import tomli_w

from . import calendar as ical
from .errors import IsrError

log = logging.getLogger(__name__)

RULE_KINDS = ("location", "category", "summary")
MODES = ("full", "working-set")


class ScheduleError(IsrError):
    """Bad schedule configuration or state (one line that says what to change)."""


@dataclass(frozen=True)
class SiteRule:
    """Events that mean the user will be at this PC."""

    kind: str  # one of RULE_KINDS
    pattern: str

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise ScheduleError(f"unknown site rule kind {self.kind!r}: use one of {', '.join(RULE_KINDS)}")
        if not self.pattern.strip():
            raise ScheduleError("a site rule needs a non-empty pattern")
        if self.kind == "summary":
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ScheduleError(f"summary pattern {self.pattern!r} is not a valid regular expression: "
                                    f"{exc}") from exc

    def matches(self, event: ical.Occurrence) -> bool:
        if self.kind == "location":
            return self.pattern.casefold() in event.location.casefold()
        if self.kind == "category":
            return any(self.pattern.casefold() == c.casefold() for c in event.categories)
        return re.search(self.pattern, event.summary, re.IGNORECASE) is not None

    def __str__(self) -> str:
        return f"{self.kind} {self.pattern!r}"


@dataclass
class ScheduleConfig:
    """What `isr site` and `isr schedule` store, in ``schedule.toml`` next to isr's config."""

    site: str = ""
    rules: list[SiteRule] = field(default_factory=list)
    calendars: list[str] = field(default_factory=list)
    #: Parcels to hoard (names or UUIDs); empty means every parcel of the user.
    parcels: list[str] = field(default_factory=list)
    mode: str = "full"
    margin: float = 0.5
    overhead_s: float = 60.0
    lead_s: float = 300.0
    horizon_days: float = 7.0
    #: Used until a hoard has been measured: 1 MB/s, a modest home or hotel link.
    assumed_bytes_per_s: float = 1e6
    allday_start: str = "08:00"
    timezone: str = ""

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ScheduleError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        for name in ("margin", "overhead_s", "lead_s"):
            if getattr(self, name) < 0:
                raise ScheduleError(f"{name} must not be negative")
        if not 0 < self.horizon_days <= 366:
            raise ScheduleError("horizon_days must be between 0 and 366")
        if self.assumed_bytes_per_s <= 0:
            raise ScheduleError("assumed_bytes_per_s must be positive")
        self.allday_time()
        self.zone()

    def allday_time(self) -> dt.time:
        try:
            return dt.time.fromisoformat(self.allday_start)
        except ValueError:
            raise ScheduleError(f"allday_start must be a time like 08:00, not {self.allday_start!r}") from None

    def zone(self) -> ZoneInfo:
        if not self.timezone:
            return ical._local_zone()
        try:
            return ZoneInfo(self.timezone)
        except (KeyError, ValueError):
            raise ScheduleError(f"unknown time zone {self.timezone!r} (use a name like Europe/Berlin)") from None

    @classmethod
    def load(cls, path: Path) -> ScheduleConfig:
        """Read ``path`` (a missing file is the default configuration). Raises ScheduleError."""
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ScheduleError(f"cannot read {path}: {exc}") from exc
        rules = [SiteRule(str(r.get("kind", "")), str(r.get("pattern", ""))) for r in data.pop("rules", [])]
        known = {f.name for f in dataclasses.fields(cls)} - {"rules"}
        unknown = set(data) - known
        if unknown:
            raise ScheduleError(f"{path}: unknown setting {sorted(unknown)[0]!r}")
        try:
            config = cls(rules=rules, **data)
        except TypeError as exc:
            raise ScheduleError(f"{path}: {exc}") from exc
        config.validate()
        return config

    def save(self, path: Path) -> None:
        self.validate()
        data = dataclasses.asdict(self)
        data["rules"] = [{"kind": r.kind, "pattern": r.pattern} for r in self.rules]
        _atomic_write(path, tomli_w.dumps(data).encode())

    def matches(self, event: ical.Occurrence) -> bool:
        return any(rule.matches(event) for rule in self.rules)


class Inventory(Protocol):
    """What the planner needs to know about a parcel at this site (implemented with the server and cache)."""

    def missing_bytes(self, parcel: str, mode: str) -> tuple[int, int]:
        """(bytes this site lacks for the parcel's newest version in ``mode``, that version number)."""


@dataclass(frozen=True)
class PlannedHoard:
    event: ical.Occurrence
    parcel: str
    version: int
    missing_bytes: int
    throughput: float
    throughput_measured: bool
    duration_s: float
    start: dt.datetime
    finish: dt.datetime
    #: "ready" (nothing missing), "planned", "start now", "not enough time", "covered" (by an earlier hoard)
    status: str

    @property
    def late_by_s(self) -> float:
        return max(0.0, (self.finish - self.event.start).total_seconds())


def hoard_duration(missing_bytes: int, throughput: float, config: ScheduleConfig) -> float:
    """Seconds to budget for fetching ``missing_bytes`` at ``throughput`` bytes/s (0 when nothing is missing)."""
    if missing_bytes <= 0:
        return 0.0
    return config.overhead_s + missing_bytes / throughput * (1.0 + config.margin)


def plan(events: Iterable[ical.Occurrence], parcels: Sequence[str], inventory: Inventory,
         config: ScheduleConfig, throughput: float | None, now: dt.datetime) -> list[PlannedHoard]:
    """Plan the hoards for the matching ``events`` (starting after ``now``) for each of ``parcels``.

    ``throughput`` is the measured bytes/s (None: use the configured assumption).
    """
    measured = throughput is not None and throughput > 0
    rate = throughput if measured and throughput is not None else config.assumed_bytes_per_s
    upcoming = sorted((e for e in events if e.start > now and config.matches(e)), key=lambda e: e.start)
    plans: list[PlannedHoard] = []
    for parcel in parcels:
        missing, version = inventory.missing_bytes(parcel, config.mode)
        first = True
        for event in upcoming:
            if not first:
                plans.append(PlannedHoard(event, parcel, version, 0, rate, measured, 0.0, event.start,
                                          event.start, "covered"))
                continue
            first = False
            duration = hoard_duration(missing, rate, config)
            if missing <= 0:
                plans.append(PlannedHoard(event, parcel, version, 0, rate, measured, 0.0, now, now, "ready"))
                continue
            start = event.start - dt.timedelta(seconds=config.lead_s + duration)
            status = "planned"
            if start <= now:
                start = now
                status = "start now"
            finish = start + dt.timedelta(seconds=duration)
            if finish > event.start:
                status = "not enough time"
            plans.append(PlannedHoard(event, parcel, version, missing, rate, measured, duration, start, finish,
                                      status))
    plans.sort(key=lambda p: (p.event.start, p.parcel))
    return plans


def read_calendars(config: ScheduleConfig, now: dt.datetime) -> ical.CalendarRead:
    """All occurrences in the planning horizon from every configured calendar; problems collected."""
    end = now + dt.timedelta(days=config.horizon_days)
    result = ical.CalendarRead([], [])
    for source in config.calendars:
        read = ical.occurrences(ical.read_source(source), source, now, end, local=config.zone(),
                                allday_start=config.allday_time())
        result.occurrences.extend(read.occurrences)
        result.problems.extend(read.problems)
    result.occurrences.sort(key=lambda o: o.start)
    return result


# --- the runner's state -------------------------------------------------------------------------------

#: Throughput samples older than this do not count: links change.
SAMPLE_MAX_AGE_S = 30 * 86400
SAMPLES_KEPT = 8


@dataclass
class RunnerState:
    """Survives restarts of `isr schedule run`: finished hoards and measured throughput."""

    done: dict[str, int] = field(default_factory=dict)  # "<parcel>|<occurrence key>" -> version hoarded
    samples: list[tuple[float, int, float]] = field(default_factory=list)  # (unix time, bytes, seconds)

    @classmethod
    def load(cls, path: Path) -> RunnerState:
        try:
            data = json.loads(path.read_text())
            return cls(done={str(k): int(v) for k, v in data.get("done", {}).items()},
                       samples=[(float(t), int(b), float(s)) for t, b, s in data.get("samples", [])])
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError, TypeError) as exc:
            # A damaged state file only costs a re-measurement and perhaps a redundant hoard.
            log.warning("ignoring unreadable schedule state %s: %s", path, exc)
            return cls()

    def save(self, path: Path) -> None:
        _atomic_write(path, json.dumps({"done": self.done, "samples": self.samples}, indent=1).encode())

    def add_sample(self, nbytes: int, seconds: float, when: float | None = None) -> None:
        # Tiny hoards measure latency, not throughput: only samples of at least 1 MiB count.
        if nbytes >= 1 << 20 and seconds > 0:
            self.samples.append((when if when is not None else time.time(), nbytes, seconds))
            self.samples = self.samples[-SAMPLES_KEPT:]

    def throughput(self, now: float | None = None) -> float | None:
        """Bytes/s over the recent samples (total bytes / total seconds), None if there are none."""
        now = now if now is not None else time.time()
        recent = [(b, s) for t, b, s in self.samples if now - t <= SAMPLE_MAX_AGE_S]
        if not recent:
            return None
        return sum(b for b, _ in recent) / sum(s for _, s in recent)

    def is_done(self, hoard: PlannedHoard) -> bool:
        return self.done.get(f"{hoard.parcel}|{hoard.event.key}", -1) >= hoard.version

    def mark_done(self, hoard: PlannedHoard) -> None:
        self.done[f"{hoard.parcel}|{hoard.event.key}"] = hoard.version


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with _suppress_oserror():
            os.unlink(tmp)
        raise


class _suppress_oserror:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        return exc_type is not None and issubclass(exc_type, OSError)


# --- presentation -------------------------------------------------------------------------------------

def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"


def format_plan(plans: Sequence[PlannedHoard], zone: ZoneInfo, problems: Sequence[ical.CalendarProblem] = ()
                ) -> str:
    """The `isr schedule show` table, times in ``zone``, followed by calendar problems and warnings."""
    def when(t: dt.datetime) -> str:
        return t.astimezone(zone).strftime("%a %d %b %H:%M")

    header = ("event", "place", "starts", "parcel", "missing", "hoard starts", "expected done", "status")
    rows = [header]
    for p in plans:
        place = p.event.location or ", ".join(p.event.categories) or "-"
        if p.status in ("ready", "covered"):
            rows.append((p.event.summary or p.event.uid, place, when(p.event.start), p.parcel,
                         _human_bytes(p.missing_bytes), "-", "-", p.status))
        else:
            rows.append((p.event.summary or p.event.uid, place, when(p.event.start), p.parcel,
                         _human_bytes(p.missing_bytes), when(p.start), when(p.finish), p.status))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    if len(rows) == 1:
        lines.append("(no upcoming events match this site's rules)")
    if plans:
        p = plans[0]
        source = "measured" if p.throughput_measured else "assumed, no hoard measured yet"
        lines.append(f"throughput {p.throughput * 8 / 1e6:.1f} Mbit/s ({source})")
    for p in plans:
        if p.status == "not enough time":
            lines.append(f"warning: not enough time to hoard {p.parcel} before {p.event.summary!r}: expected to "
                         f"finish {p.late_by_s / 60:.0f} min after it starts")
    for problem in problems:
        lines.append(f"warning: {problem}")
    return "\n".join(lines)


# --- the runner -----------------------------------------------------------------------------------------

class Hoarder(Protocol):
    def hoard(self, parcel: str, mode: str) -> tuple[int, float]:
        """Hoard the parcel's newest version (or its working set); returns (bytes fetched, seconds)."""


@dataclass
class Runner:
    """`isr schedule run`: sleep until the next planned start, hoard, re-plan; survives restarts.

    ``parcels`` lists the parcels to consider, ``clock`` and ``sleep`` are injectable for tests of the
    loop's logic (the real ones are used otherwise), ``replan_s`` bounds how long it sleeps without
    looking at the calendars and the server again.
    """

    config_path: Path
    state_path: Path
    parcels: Callable[[ScheduleConfig], list[str]]
    inventory: Inventory
    hoarder: Hoarder
    replan_s: float = 300.0
    clock: Callable[[], dt.datetime] = field(default=lambda: dt.datetime.now(dt.timezone.utc))
    sleep: Callable[[float], None] = time.sleep

    def step(self) -> tuple[list[PlannedHoard], float]:
        """Re-plan, run every hoard that is due now, and return (the plan, seconds until the next look)."""
        config = ScheduleConfig.load(self.config_path)
        state = RunnerState.load(self.state_path)
        now = self.clock()
        read = read_calendars(config, now)
        for problem in read.problems:
            log.warning("%s", problem)
        plans = plan(read.occurrences, self.parcels(config), self.inventory, config, state.throughput(), now)
        for hoard in plans:
            if hoard.status in ("ready", "covered") or state.is_done(hoard) or hoard.start > now:
                continue
            log.info("hoarding %s (version %d, %s missing) for %r at %s", hoard.parcel, hoard.version,
                     _human_bytes(hoard.missing_bytes), hoard.event.summary, hoard.event.start.isoformat())
            nbytes, seconds = self.hoarder.hoard(hoard.parcel, config.mode)
            state.add_sample(nbytes, seconds)
            state.mark_done(hoard)
            state.save(self.state_path)
            log.info("hoarded %s in %.1f s (%.1f Mbit/s)", _human_bytes(nbytes), seconds,
                     nbytes * 8 / 1e6 / seconds if seconds > 0 else 0.0)
            now = self.clock()
        pending = [p.start for p in plans if p.status not in ("ready", "covered") and not state.is_done(p)
                   and p.start > now]
        wait = self.replan_s
        if pending:
            wait = min(wait, max(0.0, (min(pending) - now).total_seconds()))
        return plans, wait

    def run(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Loop until ``stop()`` is true (checked between steps)."""
        while not stop():
            try:
                _, wait = self.step()
            except IsrError as exc:
                # A calendar or the server may be down for a while: say so and try again later.
                log.error("%s; retrying in %.0f s", exc, self.replan_s)
                wait = self.replan_s
            self.sleep(wait)
