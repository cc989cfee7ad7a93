"""What is hoarded at this site, parcel by parcel: `isr hoard --list`, `--check` and `--drop`.

The chunk cache is shared by every parcel here and knows objects only by tag; which tags are a parcel's is
known from the server (its current version's chunk list, no key needed) and from the parcel's local state
(the keyrings of its checkout, with the chunks written here). So:

- **list**: for each of the user's parcels, how many of its current version's chunk objects (and bytes) the
  cache holds;
- **check**: every cached object of a parcel (current version and local keyrings) is verified against its tag
  by vulpes (``vulpes-fetch --check``); a bad one is quarantined, moved out of the cache, so that the next use
  fetches it again. One that the server does not have (written here, not uploaded yet) cannot be fetched
  again: that is said;
- **drop**: a parcel's objects are removed from the cache (``vulpes-fetch --drop``), except those another
  parcel here needs (chunks are shared by content, e.g. between a parcel and its copy): the current version
  and the local keyrings of every other parcel that is here (hoarded, checked out or resumed at this site:
  it has a state directory), and those pinned (not uploaded yet, or kept for a disconnected session: the
  cache's own pins).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from parcels.errors import ParcelError
from parcels.keyring import Keyring
from parcels.manifest import IMAGES

from . import paths
from .checkout import Client
from .errors import StateError
from .localstate import ParcelState, local_parcels
from .vulpes import CacheCheck, cache_check, cache_drop, cache_object_path

log = logging.getLogger(__name__)


@dataclass
class Hoarded:
    """How much of one parcel's current version the cache holds."""

    parcel: str          # UUID
    name: str
    version: int
    chunks: int          # chunk objects of the version
    cached: int          # of those, in the cache
    bytes: int           # stored bytes of the version's objects (as the server lists them)
    cached_bytes: int    # of those, in the cache

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "fraction": round(self.cached / self.chunks, 4) if self.chunks else 1.0}


@dataclass
class Dropped:
    objects: int         # removed from the cache
    bytes: int           # their bytes
    shared: int          # kept: another parcel here needs them
    pinned: int          # kept: not uploaded yet, or pinned for a disconnected session

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Checked:
    result: CacheCheck
    local_only: list[str] = field(default_factory=list)  # bad tags the server does not have: lost

    def to_json(self) -> dict[str, Any]:
        return {"present": self.result.present, "absent": self.result.absent, "bytes": self.result.bytes,
                "bad": list(self.result.bad), "errors": self.result.errors, "bad_not_uploaded": self.local_only}


def _version_chunks(client: Client, parcel: dict[str, Any]) -> tuple[int, list[tuple[str, int]]]:
    version = int(parcel.get("current_version") or 0)
    if version == 0:
        return 0, []
    return version, client.remote.version_chunks(parcel["id"], version, "all")[1]


def list_hoarded(client: Client) -> list[Hoarded]:
    """Every parcel of the user with a version, and how much of its current version is in this site's cache."""
    cache = paths.chunk_cache_dir()
    out = []
    for parcel in client.remote.parcels():
        version, chunks = _version_chunks(client, parcel)
        if version == 0:
            continue
        here = [(tag, size) for tag, size in chunks if cache_object_path(cache, tag).is_file()]
        out.append(Hoarded(parcel=parcel["id"], name=parcel["name"], version=version, chunks=len(chunks),
                           cached=len(here), bytes=sum(size for _, size in chunks),
                           cached_bytes=sum(size for _, size in here)))
    return out


def local_tags(state: ParcelState) -> set[str]:
    """The tags (hex) the parcel's local state names: its local keyrings (chunks written here included)."""
    tags: set[str] = set()
    for image in IMAGES:
        path = state.keyring_path(image)
        if not path.exists():
            continue
        try:
            with Keyring.open(path) as keyring:
                tags.update(record.tag.hex() for record in keyring)
        except ParcelError as exc:
            raise StateError(f"cannot read the local keyring {path}: {exc}") from None
    return tags


def parcel_tags(client: Client, parcel: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(the tags of the parcel's current version on the server, those of its local state here)."""
    _, chunks = _version_chunks(client, parcel)
    return {tag for tag, _ in chunks}, local_tags(ParcelState(parcel["id"]))


def check(client: Client, parcel: dict[str, Any]) -> Checked:
    """Verify every cached object of the parcel; bad ones are quarantined (see the module docstring)."""
    server, local = parcel_tags(client, parcel)
    result = cache_check(paths.chunk_cache_dir(), sorted(server | local))
    return Checked(result, local_only=[tag for tag in result.bad if tag not in server])


def drop(client: Client, parcel: dict[str, Any]) -> Dropped:
    """Remove the parcel's objects from this site's cache, except those another parcel here needs and pinned
    ones. Raises StateError if the parcel runs here."""
    if ParcelState(parcel["id"]).busy():
        raise StateError(f"{parcel['name']} is in use at this site (a session, a mount, or another isr command): "
                         f"its chunks cannot be dropped now")
    server, local = parcel_tags(client, parcel)
    others: set[str] = set()
    for other in client.remote.parcels():
        if other["id"] != parcel["id"] and paths.parcel_state_dir(other["id"]).is_dir():
            others.update(tag for tag, _ in _version_chunks(client, other)[1])
    for state in local_parcels():
        if state.parcel != parcel["id"]:
            others |= local_tags(state)
    cache = paths.chunk_cache_dir()
    mine = server | local
    shared = sum(1 for tag in mine & others if cache_object_path(cache, tag).is_file())
    objects, nbytes, pinned = cache_drop(cache, sorted(mine - others))
    return Dropped(objects=objects, bytes=nbytes, shared=shared, pinned=pinned)
