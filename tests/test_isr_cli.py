"""The `isr` command without a running VM: login, ls, lock, checkout, stat, clean, errors and --help,
against a real isr-server, with each site's files in its own XDG directories."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import IsrEnv, Site, isr_env, sites  # noqa: F401  (isr_env: pytest fixture)

pytestmark = pytest.mark.timeout(300)


def test_help_teaches_every_command(isr_env: IsrEnv, tmp_path: Path) -> None:
    site = Site("A", tmp_path / "A", isr_env)
    top = site.isr("--help").stdout
    for command in ("login", "logout", "ls", "checkout", "resume", "suspend", "checkin", "sync", "discard",
                    "hoard", "stat", "clean", "rollback", "lock", "poweroff"):
        assert command in top
        text = site.isr(command, "--help").stdout
        assert "usage: isr " + command in text
    assert "baseline" in top and "eager-writeback" in top
    assert "--policy" in site.isr("resume", "--help").stdout


def test_not_logged_in_is_one_line_that_says_what_to_do(isr_env: IsrEnv, tmp_path: Path) -> None:
    site = Site("A", tmp_path / "A", isr_env)
    result = site.isr("ls", check=False)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "isr login" in result.stderr


def test_login_refuses_a_wrong_fingerprint(isr_env: IsrEnv, tmp_path: Path) -> None:
    site = Site("A", tmp_path / "A", isr_env)
    result = site.isr("login", site.server_url, "--user", "alice", "--fingerprint", "sha256:" + "ab" * 32,
                      "--password-env", "ISR_TEST_PASSWORD", check=False)
    assert result.returncode == 1 and "not logging in" in result.stderr
    assert not (tmp_path / "A" / "data" / "isr" / "token").exists()


def test_login_ls_checkout_lock_stat_clean(isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel = isr_env.make_parcel()
    with sites(isr_env, tmp_path, ["home", "office"]) as (home, office):
        token = tmp_path / "home" / "data" / "isr" / "token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        config = (tmp_path / "home" / "config" / "isr" / "config.toml").read_text()
        assert isr_env.fingerprint in config and 'site = "home"' in config and "sha256//" in config

        listing = home.isr("ls").stdout
        assert parcel.name in listing
        entry = next(p for p in json.loads(home.isr("ls", "--json").stdout) if p["name"] == parcel.name)
        assert entry["current_version"] == 1 and entry["lock"] is None

        out = home.isr("checkout", parcel.name, "--keyfile", str(parcel.keyfile)).stdout
        assert "version 1" in out
        state = home.state_dir(parcel)
        for name in ("keyring.disk", "keyring.memory", "checkout.json", "keyenvelope", "base/manifest",
                     "base/keyring.disk.stream"):
            assert (state / name).exists(), name
        info = home.stat(parcel)
        assert info["version"] == 1 and info["lock"]["site"] == "home" and info["local"] is None
        assert info["images"]["disk"]["changed_chunks"] == 0

        # The lock: refused elsewhere with who, where, since when, at which version.
        refused = office.isr("checkout", parcel.name, "--keyfile", str(parcel.keyfile), check=False)
        assert refused.returncode == 3
        assert "alice" in refused.stderr and "site home" in refused.stderr and "version 1" in refused.stderr
        assert "since" in refused.stderr and refused.stderr.count("\n") == 1
        assert "site home" in office.isr("lock", parcel.name).stdout
        assert "site home" in home.isr("ls").stdout

        # A wrong key file opens nothing, in one line.
        bad = tmp_path / "bad.key"
        bad.write_bytes(os.urandom(32))
        wrong = office.isr("hoard", parcel.name, "--keyfile", str(bad), check=False)
        assert wrong.returncode == 1 and "wrong passphrase or key file" in wrong.stderr

        # clean releases the lock and removes the local state.
        home.isr("clean", parcel.name)
        assert not state.exists()
        assert "not locked" in office.isr("lock", parcel.name).stdout
        office.isr("checkout", parcel.name, "--keyfile", str(parcel.keyfile))
        office.isr("clean", parcel.name)
        home.isr("logout")
        assert not token.exists()


def test_passwd_rewraps_the_same_keys(isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel = isr_env.make_parcel()
    with sites(isr_env, tmp_path, ["A"]) as (a,):
        env_before = os.environ.get("ISR_NEW_PASSPHRASE")
        os.environ["ISR_NEW_PASSPHRASE"] = "correct horse battery staple"
        try:
            out = a.isr("passwd", parcel.name, "--keyfile", str(parcel.keyfile),
                        "--new-passphrase-env", "ISR_NEW_PASSPHRASE").stdout
            assert "changed the passphrase" in out
            old = a.isr("checkout", parcel.name, "--keyfile", str(parcel.keyfile), check=False)
            assert old.returncode == 1 and "passphrase" in old.stderr
            a.isr("checkout", parcel.name, "--passphrase-env", "ISR_NEW_PASSPHRASE")
            assert a.stat(parcel)["lock"] is not None
            a.isr("clean", parcel.name)
        finally:
            if env_before is None:
                os.environ.pop("ISR_NEW_PASSPHRASE", None)
            else:
                os.environ["ISR_NEW_PASSPHRASE"] = env_before
