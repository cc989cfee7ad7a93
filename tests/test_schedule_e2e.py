"""Calendar-driven hoarding end to end: a hoard planned from a calendar finishes before the event, re-plans
when a new version is checked in elsewhere, and the resume that follows finds everything local.

Two sites in network namespaces behind 100 Mbit/s links and one isr-server, everything real (TLS, vulpes,
QEMU under TCG). Site A boots the parcel, works and checks in (a third site, C, hoards just the working set
that the commit named, without the key). Site B has a site rule and a calendar with an
event at its location about three minutes ahead; `isr schedule run` at B (a subprocess, as a service would
run it) sleeps until the planned start, hoards without the parcel key and finishes before the event. Site
A then checks in another version; B's runner notices, plans again and hoards the new chunks. Finally B
resumes with the demand policy (which would fetch whatever is missing): vulpes fetches nothing from the
server, no boot file is fetched again, and the guest carries on from A's last state.
"""
from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import (IsrEnv, NetSite, Site, check_continues, isr_env, nets, sites,  # noqa: F401
                                work_and_check_in)
from tests.schedule_fixtures import (cached, configure, plans, runner_state, schedule_runner, version_needs,
                                     write_calendar)

pytestmark = pytest.mark.timeout(900)

#: The event is this far ahead when B is configured; the hoard should start LEAD + its duration before it.
EVENT_AHEAD = dt.timedelta(minutes=3)
LEAD_S = 120


def test_scheduled_hoard_beats_the_event_and_resume_finds_everything_local(isr_env: IsrEnv, nets: list[NetSite],
                                                                           tmp_path: Path) -> None:
    parcel = isr_env.make_parcel("p-sched")
    with sites(isr_env, tmp_path, ["A", "B"], nets) as (a, b):
        # Site A: boot, work, suspend and check in version 2.
        marks = work_and_check_in(a, parcel, "site-a")
        assert isr_env.current_version(parcel) == 2

        # The commit named the working set's tags, so a keyless hoard can fetch just those (site C).
        with isr_env.server.client("alice") as client:
            recorded, working = client.version_chunks(parcel.id, 2, "working")
            _, everything = client.version_chunks(parcel.id, 2)
        assert recorded and working and {t for t, _ in working} < {t for t, _ in everything}
        c = Site("C", tmp_path / "C", isr_env)
        try:
            c.login()
            out = c.isr("hoard", parcel.name, "--no-key", "--working-set").stdout
            assert f"hoarded {parcel.name} version 2: {len(working)} chunks" in out, out
            assert {t for t, _ in everything if cached(c, t)} == {t for t, _ in working}
        finally:
            c.cleanup()

        # Site B: events in Lab 4 mean this PC; one is three minutes ahead (lunch is elsewhere).
        now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
        event = now + EVENT_AHEAD
        calendar = write_calendar(tmp_path / "calendar.ics", [("Lunch", "Cafe", now + dt.timedelta(minutes=1)),
                                                              ("ISR review", "CMU, Lab 4", event)])
        configure(b, calendar, lead_s=LEAD_S, overhead_s=5, margin=0.5, assumed_bytes_per_s=5e6,
                  parcels=parcel.name)
        (plan,) = plans(b)
        planned_start = dt.datetime.fromisoformat(plan["hoard_start"])
        assert plan["event"] == "ISR review" and plan["status"] == "planned" and plan["version"] == 2
        assert planned_start > dt.datetime.now(dt.timezone.utc), "the runner should have to wait"
        chunks, _ = version_needs(isr_env, parcel, 2)
        assert not any(cached(b, tag) for tag, _ in chunks)

        log_path = tmp_path / "schedule-run.log"
        with schedule_runner(b, log_path, "--watch", "2", "--replan", "60"):
            history = wait_until(lambda: runner_state(b)["history"], 240, "the planned hoard")
            first = history[0]
            print(f"first hoard: {first}; planned start {planned_start}, event {event}")
            assert first["version"] == 2
            assert first["started"] >= planned_start.timestamp() - 2, "the runner did not wait for the planned start"
            assert first["finished"] < event.timestamp(), "the hoard finished after the event started"
            assert all(cached(b, tag) for tag, _ in chunks)

            # A new version is checked in at A: B's runner notices, plans again and hoards its new chunks.
            suspended = time.time()
            marks = work_and_check_in(a, parcel, "site-a-again", marks)
            assert isr_env.current_version(parcel) == 3
            history = wait_until(lambda: runner_state(b)["history"][1:], 120, "a hoard of version 3")
            second = history[0]
            assert second["version"] == 3 and second["started"] >= suspended
            assert second["finished"] < event.timestamp()
            chunks, _ = version_needs(isr_env, parcel, 3)
            assert all(cached(b, tag) for tag, _ in chunks)
        print(log_path.read_text())
        assert "planning again" in log_path.read_text()

        # B resumes with the demand policy: every chunk and both boot files are already here.
        out = b.resume(parcel, "--policy", "demand").stdout
        print(out)
        assert "version 3 resumed" in out and "fetching boot file" not in out, out
        with b.console(parcel) as console:
            check_continues(console, marks)
        vulpes = b.stat(parcel)["session_status"]["vulpes"]
        assert vulpes["fetch"]["fetches"] == 0 and vulpes["fetch"]["bytes"] == 0, vulpes["fetch"]
        assert vulpes["hits"]["server"] == 0 and vulpes["hits"]["cache"] > 0, vulpes["hits"]
        b.isr("suspend", parcel.name, "--no-checkin")
        b.wait_session_end(parcel)
