"""`isr site`, `isr schedule` and `isr hoard --no-key` without a running VM, against a real isr-server: site
rules and calendars on the command line, the plan table (with a broken calendar entry named by its line and
the rest still planned), keyless hoards into the real chunk cache (the boot files checked by the next keyed
use), `isr schedule run --once`, and a `schedule run` that stops cleanly on SIGTERM."""
from __future__ import annotations

import datetime as dt
import subprocess
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import ISR, IsrEnv, Site, isr_env, sites  # noqa: F401  (isr_env: pytest fixture)
from tests.schedule_fixtures import (cached, configure, plans, runner_state, schedule_runner, version_needs,
                                     write_calendar)

pytestmark = pytest.mark.timeout(300)


def test_help_explains_site_and_schedule(isr_env: IsrEnv, tmp_path: Path) -> None:
    site = Site("A", tmp_path / "A", isr_env)
    top = site.isr("--help").stdout
    assert "site" in top and "schedule" in top
    assert "--location" in site.isr("site", "add", "--help").stdout
    text = site.isr("schedule", "--help").stdout
    for word in ("calendar", "show", "run", "set", "systemd"):
        assert word in text
    assert "--once" in site.isr("schedule", "run", "--help").stdout
    assert "--no-key" in site.isr("hoard", "--help").stdout


def test_site_rules_calendars_and_settings(isr_env: IsrEnv, tmp_path: Path) -> None:
    site = Site("A", tmp_path / "A", isr_env)
    assert "no site rules" in site.isr("site", "ls").stdout
    site.isr("site", "add", "--location", "Lab 4")
    site.isr("site", "add", "--summary", "^Review")
    site.isr("site", "add", "--category", "travel")
    listed = site.isr("site", "ls").stdout.splitlines()
    assert [line.split()[1] for line in listed] == ["location", "summary", "category"]
    site.isr("site", "rm", "2")
    site.isr("site", "rm", "--category", "travel")
    assert site.isr("site", "ls").stdout.split() == ["1", "location", "Lab", "4"]
    for args, words in ((["site", "add", "--summary", "("], "regular expression"),
                        (["site", "rm", "7"], "isr site ls"),
                        (["schedule", "calendar", "add", str(tmp_path / "none.ics")], "cannot read calendar"),
                        (["schedule", "calendar", "add", "http://example.org/cal.ics"], "https"),
                        (["schedule", "set", "margin", "lots"], "must be a number"),
                        (["schedule", "set", "mode", "sometimes"], "mode must be one of"),
                        (["schedule", "set", "colour", "blue"], "unknown setting")):
        result = site.isr(*args, check=False)
        assert result.returncode == 1 and result.stderr.count("\n") == 1 and words in result.stderr, result.stderr
    now = dt.datetime.now(dt.timezone.utc)
    calendar = write_calendar(tmp_path / "cal.ics", [("Lab meeting", "Lab 4", now + dt.timedelta(hours=2)),
                                                     ("Lunch", "Cafe", now + dt.timedelta(hours=3))])
    out = site.isr("schedule", "calendar", "add", str(calendar)).stdout
    assert "2 events in the next 7 days, 1 of them at this PC" in out
    assert site.isr("schedule", "calendar", "ls").stdout.strip() == str(calendar)
    site.isr("schedule", "set", "lead_s", "90")
    site.isr("schedule", "set", "parcels", "a, b")
    settings = site.isr("schedule", "set").stdout
    assert "lead_s = 90.0" in settings and "parcels = ['a', 'b']" in settings
    site.isr("schedule", "calendar", "rm", str(calendar))
    assert "no calendars" in site.isr("schedule", "calendar", "ls").stdout
    # A hand-edited file that is broken is named, with what to change.
    (tmp_path / "A" / "config" / "isr" / "schedule.toml").write_text('colour = "blue"\n')
    result = site.isr("site", "ls", check=False)
    assert result.returncode == 1 and "unknown setting 'colour'" in result.stderr


def test_plan_table_names_a_broken_entry_and_plans_the_rest(isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel = isr_env.make_parcel()
    chunks, blobs = version_needs(isr_env, parcel, 1)
    missing = sum(size for _, size in chunks) + sum(blobs.values())
    now = dt.datetime.now(dt.timezone.utc)
    soon, later = now + dt.timedelta(minutes=2), now + dt.timedelta(hours=5)
    calendar = write_calendar(tmp_path / "cal.ics", [("Standup", "Lab 4, 2nd floor", soon),
                                                     ("Lunch", "Cafe", now + dt.timedelta(hours=1)),
                                                     ("Design review", "Lab 4", later)], broken=True)
    with sites(isr_env, tmp_path, ["lab"]) as (lab,):
        # At an assumed 200 kB/s the hoard takes minutes: not enough time before the standup.
        configure(lab, calendar, lead_s=300, overhead_s=30, margin=0.5, assumed_bytes_per_s=2e5,
                  parcels=parcel.name, timezone="UTC")
        out = lab.isr("schedule", "show").stdout
        header, *rows = out.splitlines()
        for column in ("event", "place", "starts", "missing", "hoard starts", "expected done", "status"):
            assert column in header
        standup = next(r for r in rows if r.startswith("Standup"))
        assert "not enough time" in standup and "Lab 4, 2nd floor" in standup
        assert next(r for r in rows if r.startswith("Design review")).rstrip().endswith("covered")
        assert not any(r.startswith("Lunch") for r in rows)
        assert f"warning: not enough time to hoard {parcel.name} before 'Standup'" in out
        # The garbled event is named by the line where it begins; the others are still planned.
        problem = next(r for r in rows if "Garbled" in r)
        line = int(problem.split(" line ", 1)[1].split(":", 1)[0])
        assert calendar.read_text().splitlines()[line - 1] == "BEGIN:VEVENT"
        assert problem.startswith(f"warning: {calendar} line {line}: event 'Garbled' skipped")
        (plan,) = [p for p in plans(lab) if p["event"] == "Standup"]
        assert plan["missing_bytes"] == missing and plan["status"] == "not enough time"
        assert plan["duration_s"] == pytest.approx(30 + missing / 2e5 * 1.5)
        # With a fast link and a short lead the hoard is planned ahead, ending lead_s before the event.
        lab.isr("schedule", "set", "lead_s", "60")
        lab.isr("schedule", "set", "assumed_bytes_per_s", "1e8")
        (plan,) = [p for p in plans(lab) if p["event"] == "Standup"]
        finish = dt.datetime.fromisoformat(plan["expected_finish"])
        assert plan["status"] == "planned" and finish == soon.replace(microsecond=0) - dt.timedelta(seconds=60)
        # A calendar that cannot be read is a warning; the plan goes on without it.
        calendar.unlink()
        result = lab.isr("schedule", "show")
        assert f"warning: {calendar}: not read: cannot read calendar" in result.stdout


def test_keyless_hoard_fetches_everything_and_the_next_keyed_use_checks_it(isr_env: IsrEnv,
                                                                           tmp_path: Path) -> None:
    parcel = isr_env.make_parcel()
    chunks, blobs = version_needs(isr_env, parcel, 1)
    with sites(isr_env, tmp_path, ["home", "hotel"]) as (home, hotel):
        out = home.isr("hoard", parcel.name, "--no-key").stdout
        assert f"hoarded {parcel.name} version 1: {len(chunks)} chunks and 2 boot files fetched" in out, out
        assert all(cached(home, tag) for tag, _ in chunks)
        for name, size in blobs.items():
            assert (home.state_dir(parcel) / "blobs" / f"v1.{name}").stat().st_size == size
        # The throughput was measured for the scheduler.
        state = runner_state(home)
        assert len(state["samples"]) == 1 and state["samples"][0][1] >= sum(s for _, s in chunks)
        # Version 1 (made by isr-admin) has no recorded working set: a working-set hoard takes everything.
        out = home.isr("hoard", parcel.name, "--no-key", "--working-set").stdout
        assert "hoarding everything" in out
        # Nothing is fetched twice; without a key and without a terminal, isr hoards without the key.
        out = home.isr("hoard", parcel.name, input_text="").stdout
        assert "hoarding without the key" in out and "0 chunks and 0 boot files fetched" in out
        # The next keyed use opens the sealed boot files, checks them against the manifest and files them
        # by payload digest: nothing is fetched again.
        out = home.isr("hoard", parcel.name, "--keyfile", str(parcel.keyfile)).stdout
        assert "fetching boot file" not in out, out
        filed = [p for p in (home.state_dir(parcel) / "blobs").iterdir() if len(p.name) == 64]
        assert sorted(p.stat().st_size for p in filed) == sorted(blobs.values())

        # A damaged keyless copy is never used: the keyed use fetches the file again.
        hotel.isr("hoard", parcel.name, "--no-key")
        kernel = hotel.state_dir(parcel) / "blobs" / "v1.kernel"
        data = bytearray(kernel.read_bytes())
        data[len(data) // 2] ^= 1
        kernel.write_bytes(bytes(data))
        out = hotel.isr("hoard", parcel.name, "--keyfile", str(parcel.keyfile)).stdout
        assert "fetching boot file kernel" in out and "fetching boot file initrd" not in out, out


def test_schedule_run_once_hoards_what_is_due_and_remembers_it(isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel = isr_env.make_parcel()
    chunks, _ = version_needs(isr_env, parcel, 1)
    now = dt.datetime.now(dt.timezone.utc)
    calendar = write_calendar(tmp_path / "cal.ics", [("Lab meeting", "Lab 4", now + dt.timedelta(minutes=20))])
    with sites(isr_env, tmp_path, ["lab"]) as (lab,):
        configure(lab, calendar, lead_s=1200, overhead_s=5, parcels=parcel.name)
        (plan,) = plans(lab)
        assert plan["status"] == "start now" and not plan["throughput_measured"]
        out = lab.isr("schedule", "run", "--once")
        assert "hoarding" in out.stderr and "hoarded" in out.stderr
        assert all(cached(lab, tag) for tag, _ in chunks)
        (done,) = runner_state(lab)["history"]
        assert done["version"] == 1 and done["finished"] < done["event_start"]
        (plan,) = plans(lab)
        assert plan["status"] == "ready" and plan["missing_bytes"] == 0 and plan["throughput_measured"]
        assert "hoarded " + parcel.name in lab.isr("schedule", "show").stdout
        # Run again: nothing is due, nothing is fetched.
        out = lab.isr("schedule", "run", "--once")
        assert "hoarding" not in out.stderr


def test_schedule_run_waits_and_stops_cleanly_on_sigterm(isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel = isr_env.make_parcel()
    now = dt.datetime.now(dt.timezone.utc)
    calendar = write_calendar(tmp_path / "cal.ics", [("Offsite", "Lab 4", now + dt.timedelta(days=2))])
    with sites(isr_env, tmp_path, ["lab"]) as (lab,):
        configure(lab, calendar, lead_s=60, parcels=parcel.name)
        log_path = tmp_path / "run.log"
        with schedule_runner(lab, log_path, "--watch", "1"):
            wait_until(lambda: "next look in" in log_path.read_text(), 60, "the runner to plan")
            second = lab.isr("schedule", "run", check=False)
            assert second.returncode == 1 and "another `isr schedule run` is running" in second.stderr
            # Editing the calendar makes it plan again at once.
            write_calendar(calendar, [("Offsite", "Lab 4", now + dt.timedelta(days=1))])
            wait_until(lambda: "planning again" in log_path.read_text(), 30, "a re-plan after the edit")
        # (leaving the block sent SIGTERM and checked the clean exit)


def test_systemd_user_unit_is_valid(source_dir: Path, tmp_path: Path) -> None:
    """contrib/systemd/isr-schedule.service, installed as doc/isrctl.md says, passes systemd's own check."""
    template = (source_dir / "contrib" / "systemd" / "isr-schedule.service").read_text()
    assert "ExecStart=@ISR@ schedule run" in template and "Restart=on-failure" in template
    unit = tmp_path / "isr-schedule.service"
    unit.write_text(template.replace("@ISR@", str(ISR)))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    assert "sed \"s|@ISR@|$(command -v isr)|\" contrib/systemd/isr-schedule.service" in \
        (source_dir / "doc" / "isrctl.md").read_text()
