"""The `isr` command where things go wrong without a VM (issue 16): damaged files, a lock that changed
hands behind this site's back, a release that failed, a server that does not answer. Each test runs `isr`
as a person would, against a real isr-server, and checks for one line that says what happened and what to
do, and that nothing was lost."""
from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import IsrEnv, Parcel, Site, isr_env, sites  # noqa: F401  (isr_env: pytest fixture)

pytestmark = pytest.mark.timeout(300)


def one_line_error(result, *words: str) -> str:  # type: ignore[no-untyped-def]
    """Assert that `isr` failed with exit code 1 and one line on stderr containing every word."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr)
    return str(result.stderr)


def test_non_utf8_config_and_token_name_the_file(isr_env: IsrEnv, tmp_path: Path) -> None:
    with sites(isr_env, tmp_path, ["A"]) as (a,):
        config = a.root / "config" / "isr" / "config.toml"
        token = a.root / "data" / "isr" / "token"
        good_config, good_token = config.read_bytes(), token.read_bytes()
        config.write_bytes(good_config + b'# caf\xe9 \xff\n')
        one_line_error(a.isr("ls", check=False), str(config), "UTF-8")
        config.write_bytes(good_config)
        token.write_bytes(b"isr_\xff\xfe" + good_token[4:])
        one_line_error(a.isr("ls", check=False), str(token), "UTF-8")
        token.write_bytes(good_token)
        a.isr("ls")


@contextlib.contextmanager
def releases_fail(env: IsrEnv) -> Iterator[None]:
    """While inside, the server's database refuses to delete a lock row, so every lock release answers
    503 (the storage failed) while commits, which only update the row, still work."""
    db = Path(env.server.settings["server.data_dir"]) / "meta.sqlite"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("CREATE TRIGGER test_no_release BEFORE DELETE ON locks "
                     "BEGIN SELECT RAISE(ABORT, 'disk I/O error (test)'); END")
        conn.commit()
    try:
        yield
    finally:
        with contextlib.closing(sqlite3.connect(db)) as conn:
            conn.execute("DROP TRIGGER test_no_release")
            conn.commit()


def server_lock(site: Site, parcel: Parcel) -> str:
    return site.isr("lock", parcel.name).stdout


def test_failed_release_at_checkin_keeps_the_lock_record(isr_env: IsrEnv, tmp_path: Path) -> None:
    """The commit succeeds but releasing the lock fails: the command must not say "lock released" nor exit
    0, and the site keeps its lock record so that a later `isr checkin` releases it (no --force needed)."""
    parcel = isr_env.make_parcel()
    with sites(isr_env, tmp_path, ["A", "B"]) as (a, b):
        a.isr("checkout", parcel.name, "--keyfile", str(parcel.keyfile))
        with releases_fail(isr_env):
            result = a.isr("poweroff", parcel.name, "--keyfile", str(parcel.keyfile), check=False)
            assert result.returncode == 1, (result.stdout, result.stderr)
            assert "lock released" not in result.stdout + result.stderr
            error = one_line_error(result, "committed version 2", f"isr checkin {parcel.name}")
            assert "still holds the lock" in error
            assert isr_env.current_version(parcel) == 2
            assert "site A" in server_lock(b, parcel)
            checkout = json.loads((a.state_dir(parcel) / "checkout.json").read_text())
            assert checkout["lock"] is not None and checkout["version"] == 2
            info = a.stat(parcel)
            assert info["version"] == 2 and info["lock"] is not None and info["local"] is None
            # Still failing: the retry says so, and keeps the record again.
            again = a.isr("checkin", parcel.name, "--keyfile", str(parcel.keyfile), check=False)
            one_line_error(again, "lock", f"isr checkin {parcel.name}")
        # The server works again: a plain checkin releases the lock, and B can take it.
        out = a.isr("checkin", parcel.name, "--keyfile", str(parcel.keyfile)).stdout
        assert "lock of" in out and "released" in out
        assert "not locked" in server_lock(b, parcel)
        assert json.loads((a.state_dir(parcel) / "checkout.json").read_text())["lock"] is None
        b.isr("checkout", parcel.name, "--keyfile", str(parcel.keyfile))
        b.isr("clean", parcel.name)
