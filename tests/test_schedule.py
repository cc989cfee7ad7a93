"""Hoard scheduling from calendars: iCalendar reading (recurrence, zones, DST, exceptions, broken entries),
site rules, the planning arithmetic, and the runner's persistent state and loop logic."""
from __future__ import annotations

import datetime as dt
import multiprocessing
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from isrctl import calendar as ical
from isrctl.schedule import (PlannedHoard, Runner, RunnerState, ScheduleConfig, ScheduleError, SiteRule,
                             format_plan, hoard_duration, plan)

UTC = dt.timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")

VTIMEZONE_BERLIN = """BEGIN:VTIMEZONE
TZID:Europe/Berlin
BEGIN:DAYLIGHT
TZOFFSETFROM:+0100
TZOFFSETTO:+0200
TZNAME:CEST
DTSTART:19700329T020000
RRULE:FREQ=YEARLY;BYMONTH=3;BYDAY=-1SU
END:DAYLIGHT
BEGIN:STANDARD
TZOFFSETFROM:+0200
TZOFFSETTO:+0100
TZNAME:CET
DTSTART:19701025T030000
RRULE:FREQ=YEARLY;BYMONTH=10;BYDAY=-1SU
END:STANDARD
END:VTIMEZONE"""


def calendar(*events: str, timezone: str = VTIMEZONE_BERLIN) -> bytes:
    body = "\n".join(["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//isr tests//EN", timezone, *events,
                      "END:VCALENDAR", ""])
    return body.replace("\n", "\r\n").encode()


def event(uid: str, *lines: str) -> str:
    return "\n".join(["BEGIN:VEVENT", f"UID:{uid}", "DTSTAMP:20261001T000000Z", *lines, "END:VEVENT"])


def read(data: bytes, start: dt.datetime, days: float = 14, **kwargs: object) -> ical.CalendarRead:
    return ical.occurrences(data, "test.ics", start, start + dt.timedelta(days=days), local=BERLIN, **kwargs)


def utc(*args: int) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)


# --- reading calendars ------------------------------------------------------------------------------------

def test_weekly_recurrence_across_the_dst_change_keeps_local_time() -> None:
    data = calendar(event("standup", "SUMMARY:Standup", "LOCATION:Lab 4",
                          "DTSTART;TZID=Europe/Berlin:20261019T090000",
                          "DTEND;TZID=Europe/Berlin:20261019T093000", "RRULE:FREQ=WEEKLY;COUNT=3"))
    got = read(data, utc(2026, 10, 18), days=21)
    # 09:00 Berlin is 07:00 UTC in summer time and 08:00 UTC after the change on 25 October.
    assert [o.start for o in got.occurrences] == [utc(2026, 10, 19, 7), utc(2026, 10, 26, 8), utc(2026, 11, 2, 8)]
    assert all(o.end - o.start == dt.timedelta(minutes=30) for o in got.occurrences)
    assert got.problems == []


def test_exdate_rdate_override_and_cancellation() -> None:
    data = calendar(
        event("daily", "SUMMARY:Office day", "LOCATION:Office",
              "DTSTART;TZID=Europe/Berlin:20261102T083000", "RRULE:FREQ=DAILY;COUNT=5",
              "EXDATE;TZID=Europe/Berlin:20261103T083000",
              "RDATE;TZID=Europe/Berlin:20261110T120000"),
        # The occurrence of 4 November moved to the afternoon, and the one of 5 November is cancelled.
        event("daily", "SUMMARY:Office day (late)", "LOCATION:Office",
              "RECURRENCE-ID;TZID=Europe/Berlin:20261104T083000", "DTSTART;TZID=Europe/Berlin:20261104T140000"),
        event("daily", "SUMMARY:Office day", "LOCATION:Office", "STATUS:CANCELLED",
              "RECURRENCE-ID;TZID=Europe/Berlin:20261105T083000", "DTSTART;TZID=Europe/Berlin:20261105T083000"),
        event("gone", "SUMMARY:Called off", "STATUS:CANCELLED", "DTSTART:20261103T100000Z"))
    got = read(data, utc(2026, 11, 1))
    local = [(o.start.astimezone(BERLIN).strftime("%d %H:%M"), o.summary) for o in got.occurrences]
    assert local == [("02 08:30", "Office day"), ("04 14:00", "Office day (late)"), ("06 08:30", "Office day"),
                     ("10 12:00", "Office day")]


def test_all_day_and_floating_events_use_the_local_zone() -> None:
    data = calendar(event("trip", "SUMMARY:Offsite", "CATEGORIES:travel,Lab", "DTSTART;VALUE=DATE:20261112",
                          "DTEND;VALUE=DATE:20261114"),
                    event("floating", "SUMMARY:Dentist", "DTSTART:20261113T160000"))
    got = read(data, utc(2026, 11, 10), allday_start=dt.time(7, 30))
    trip, dentist = got.occurrences
    assert trip.all_day and trip.start == utc(2026, 11, 12, 6, 30)  # 07:30 CET
    assert trip.categories == ("travel", "Lab")
    assert not dentist.all_day and dentist.start == utc(2026, 11, 13, 15)


def test_event_zone_given_only_by_tzid_name() -> None:
    data = calendar(event("ny", "SUMMARY:Call", "DTSTART;TZID=America/New_York:20261110T090000"), timezone="")
    (got,) = read(data, utc(2026, 11, 9)).occurrences
    assert got.start == utc(2026, 11, 10, 14)


def test_broken_events_are_named_by_line_and_the_rest_is_still_read() -> None:
    data = calendar(event("ok1", "SUMMARY:First", "DTSTART:20261110T090000Z"),
                    event("bad-date", "SUMMARY:Garbled", "DTSTART:2026XX10T090000Z"),
                    event("no-start", "SUMMARY:Startless"),
                    event("bad-rule", "SUMMARY:Ruleless", "DTSTART:20261111T090000Z", "RRULE:COUNT=3"),
                    event("ok2", "SUMMARY:Second", "DTSTART:20261112T090000Z"))
    got = read(data, utc(2026, 11, 9))
    assert [o.summary for o in got.occurrences] == ["First", "Second"]
    text = data.decode().splitlines()
    for problem, summary in zip(got.problems, ("Garbled", "Startless", "Ruleless")):
        assert problem.source == "test.ics"
        assert text[problem.line - 1] == "BEGIN:VEVENT", problem
        assert summary in problem.message
        assert str(problem).startswith(f"test.ics line {problem.line}: ")
    assert len(got.problems) == 3


def test_unclosed_event_is_reported_and_folded_lines_are_joined() -> None:
    data = (b"BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:x\r\n"
            b"BEGIN:VEVENT\r\nUID:a\r\nSUMMARY:A long\r\n  summary\r\nDTSTART:20261110T090000Z\r\nEND:VEVENT\r\n"
            b"BEGIN:VEVENT\r\nUID:b\r\nSUMMARY:Never closed\r\nDTSTART:20261111T090000Z\r\n"
            b"END:VCALENDAR\r\n")
    got = read(data, utc(2026, 11, 9))
    assert [o.summary for o in got.occurrences] == ["A long summary"]
    assert len(got.problems) == 1 and got.problems[0].line == 10


def test_not_a_calendar_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ical.CalendarError, match="BEGIN:VCALENDAR"):
        read(b"hello\r\n", utc(2026, 11, 9))
    with pytest.raises(ical.CalendarError, match="cannot read calendar"):
        ical.read_source(str(tmp_path / "missing.ics"))
    with pytest.raises(ical.CalendarError, match="https"):
        ical.read_source("http://calendar.example/cal.ics")


# --- site rules and configuration -------------------------------------------------------------------------

def occurrence(summary: str = "Meeting", location: str = "", categories: tuple[str, ...] = (),
               start: dt.datetime = utc(2026, 11, 10, 9)) -> ical.Occurrence:
    return ical.Occurrence(uid=f"uid-{summary}", summary=summary, location=location, categories=categories,
                           start=start, end=start + dt.timedelta(hours=1), all_day=False, source="t")


def test_site_rules_match_location_category_and_summary() -> None:
    assert SiteRule("location", "lab 4").matches(occurrence(location="CMU, Lab 4, 2nd floor"))
    assert not SiteRule("location", "lab 4").matches(occurrence(location="Lab 5"))
    assert SiteRule("category", "travel").matches(occurrence(categories=("Work", "Travel")))
    assert not SiteRule("category", "trav").matches(occurrence(categories=("Travel",)))
    assert SiteRule("summary", r"^review\b").matches(occurrence(summary="Review of ISR"))
    with pytest.raises(ScheduleError, match="regular expression"):
        SiteRule("summary", "(")
    with pytest.raises(ScheduleError, match="unknown site rule kind"):
        SiteRule("room", "x")


def test_config_round_trip_and_one_line_errors(tmp_path: Path) -> None:
    path = tmp_path / "schedule.toml"
    config = ScheduleConfig(site="lab", rules=[SiteRule("location", "Lab 4"), SiteRule("summary", "ISR")],
                            calendars=["/tmp/a.ics"], parcels=["ws"], mode="working-set", margin=0.25)
    config.save(path)
    assert ScheduleConfig.load(path) == config
    assert ScheduleConfig.load(tmp_path / "absent.toml") == ScheduleConfig()
    path.write_text('mode = "sometimes"\n')
    with pytest.raises(ScheduleError, match="mode must be one of"):
        ScheduleConfig.load(path)
    path.write_text('colour = "blue"\n')
    with pytest.raises(ScheduleError, match="unknown setting 'colour'"):
        ScheduleConfig.load(path)
    path.write_text('timezone = "Mars/Olympus"\n')
    with pytest.raises(ScheduleError, match="unknown time zone"):
        ScheduleConfig.load(path)


# --- planning arithmetic ------------------------------------------------------------------------------------

class Inventory:
    """The parcels' state as the planner sees it (a table, for arithmetic tests)."""

    def __init__(self, missing: dict[str, int], version: int = 3) -> None:
        self.missing = missing
        self.version = version
        self.asked: list[tuple[str, str]] = []

    def missing_bytes(self, parcel: str, mode: str) -> tuple[int, int]:
        self.asked.append((parcel, mode))
        return self.missing[parcel], self.version


CONFIG = ScheduleConfig(rules=[SiteRule("location", "Lab")], margin=0.5, overhead_s=60, lead_s=300)


def test_hoard_duration_formula() -> None:
    assert hoard_duration(0, 1e6, CONFIG) == 0
    # 600 MB at 1 MB/s = 600 s, +50 % margin = 900 s, + 60 s overhead.
    assert hoard_duration(600_000_000, 1e6, CONFIG) == pytest.approx(960)


def test_plan_starts_early_enough_and_only_for_matching_events() -> None:
    now = utc(2026, 11, 10, 8)
    meeting = occurrence("Lab meeting", location="Lab", start=utc(2026, 11, 10, 12))
    elsewhere = occurrence("Lunch", location="Cafe", start=utc(2026, 11, 10, 11))
    (p,) = plan([elsewhere, meeting], ["ws"], Inventory({"ws": 600_000_000}), CONFIG, 1e6, now)
    assert p.event is meeting and p.status == "planned"
    assert p.duration_s == pytest.approx(960)
    assert p.start == utc(2026, 11, 10, 12) - dt.timedelta(seconds=300 + 960)
    assert p.finish == p.start + dt.timedelta(seconds=960)
    assert p.finish <= meeting.start and p.throughput_measured


def test_plan_says_when_there_is_not_enough_time() -> None:
    now = utc(2026, 11, 10, 11, 50)
    meeting = occurrence("Lab meeting", location="Lab", start=utc(2026, 11, 10, 12))
    (p,) = plan([meeting], ["ws"], Inventory({"ws": 600_000_000}), CONFIG, 1e6, now)
    assert p.status == "not enough time" and p.start == now
    assert p.late_by_s == pytest.approx(960 - 600)
    text = format_plan([p], UTC)
    assert "not enough time to hoard ws before 'Lab meeting': expected to finish 6 min after it starts" in text


def test_plan_start_now_ready_covered_and_assumed_throughput() -> None:
    now = utc(2026, 11, 10, 11, 30)
    first = occurrence("Lab 1", location="Lab", start=utc(2026, 11, 10, 12))
    second = occurrence("Lab 2", location="Lab", start=utc(2026, 11, 11, 12))
    plans = plan([second, first], ["ws", "old"], Inventory({"ws": 100_000_000, "old": 0}), CONFIG, None, now)
    by = {(p.parcel, p.event.summary): p for p in plans}
    # 100 MB at the assumed 1 MB/s: 150 s + 60 s = 210 s, +300 s lead: should have started at 11:51:30 -> now.
    assert by["ws", "Lab 1"].status == "planned"
    assert by["ws", "Lab 1"].start == utc(2026, 11, 10, 11, 51, 30)
    assert not by["ws", "Lab 1"].throughput_measured
    assert by["ws", "Lab 2"].status == "covered"
    assert by["old", "Lab 1"].status == "ready" and by["old", "Lab 2"].status == "covered"
    late = plan([first], ["ws"], Inventory({"ws": 100_000_000}), CONFIG, None, utc(2026, 11, 10, 11, 55))
    assert late[0].status == "start now"
    text = format_plan(plans, UTC)
    assert "assumed, no hoard measured yet" in text and "Lab 2" in text


# --- the runner -----------------------------------------------------------------------------------------------

def test_runner_state_survives_restarts_and_measures_throughput(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    state = RunnerState()
    state.add_sample(10 << 20, 2.0, when=1000.0)
    state.add_sample(100, 1.0, when=1000.0)  # too small to count
    state.add_sample(30 << 20, 2.0, when=2000.0)
    state.save(path)
    again = RunnerState.load(path)
    assert again.throughput(now=3000.0) == pytest.approx((40 << 20) / 4.0)
    assert again.throughput(now=2000.0 + 31 * 86400) is None
    path.write_text("{not json")
    assert RunnerState.load(path) == RunnerState()


def _mark_many(path: Path, who: str, count: int) -> None:
    for i in range(count):
        with RunnerState.updating(path) as state:
            state.done[f"{who}|{i}"] = 1


def test_runner_state_updates_from_two_processes_are_all_kept(tmp_path: Path) -> None:
    """`isr hoard` and the runner both read, change and write the state: no update may overwrite another."""
    path = tmp_path / "state.json"
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_mark_many, args=(path, who, 150)) for who in ("hoard", "runner")]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
        assert writer.exitcode == 0
    assert len(RunnerState.load(path).done) == 300


class Hoarder:
    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self.runs: list[tuple[str, str]] = []

    def hoard(self, parcel: str, mode: str) -> tuple[int, float]:
        self.runs.append((parcel, mode))
        nbytes = self.inventory.missing[parcel]
        self.inventory.missing[parcel] = 0
        return nbytes, nbytes / 4e6


def test_runner_sleeps_until_the_planned_start_then_hoards_once(tmp_path: Path) -> None:
    cal = tmp_path / "cal.ics"
    cal.write_bytes(calendar(event("m", "SUMMARY:Lab meeting", "LOCATION:Lab 4", "DTSTART:20261110T120000Z")))
    config_path = tmp_path / "schedule.toml"
    ScheduleConfig(rules=[SiteRule("location", "lab")], calendars=[str(cal)], lead_s=300, overhead_s=60,
                   margin=0.5, timezone="UTC").save(config_path)
    inventory = Inventory({"ws": 40_000_000})
    hoarder = Hoarder(inventory)
    clock = [utc(2026, 11, 10, 9)]
    runner = Runner(config_path, tmp_path / "state.json", parcels=lambda c: ["ws"], inventory=inventory,
                    hoarder=hoarder, replan_s=600, clock=lambda: clock[0])
    plans, wait = runner.step()
    assert hoarder.runs == [] and plans[0].status == "planned"
    assert wait == 600  # the start (11:53) is further away than the re-plan interval
    clock[0] = plans[0].start - dt.timedelta(seconds=100)
    _, wait = runner.step()
    assert hoarder.runs == [] and wait == pytest.approx(100)
    clock[0] = plans[0].start
    runner.step()
    assert hoarder.runs == [("ws", "full")]
    # Done is remembered across a restart (a new Runner reading the same state file).
    runner2 = Runner(config_path, tmp_path / "state.json", parcels=lambda c: ["ws"], inventory=inventory,
                     hoarder=hoarder, clock=lambda: clock[0])
    plans, _ = runner2.step()
    assert hoarder.runs == [("ws", "full")] and plans[0].status == "ready"
    assert RunnerState.load(tmp_path / "state.json").throughput() == pytest.approx(4e6)


@pytest.mark.timeout(60)
def test_an_event_recurring_every_second_is_skipped_not_expanded() -> None:
    """Found by fuzzing (doc/fuzzing.md): one RRULE:FREQ=SECONDLY event took 37 s and 486,000 occurrences to read
    for a week, and a MINUTELY one that began a year ago a minute; now such an event is reported and left out,
    and the rest of the calendar is read."""
    data = calendar(event("every-second", "SUMMARY:Tick", "DTSTART:20261101T000000Z", "RRULE:FREQ=SECONDLY"),
                    event("every-minute", "SUMMARY:Tock", "DTSTART:20251101T000000Z", "RRULE:FREQ=MINUTELY"),
                    event("hourly", "SUMMARY:Check", "DTSTART:20261101T000000Z", "RRULE:FREQ=HOURLY;COUNT=600"),
                    event("standup", "SUMMARY:Standup", "DTSTART:20261103T090000Z", "RRULE:FREQ=DAILY;COUNT=3"))
    got = read(data, utc(2026, 11, 1), days=30)
    assert {o.uid for o in got.occurrences} == {"hourly", "standup"}
    assert len(got.occurrences) == 603
    assert [p.line for p in got.problems] == [21, 28]
    assert all("too often to expand" in p.message for p in got.problems)


@pytest.mark.timeout(60)
def test_occurrences_beyond_the_limit_are_left_out_and_said() -> None:
    """A daily rule that expands to every second of the day stops at MAX_OCCURRENCES, with a problem saying so."""
    every_second = ",".join(map(str, range(60)))
    data = calendar(event("busy", "DTSTART:20261101T000000Z",
                          f"RRULE:FREQ=DAILY;BYHOUR=0,1,2,3,4,5;BYMINUTE={every_second};BYSECOND={every_second}"))
    got = read(data, utc(2026, 11, 1), days=30)
    assert len(got.occurrences) == ical.MAX_OCCURRENCES
    assert got.occurrences[-1].start < utc(2026, 11, 1, 3)
    assert [p.line for p in got.problems] == [0]
    assert "more than 10000 occurrences" in got.problems[0].message


def test_an_event_with_two_rrules_is_read_and_a_broken_one_reported() -> None:
    """Found by fuzzing (doc/fuzzing.md): an event with two RRULE lines (RFC 5545 advises against it, but allows
    it) raised AttributeError out of occurrences(), a traceback instead of the calendar."""
    data = calendar(event("two", "DTSTART:20261124T090000Z", "RRULE:FREQ=DAILY;COUNT=2", "RRULE:FREQ=WEEKLY;COUNT=2"),
                    event("broken", "DTSTART:20261124T100000Z", "RRULE:FREQ=DAILY;COUNT=2", "RRULE:COUNT=2"))
    got = read(data, utc(2026, 11, 23), days=10)
    assert [o.start for o in got.occurrences] == [utc(2026, 11, 24, 9), utc(2026, 11, 25, 9), utc(2026, 12, 1, 9)]
    assert [(p.line, p.message) for p in got.problems] == [(28, "event skipped: RRULE without FREQ")]


def test_a_recurrence_that_cannot_be_expanded_skips_that_event_only() -> None:
    """BYHOUR=25 passes the parser but makes the recurrence library fail: that used to fail the whole calendar
    with CalendarError; now that event is skipped with a problem line and the others are still read."""
    data = calendar(event("fine", "SUMMARY:Standup", "DTSTART:20261124T090000Z", "RRULE:FREQ=DAILY;COUNT=2"),
                    event("bad", "SUMMARY:Odd", "DTSTART:20261124T100000Z", "RRULE:FREQ=DAILY;BYHOUR=25"),
                    event("once", "SUMMARY:Review", "DTSTART:20261126T100000Z"))
    got = read(data, utc(2026, 11, 23), days=10)
    assert [(o.uid, o.start) for o in got.occurrences] == [("fine", utc(2026, 11, 24, 9)), ("fine", utc(2026, 11, 25, 9)),
                                                           ("once", utc(2026, 11, 26, 10))]
    (problem,) = got.problems
    assert data.decode().splitlines()[problem.line - 1] == "BEGIN:VEVENT"
    assert problem.message.startswith("event 'Odd' skipped: its recurrence cannot be expanded")


def test_a_recurrence_with_interval_zero_is_skipped_not_expanded_forever() -> None:
    """RRULE INTERVAL=0 made the recurrence library loop forever: `isr schedule show` hung on such a calendar."""
    data = calendar(event("zero", "SUMMARY:Never", "DTSTART:20261124T090000Z", "RRULE:FREQ=DAILY;INTERVAL=0"),
                    event("once", "SUMMARY:Review", "DTSTART:20261126T100000Z"))
    got = read(data, utc(2026, 11, 23), days=10)
    assert [o.uid for o in got.occurrences] == ["once"]
    assert [p.message for p in got.problems] == ["event 'Never' skipped: RRULE with an INTERVAL below 1"]
