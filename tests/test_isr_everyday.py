"""What a user reaches for past the demo (issue 18), through the real `isr` against a real isr-server: the
hoard plan with zone labels, deduplicated events and offline planning from the last known state; `isr hoard
--list`, `--check` and `--drop` on the real chunk cache; `isr stat --watch` of a running parcel; `isr mount`
of a parcel's disk through vulpes (FUSE)."""
from __future__ import annotations

import datetime as dt
import json
import re
import socket
from pathlib import Path

import pytest

from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import IsrEnv, isr_env, sites  # noqa: F401  (isr_env: pytest fixture)
from tests.schedule_fixtures import configure, plans, write_calendar

pytestmark = pytest.mark.timeout(300)


def _dead_server() -> str:
    """An https URL where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"https://127.0.0.1:{s.getsockname()[1]}"


def test_schedule_show_labels_zones_lists_events_once_and_plans_offline(isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel = isr_env.make_parcel()
    now = dt.datetime.now(dt.timezone.utc)
    events = [("Standup", "Lab 4", now + dt.timedelta(hours=3)), ("Review", "Lab 4", now + dt.timedelta(hours=30))]
    work = write_calendar(tmp_path / "work.ics", events)
    # The same events in a second calendar (a shared team calendar, say), plus one of its own.
    team = write_calendar(tmp_path / "team.ics", [*events, ("Retro", "Lab 4", now + dt.timedelta(hours=50))])
    with sites(isr_env, tmp_path, ["lab"]) as (lab,):
        configure(lab, work, parcels=parcel.name, timezone="Europe/Berlin")
        lab.isr("schedule", "calendar", "add", str(team))
        online = lab.isr("schedule", "show").stdout
        rows = [line for line in online.splitlines() if line.startswith(("Standup", "Review", "Retro"))]
        assert [r.split()[0] for r in rows] == ["Standup", "Review", "Retro"], online
        # Every time carries its zone's label (Berlin is CET in winter, CEST in summer).
        assert all(re.search(r"\d\d:\d\d CES?T", r) for r in rows), online
        shown = json.loads(lab.isr("schedule", "show", "--json").stdout)
        assert shown["zone"] == "Europe/Berlin" and shown["offline"] is None
        # With the server away the plan is made from the last known state, and one line says so.
        config = lab.root / "config" / "isr" / "config.toml"
        config.write_text(re.sub(r'server = "[^"]*"', f'server = "{_dead_server()}"', config.read_text()))
        result = lab.isr("schedule", "show")
        first, *rest = result.stdout.splitlines()
        assert first.startswith("the server is unreachable (") and "planned from the last known state, of" in first
        assert rest == online.splitlines(), result.stdout
        offline = json.loads(lab.isr("schedule", "show", "--json").stdout)
        assert offline["plans"] == shown["plans"] and offline["offline"].startswith("the server is unreachable")
        # A site that never planned with the server says only that the server is unreachable.
        with sites(isr_env, tmp_path, ["hotel"]) as (hotel,):
            configure(hotel, work, parcels=parcel.name)
            hotel_config = hotel.root / "config" / "isr" / "config.toml"
            hotel_config.write_text(re.sub(r'server = "[^"]*"', f'server = "{_dead_server()}"',
                                           hotel_config.read_text()))
            result = hotel.isr("schedule", "show", check=False)
            assert result.returncode == 1 and result.stderr.startswith("isr: the server is unreachable")
            assert result.stderr.count("\n") == 1
        assert plans(lab) == shown["plans"]
