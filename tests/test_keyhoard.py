"""What a site fetches of a version besides its chunks, each in one request: the manifest and keyrings of a hoard
with the key (`isrctl.keyhoard`, also `isr mount` of a version not checked out) and the boot files
(`isrctl.checkout`). The whole hoard and resume run in tests/test_isr_everyday.py and tests/test_isr_policies.py."""
from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from isrctl.checkout import boot_blobs
from isrctl.keyhoard import fetch_keyrings
from isrctl.localstate import ParcelState
from isrctl.remote import Remote
from parcels import seal
from parcels.crypto import sha256
from parcels.keyring import Keyring, KeyringRecord, encode_stream
from parcels.manifest import IMAGES, BlobInfo, ImageInfo, Manifest, seal_manifest
from parcels.store import KEYRING_FILES, MANIFEST
from tests.server_fixtures import ServerEnv, server_env  # noqa: F401
from tests.test_format import sample_manifest


def commit_version_1(remote: Remote, parcel: str, blobs: dict[str, bytes]) -> list[str]:
    """Commit version 1 of ``parcel`` from ``blobs``; returns the list the paths of ``remote``'s requests from then
    on are added to."""
    nonce = remote.acquire(parcel, host="laptop")["nonce"]
    for name, data in blobs.items():
        remote.put_blob(parcel, name, data, nonce)
    remote.commit(parcel, nonce, 0, list(blobs), [])
    remote.release(parcel, nonce)
    requests: list[str] = []
    remote.client.event_hooks["request"] = [lambda request: requests.append(request.url.path)]
    return requests


@pytest.mark.parametrize("server_env", ["sqlite-directory"], indirect=True)
def test_fetch_keyrings_takes_the_manifest_and_keyrings_from_one_bundle(server_env: ServerEnv,  # noqa: F811
                                                                        tmp_path: Path) -> None:
    """The manifest and both keyrings of a version come from a real server in one request, and the manifest is
    handed on (to start the boot files) before the keyrings have been written."""
    parcel = server_env.new_parcel("alice")
    key = os.urandom(32)
    base = sample_manifest(1)
    records = {"disk": [KeyringRecord(idx=i, flags=0, tag=sha256(bytes([i])), wkey=os.urandom(40)) for i in (0, 2)],
               "memory": []}
    streams = {image: encode_stream(base.image_chunk_size(image), base.images[image].size, records[image])
               for image in IMAGES}
    manifest = dataclasses.replace(base, parcel=uuid.UUID(parcel), images={
        image: ImageInfo(size=base.images[image].size, keyring_sha256=sha256(streams[image]),
                         keyring_size=len(streams[image]), chunks=len(records[image])) for image in IMAGES})
    blobs = {MANIFEST: seal_manifest(key, manifest),
             **{KEYRING_FILES[image]: seal.seal(key, seal.KIND_KEYRING, streams[image]) for image in IMAGES}}
    scratch = tmp_path / "hoard"
    with server_env.client("alice") as remote:
        requests = commit_version_1(remote, parcel, blobs)
        handed: list[tuple[Manifest, bool]] = []
        got = fetch_keyrings(SimpleNamespace(remote=remote), parcel, 1,  # type: ignore[arg-type]
                             SimpleNamespace(parcel_key=key), scratch,  # type: ignore[arg-type]
                             on_manifest=lambda m: handed.append((m, any(scratch.iterdir()))))
    assert requests == [f"/v1/parcels/{parcel}/versions/1/_bundle"]
    assert got == manifest and handed == [(manifest, False)]
    for image in IMAGES:
        with Keyring.open(scratch / f"keyring.{image}") as keyring:
            assert list(keyring) == records[image]


@pytest.mark.parametrize("server_env", ["sqlite-directory"], indirect=True)
def test_boot_files_not_at_this_site_come_in_one_request(server_env: ServerEnv,  # noqa: F811
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`checkout.version_blobs` opens what this site keeps and fetches the rest in one request (a bundle), checks
    each against the manifest and keeps it; asked again, it needs the server no more."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    parcel = server_env.new_parcel("alice")
    key = os.urandom(32)
    payloads = {"kernel": os.urandom(3000), "initrd": os.urandom(5000)}
    base = sample_manifest(1)
    assert base.vm.boot is not None
    manifest = dataclasses.replace(
        base, parcel=uuid.UUID(parcel), vm=dataclasses.replace(base.vm, boot=dataclasses.replace(base.vm.boot,
                                                                                                 initrd="initrd")),
        blobs={name: BlobInfo(kind=seal.KIND_BOOT, sha256=sha256(data), size=len(data))
               for name, data in payloads.items()})
    state = ParcelState(parcel)
    blobs = {MANIFEST: seal_manifest(key, manifest), "keyring.disk": b"k", "keyring.memory": b"k",
             **{name: seal.seal(key, seal.KIND_BOOT, data) for name, data in payloads.items()}}
    with server_env.client("alice") as remote:
        requests = commit_version_1(remote, parcel, blobs)
        keys = SimpleNamespace(parcel_key=key)
        assert boot_blobs(state, manifest, keys, remote=remote) == payloads  # type: ignore[arg-type]
        assert requests == [f"/v1/parcels/{parcel}/versions/1/_bundle"]
    assert boot_blobs(state, manifest, keys, remote=None) == payloads  # type: ignore[arg-type]
