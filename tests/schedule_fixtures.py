"""Helpers for the hoard-scheduling tests: calendar files, a site's schedule configuration, its plan and
state, and what the server lists for a version."""
from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.isr_fixtures import IsrEnv, Parcel, Site


def ics_time(when: dt.datetime) -> str:
    return when.astimezone(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def write_calendar(path: Path, events: list[tuple[str, str, dt.datetime]], broken: bool = False) -> Path:
    """An iCalendar file with (summary, location, start) events; with ``broken``, one event with a garbled
    DTSTART between them."""
    lines = ["BEGIN:VCALENDAR", "VERSION:2.0", "PRODID:-//isr tests//EN"]
    for number, (summary, location, start) in enumerate(events):
        lines += ["BEGIN:VEVENT", f"UID:e{number}@isr.test", "DTSTAMP:20260101T000000Z", f"SUMMARY:{summary}",
                  f"LOCATION:{location}", f"DTSTART:{ics_time(start)}",
                  f"DTEND:{ics_time(start + dt.timedelta(hours=1))}", "END:VEVENT"]
        if broken and number == 0:
            lines += ["BEGIN:VEVENT", "UID:broken@isr.test", "DTSTAMP:20260101T000000Z", "SUMMARY:Garbled",
                      "LOCATION:Lab 4", "DTSTART:2026XX10T090000Z", "END:VEVENT"]
    lines.append("END:VCALENDAR")
    path.write_text("\r\n".join(lines) + "\r\n")
    return path


def version_needs(env: IsrEnv, parcel: Parcel, version: int) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """What the server lists for a version: its chunks (tag, size) and its boot files (name -> size)."""
    with env.server.client("alice") as client:
        _, chunks = client.version_chunks(parcel.id, version)
        record = client.version(parcel.id, version)
    blobs = {b["name"]: b["size"] for b in record["blobs"] if b["name"] in ("kernel", "initrd")}
    return chunks, blobs


def cached(site: Site, tag: str) -> bool:
    """Whether the site's chunk cache holds the object ``tag``, intact."""
    path = site.root / "cache" / "isr" / "chunks" / "chunks" / tag[:2] / tag[2:4] / tag
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == tag


def configure(site: Site, calendar: Path, **settings: object) -> None:
    """Events at "Lab 4" mean this site; ``calendar`` is read; ``settings`` as `isr schedule set` takes them."""
    site.isr("site", "add", "--location", "Lab 4")
    site.isr("schedule", "calendar", "add", str(calendar))
    for name, value in settings.items():
        site.isr("schedule", "set", name, str(value))


def plans(site: Site) -> list[dict[str, Any]]:
    """The site's plan, as `isr schedule show --json` prints it."""
    return list(json.loads(site.isr("schedule", "show", "--json").stdout)["plans"])


def runner_state(site: Site) -> dict[str, Any]:
    """The site's `isr schedule run` state (hoards done, throughput samples, history); empty if none yet."""
    try:
        return dict(json.loads((site.root / "data" / "isr" / "schedule-state.json").read_text()))
    except FileNotFoundError:
        return {"done": {}, "samples": [], "history": []}


@contextlib.contextmanager
def schedule_runner(site: Site, log_path: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """`isr schedule run ARGS` at ``site`` as a service would run it (its log in ``log_path``). Leaving the
    block normally stops it with SIGTERM and requires a clean exit (0, no traceback); it is killed anyway."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(site.command("schedule", "run", *args), env=site.environ(), stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        yield proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_path.read_text()
        text = log_path.read_text()
        assert "stopped" in text and "Traceback" not in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
