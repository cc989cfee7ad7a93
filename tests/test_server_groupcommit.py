"""Group commit of chunk uploads (server/groupcommit.py), against a real isr-server over TLS with each
backend set (sqlite + directory store; PostgreSQL + versitygw S3).

- Concurrent chunk PUTs share metadata transactions: every chunk recorded in one transaction carries that
  transaction's time in the chunk index, so uploads that each committed alone (as before group commit)
  have as many distinct times as chunks.
- An acknowledged upload is durable: PUTs answered just before a kill -9 of the server are all there,
  with their bytes, after a restart.
"""
from __future__ import annotations

import collections
import hashlib
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from isrctl.remote import RemoteError
from tests.server_fixtures import BACKENDS, ServerEnv, postgres_dsn, s3_server, start_env  # noqa: F401

THREADS = 32
PER_THREAD = 2


@pytest.fixture(params=BACKENDS)
def fresh_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServerEnv]:
    """A server of its own (the test kills it)."""
    env = start_env(request.param, tmp_path / request.param, request)
    try:
        yield env
    finally:
        env.server.stop()


def chunk_objects(count: int, seed: int) -> dict[str, bytes]:
    """Distinct objects of chunk-object size, by tag."""
    out = {}
    for i in range(count):
        data = hashlib.sha256(f"{seed}-{i}".encode()).digest() * 1024 + os.urandom(64)
        out[hashlib.sha256(data).hexdigest()] = data
    return out


def put_concurrently(env: ServerEnv, objects: dict[str, bytes], *, kill_after: int | None = None) -> dict[str, bool]:
    """PUT the objects from THREADS connections at once (each connected first, then all released
    together); the answers by tag. With `kill_after`, the server gets SIGKILL as soon as that many PUTs
    were answered, while the others are still being sent (those fail and have no answer)."""
    items = list(objects.items())
    barrier = threading.Barrier(THREADS)
    answers: dict[str, bool] = {}
    lock = threading.Lock()
    killed = threading.Event()

    def kill() -> None:
        proc = env.server.proc
        assert proc is not None
        os.killpg(proc.pid, signal.SIGKILL)
        killed.set()

    def worker(index: int) -> None:
        with env.client("alice") as client:
            client.health()
            barrier.wait(timeout=30)
            for tag, data in items[index::THREADS]:
                try:
                    stored = client.put_chunk(tag, data)
                except RemoteError:
                    if killed.is_set():
                        return
                    raise
                with lock:
                    answers[tag] = stored
                    if kill_after is not None and len(answers) == kill_after:
                        kill()

    with ThreadPoolExecutor(THREADS) as pool:
        for future in [pool.submit(worker, i) for i in range(THREADS)]:
            future.result()
    return answers


def test_concurrent_chunk_puts_share_commits(fresh_env: ServerEnv) -> None:
    objects = chunk_objects(THREADS * PER_THREAD, seed=1)
    answers = put_concurrently(fresh_env, objects)
    assert answers == {tag: True for tag in objects}

    meta, store = fresh_env.open_backends()
    try:
        touched = {row.tag: row.touched for row in meta.chunk_rows() if row.tag in objects}
    finally:
        meta.close()
        store.close()
    assert set(touched) == set(objects)
    groups = collections.Counter(touched.values())
    # One transaction per upload would give len(objects) distinct times; group commit puts the uploads
    # that arrive while a commit runs into the next one.
    assert len(groups) < len(objects), f"every one of {len(objects)} concurrent uploads committed alone"
    assert max(groups.values()) >= 4, f"no commit carried more than {max(groups.values())} uploads: {groups}"
    with fresh_env.client("alice") as client:
        assert client.missing(list(objects)) == []
        for tag in list(objects)[:8]:
            assert client.get_chunk(tag) == objects[tag]


def test_acknowledged_uploads_survive_kill9(fresh_env: ServerEnv) -> None:
    objects = chunk_objects(THREADS * 4, seed=2)
    # kill -9 in the middle of the uploads: some were answered, some are in a batch being committed,
    # some not yet received.
    answers = put_concurrently(fresh_env, objects, kill_after=THREADS * 2)
    assert THREADS * 2 <= len(answers) < len(objects)
    proc = fresh_env.server.proc
    assert proc is not None
    proc.wait(timeout=30)
    fresh_env.server.url = ""  # listen port 0: the restarted server says its new address
    fresh_env.server.start()
    with fresh_env.client("alice") as client:
        assert client.missing(list(answers)) == [], "acknowledged uploads were lost"
        for tag in answers:
            assert client.get_chunk(tag) == objects[tag]
