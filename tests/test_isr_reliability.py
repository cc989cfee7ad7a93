"""The `isr` command where things go wrong (issue 16): damaged files, a lock that changed hands behind this
site's back, a release that failed, a server that does not answer or refuses the uploads of a suspend. Each
test runs `isr` as a person would, against a real isr-server, and checks for one line that says what happened
and what to do, and that nothing was lost."""
from __future__ import annotations

import contextlib
import json
import socket
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import (IsrEnv, Parcel, Site, check_continues, isr_env,  # noqa: F401  (isr_env: fixture)
                                make_changes, one_line_error, sites)

pytestmark = pytest.mark.timeout(300)


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
def database_refuses(env: IsrEnv, name: str, event: str) -> Iterator[None]:
    """While inside, a trigger makes the server's database fail ``event`` ("DELETE ON locks", ...) as a
    failing disk would, so the requests that need it answer 503 while everything else works."""
    db = Path(env.server.settings["server.data_dir"]) / "meta.sqlite"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute(f"CREATE TRIGGER {name} BEFORE {event} BEGIN SELECT RAISE(ABORT, 'disk I/O error (test)'); END")
        conn.commit()
    try:
        yield
    finally:
        with contextlib.closing(sqlite3.connect(db)) as conn:
            conn.execute(f"DROP TRIGGER {name}")
            conn.commit()


def releases_fail(env: IsrEnv) -> contextlib.AbstractContextManager[None]:
    """Every lock release answers 503 (the storage failed) while commits, which only update the row, work."""
    return database_refuses(env, "test_no_release", "DELETE ON locks")


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


def test_stat_ls_discard_notice_a_lock_lost_at_the_server(isr_env: IsrEnv, tmp_path: Path) -> None:
    """The lock this site recorded was broken by an administrator (and later taken by another site):
    `isr stat`, `isr ls` and `isr discard` ask the server and say that this site no longer holds it."""
    parcel = isr_env.make_parcel()
    with sites(isr_env, tmp_path, ["A", "B"]) as (a, b):
        a.isr("checkout", parcel.name, "--keyfile", str(parcel.keyfile))
        a.isr("poweroff", parcel.name, "--no-checkin")  # a local change, so that discard has work
        assert "lock held" in a.isr("ls").stdout
        isr_env.server.admin("lock", "break", f"alice/{parcel.name}", "--reason", "left at the lab")

        for holder_words in (["not locked"], ["site B"]):
            text = a.isr("stat", parcel.name).stdout
            assert "lock held since" not in text, text
            assert "lock lost" in text and all(w in text for w in holder_words), text
            info = a.stat(parcel)
            assert info["lock"] is None and info["stale_lock"]["site"] == "A", info
            row = next(line for line in a.isr("ls").stdout.splitlines() if line.startswith(parcel.name))
            assert "lock held" not in row and "lock lost" in row, row
            entry = next(p for p in json.loads(a.isr("ls", "--json").stdout) if p["id"] == parcel.id)
            assert entry["local"]["lock_held"] is False and entry["local"]["lock_lost"] is True
            if holder_words == ["not locked"]:  # then site B takes the lock: A's record is still stale
                b.isr("checkout", parcel.name, "--keyfile", str(parcel.keyfile))

        result = a.isr("discard", parcel.name, "--yes")
        assert "still holds the lock" not in result.stdout
        assert "lock" in result.stdout and "site B" in result.stdout, result.stdout
        b.isr("clean", parcel.name)


def test_ls_and_stat_against_a_frozen_server_are_bounded_and_say_so(isr_env: IsrEnv, tmp_path: Path) -> None:
    """A server that accepts connections but never answers (stopped with SIGSTOP, or hung): `isr ls` says
    within seconds that it is waiting, and gives up with one line well before a minute; `isr stat`, which
    needs no server, still answers and says the lock could not be confirmed."""
    parcel = isr_env.make_parcel()
    with sites(isr_env, tmp_path, ["A"]) as (a,), socket.socket() as frozen:
        a.isr("checkout", parcel.name, "--keyfile", str(parcel.keyfile))
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(16)  # the kernel completes the handshakes; nobody ever reads
        config = a.root / "config" / "isr" / "config.toml"
        good = config.read_text()
        server = good.split('server = "', 1)[1].split('"', 1)[0]
        frozen_url = f"https://127.0.0.1:{frozen.getsockname()[1]}"
        config.write_text(good.replace(server, frozen_url))
        checkout = a.state_dir(parcel) / "checkout.json"
        checkout.write_text(checkout.read_text().replace(server, frozen_url))
        started = time.monotonic()
        result = a.isr("ls", check=False, timeout=50)
        took = time.monotonic() - started
        assert result.returncode == 1, (result.stdout, result.stderr)
        lines = result.stderr.splitlines()
        assert "waiting for the server" in lines[0] and frozen_url in lines[0], lines
        assert len(lines) == 2 and "did not answer within" in lines[1] and "Traceback" not in result.stderr, lines
        assert took < 30, took
        text = a.isr("stat", parcel.name, timeout=50).stdout
        assert "lock held since" in text and "not confirmed" in text, text
        config.write_text(good)
        checkout.write_text(checkout.read_text().replace(frozen_url, server))
        a.isr("clean", parcel.name)


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """``directory`` on a read-only bind mount of itself (even root cannot write there: EROFS)."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], check=True)
        yield
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def test_resume_with_a_read_only_cache_names_the_path(isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel = isr_env.make_parcel()
    with sites(isr_env, tmp_path, ["A"]) as (a,):
        cache = a.root / "cache" / "isr"
        with read_only(cache):
            result = a.resume(parcel, check=False)
            one_line_error(result, str(cache), "Read-only file system", "XDG_CACHE_HOME")
            assert "OSError(" not in result.stderr and "Errno" not in result.stderr
            assert not (a.state_dir(parcel) / "checkout.json").exists()  # refused before taking the lock
        assert "not locked" in a.isr("lock", parcel.name).stdout


def test_a_failed_first_checkout_or_resume_leaves_no_half_state(isr_env: IsrEnv, tmp_path: Path) -> None:
    """The version is refused after the lock was taken (this PC has too little RAM for it): the command
    fails in one place, and leaves neither the lock nor a "version 0, incomplete" local state that the next
    command would trip over."""
    parcel = isr_env.make_parcel(ram_mib=4 << 20)
    with sites(isr_env, tmp_path, ["A"]) as (a,):
        for args in (("checkout", parcel.name, "--keyfile", str(parcel.keyfile)),
                     ("resume", parcel.name, "--detach", "--vnc", "none", "--keyfile", str(parcel.keyfile))):
            result = a.isr(*args, check=False)
            assert result.returncode == 1 and "cannot run parcel" in result.stderr, (args, result.stderr)
            assert not a.state_dir(parcel).exists(), (args, list(a.state_dir(parcel).iterdir()))
            assert "not locked" in a.isr("lock", parcel.name).stdout, args
            assert "no parcel has local state" in a.isr("stat").stdout
            row = next(line for line in a.isr("ls").stdout.splitlines() if line.startswith(parcel.name))
            assert row.split()[-1] == "-", row


def test_a_blob_that_does_not_decrypt_is_named(isr_env: IsrEnv, tmp_path: Path) -> None:
    """A byte of a version's manifest or keyring changed in the server's store: `isr checkout` refuses it in
    one line that says which object of which version failed, not just "AES-GCM authentication failed"."""
    parcel = isr_env.make_parcel()
    version = isr_env.store / "parcels" / parcel.id / "versions" / "1"
    with sites(isr_env, tmp_path, ["A"]) as (a,):
        for name, words in (("manifest", ("manifest", "version 1")), ("keyring.disk", ("disk keyring", "version 1"))):
            path = version / name
            good = path.read_bytes()
            path.write_bytes(good[:-5] + bytes([good[-5] ^ 1]) + good[-4:])
            try:
                result = a.isr("checkout", parcel.name, "--keyfile", str(parcel.keyfile), check=False)
            finally:
                path.write_bytes(good)
            one_line_error(result, "AES-GCM", *words)
        a.isr("checkout", parcel.name, "--keyfile", str(parcel.keyfile))
        a.isr("clean", parcel.name)


def test_an_upload_cut_short_does_not_claim_every_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkin's upload (from the cache) to a server that is gone: the progress line says how many chunks
    were sent (none), not the number it meant to send, and the error is the connection's."""
    import hashlib
    import os

    from isrctl import checkin, config
    from isrctl.checkout import Client
    from isrctl.remote import RemoteUnreachable
    from isrctl.vulpes import cache_object_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tags = []
    for _ in range(5):
        data = os.urandom(2000)
        tag = hashlib.sha256(data).hexdigest()
        path = cache_object_path(tmp_path / "cache" / "isr" / "chunks", tag)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        tags.append(tag)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens once this socket is closed
    notes: list[str] = []

    class Recorder:
        def say(self, text: str) -> None:
            pass

        def progress(self, label: str, total: int, unit: str = "B") -> Any:
            class Bar:
                def update(self, done: int, total: int | None = None) -> None:
                    pass

                def close(self, note: str = "") -> None:
                    notes.append(note)
            return Bar()

    cfg = config.ClientConfig(server=f"https://127.0.0.1:{port}", user="alice", fingerprint="sha256:" + "0" * 64,
                              pin="sha256//" + "A" * 43 + "=", site="A")
    with Client(cfg, token="isr_test", timeout=5) as client, pytest.raises(RemoteUnreachable):
        checkin.upload_from_cache(client, tags, Recorder())
    assert notes == ["0 of 5 chunks sent"], notes


def chunk_uploads_fail(env: IsrEnv) -> contextlib.AbstractContextManager[None]:
    """Every upload of a new chunk answers 503 (what a server with a full or failing store says) while
    everything else works."""
    return database_refuses(env, "test_no_chunks", "INSERT ON chunks")


def test_a_suspend_whose_uploads_the_server_refuses_ends_and_keeps_the_state(isr_env: IsrEnv,
                                                                              tmp_path: Path) -> None:
    """Issue 16: a server answering 503 to chunk uploads made `isr suspend` wait forever, saying nothing
    (vulpes retries, as it should for a running VM). Now the suspend gives up the upload after a while,
    says why on one line, keeps the suspended state here, and a later `isr checkin` commits it."""
    parcel = isr_env.make_parcel()
    with sites(isr_env, tmp_path, ["A"]) as (a,):
        a.resume(parcel)
        with a.console(parcel) as console:
            console.wait_ready(90)
            marks = make_changes(console, "refused", megabytes=1)
        with chunk_uploads_fail(isr_env):
            started = time.monotonic()
            result = a.isr("suspend", parcel.name, check=False, timeout=240)
            assert time.monotonic() - started < 180
            error = one_line_error(result, f"isr checkin {parcel.name}", "503")
            assert "kept at this site" in error
            assert "the server has taken no new chunk" in result.stdout, result.stdout
            a.wait_session_end(parcel)
            assert isr_env.current_version(parcel) == 1
            info = a.stat(parcel)
            assert info["local"]["state"] == "suspended" and info["lock"] is not None, info
        assert "committed version 2" in a.isr("checkin", parcel.name, "--keyfile", str(parcel.keyfile)).stdout
        a.resume(parcel)
        with a.console(parcel) as console:
            check_continues(console, marks)
        a.isr("suspend", parcel.name, "--no-checkin")
        a.wait_session_end(parcel)
