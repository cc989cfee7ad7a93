"""vulpes-fetch, the keyless hoard's transfer engine, against a real HTTPS server with faults: objects are
verified before they are stored, missing ones are reported and the rest kept, cached ones cost no request,
SIGTERM stops it keeping what it has, an unreachable server makes it give up after --patience, and bad input
is one line."""
from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from isrctl.vulpes import cache_usage
from tests.vulpes_fixtures import FaultServer, chunk_path, make_state, random_image, vulpes_binary  # noqa: F401

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20


def command(binary: Path, server: FaultServer, tmp_path: Path, *extra: str) -> list[str]:
    token = tmp_path / "token"
    token.write_text(f"{server.token}\n")
    return [str(binary.with_name("vulpes-fetch")), f"--cache={tmp_path / 'cache'}", f"--server={server.url}",
            f"--token-file={token}", f"--ca={server.cert}", *extra]


def fetch(binary: Path, server: FaultServer, tmp_path: Path, tags: Iterable[bytes], *extra: str) \
        -> tuple[int, list[dict[str, Any]], str]:
    """Run vulpes-fetch to the end: (exit status, its JSON lines, its stderr)."""
    result = subprocess.run(command(binary, server, tmp_path, *extra), input="".join(f"{t.hex()}\n" for t in tags),
                            capture_output=True, text=True, timeout=60)
    return result.returncode, [json.loads(line) for line in result.stdout.splitlines()], result.stderr


def test_fetches_verified_objects_and_reports_what_is_missing(vulpes_binary: Path, tmp_path: Path) -> None:
    state = make_state(tmp_path / "state", random_image(2 * MIB, seed=81, data_fraction=1.0), 1 * MIB)
    store = tmp_path / "store"
    state.publish(store)
    tags = list(state.objects)
    absent = tags[3]
    chunk_path(store, absent).unlink()
    server = FaultServer(store, tmp_path).start()
    try:
        server.corrupt = 2  # two damaged answers: rejected and fetched again
        code, lines, stderr = fetch(vulpes_binary, server, tmp_path, tags, "--progress-interval=0")
        assert code == 1, stderr
        start, *progress, done = lines
        assert start == {"event": "start", "tags": len(tags), "cached": 0, "wanted": len(tags)}
        assert done["event"] == "done" and done["failed"] == 1 and done["fetched"] == len(tags) - 1
        assert done["stored"] == len(tags) - 1 and done["bytes"] == sum(len(state.objects[t]) for t in tags) - \
            len(state.objects[absent])
        assert all(line["event"] == "progress" for line in progress)
        assert f"failed to fetch chunk {absent.hex()}: the server does not have it" in stderr
        assert stderr.count("do not match the tag") == 2, stderr
        for tag in tags:
            path = chunk_path(tmp_path / "cache", tag)
            assert (path.read_bytes() == state.objects[tag]) if tag != absent else not path.exists()
        assert not list((tmp_path / "cache" / "tmp").iterdir())
        # What the cache has costs no request.
        asked = dict(server.requests)
        code, lines, stderr = fetch(vulpes_binary, server, tmp_path, [t for t in tags if t != absent])
        assert code == 0, stderr
        assert lines[0]["cached"] == len(tags) - 1 and lines[0]["wanted"] == 0 and lines[-1]["event"] == "done"
        assert server.requests == asked
        # The cache's own account of itself, as `isr stat` asks for it.
        usage = subprocess.run([str(vulpes_binary.with_name("vulpes-fetch")), f"--cache={tmp_path / 'cache'}",
                                "--usage"], capture_output=True, text=True, timeout=30)
        assert usage.returncode == 0, usage.stderr
        stored = sum(len(state.objects[t]) for t in tags if t != absent)
        answer = json.loads(usage.stdout)
        assert {k: answer[k] for k in ("event", "objects", "bytes", "pinned", "pinned_bytes", "evictions_total",
                                       "limit")} == {"event": "usage", "objects": len(tags) - 1, "bytes": stored,
                                                     "pinned": 0, "pinned_bytes": 0, "evictions_total": 0,
                                                     "limit": 0}
        assert 0 < answer["fs_free"] < answer["fs_size"] and answer["room"] >= answer["fs_free"]
        usage = cache_usage(tmp_path / "cache")
        assert (usage.objects, usage.bytes, usage.clean_bytes) == (len(tags) - 1, stored, stored)
        empty = cache_usage(tmp_path / "no-cache-here")
        assert (empty.objects, empty.bytes) == (0, 0) and empty.room == empty.fs_free > 0
    finally:
        server.stop()


def test_a_full_cache_ends_the_hoard_and_says_exactly_what_is_there(vulpes_binary: Path, tmp_path: Path) -> None:
    """Under a limit that cannot take every object: older objects are evicted to make room, never what this
    run stored or found in the cache; then no more requests go out, the last line says cache_full and how
    many objects were stored, and the exit status is 1."""
    older = make_state(tmp_path / "older", random_image(1 * MIB, seed=84, data_fraction=1.0), 1 * MIB, seed=5)
    state = make_state(tmp_path / "state", random_image(4 * MIB, seed=85, data_fraction=1.0), 1 * MIB)
    store = tmp_path / "store"
    older.publish(store)
    state.publish(store)
    tags = list(state.objects)
    server = FaultServer(store, tmp_path).start()
    try:
        code, _, stderr = fetch(vulpes_binary, server, tmp_path, list(older.objects) + tags[:4])
        assert code == 0, stderr
        asked = sum(server.requests.values())
        code, lines, stderr = fetch(vulpes_binary, server, tmp_path, tags, "--cache-limit=1M", "--window=4")
        assert code == 1, (stderr, lines[0], lines[-1])
        start, *_, done = lines
        assert start["cached"] == 4 and done["event"] == "done" and done["cache_full"] is True
        cache = tmp_path / "cache"
        here = [t for t in tags if chunk_path(cache, t).exists()]
        assert tags[:4] == here[:4], "the objects the run found were evicted for it"
        assert len(here) == start["cached"] + done["stored"] and len(here) < len(tags)
        assert not any(chunk_path(cache, t).exists() for t in older.objects), "older objects make room first"
        # Requests stop once the cache is full: at most a window's worth more than were stored.
        assert sum(server.requests.values()) - asked <= done["stored"] + 4 + 1
        assert "the cache" in stderr and "has no room left" in stderr
        usage = cache_usage(cache, limit="1M")
        # Every object is clean (the server has it): the room is the whole limit, for a writer that may evict.
        assert usage.bytes <= 1 * MIB and usage.room == 1 * MIB and usage.limit_bound
    finally:
        server.stop()


def test_sigterm_keeps_what_was_fetched(vulpes_binary: Path, tmp_path: Path) -> None:
    state = make_state(tmp_path / "state", random_image(4 * MIB, seed=82, data_fraction=1.0), 1 * MIB)
    store = tmp_path / "store"
    state.publish(store)
    server = FaultServer(store, tmp_path).start()
    server.delay = 0.2
    try:
        proc = subprocess.Popen(command(vulpes_binary, server, tmp_path, "--window=2", "--max-transfers=2"),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("".join(f"{t.hex()}\n" for t in state.objects))
        proc.stdin.close()
        assert json.loads(proc.stdout.readline())["event"] == "start"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        last = json.loads(proc.stdout.read().splitlines()[-1])
        assert last["event"] == "stopped" and last["signal"] == signal.SIGTERM
        assert last["fetched"] < len(state.objects)
        kept = [t for t in state.objects if chunk_path(tmp_path / "cache", t).exists()]
        assert len(kept) == last["stored"]
        assert all(chunk_path(tmp_path / "cache", t).read_bytes() == state.objects[t] for t in kept)
    finally:
        server.stop()


def test_gives_up_when_the_server_stays_away(vulpes_binary: Path, tmp_path: Path) -> None:
    state = make_state(tmp_path / "state", random_image(1 * MIB, seed=83, data_fraction=1.0), 1 * MIB)
    server = FaultServer(tmp_path / "store", tmp_path).start()
    server.stop()
    code, lines, stderr = fetch(vulpes_binary, server, tmp_path, state.objects, "--patience=1")
    assert code == 75 and lines[-1]["event"] == "error" and lines[-1]["fetched"] == 0
    assert "failed to reach the server for 1 s" in stderr


def test_bad_input_is_one_line(vulpes_binary: Path, tmp_path: Path) -> None:
    server = FaultServer(tmp_path / "store", tmp_path)
    result = subprocess.run(command(vulpes_binary, server, tmp_path), input=f"{'ab' * 32}\nnot-a-tag\n",
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == "vulpes-fetch: failed to read the tags: line 2 is not 64 hex digits\n"
    result = subprocess.run(command(vulpes_binary, server, tmp_path, "--window=0"), capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    result = subprocess.run([str(vulpes_binary.with_name("vulpes-fetch")), "--usage"], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2 and result.stderr == "vulpes-fetch: --usage needs --cache=DIR\n"
