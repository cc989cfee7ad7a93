"""`isr rollback`: a new version with an older version's content, made on the server without moving chunks.

The older version's sealed keyrings and device state are staged as they are (they are bound to the
manifest by digest, not by version number); only the manifest is sealed again, with the new version
number and parent. Boot files identical to the current version's are inherited, not uploaded again.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from parcels.manifest import IMAGES, open_keyring, seal_manifest, utc_now
from parcels.store import KEYRING_FILES, MANIFEST

from . import workingset
from .checkout import Client
from .errors import IsrError


def rollback(client: Client, parcel: dict[str, Any], parcel_keys: Any, nonce: str, current: int, target: int) -> int:
    """Commit version current+1 with version ``target``'s content; returns the new version number.

    The target's sealed keyrings and device state are staged as they are (they are bound to the manifest by
    digest, not by version number); the manifest is re-sealed with the new version and parent; boot files
    identical to the current version's are inherited.
    """
    if not 1 <= target < current:
        raise IsrError(f"version {target} is not an older version of {parcel['name']} (current: {current})")
    remote = client.remote
    _, old = client.fetch_manifest(parcel["id"], target, parcel_keys)
    _, now = client.fetch_manifest(parcel["id"], current, parcel_keys)
    tags: set[str] = set()
    staged: dict[str, bytes] = {}
    records = {}
    for image in IMAGES:
        sealed = remote.get_blob(parcel["id"], target, KEYRING_FILES[image])
        records[image] = open_keyring(parcel_keys.parcel_key, sealed, old, image)
        tags.update(r.tag.hex() for r in records[image])
        staged[KEYRING_FILES[image]] = sealed
    inherit = []
    for name, info in old.blobs.items():
        same = now.blobs.get(name)
        if same is not None and same.sha256 == info.sha256 and same.kind == info.kind:
            inherit.append(name)
        else:
            staged[name] = remote.get_blob(parcel["id"], target, name)
    manifest = old.replace(version=current + 1, parent=current,
                           timestamps=dataclasses.replace(old.timestamps, created=utc_now()))
    staged[MANIFEST] = seal_manifest(parcel_keys.parcel_key, manifest)
    for name, data in staged.items():
        remote.put_blob(parcel["id"], name, data, nonce)
    record = remote.commit(parcel["id"], nonce, current, list(staged), sorted(tags), inherit,
                           workingset.tags(old.working_set, records))
    return int(record["version"])
