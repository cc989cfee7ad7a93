"""`isr` through a flaky link: a site whose every connection to isr-server (the `isr` command's own and
vulpes's HTTP/2 one) goes through toxiproxy, which resets, delays and cuts them. The guest resumes and goes
on through the faults; a suspend through a reset ends with one line and keeps the state here (no version is
half committed), and the checkin afterwards commits it, also while the uploads are being cut. A suspend's checkin stages the new
version's blobs (keyrings, device state, manifest) while vulpes is still uploading the chunks; staged blobs are
no version: a session killed (-9) then leaves the server at the old version, and the checkin afterwards
uploads the rest and commits a version that resumes at another site."""
from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import (GuestMarks, IsrEnv, Parcel, Site, check_continues, isr_env,  # noqa: F401
                                make_changes, one_line_error, sites)
from tests.toxiproxy_fixtures import Proxy, Toxiproxy, toxiproxy  # noqa: F401  (toxiproxy: pytest fixture)

pytestmark = pytest.mark.timeout(420)


@pytest.fixture
def proxy(toxiproxy: Toxiproxy, isr_env: IsrEnv) -> Iterator[Proxy]:  # noqa: F811
    made = toxiproxy.proxy(f"isr-{uuid.uuid4().hex[:8]}", listen=("127.0.0.1", 0), upstream=("127.0.0.1", isr_env.port))
    try:
        yield made
    finally:
        made.remove()


def log_grows(path: Path, since: int, text: str) -> bool:
    """Whether ``text`` was written to the log at ``path`` after its first ``since`` bytes."""
    try:
        with open(path, "rb") as f:
            f.seek(since)
            return text.encode() in f.read()
    except FileNotFoundError:
        return False


def continues_at(site: Site, parcel: Parcel, marks: GuestMarks) -> None:
    """Resume the committed version at ``site``, check the guest goes on from ``marks``, suspend it there."""
    site.resume(parcel)
    with site.console(parcel) as console:
        check_continues(console, marks)
    site.isr("suspend", parcel.name, "--no-checkin")
    site.wait_session_end(parcel)


def test_resume_suspend_and_checkin_through_a_flaky_link(isr_env: IsrEnv, proxy: Proxy,  # noqa: F811
                                                         tmp_path: Path) -> None:
    parcel = isr_env.make_parcel()
    with sites(isr_env, tmp_path, ["A"], servers=[proxy.address]) as (a,):
        vulpes_log = a.state_dir(parcel) / "vulpes.log"
        # Resume over a link with delay spikes, then reset every connection while the guest boots.
        with proxy.toxic("latency", latency=100, jitter=100), \
                proxy.toxic("latency", stream="upstream", latency=100, jitter=100):
            a.resume(parcel, "--policy", "demand")
            with proxy.toxic("reset_peer", timeout=0):
                wait_until(lambda: log_grows(vulpes_log, 0, "server trouble"), 60, "vulpes to meet the resets")
            with a.console(parcel) as console:
                console.wait_ready(120)
                marks = make_changes(console, "flaky", megabytes=1)
        wait_until(lambda: log_grows(vulpes_log, 0, "server reachable again"), 60, "vulpes to reach the server again")

        # A suspend through a reset: the VM state is safe here, the server is not asked to commit anything.
        with proxy.toxic("reset_peer", timeout=0):
            result = a.isr("suspend", parcel.name, check=False)
            a.wait_session_end(parcel)
        one_line_error(result, "the server does not answer", "kept at this site", f"isr checkin {parcel.name}")
        assert isr_env.current_version(parcel) == 1
        info = a.stat(parcel)
        assert info["local"]["state"] == "suspended" and info["lock"] is not None, info

        # The checkin while every upload is cut after 60 kB: one line, nothing committed, the state kept.
        with proxy.toxic("limit_data", stream="upstream", bytes=60_000):
            one_line_error(a.isr("checkin", parcel.name, "--keyfile", str(parcel.keyfile), check=False),
                           "the server is unreachable", "PUT")
        assert isr_env.current_version(parcel) == 1
        assert a.stat(parcel)["local"]["state"] == "suspended"

        # The link is sound again: the checkin commits, and the guest goes on from where it was.
        assert "committed version 2" in a.isr("checkin", parcel.name, "--keyfile", str(parcel.keyfile)).stdout
        isr_env.check_committed_disk(parcel, tmp_path)
        continues_at(a, parcel, marks)


def test_blobs_staged_during_the_upload_are_no_version_until_the_commit(isr_env: IsrEnv, proxy: Proxy,  # noqa: F811
                                                                         tmp_path: Path) -> None:
    """The chunk upload is slowed (150 KB/s a connection: vulpes runs up to 32) so that it is caught half way;
    the blobs go over a connection of their own."""
    parcel = isr_env.make_parcel()
    with sites(isr_env, tmp_path, ["A", "B"], servers=[proxy.address, f"127.0.0.1:{isr_env.port}"]) as (a, b):
        a.resume(parcel, "--policy", "demand")
        with a.console(parcel) as console:
            console.wait_ready(120)
            marks = make_changes(console, "staged", megabytes=8)
        info = a.session(parcel)
        assert info is not None

        # Uploads at 150 KB/s a connection, up to 32 of them: the chunks (tens of MiB of RAM and disk) take
        # many seconds.
        with proxy.toxic("bandwidth", stream="upstream", rate=150):
            suspend = subprocess.Popen(a.command("suspend", parcel.name), env=a.environ(), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
            try:
                manifests = isr_env.store / "staging" / parcel.id
                wait_until(lambda: any(manifests.glob("*/manifest")), 120, "the manifest to be staged")
                os.kill(int(info["pid"]), signal.SIGKILL)
                os.kill(int(info["vulpes_pid"]), signal.SIGKILL)
            finally:
                out = suspend.communicate(timeout=60)[0]
            a.wait_session_end(parcel)
        assert "safe at this site" in out, out
        assert isr_env.current_version(parcel) == 1, "staged blobs became a version without a commit"
        assert a.stat(parcel)["local"]["state"] == "suspended"

        # The checkin sends what vulpes had not (so the blobs really were staged half way through the upload).
        checkin = a.isr("checkin", parcel.name, "--keyfile", str(parcel.keyfile)).stdout
        assert "uploading chunks" in checkin and "committed version 2" in checkin, checkin
        isr_env.check_committed_disk(parcel, tmp_path)
        continues_at(b, parcel, marks)
