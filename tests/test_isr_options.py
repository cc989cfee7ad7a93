"""Options of `isr` that only a resume shows the effect of, each through the real command: `login
--cache-limit` and `--accel`, `resume --lookaside`, `resume --writeback-rate` (issue 16: options that no test
ran). One resume of the test guest (QEMU, TCG) against a real isr-server; the effects are read from the
running session's vulpes status and QEMU's command line."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import IsrEnv, isr_env, sites  # noqa: F401  (isr_env: pytest fixture)

pytestmark = pytest.mark.timeout(600)


def test_login_and_resume_options_reach_vulpes_and_qemu(isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel = isr_env.make_parcel()
    with sites(isr_env, tmp_path, ["A"]) as (a,):
        bad = a.isr("login", a.server_url, "--user", "alice", "--fingerprint", isr_env.fingerprint,
                    "--password-env", "ISR_TEST_PASSWORD", "--cache-limit", "lots", check=False)
        assert bad.returncode == 1 and "cache_limit" in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr
        a.isr("login", a.server_url, "--user", "alice", "--fingerprint", isr_env.fingerprint, "--site", "A",
              "--password-env", "ISR_TEST_PASSWORD", "--cache-limit", "64M", "--accel", "kvm")
        config = (a.root / "config" / "isr" / "config.toml").read_text()
        assert 'cache_limit = "64M"' in config and 'accel = "kvm"' in config

        # Every chunk is in the lookaside directory (the server's own store has the same layout as a cache).
        resumed = a.resume(parcel, "--vnc", "none", "--lookaside", str(isr_env.store), "--writeback",
                           "--writeback-rate", "512K")
        status = a.stat(parcel)["session_status"]
        vulpes = status["vulpes"]
        assert vulpes["cache"]["limit"] == 64 << 20, vulpes["cache"]
        assert vulpes["writeback"]["trickle"] is True and vulpes["writeback"]["rate"] == 512 << 10, vulpes
        assert vulpes["hits"]["lookaside"] > 0 and vulpes["hits"]["server"] == 0, vulpes["hits"]
        assert "512 KiB/s" in resumed.stdout

        # accel = kvm from the login: a probe boot decides (this machine's PVM KVM fails it, others pass).
        session = a.session(parcel)
        assert session is not None
        argv = Path(f"/proc/{session['qemu_pid']}/cmdline").read_bytes().split(b"\0")
        accel = argv[argv.index(b"-accel") + 1].decode()
        assert (a.root / "cache" / "isr" / "kvm-probe.json").exists()  # the probe ran
        if "KVM does not work here" in resumed.stdout:
            assert accel.startswith("tcg"), argv
        else:
            assert accel.startswith("kvm"), argv
        a.isr("poweroff", parcel.name, "--no-checkin")
        a.wait_session_end(parcel)
        a.isr("clean", parcel.name, "--force", "--yes")
