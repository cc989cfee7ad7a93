"""Room in the chunk cache: whether what a resume or a hoard is about to fetch fits, and the lines that say
what to do when it does not.

The cache makes room by itself (vulpes evicts clean objects, least recently used first, before it refuses a
write; doc/vulpes.md, "Room"), so what counts is `CacheUsage.room`: the free space under the cache plus the
clean objects it may drop, within the cache limit, less what must stay (objects not yet uploaded, pinned).
A resume or hoard that needs more than that is warned about before it starts; a VM that finds no room at
all is paused, and `full_line` is what the session says then.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from isrprogress import human_bytes
from parcels.keyring import KeyringRecord

from .remote import Remote
from .vulpes import CacheUsage, cache_object_path

#: What a chunk object of a chunk may take at most beyond the chunk itself (header, tag, GCM tag, zstd framing).
_OBJECT_OVERHEAD = 4096


def missing_tags(cache_dir: Path, records: Iterable[KeyringRecord]) -> tuple[list[bytes], int]:
    """The distinct tags of ``records`` whose object is not in the cache, and the bytes of those that are:
    what a hoard or a resume keeps, so they are not room it can make for the rest."""
    missing, kept = [], 0
    for tag in dict.fromkeys(record.tag for record in records):
        try:
            kept += cache_object_path(cache_dir, tag).stat().st_size
        except FileNotFoundError:
            missing.append(tag)
    return missing, kept


def expected_bytes(remote: Remote | None, parcel: str, version: int, tags: list[bytes], chunk_size: int,
                   room: int) -> int:
    """The stored bytes of the objects ``tags`` (of ``version`` of ``parcel``). The server is asked for their
    sizes only if they might not fit in ``room`` (each is at most a chunk and a little), so a cache with
    plenty of room costs no request. Objects the server does not list (this site's own changes) count 0;
    without a server each counts as a whole chunk."""
    most = len(tags) * (chunk_size + _OBJECT_OVERHEAD)
    if most <= room:
        return most
    if remote is None:
        return most
    _, listed = remote.version_chunks(parcel, version, "all")
    sizes = dict(listed)
    return sum(sizes.get(tag.hex(), 0) for tag in tags)


def shortfall(usage: CacheUsage, need: int, doing: str, then: str, *, kept: int = 0) -> str | None:
    """The warning for ``doing`` ("resuming p with policy demand", "hoarding p"), which fetches ``need``
    bytes into the cache and keeps ``kept`` bytes of what is there (not room it can make), if they do not
    fit; ``then`` says what happens when the cache is full. None if they fit."""
    room = max(0, usage.room - min(kept, usage.clean_bytes))
    if need <= room:
        return None
    return (f"warning: {doing} fetches {human_bytes(need)} into the chunk cache, which has room for "
            f"{human_bytes(room)} ({usage.describe()}): {usage.what_to_do()} first, or {then}")


def full_line(name: str, usage: CacheUsage, dirty: int, *, disconnected: bool) -> str:
    """What a session says, on one line, when its VM is paused because the cache has no room for its writes:
    that the cache is full, how much of the parcel is not uploaded yet, and what to do."""
    if usage.limit_bound:
        where = f"its limit of {human_bytes(usage.limit)}"
        fix = f"raise the limit (`isr login --cache-limit`, then `isr resume {name}`)"
    else:
        where = f"{human_bytes(usage.fs_free)} free on its file system"
        fix = f"free space under {usage.dir}"
    upload = "" if disconnected else f", or `isr sync {name}` to upload what is dirty so that it can be dropped"
    return (f"{name} is paused: the chunk cache {usage.dir} is full ({where}; {human_bytes(dirty)} of {name} not "
            f"yet uploaded): {fix}{upload}; it continues by itself once there is room (`isr resume {name}` tries "
            f"at once)")
