"""`isr resume` in the foreground (Ctrl-C suspends), `sync` (a version, keeping the lock), `poweroff`
(forgetting the RAM: the next resume boots cold) and `rollback` (a new version with an old one's content),
with a real session on loopback."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import IsrEnv, check_continues, isr_env, make_changes, sites  # noqa: F401

pytestmark = pytest.mark.timeout(400)


def test_foreground_sync_poweroff_rollback(isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel = isr_env.make_parcel("versions")
    with sites(isr_env, tmp_path, ["A"]) as (a,):
        # Foreground: the session runs in `isr resume` itself; Ctrl-C suspends and checks in.
        # Its own process group, so that a Ctrl-C can be sent the way a terminal sends it: to the whole group.
        proc = subprocess.Popen(a.command("resume", parcel.name, "--vnc", "unix", "--keyfile", str(parcel.keyfile)),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=a.environ(),
                                process_group=0)
        try:
            assert proc.stdout is not None
            seen = []
            deadline = time.monotonic() + 120
            for line in proc.stdout:
                seen.append(line)
                if line.startswith("running;"):
                    break
                assert time.monotonic() < deadline, "".join(seen)
            else:
                pytest.fail("isr resume ended early:\n" + "".join(seen) + a.logs())
            with a.console(parcel) as console:
                console.wait_ready(90)
                first = make_changes(console, "first")
            os.killpg(proc.pid, signal.SIGINT)
            rest, _ = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, "".join(seen) + rest
        assert "committed version 2" in rest
        assert isr_env.current_version(parcel) == 2

        # sync: a new version, and this site keeps the lock.
        a.resume(parcel)
        with a.console(parcel) as console:
            check_continues(console, first)
            second = make_changes(console, "second")
        out = a.isr("suspend", parcel.name, "--no-checkin").stdout
        assert "not checked in" in out
        a.wait_session_end(parcel)
        info = a.stat(parcel)
        assert info["local"]["state"] == "suspended" and info["lock"] is not None
        assert info["images"]["memory"]["changed_chunks"] > 0

        # A damaged working-set record only costs the prefetch: the resume warns and the guest carries on.
        local = a.state_dir(parcel) / "local.json"
        record = json.loads(local.read_text())
        record["working_set"]["memory"] = [0, 10**9]
        local.write_text(json.dumps(record))
        out = a.resume(parcel, "--policy", "lazy-ws").stdout
        assert "warning: the recorded working set is ignored (its memory list names chunks this version's " \
               "memory image does not have)" in out, out
        with a.console(parcel) as console:
            check_continues(console, second)
        a.isr("suspend", parcel.name, "--no-checkin")
        a.wait_session_end(parcel)
        assert "committed version 3" in a.isr("sync", parcel.name, "--keyfile", str(parcel.keyfile)).stdout
        info = a.stat(parcel)
        assert info["version"] == 3 and info["lock"] is not None and info["local"] is None

        # poweroff: version 4 keeps the disk but forgets the RAM; the next resume boots cold.
        a.isr("poweroff", parcel.name, "--keyfile", str(parcel.keyfile))
        assert isr_env.current_version(parcel) == 4
        manifest = isr_env.check_committed_disk(parcel, tmp_path)
        assert not manifest.suspended and manifest.images["memory"].chunks == 0
        assert a.stat(parcel)["lock"] is None
        out = a.resume(parcel).stdout
        assert "booted cold" in out
        with a.console(parcel) as console:
            console.wait_ready(90)
            assert console.token() == ""
            assert console.check(f"md5sum {second.file}").split()[0] == second.digest
        a.isr("suspend", parcel.name)
        a.wait_session_end(parcel)
        assert isr_env.current_version(parcel) == 5

        # rollback: version 6 holds version 2's content, so the guest continues from the first suspend.
        out = a.isr("rollback", parcel.name, "2", "--keyfile", str(parcel.keyfile)).stdout
        assert "version 6" in out and "version 2" in out
        a.resume(parcel)
        with a.console(parcel) as console:
            check_continues(console, first)
            assert console.run(f"test -e {second.file}")[0] != 0
        a.isr("suspend", parcel.name)
        a.wait_session_end(parcel)
        assert isr_env.current_version(parcel) == 7
