"""Garbage collection racing commits (issue 16): `server.ops.gc` with a short grace period runs in a loop
while a client uploads chunks and commits versions through the real server, on every backend set (sqlite +
directory, PostgreSQL + S3). A commit may lose the race and be told ``chunks_missing`` (the client uploads
again, as isrctl does); what must never happen is a committed version that references a chunk the store
no longer has."""
from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

import pytest

from isrctl.remote import ChunksMissing
from tests.server_fixtures import ServerEnv, postgres_dsn, s3_server, server_env  # noqa: F401
from tests.test_server_api import make_chunk

pytestmark = pytest.mark.timeout(300)

ROUNDS = 25
CHUNKS_PER_ROUND = 4
#: gc keeps what was uploaded or claimed this recently; each round waits a random 0 to 2 x GRACE between its
#: uploads and its commit, so that about half the commits find their chunks already gc candidates.
GRACE = 0.3


def _missing_from_store(store: Any, committed: dict[int, list[str]]) -> list[tuple[int, str]]:
    from server.store import chunk_key

    return [(version, tag) for version, tags in committed.items() for tag in tags
            if store.size(chunk_key(tag)) is None]


def test_gc_never_collects_a_chunk_of_a_committed_version(server_env: ServerEnv) -> None:
    from server import ops

    parcel = server_env.new_parcel("alice")
    stop = threading.Event()
    failures: list[BaseException] = []
    stats = {"gc_runs": 0, "deleted": 0}

    def collect() -> None:
        meta, store = server_env.open_backends()
        try:
            while not stop.is_set():
                result = ops.gc(meta, store, grace=GRACE)
                stats["gc_runs"] += 1
                stats["deleted"] += int(result["deleted"])
        except BaseException as exc:  # reported by the test below
            failures.append(exc)
        finally:
            meta.close()
            store.close()

    meta, store = server_env.open_backends()
    collector = threading.Thread(target=collect, name="gc", daemon=True)
    committed: dict[int, list[str]] = {}
    races = 0
    try:
        with server_env.client("alice") as client:
            nonce = client.acquire(parcel, host="gc-race")["nonce"]
            collector.start()
            parent = 0
            for _ in range(ROUNDS):
                chunks = dict(make_chunk(1024) for _ in range(CHUNKS_PER_ROUND))
                # Half the previous version's chunks again: a chunk of an older version must survive too.
                tags = list(chunks) + committed.get(parent, [])[:CHUNKS_PER_ROUND // 2]
                for tag, data in chunks.items():
                    client.put_chunk(tag, data)
                blobs = {"manifest": os.urandom(300), "keyring.disk": os.urandom(200),
                         "keyring.memory": os.urandom(28)}
                for name, data in blobs.items():
                    client.put_blob(parcel, name, data, nonce)
                time.sleep(random.uniform(0, 2 * GRACE))
                for _attempt in range(50):
                    try:
                        version = client.commit(parcel, nonce, parent, list(blobs), tags)
                        break
                    except ChunksMissing as exc:  # gc took them before the commit claimed them
                        races += 1
                        for tag in exc.missing:
                            client.put_chunk(tag, chunks[tag])
                else:
                    pytest.fail("the commit lost to gc 50 times in a row")  # pragma: no cover
                parent = int(version["version"])
                committed[parent] = tags
                assert _missing_from_store(store, committed) == [], f"after committing version {parent}"
            stop.set()
            collector.join(timeout=120)
            assert not failures, failures
            ops.gc(meta, store, grace=0.0)
            assert _missing_from_store(store, committed) == []
            for tag in committed[parent]:
                client.get_chunk(tag)
            client.release(parcel, nonce)
    finally:
        stop.set()
        collector.join(timeout=120)
        meta.close()
        store.close()
    # The race was run, not avoided: gc ran throughout and collected the chunks it was allowed to.
    assert stats["gc_runs"] >= ROUNDS and races > 0, (races, stats)
    print(f"{server_env.name}: {ROUNDS} commits, {races} lost a race to gc, {stats}")
