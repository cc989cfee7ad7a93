"""Read iCalendar files (RFC 5545) into concrete event occurrences, for hoard scheduling.

This is the only isrctl module that imports ``icalendar`` and ``recurring_ical_events``: parsing, time
zones and recurrence (RRULE, RDATE, EXDATE, RECURRENCE-ID overrides) are theirs. What this module adds:

- **Fault isolation.** One broken event must not cost the user the rest of their calendar. The text is
  split into its VEVENT blocks (after RFC 5545 line unfolding, keeping the original line numbers); each
  block is parsed and checked on its own, together with the calendar's VTIMEZONE definitions. A broken
  block becomes a `CalendarProblem` naming its source and first line, and every other event is still used.
- **One notion of time.** Every occurrence comes out as an aware UTC `datetime`. Floating times (no zone)
  are read in the user's local zone. An all-day event starts at ``allday_start`` local time on its day
  (people do not arrive at midnight).
- **Cancelled is gone.** Events and occurrences with STATUS:CANCELLED are dropped.
"""
from __future__ import annotations

import datetime as dt
import logging
import os
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from zoneinfo import ZoneInfo

import icalendar
import recurring_ical_events

from .errors import IsrError

log = logging.getLogger(__name__)

#: Largest calendar accepted, from a file or a URL: a person's calendar is far smaller.
MAX_CALENDAR_BYTES = 32 << 20
#: The most occurrences read from one calendar in one window: hoarding ahead of more is pointless, and they
#: are expanded lazily, so that a rule with endless occurrences costs no more (doc/fuzzing.md).
MAX_OCCURRENCES = 10000
#: The most periods of SECONDLY, MINUTELY and HOURLY rules expanded from one calendar, counted from each
#: rule's DTSTART to the window's end: the recurrence library steps through every period since DTSTART (up to
#: 60 µs each), so one event of a hundred bytes, RRULE:FREQ=SECONDLY, cost 37 s for a week and a MINUTELY one
#: that started a year ago a minute (found by fuzzing, doc/fuzzing.md). An event beyond it is skipped.
MAX_PERIODS = 100000
_PERIOD_SECONDS = {"SECONDLY": 1, "MINUTELY": 60, "HOURLY": 3600}


class CalendarError(IsrError):
    """A calendar source cannot be read at all (missing file, unreachable URL, not iCalendar)."""


@dataclass(frozen=True)
class CalendarProblem:
    """One event that could not be used, and why; the rest of its calendar still counts. Line 0 means a
    whole calendar that could not be read (the other calendars still count)."""

    source: str
    line: int
    message: str

    def __str__(self) -> str:
        if self.line <= 0:  # the whole calendar
            return f"{self.source}: {self.message}"
        return f"{self.source} line {self.line}: {self.message}"


@dataclass(frozen=True)
class Occurrence:
    """One concrete occurrence of a calendar event."""

    uid: str
    summary: str
    location: str
    categories: tuple[str, ...]
    start: dt.datetime  # aware, UTC
    end: dt.datetime  # aware, UTC
    all_day: bool
    source: str

    @property
    def key(self) -> str:
        """Identifies this occurrence across re-reads of the calendar (for "already hoarded" state)."""
        return f"{self.uid}@{self.start.strftime('%Y%m%dT%H%M%SZ')}"


@dataclass
class CalendarRead:
    occurrences: list[Occurrence]
    problems: list[CalendarProblem]


def read_source(source: str, *, timeout: float = 20.0) -> bytes:
    """The bytes of a calendar given as a file path or an https URL.

    Raises CalendarError if it cannot be read, is too large, or the URL is not https.
    """
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", source):
        scheme = urllib.parse.urlsplit(source).scheme.lower()
        if scheme != "https":
            raise CalendarError(f"calendar URL {source} must use https")
        import httpx  # only needed for URLs

        try:
            with httpx.Client(timeout=timeout, follow_redirects=True) as client:
                response = client.get(source)
        except httpx.HTTPError as exc:
            raise CalendarError(f"cannot fetch calendar {source}: {exc}") from exc
        if response.status_code != 200:
            raise CalendarError(f"cannot fetch calendar {source}: HTTP {response.status_code}")
        data = response.content
    else:
        try:
            with open(source, "rb") as f:
                data = f.read(MAX_CALENDAR_BYTES + 1)
        except OSError as exc:
            raise CalendarError(f"cannot read calendar {source}: {exc.strerror}") from exc
    if len(data) > MAX_CALENDAR_BYTES:
        raise CalendarError(f"calendar {source} is larger than {MAX_CALENDAR_BYTES >> 20} MiB")
    return data


def _unfold(text: str) -> list[tuple[int, str]]:
    """RFC 5545 §3.1 unfolding: (first physical line number, logical content line), blank lines dropped."""
    lines: list[tuple[int, str]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if raw[:1] in (" ", "\t") and lines:
            first, content = lines[-1]
            lines[-1] = (first, content + raw[1:])
        elif raw.strip():
            lines.append((number, raw))
    return lines


def _name(line: str) -> str:
    return re.split(r"[;:]", line, maxsplit=1)[0].upper()


@dataclass
class _Block:
    line: int
    lines: list[str]


def _split(lines: list[tuple[int, str]], source: str) -> tuple[list[str], list[_Block], list[CalendarProblem]]:
    """Split a calendar into its top-level lines and VTIMEZONE blocks (kept as-is) and its VEVENT blocks."""
    if not lines or lines[0][1].strip().upper() != "BEGIN:VCALENDAR":
        raise CalendarError(f"{source} is not an iCalendar file (it must start with BEGIN:VCALENDAR)")
    keep: list[str] = []
    events: list[_Block] = []
    problems: list[CalendarProblem] = []
    stack: list[str] = []
    current: _Block | None = None
    for number, line in lines:
        name = _name(line)
        value = line.split(":", 1)[1].strip().upper() if ":" in line else ""
        if name == "BEGIN":
            stack.append(value)
        if current is not None:
            current.lines.append(line)
        elif name == "BEGIN" and value == "VEVENT" and len(stack) == 2:
            current = _Block(number, [line])
        else:
            keep.append(line)
        if name == "END":
            if not stack or stack[-1] != value:
                if current is not None:
                    # The broken event is dropped as a whole, reported where it begins.
                    problems.append(CalendarProblem(source, current.line, f"event is not closed by END:VEVENT "
                                                    f"(line {number} has END:{value})"))
                    current = None
                else:
                    problems.append(CalendarProblem(source, number, f"END:{value} does not close "
                                                    f"{'BEGIN:' + stack[-1] if stack else 'anything'}"))
                if value in stack:
                    while stack and stack.pop() != value:
                        pass
                continue
            stack.pop()
            if value == "VEVENT" and current is not None and len(stack) == 1:
                events.append(current)
                current = None
    if current is not None:
        problems.append(CalendarProblem(source, current.line, "event is not closed by END:VEVENT"))
    return keep, events, problems


def _frame(keep: list[str], body: list[str]) -> str:
    """A complete calendar: the top-level lines (properties, VTIMEZONEs) around ``body``."""
    head = [line for line in keep if _name(line) != "END" or not line.upper().startswith("END:VCALENDAR")]
    return "\r\n".join(head + body + ["END:VCALENDAR", ""])


_REQUIRED_CHECKS = ("DTSTART",)


def _check_event(event: icalendar.Event) -> str | None:
    """Why this parsed event cannot be scheduled, or None."""
    for prop in _REQUIRED_CHECKS:
        if prop not in event:
            return f"event has no {prop}"
    try:
        start = event.decoded("DTSTART")
        if "DTEND" in event:
            end = event.decoded("DTEND")
            if type(end) is not type(start):
                return "DTSTART and DTEND are of different kinds (date vs date-time)"
        if "RRULE" in event:
            # An event may carry more than one RRULE (RFC 5545 advises against it): then icalendar gives a list.
            rrules = event.get("RRULE")
            rrules = rrules if isinstance(rrules, list) else [rrules]
            if not all(rrule is not None and rrule.get("FREQ") for rrule in rrules):
                return "RRULE without FREQ"
            # INTERVAL=0 makes the expansion loop forever (dateutil), a whole `isr schedule show` with it.
            if any(int((rrule.get("INTERVAL") or [1])[0]) < 1 for rrule in rrules):
                return "RRULE with an INTERVAL below 1"
    except (ValueError, TypeError, KeyError) as exc:
        return f"unreadable date: {exc}"
    if not isinstance(start, (dt.date, dt.datetime)):
        return "DTSTART is not a date or date-time"
    return None


def _summary(event: icalendar.Event) -> str:
    return str(event.get("SUMMARY", "")).strip()


def _categories(event: icalendar.Event) -> tuple[str, ...]:
    value = event.get("CATEGORIES")
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    cats: list[str] = []
    for item in items:
        cats.extend(str(c).strip() for c in getattr(item, "cats", [item]))
    return tuple(c for c in cats if c)


def _as_utc(value: dt.date | dt.datetime, local: ZoneInfo, allday_start: dt.time) -> tuple[dt.datetime, bool]:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:  # floating time: the user's wall clock wherever they are
            value = value.replace(tzinfo=local)
        return value.astimezone(dt.timezone.utc), False
    return dt.datetime.combine(value, allday_start, tzinfo=local).astimezone(dt.timezone.utc), True


def occurrences(data: bytes, source: str, start: dt.datetime, end: dt.datetime, *,
                local: ZoneInfo | None = None, allday_start: dt.time = dt.time(8, 0)) -> CalendarRead:
    """Every occurrence of every usable event in ``data`` that starts in [start, end) (aware datetimes).

    Broken events are reported in `CalendarRead.problems` (with their line numbers) and left out.
    Raises CalendarError only if ``data`` is not an iCalendar file at all.
    """
    local = local or _local_zone()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise CalendarError(f"{source} is not UTF-8 text: {exc}") from exc
    keep, blocks, problems = _split(_unfold(text), source)
    try:
        skeleton = icalendar.Calendar.from_ical(_frame(keep, []))
    except ValueError as exc:
        raise CalendarError(f"{source}: unreadable calendar properties or time zones: {exc}") from exc
    usable: list[tuple[icalendar.Event, _Block]] = []
    periods_left = MAX_PERIODS
    for block in blocks:
        try:
            parsed = icalendar.Calendar.from_ical(_frame(keep, block.lines))
            events = parsed.events
            why = _check_event(events[0]) if events else "no event found"
            if why is None:
                periods = _subdaily_periods(events[0], end, local, allday_start)
                if periods > periods_left:
                    why = (f"it recurs every few seconds, minutes or hours, {periods} times from its start to the "
                           f"end of the window: too often to expand ({MAX_PERIODS} in all)")
                else:
                    periods_left -= periods
        except (ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
            why = f"unreadable event: {exc}"
            events = []
        if why is not None:
            problems.append(_skipped(source, block, why))
            continue
        usable.append((events[0], block))
    found: list[Occurrence] = []
    try:
        expanded = _expand(_calendar(skeleton, [e for e, _ in usable]), start, end, local, allday_start)
    except Exception:  # the library raises a variety of types for inconsistent recurrences
        # One bad recurrence must not cost the calendar: expand each event alone and skip those that fail.
        expanded = []
        for event, block in usable:
            try:
                expanded += _expand(_calendar(skeleton, [event]), start, end, local, allday_start)
            except Exception as exc:
                problems.append(_skipped(source, block, f"its recurrence cannot be expanded: {exc}"))
        expanded.sort(key=lambda e: _as_utc(e.decoded("DTSTART"), local, allday_start)[0])
    if len(expanded) > MAX_OCCURRENCES:
        expanded = expanded[:MAX_OCCURRENCES]
        problems.append(CalendarProblem(source, 0, f"more than {MAX_OCCURRENCES} occurrences in "
                                        f"{(end - start).days} days; the later ones are left out"))
    for event in expanded:
        if str(event.get("STATUS", "")).upper() == "CANCELLED":
            continue
        begin, all_day = _as_utc(event.decoded("DTSTART"), local, allday_start)
        if "DTEND" in event:
            finish, _ = _as_utc(event.decoded("DTEND"), local, allday_start)
        elif "DURATION" in event:
            finish = begin + event.decoded("DURATION")
        else:
            finish = begin + (dt.timedelta(days=1) if all_day else dt.timedelta(0))
        if not (start <= begin < end):
            continue
        found.append(Occurrence(uid=str(event.get("UID", "")) or f"{source}:{begin.isoformat()}",
                                summary=_summary(event), location=str(event.get("LOCATION", "")).strip(),
                                categories=_categories(event), start=begin, end=max(finish, begin),
                                all_day=all_day, source=source))
    found.sort(key=lambda o: (o.start, o.uid))
    return CalendarRead(found, problems)


def _skipped(source: str, block: _Block, why: str) -> CalendarProblem:
    """The problem line for an event left out: its calendar, the line of its BEGIN:VEVENT, its title."""
    summary = next((line.split(":", 1)[1] for line in block.lines if _name(line) == "SUMMARY"), "")
    label = f" {summary.strip()!r}" if summary else ""
    return CalendarProblem(source, block.line, f"event{label} skipped: {why}")


def _calendar(skeleton: icalendar.Calendar, events: list[icalendar.Event]) -> icalendar.Calendar:
    """A calendar of ``events`` with the properties and time zones of ``skeleton``."""
    calendar = icalendar.Calendar()
    for key, value in skeleton.property_items(recursive=False):
        if key not in ("BEGIN", "END"):
            calendar.add(key, value)
    for tz in skeleton.walk("VTIMEZONE"):
        calendar.add_component(tz)
    for event in events:
        calendar.add_component(event)
    return calendar


def _subdaily_periods(event: icalendar.Event, end: dt.datetime, local: ZoneInfo, allday_start: dt.time) -> int:
    """How many periods of the event's SECONDLY, MINUTELY or HOURLY rules lie between its DTSTART and `end`
    (bounded by COUNT and UNTIL): what expanding it costs. 0 for any other event."""
    rules = event.get("RRULE")
    if rules is None:
        return 0
    start, _ = _as_utc(event.decoded("DTSTART"), local, allday_start)
    total = 0
    for rule in rules if isinstance(rules, list) else [rules]:
        freq = str((rule.get("FREQ") or [""])[0]).upper()
        if freq not in _PERIOD_SECONDS:
            continue
        stop = end
        until = (rule.get("UNTIL") or [None])[0]
        if isinstance(until, dt.date):
            stop = min(stop, _as_utc(until, local, allday_start)[0])
        period = _PERIOD_SECONDS[freq] * max(int((rule.get("INTERVAL") or [1])[0]), 1)
        periods = max(int((stop - start).total_seconds()) // period + 1, 0)
        count = (rule.get("COUNT") or [None])[0]
        total += min(periods, int(count)) if count is not None else periods
    return total


def _expand(calendar: icalendar.Calendar, start: dt.datetime, end: dt.datetime, local: ZoneInfo,
            allday_start: dt.time) -> list[icalendar.Event]:
    """The occurrences of the calendar's events that may start in [start, end), in the order they start, at most
    MAX_OCCURRENCES + 1 of them: the recurrences are expanded lazily, so an endless one costs no more."""
    expanded: list[icalendar.Event] = []
    # The library orders by its own start, which for an all-day event is up to a day before ours (allday_start).
    stop = end + dt.timedelta(days=2)
    for event in recurring_ical_events.of(calendar).after(start.astimezone(local)):
        if _as_utc(event.decoded("DTSTART"), local, allday_start)[0] >= stop or len(expanded) > MAX_OCCURRENCES:
            break
        expanded.append(event)
    return expanded


def _local_zone() -> ZoneInfo:
    """The machine's time zone (TZ, then /etc/localtime), UTC if none is configured."""
    name = os.environ.get("TZ", "").lstrip(":")
    if not name:
        try:
            target = Path("/etc/localtime").resolve()
            parts = target.parts
            if "zoneinfo" in parts:
                name = "/".join(parts[parts.index("zoneinfo") + 1:])
        except OSError:
            name = ""
    try:
        return ZoneInfo(name or "UTC")
    except (KeyError, ValueError):
        return ZoneInfo("UTC")
