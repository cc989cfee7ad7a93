"""A checkin's commit whose answer is lost, against a real server: the commit is looked up, not repeated blindly,
and a checkin run again after such a loss finds its version instead of reporting a conflict (the whole checkin
path, with QEMU and vulpes, is in tests/test_isr_*.py)."""
from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from isrctl import checkin
from isrctl.remote import Remote, RemoteUnreachable, VersionConflict
from parcels import seal
from parcels.crypto import sha256
from parcels.manifest import BlobInfo, Manifest, seal_manifest
from tests.server_fixtures import ServerEnv, server_env  # noqa: F401
from tests.test_format import sample_manifest

BLOBS = ("keyring.disk", "keyring.memory")
KEY = os.urandom(32)


def state(parcel: str, version: int, what: bytes) -> Manifest:
    """A manifest of ``version`` whose state (here: one blob's digest) is ``what``."""
    base = sample_manifest(version)
    return dataclasses.replace(base, parcel=uuid.UUID(parcel),
                               blobs={**base.blobs, "devstate": BlobInfo(kind=seal.KIND_DEVSTATE, sha256=sha256(what),
                                                                         size=len(what))})


def stage(remote: Remote, parcel: str, nonce: str, manifest: Manifest) -> None:
    """Stage a version's blobs as a checkin does before it commits: the manifest sealed afresh (a salt of its
    own each time, as a checkin run again seals it)."""
    remote.put_blob(parcel, "manifest", seal_manifest(KEY, manifest), nonce)
    for name in BLOBS:
        remote.put_blob(parcel, name, os.urandom(16), nonce)


def current(remote: Remote, parcel: str) -> int:
    """The server's newest version of the parcel."""
    return max(int(v["version"]) for v in remote.versions(parcel)["versions"])


def lose_commit_answers(remote: Remote, times: int) -> list[int]:
    """Make the next ``times`` commits reach the server and their answers break off (as a connection that
    dies after the request went out); returns the list the lost commits' statuses are appended to."""
    lost: list[int] = []

    def hook(response: httpx.Response) -> None:
        request = response.request
        if request.method == "POST" and request.url.path.endswith("/versions") and len(lost) < times:
            lost.append(response.status_code)
            raise httpx.ReadError("connection reset by peer", request=request)

    remote.client.event_hooks["response"] = [hook]
    return lost


@pytest.mark.parametrize("server_env", ["sqlite-directory"], indirect=True)
def test_a_commit_whose_answer_is_lost_is_found_not_repeated(server_env: ServerEnv) -> None:
    parcel = server_env.new_parcel("alice")
    with server_env.client("alice") as remote:
        nonce = remote.acquire(parcel, host="laptop")["nonce"]
        calls: list[int] = []

        def commit_it(parent: int) -> dict[str, Any]:
            calls.append(parent)
            return remote.commit(parcel, nonce, parent, ["manifest", *BLOBS], [])

        def commit(manifest: Manifest, commit_it: Callable[[], dict[str, Any]]) -> int:
            return int(checkin.commit(remote, parcel, KEY, manifest, commit_it)["version"])

        # The answer is lost: the server has version 1, and the commit is not sent again.
        one = state(parcel, 1, b"one")
        stage(remote, parcel, nonce, one)
        lost = lose_commit_answers(remote, 1)
        assert commit(one, lambda: commit_it(0)) == 1
        assert lost == [201] and calls == [0] and current(remote, parcel) == 1

        # A checkin run again after such a loss seals the same state afresh: its commit is refused (version 1 is
        # there), and version 1 is found to hold its state.
        stage(remote, parcel, nonce, one)
        assert commit(one, lambda: commit_it(0)) == 1
        assert calls == [0, 0] and current(remote, parcel) == 1

        # A commit lost before it reached the server (the server has no version 2): sent again, once.
        two = state(parcel, 2, b"two")
        stage(remote, parcel, nonce, two)
        remote.client.event_hooks["response"] = []

        def lost_on_the_way() -> dict[str, Any]:
            if not calls[2:]:
                calls.append(-1)
                raise RemoteUnreachable("connection reset before the request went out")
            return commit_it(1)

        assert commit(two, lost_on_the_way) == 2
        assert calls == [0, 0, -1, 1] and current(remote, parcel) == 2

        # Someone else's version 3: a conflict, as before.
        stage(remote, parcel, nonce, state(parcel, 3, b"theirs"))
        remote.commit(parcel, nonce, 2, ["manifest", *BLOBS], [])
        mine = state(parcel, 3, b"mine")
        stage(remote, parcel, nonce, mine)
        with pytest.raises(VersionConflict):
            commit(mine, lambda: commit_it(2))

        # The answer is lost and so is the lookup's: the loss is reported; a checkin run again finds the version,
        # which the server has.
        four = state(parcel, 4, b"four")
        stage(remote, parcel, nonce, four)

        def hook(response: httpx.Response) -> None:
            if response.request.url.path.endswith(("/versions", "/versions/4/manifest")):
                raise httpx.ReadError("connection reset by peer", request=response.request)

        remote.client.event_hooks["response"] = [hook]
        with pytest.raises(RemoteUnreachable, match="connection reset"):
            commit(four, lambda: commit_it(3))
        remote.client.event_hooks["response"] = []
        assert current(remote, parcel) == 4
        stage(remote, parcel, nonce, four)
        assert commit(four, lambda: commit_it(3)) == 4
        remote.release(parcel, nonce)
