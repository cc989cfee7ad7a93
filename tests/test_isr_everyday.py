"""What a user reaches for past the demo (issue 18), through the real `isr` against a real isr-server: the
hoard plan with zone labels, deduplicated events and offline planning from the last known state; `isr hoard
--list`, `--check` and `--drop` on the real chunk cache; `isr stat --watch` of a running parcel; `isr mount`
of a parcel's disk through vulpes (FUSE)."""
from __future__ import annotations

import contextlib
import datetime as dt
import errno
import hashlib
import io
import json
import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from isrprogress import LiveView
from tests.conftest import wait_until
from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tools.guest.disk import check_ext4
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _debugfs(image: Path, request: str, *, write: bool = False) -> str:
    result = subprocess.run(["debugfs", *(["-w"] if write else []), "-R", request, str(image)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


@contextlib.contextmanager
def _mounted(site: Site, parcel: Parcel, directory: Path, *args: str) -> Iterator[dict[str, Any]]:
    """`isr mount` at the site; the block must leave it mounted or unmounted, and it is unmounted anyway."""
    record = json.loads(site.isr("mount", parcel.name, str(directory), "--key-file", str(parcel.keyfile), "--json",
                                 *args).stdout)["mount"]
    try:
        yield record
    finally:
        if os.path.ismount(directory):
            site.isr("umount", str(directory), check=False)
            subprocess.run(["fusermount3", "-u", "-z", str(directory)], capture_output=True, timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(record["pid"]), signal.SIGKILL)


def test_mount_serves_the_disk_read_only_and_read_write_as_a_session(isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel = isr_env.make_parcel()
    committed = tmp_path / "v1.img"
    isr_env.extract_disk(parcel, committed, 1)
    directory = tmp_path / "mnt"
    with sites(isr_env, tmp_path, ["lab"]) as (lab,):
        # Not checked out, nothing hoarded: read-only from the server's current version, fetched on demand.
        with _mounted(lab, parcel, directory) as record:
            assert not record["rw"] and record["version"] == 1 and os.path.ismount(directory)
            assert _sha256(directory / "disk") == _sha256(committed)
            status, output = check_ext4(directory / "disk")
            assert status == 0, output
            with pytest.raises(OSError) as refused:
                open(directory / "disk", "r+b")
            assert refused.value.errno == errno.EROFS
            # Live figures of the mounted parcel: a JSON line per update, and plain lines when not a terminal.
            lines = lab.isr("stat", parcel.name, "--watch", "--json", "--count", "2", "--interval", "0.2")
            updates = [json.loads(line) for line in lines.stdout.splitlines()]
            assert len(updates) == 2 and updates[0]["cache_bytes"] > 0 and updates[1]["hoard"]["state"] == "idle"
            assert {"dirty_bytes", "not_uploaded_bytes", "cache_fill", "fetch_bytes_per_s", "upload_bytes_per_s",
                    "demand_misses_per_s"} <= set(updates[0])
            plain = lab.isr("top", parcel.name, "--count", "2", "--interval", "0.2").stdout.splitlines()
            assert len(plain) == 2 and all(f"{parcel.name}: dirty 0 B" in line for line in plain), plain
            # The parcel is busy while mounted: a second mount or a resume is refused with one line.
            other = lab.isr("mount", parcel.name, str(tmp_path / "again"), "--key-file", str(parcel.keyfile),
                            check=False)
            assert other.returncode == 1 and f"mounted on {directory}" in other.stderr
            resume = lab.resume(parcel, check=False)
            assert resume.returncode == 1 and f"is mounted on {directory}: `isr umount" in resume.stderr, resume.stderr
            out = lab.isr("umount", str(directory)).stdout
            assert out.startswith(f"unmounted {parcel.name} from {directory}")
        assert not os.path.ismount(directory) and not (lab.state_dir(parcel) / "mount").exists()
        # --rw needs the lock: refused, nothing left behind.
        result = lab.isr("mount", parcel.name, str(directory), "--rw", "--key-file", str(parcel.keyfile),
                         check=False)
        assert result.returncode == 1 and "needs this site to hold the lock" in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1 and not os.path.ismount(directory)

        # Read-write while holding the lock: a file written into the guest's file system is a local change,
        # checked in like a resume's.
        lab.isr("checkout", parcel.name, "--key-file", str(parcel.keyfile))
        note = tmp_path / "note.txt"
        note.write_text("written through isr mount\n")
        with _mounted(lab, parcel, directory, "--rw") as record:
            assert record["rw"]
            _debugfs(directory / "disk", f"write {note} note.txt", write=True)
            stat = lab.stat(parcel)
            assert stat["local"]["state"] == "running" and stat["mount"]["rw"] and stat["mount"]["dir"] == str(directory)
            assert f"mount     {directory}: version 1, read-write" in lab.isr("stat", parcel.name).stdout
            out = lab.isr("umount", str(directory)).stdout
            assert re.search(r"; [1-9][0-9]* chunks differ from the version checked out: `isr checkin", out), out
        assert lab.stat(parcel)["local"]["state"] == "poweroff"
        # What was written is not uploaded yet: dropping the parcel's chunks keeps it.
        dropped = json.loads(lab.isr("hoard", parcel.name, "--drop", "--json").stdout)["drop"]
        assert dropped["pinned"] > 0
        lab.isr("checkin", parcel.name, "--key-file", str(parcel.keyfile))
        assert isr_env.current_version(parcel) == 2
        isr_env.extract_disk(parcel, committed, 2)
        assert _debugfs(committed, "cat note.txt") == note.read_text()
        status, output = check_ext4(committed)
        assert status == 0, output

        # A --rw mount whose vulpes dies is a crashed session: damaged until discarded.
        lab.isr("checkout", parcel.name, "--key-file", str(parcel.keyfile))
        with _mounted(lab, parcel, directory, "--rw") as record:
            os.kill(int(record["pid"]), signal.SIGKILL)
            wait_until(lambda: lab.stat(parcel)["local"]["state"] == "damaged", 30, "the mount to read as damaged")
            out = lab.isr("umount", str(directory)).stdout
            assert "its vulpes had exited before" in out and f"`isr discard {parcel.name}`" in out, out
        assert not os.path.ismount(directory)
        lab.isr("discard", parcel.name, "--yes")
        assert lab.stat(parcel)["local"] is None


def test_top_follows_a_running_parcel_which_the_plan_shows_as_running(isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel = isr_env.make_parcel()
    now = dt.datetime.now(dt.timezone.utc)
    calendar = write_calendar(tmp_path / "cal.ics", [("Lab day", "Lab 4", now + dt.timedelta(hours=2))])
    with sites(isr_env, tmp_path, ["lab"]) as (lab,):
        configure(lab, calendar, parcels=parcel.name)
        lab.resume(parcel, "--policy", "demand")
        # `isr top` without a name follows the only parcel running here; when not a terminal, a line an update.
        lines = lab.isr("top", "--count", "3", "--interval", "0.3").stdout.splitlines()
        assert len(lines) == 3 and all(f" {parcel.name}: dirty " in line and "misses/s" in line for line in lines)
        updates = [json.loads(line) for line in
                   lab.isr("stat", parcel.name, "--watch", "--json", "--count", "2").stdout.splitlines()]
        assert updates[1]["cache_bytes"] > 0 and updates[1]["cache_fill"] > 0
        # Ctrl-C stops watching, cleanly; the parcel goes on.
        watcher = subprocess.Popen(lab.command("top", parcel.name), env=lab.environ(), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            assert watcher.stdout is not None
            assert parcel.name in watcher.stdout.readline()
            watcher.send_signal(signal.SIGINT)
            _, err = watcher.communicate(timeout=30)
        finally:
            if watcher.poll() is None:
                watcher.kill()
        assert watcher.returncode == 0 and err == "", err
        # The hoard plan does not call a running parcel "0 B ready".
        (plan,) = plans(lab)
        assert plan["status"] == "running here", plan
        assert "running here" in lab.isr("schedule", "show").stdout
        lab.isr("suspend", parcel.name)
        lab.wait_session_end(parcel)
        result = lab.isr("top", parcel.name, check=False)
        assert result.returncode == 1 and "is not in use at this site" in result.stderr


def test_live_view_redraws_on_a_terminal_and_prints_lines_elsewhere() -> None:
    """isrprogress.LiveView, which `isr top` draws with: in place on a terminal (control codes, the last view
    kept), one plain line per update elsewhere."""
    drawn, plain = io.StringIO(), io.StringIO()
    with LiveView(drawn, interactive=True) as view:
        view.show(["p1", "  dirty 1.0 MiB"], "p1: dirty 1.0 MiB")
        view.show(["p1", "  dirty 2.0 MiB"], "p1: dirty 2.0 MiB")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn.getvalue())
    assert "\x1b[" in drawn.getvalue() and text.rstrip().endswith("p1\n  dirty 2.0 MiB")
    with LiveView(plain, interactive=False) as view:
        view.show(["p1", "  dirty 1.0 MiB"], "p1: dirty 1.0 MiB")
        view.show(["p1", "  dirty 2.0 MiB"], "p1: dirty 2.0 MiB")
    assert plain.getvalue() == "p1: dirty 1.0 MiB\np1: dirty 2.0 MiB\n"
