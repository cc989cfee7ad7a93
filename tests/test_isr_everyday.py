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
from tests.isr_fixtures import IsrEnv, Parcel, Site, isr_env, sites  # noqa: F401  (isr_env: pytest fixture)
from tests.schedule_fixtures import cached, configure, plans, version_needs, write_calendar

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


def _hoarded(site: Site) -> dict[str, dict[str, object]]:
    listed = json.loads(site.isr("hoard", "--list", "--json").stdout)
    return {p["name"]: p for p in listed["parcels"]}


def _copy(env: IsrEnv, parcel: Parcel) -> Parcel:
    """A copy of the parcel's current version (its chunks are shared on the server, and so in a cache)."""
    name = parcel.name + "-copy"
    made = env.server.admin_json("parcel", "copy", f"alice/{parcel.name}", "--owner", "alice", "--name", name,
                                 "--key-file", str(parcel.keyfile))
    return Parcel(name=name, id=made["id"], keyfile=parcel.keyfile)


def test_hoard_list_check_and_drop(isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel, other = isr_env.make_parcel(), isr_env.make_parcel()
    copy = _copy(isr_env, parcel)
    chunks, _ = version_needs(isr_env, parcel, 1)
    with sites(isr_env, tmp_path, ["home"]) as (home,):
        listed = _hoarded(home)
        assert listed[parcel.name]["cached"] == 0 and listed[parcel.name]["chunks"] == len(chunks)
        for p in (parcel, other):
            home.isr("hoard", p.name, "--no-key")
        listed = _hoarded(home)
        for p in (parcel, other):
            assert listed[p.name]["cached"] == listed[p.name]["chunks"] and listed[p.name]["fraction"] == 1.0
        # The copy's chunks are the same objects: they are in the cache too, though it was never hoarded here.
        assert listed[copy.name]["cached"] == listed[copy.name]["chunks"]
        table = home.isr("hoard", "--list").stdout
        assert re.search(rf"{parcel.name} +1 +{len(chunks)} of {len(chunks)} \(100%\)", table), table

        # A damaged object is found, quarantined (out of the cache, kept aside) and fetched again later.
        tag = chunks[len(chunks) // 2][0]
        path = home.root / "cache" / "isr" / "chunks" / "chunks" / tag[:2] / tag[2:4] / tag
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
        result = home.isr("hoard", parcel.name, "--check", check=False)
        assert result.returncode == 1 and "1 bad, quarantined" in result.stdout, result.stdout + result.stderr
        assert result.stderr.count("\n") == 1 and "were bad or unreadable" in result.stderr
        assert not path.exists() and list((home.root / "cache" / "isr" / "chunks" / "quarantine").glob(tag + ".*"))
        checked = json.loads(home.isr("hoard", parcel.name, "--check", "--json").stdout)["check"]
        assert checked["bad"] == [] and checked["absent"] == 1 and checked["present"] == len(chunks) - 1
        out = home.isr("hoard", parcel.name, "--no-key").stdout
        assert "1 of " in out and cached(home, tag), out

        # Dropping it frees its chunks, and never another parcel's here.
        dropped = json.loads(home.isr("hoard", parcel.name, "--drop", "--json").stdout)["drop"]
        assert dropped["objects"] == len(chunks) and dropped["shared"] == 0 and dropped["pinned"] == 0
        assert dropped["bytes"] == sum(size for _, size in chunks)
        listed = _hoarded(home)
        assert listed[parcel.name]["cached"] == 0 and listed[other.name]["cached"] == listed[other.name]["chunks"]
        # With its copy hoarded here too, the shared chunks stay.
        for p in (parcel, copy):
            home.isr("hoard", p.name, "--no-key")
        out = home.isr("hoard", parcel.name, "--drop").stdout
        assert f"dropped 0 chunks of {parcel.name}" in out and f"kept {len(chunks)} shared with another parcel" in out
        assert all(cached(home, t) for t, _ in chunks)
        for args, words in ((["hoard"], "name the parcel"), (["hoard", "--list", "--drop"], "not allowed with")):
            result = home.isr(*args, check=False)
            assert result.returncode in (1, 2) and words in result.stderr, result.stderr
