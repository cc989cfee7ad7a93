"""`isr rollback`: a new version with an older version's content, made on the server without moving chunks.

The older version's sealed keyrings and device state are staged as they are (they are bound to the
manifest by digest, not by version number); only the manifest is sealed again, with the new version
number and parent. Boot files identical to the current version's are inherited, not uploaded again.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from parcels.manifest import IMAGES, open_keyring, seal_manifest, utc_now
from parcels.store import KEYRING_FILES, MANIFEST

from . import workingset
from .checkout import Client, manifest_and_blobs
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
    _, now = client.fetch_manifest(parcel["id"], current, parcel_keys)
    tags: set[str] = set()
    staged: dict[str, bytes] = {}
    records = {}
    # The target's manifest and keyrings in one request, then the blobs it does not share with the current
    # version in another: not one round trip each.
    keyrings = {KEYRING_FILES[image]: image for image in IMAGES}
    with contextlib.closing(manifest_and_blobs(remote, parcel["id"], target, parcel_keys, list(keyrings))) as arriving:
        for old, name, sealed in arriving:
            if name in keyrings:
                records[keyrings[name]] = open_keyring(parcel_keys.parcel_key, sealed, old, keyrings[name])
                tags.update(r.tag.hex() for r in records[keyrings[name]])
                staged[name] = sealed
    inherit = []
    for name, info in old.blobs.items():
        same = now.blobs.get(name)
        if same is not None and same.sha256 == info.sha256 and same.kind == info.kind:
            inherit.append(name)
    with contextlib.closing(remote.get_blobs(parcel["id"], target, [n for n in old.blobs if n not in inherit])) \
            as arriving:
        staged.update(arriving)
    manifest = old.replace(version=current + 1, parent=current,
                           timestamps=dataclasses.replace(old.timestamps, created=utc_now()))
    staged[MANIFEST] = seal_manifest(parcel_keys.parcel_key, manifest)
    for name, data in staged.items():
        remote.put_blob(parcel["id"], name, data, nonce)
    record = remote.commit(parcel["id"], nonce, current, list(staged), sorted(tags), inherit,
                           workingset.tags(old.working_set, records))
    return int(record["version"])
