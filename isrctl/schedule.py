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
The `Inventory` and `Hoarder` it uses in `isr schedule run` are `hoard.ServerInventory` and
`hoard.KeylessHoarder`: no parcel key is needed. doc/isrctl.md, "Hoard scheduling", is the user's view.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import fcntl
import json
import logging
import math
import os
import re
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from zoneinfo import ZoneInfo

import tomli_w

from isrprogress import human_bytes

from . import calendar as ical
from .config import write_private
from .errors import HoardStopped, IsrError

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
        write_private(path, tomli_w.dumps(data).encode())

    def matches(self, event: ical.Occurrence) -> bool:
        return any(rule.matches(event) for rule in self.rules)

    def set(self, name: str, text: str) -> None:
        """Change one setting from its text, as `isr schedule set NAME VALUE` gives it (a list: comma-separated).
        Raises ScheduleError naming what to change."""
        settable = [f.name for f in dataclasses.fields(self) if f.name not in ("rules", "calendars")]
        if name not in settable:
            raise ScheduleError(f"unknown setting {name!r}: use one of {', '.join(settable)} (rules: `isr site`, "
                                f"calendars: `isr schedule calendar`)")
        current = getattr(type(self)(), name)  # the default shows the type (a hand-edited file may hold 60)
        value: Any = text
        if isinstance(current, list):
            value = [item.strip() for item in text.split(",") if item.strip()]
        elif isinstance(current, float):
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            if not math.isfinite(value):
                raise ScheduleError(f"{name} must be a number, not {text!r}")
        setattr(self, name, value)
        self.validate()


#: What `Inventory.missing_bytes` answers for a parcel whose VM runs at this site: its user is here, it needs no
#: hoard (and "0 B missing, ready" would be untrue: a running session fetches as it goes).
RUNNING_HERE = -1
#: Plan statuses that need no hoard.
NO_HOARD = ("ready", "covered", "running here")


class Inventory(Protocol):
    """What the planner needs to know about a parcel at this site (implemented with the server and cache)."""

    def missing_bytes(self, parcel: str, mode: str) -> tuple[int, int]:
        """(bytes this site lacks for the parcel's newest version in ``mode``, or RUNNING_HERE; that version
        number)."""


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
    #: "ready" (nothing missing), "planned", "start now", "not enough time", "covered" (by an earlier hoard),
    #: "running here" (the parcel's VM runs at this site)
    status: str

    @property
    def late_by_s(self) -> float:
        return max(0.0, (self.finish - self.event.start).total_seconds())


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


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
            if missing == RUNNING_HERE:
                plans.append(PlannedHoard(event, parcel, version, 0, rate, measured, 0.0, now, now, "running here"))
                continue
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


def read_calendar(config: ScheduleConfig, source: str, now: dt.datetime) -> ical.CalendarRead:
    """The occurrences of one calendar in the planning horizon. Raises CalendarError if it cannot be read."""
    return ical.occurrences(ical.read_source(source), source, now, now + dt.timedelta(days=config.horizon_days),
                            local=config.zone(), allday_start=config.allday_time())


def read_calendars(config: ScheduleConfig, now: dt.datetime) -> ical.CalendarRead:
    """All occurrences in the planning horizon from every configured calendar, each once (an event in two
    calendars, by its UID or by its title, place and start, is planned once); problems (broken events,
    calendars that cannot be read) collected, never raised."""
    result = ical.CalendarRead([], [])
    seen: set[object] = set()
    for source in config.calendars:
        try:
            read = read_calendar(config, source, now)
        except ical.CalendarError as exc:
            # One calendar that is away (a URL down, a file moved) must not cost the others.
            result.problems.append(ical.CalendarProblem(source, 0, f"not read: {exc}"))
            continue
        for occurrence in read.occurrences:
            same = (occurrence.key, (occurrence.summary, occurrence.location, occurrence.start))
            if not seen.intersection(same):
                result.occurrences.append(occurrence)
            seen.update(same)
        result.problems.extend(read.problems)
    result.occurrences.sort(key=lambda o: o.start)
    return result


# --- the runner's state -------------------------------------------------------------------------------

#: Throughput samples older than this do not count: links change.
SAMPLE_MAX_AGE_S = 30 * 86400
SAMPLES_KEPT = 8


HISTORY_KEPT = 20
#: "Done" marks of events that started longer ago than this are forgotten.
DONE_MAX_AGE_S = 2 * 86400


@dataclass
class RunnerState:
    """Survives restarts of `isr schedule run`: finished hoards and measured throughput."""

    done: dict[str, int] = field(default_factory=dict)  # "<parcel>|<occurrence key>" -> version hoarded
    samples: list[tuple[float, int, float]] = field(default_factory=list)  # (unix time, bytes, seconds)
    #: The last hoards, newest last: parcel, version, event, event_start, started, finished (Unix times),
    #: bytes, seconds.
    history: list[dict[str, Any]] = field(default_factory=list)
    #: What the server last told this site, for planning while it is away (`hoard.ServerInventory` keeps it):
    #: "at" (Unix time), "server", "parcels" (the names planned for when none are configured), and "missing":
    #: "<parcel>|<mode>" -> {"id", "bytes", "version"}.
    known: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> RunnerState:
        try:
            data = json.loads(path.read_text())
            return cls(done={str(k): int(v) for k, v in data.get("done", {}).items()},
                       samples=[(float(t), int(b), float(s)) for t, b, s in data.get("samples", [])],
                       history=[dict(h) for h in data.get("history", [])][-HISTORY_KEPT:],
                       known=dict(data.get("known", {})))
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError, TypeError) as exc:
            # A damaged state file only costs a re-measurement and perhaps a redundant hoard.
            log.warning("ignoring unreadable schedule state %s: %s", path, exc)
            return cls()

    def _encode(self) -> bytes:
        return json.dumps({"done": self.done, "samples": self.samples, "history": self.history,
                           "known": self.known}, indent=1).encode()

    def save(self, path: Path) -> None:
        write_private(path, self._encode())

    @classmethod
    @contextlib.contextmanager
    def updating(cls, path: Path) -> Iterator[RunnerState]:
        """Load, let the caller change, and save the state (only if it changed), under a lock next to it:
        `isr hoard` and the runner both add to it, and a read-modify-write of each without the lock could
        drop the other's."""
        lock_path = path.with_name(path.name + ".update-lock")
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            state = cls.load(path)
            before = state._encode()
            yield state
            if state._encode() != before:
                state.save(path)

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

    def record(self, hoard: PlannedHoard, started: float, nbytes: int, seconds: float) -> None:
        """Remember a finished hoard (shown by `isr schedule show`)."""
        self.history.append({"parcel": hoard.parcel, "version": hoard.version, "event": hoard.event.summary,
                             "event_start": hoard.event.start.timestamp(), "started": started,
                             "finished": time.time(), "bytes": nbytes, "seconds": seconds})
        self.history = self.history[-HISTORY_KEPT:]

    def forget_past(self, now: dt.datetime) -> None:
        """Drop the done marks of events long past (an occurrence key ends with its UTC start)."""
        def start(key: str) -> dt.datetime | None:
            try:
                return dt.datetime.strptime(key.rpartition("@")[2], "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.timezone.utc)
            except ValueError:
                return None
        self.done = {k: v for k, v in self.done.items()
                     if (when := start(k)) is None or (now - when).total_seconds() < DONE_MAX_AGE_S}


# --- presentation -------------------------------------------------------------------------------------

def local_time(t: dt.datetime, zone: ZoneInfo) -> str:
    """A time as `isr schedule` shows it: in ``zone``, with the zone's label ("Mon 30 Nov 09:00 CET")."""
    return t.astimezone(zone).strftime("%a %d %b %H:%M %Z")


def format_plan(plans: Sequence[PlannedHoard], zone: ZoneInfo, problems: Sequence[ical.CalendarProblem] = ()
                ) -> str:
    """The `isr schedule show` table, times in ``zone`` with its label, followed by calendar problems and
    warnings."""
    def when(t: dt.datetime) -> str:
        return local_time(t, zone)

    header = ("event", "place", "starts", "parcel", "missing", "hoard starts", "expected done", "status")
    rows = [header]
    for p in plans:
        place = p.event.location or ", ".join(p.event.categories) or "-"
        if p.status in NO_HOARD:
            rows.append((p.event.summary or p.event.uid, place, when(p.event.start), p.parcel,
                         "-" if p.status == "running here" else human_bytes(p.missing_bytes), "-", "-", p.status))
        else:
            rows.append((p.event.summary or p.event.uid, place, when(p.event.start), p.parcel,
                         human_bytes(p.missing_bytes), when(p.start), when(p.finish), p.status))
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


def plan_json(p: PlannedHoard) -> dict[str, Any]:
    """One planned hoard for `isr schedule show --json` (times as ISO 8601 in UTC)."""
    return {"event": p.event.summary, "uid": p.event.uid, "location": p.event.location,
            "categories": list(p.event.categories), "event_start": p.event.start.isoformat(), "parcel": p.parcel,
            "version": p.version, "missing_bytes": p.missing_bytes, "throughput": p.throughput,
            "throughput_measured": p.throughput_measured, "duration_s": p.duration_s,
            "hoard_start": p.start.isoformat(), "expected_finish": p.finish.isoformat(), "status": p.status}


def format_history(done: dict[str, Any], zone: ZoneInfo) -> str:
    """One line about a finished hoard from `RunnerState.history`."""
    finished = dt.datetime.fromtimestamp(float(done["finished"]), zone)
    ahead = float(done["event_start"]) - float(done["finished"])
    timing = (f"{ahead / 60:.0f} min before it started" if ahead >= 0 else f"{-ahead / 60:.0f} min after it started")
    return (f"hoarded {done['parcel']} version {done['version']} for {done['event']!r}: "
            f"{human_bytes(int(done['bytes']))} in {float(done['seconds']):.1f} s, done "
            f"{local_time(finished, zone)}, {timing}")


# --- the runner -----------------------------------------------------------------------------------------

@contextlib.contextmanager
def single_runner(state_path: Path) -> Iterator[None]:
    """Hold the lock that lets one `isr schedule run` at a time work for this user (next to its state).
    Raises ScheduleError if another holds it."""
    lock_path = state_path.with_name(state_path.name + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise ScheduleError(f"another `isr schedule run` is running here (pid {f.read().strip() or '?'}): "
                                f"stop it first (systemctl --user stop isr-schedule)") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield


class Hoarder(Protocol):
    def hoard(self, parcel: str, mode: str) -> tuple[int, float]:
        """Hoard the parcel's newest version (or its working set); returns (bytes fetched, seconds)."""

    def stop(self) -> None:
        """End a running hoard early (from another thread); later hoards raise HoardStopped."""


def file_fingerprint(config_path: Path, config: ScheduleConfig) -> tuple[Any, ...]:
    """What changes when the schedule configuration or a calendar file is edited (URLs are re-read at
    every re-plan instead)."""
    marks: list[Any] = []
    for path in (config_path, *(Path(c) for c in config.calendars if "://" not in c)):
        try:
            st = path.stat()
            marks.append((str(path), st.st_mtime_ns, st.st_size))
        except OSError:
            marks.append((str(path), None))
    return tuple(marks)


@dataclass
class Runner:
    """`isr schedule run`: sleep until the next planned start, hoard, re-plan; survives restarts.

    ``parcels`` lists the parcels to consider. ``watch`` returns something that changes when a re-plan is
    due early (a calendar file edited, a new version checked in); `run` polls it every ``watch_s`` seconds
    while it waits. ``replan_s`` bounds how long it waits without looking at the calendars and the server
    again. ``clock`` is injectable for tests of the loop's logic.
    """

    config_path: Path
    state_path: Path
    parcels: Callable[[ScheduleConfig], list[str]]
    inventory: Inventory
    hoarder: Hoarder
    replan_s: float = 300.0
    watch_s: float = 30.0
    watch: Callable[[ScheduleConfig], object] | None = None
    clock: Callable[[], dt.datetime] = utc_now
    stopping: threading.Event = field(default_factory=threading.Event)
    _logged_plan: list[str] = field(default_factory=list, init=False, repr=False)

    def step(self) -> tuple[list[PlannedHoard], float]:
        """Re-plan, run every hoard that is due now, and return (the plan, seconds until the next look)."""
        config = ScheduleConfig.load(self.config_path)
        now = self.clock()
        with RunnerState.updating(self.state_path) as state:
            state.forget_past(now)
        read = read_calendars(config, now)
        for problem in read.problems:
            log.warning("%s", problem)
        plans = plan(read.occurrences, self.parcels(config), self.inventory, config, state.throughput(), now)
        self._log_plan(plans, config.zone())
        for hoard in plans:
            if hoard.status in NO_HOARD or state.is_done(hoard) or hoard.start > now:
                continue
            if self.stopping.is_set():
                break
            log.info("hoarding %s (version %d, %s missing) for %r at %s%s", hoard.parcel, hoard.version,
                     human_bytes(hoard.missing_bytes), hoard.event.summary, hoard.event.start.isoformat(),
                     "; warning: not enough time" if hoard.status == "not enough time" else "")
            started = time.time()
            nbytes, seconds = self.hoarder.hoard(hoard.parcel, config.mode)
            with RunnerState.updating(self.state_path) as state:  # `isr hoard` may have added a sample meanwhile
                state.add_sample(nbytes, seconds)
                state.mark_done(hoard)
                state.record(hoard, started, nbytes, seconds)
            log.info("hoarded %s of %s in %.1f s (%.1f Mbit/s); %s starts in %.0f s", human_bytes(nbytes),
                     hoard.parcel, seconds, nbytes * 8 / 1e6 / seconds if seconds > 0 else 0.0,
                     hoard.event.summary or "the event", (hoard.event.start - self.clock()).total_seconds())
            now = self.clock()
        pending = [p.start for p in plans if p.status not in NO_HOARD and not state.is_done(p)
                   and p.start > now]
        wait = self.replan_s
        if pending:
            wait = min(wait, max(0.0, (min(pending) - now).total_seconds()))
        return plans, wait

    def _log_plan(self, plans: Sequence[PlannedHoard], zone: ZoneInfo) -> None:
        """Log the plan when it differs from the last one logged (a service's log shows each decision once)."""
        def when(t: dt.datetime) -> str:
            return t.astimezone(zone).strftime("%H:%M:%S")

        lines = [f"{p.parcel} v{p.version} for {p.event.summary!r} at {p.event.start.astimezone(zone):%a %H:%M}: "
                 + (p.status if p.status in NO_HOARD else
                    f"{human_bytes(p.missing_bytes)} missing, hoard {when(p.start)}-{when(p.finish)} ({p.status})")
                 for p in plans]
        if lines != self._logged_plan:
            for line in lines or ["no upcoming event matches this site's rules"]:
                log.info("plan: %s", line)
            self._logged_plan = lines

    def fingerprint(self) -> object:
        """What `watch` sees now (None where it cannot look: a server or file that is away)."""
        try:
            config = ScheduleConfig.load(self.config_path)
            return (file_fingerprint(self.config_path, config), self.watch(config) if self.watch else None)
        except IsrError as exc:
            log.debug("cannot look for changes: %s", exc)
            return None

    def run(self) -> None:
        """Plan, hoard and wait until `stop` is called."""
        while not self.stopping.is_set():
            try:
                _, wait = self.step()
            except HoardStopped:
                break
            except IsrError as exc:
                # A calendar or the server may be down for a while: say so and try again later.
                log.error("%s; retrying in %.0f s", exc, self.replan_s)
                wait = self.replan_s
            seen = self.fingerprint()
            log.info("next look in %.0f s", wait)
            deadline = time.monotonic() + wait
            while not self.stopping.is_set():
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping.wait(min(left, self.watch_s)):
                    break
                now = self.fingerprint()
                if now is not None and seen is not None and now != seen:
                    log.info("a calendar, the schedule or a parcel's version changed: planning again")
                    break
                seen = now if seen is None else seen

    def stop(self) -> None:
        """Make `run` return soon (from a signal handler or another thread), ending a running hoard."""
        self.stopping.set()
        self.hoarder.stop()
