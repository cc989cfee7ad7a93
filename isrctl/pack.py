"""The resume pack: made at suspend from what the guest touched first after its resume, loaded into vulpes at
the next resume at a site whose cache lacks those chunks (doc/parcel-format.md, "Resume pack").

A resumed guest does not need all of each 128 KiB chunk it faults on: before it answers, the test guest
touches 5-6 MiB of its memory image spread over some 200 chunks (BENCHMARKS.md, "what the resumed guest
touches"). vulpes's trace records the byte ranges of the reads the kernel sent it; the first `PACK_BYTES` of
them after a resume, read back from the memory image at suspend, are the next resume's best prediction of
what its guest touches first, as Firecracker's REAP records them. Sealed and compressed they cross the link
in one transfer before QEMU loads the device state, and vulpes serves those bytes from RAM while the chunks
follow in the background.

A session that booted cold makes no pack: what a boot touches says little about what a resume will.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from parcels import resumepack, seal
from parcels.errors import ParcelError
from parcels.keyring import decode_stream
from parcels.manifest import Manifest, open_blob
from parcels.parcel import ParcelKeys

from . import paths, workingset
from .errors import IsrError
from .localstate import ParcelState
from .remote import Remote
from .vulpes import Vulpes

log = logging.getLogger(__name__)

#: The most plaintext a pack holds. A little more than a resumed test guest touches before it answers
#: (BENCHMARKS.md); compressed, about a quarter of it crosses the link before the guest starts.
PACK_BYTES = 6 << 20
#: Touched ranges this close are packed as one extent: a later resume's read-around may straddle them.
_JOIN_GAP = 16 << 10
_PAGE = 4096


def first_touches(trace: Path, image: str, limit: int) -> list[tuple[int, int]]:
    """The byte ranges of ``image`` the trace's reads touched, in first-touch order, until ``limit`` new bytes
    (a version-1 trace, which has no ranges, or a missing one: nothing)."""
    ranges: list[tuple[int, int]] = []
    seen: set[int] = set()               # pages already taken
    total = 0
    try:
        with open(trace, errors="replace") as f:
            header = f.readline()
            if not header.startswith("# vulpes-trace 2"):
                return []
            for line in f:
                parts = line.split()
                if len(parts) < 7 or parts[1] != image or parts[3] != "r":
                    continue
                try:
                    offset, length = int(parts[5]), int(parts[6])
                except ValueError:
                    continue
                first, last = offset // _PAGE, (offset + length - 1) // _PAGE
                new = [p for p in range(first, last + 1) if p not in seen]
                if not new or length <= 0:
                    continue
                seen.update(new)
                ranges.append((offset, length))
                total += len(new) * _PAGE
                if total >= limit:
                    break
    except FileNotFoundError:
        return []
    return ranges


def extents(ranges: list[tuple[int, int]], image_size: int) -> list[tuple[int, int]]:
    """``ranges`` sorted, page-aligned, within the image, and joined where they overlap or nearly touch."""
    out: list[tuple[int, int]] = []
    for offset, length in sorted(ranges):
        start = offset // _PAGE * _PAGE
        end = min(image_size, -(-(offset + length) // _PAGE) * _PAGE)
        if start >= end:
            continue
        if out and start <= out[-1][0] + out[-1][1] + _JOIN_GAP:
            previous = out[-1][0]
            out[-1] = (previous, max(out[-1][0] + out[-1][1], end) - previous)
        else:
            out.append((start, end - start))
    return [(offset, min(length, resumepack.EXTENT_MAX // _PAGE * _PAGE)) for offset, length in out]


def build(trace: Path, memory: Path, image_size: int, limit: int = PACK_BYTES) -> bytes | None:
    """The pack payload for the memory image at ``memory`` (vulpes's file, read after the guest stopped), from
    this session's ``trace``; None if the trace recorded no memory reads."""
    chosen = extents(first_touches(trace, "memory", limit), image_size)
    if not chosen:
        return None
    fd = os.open(memory, os.O_RDONLY)
    try:
        pieces = []
        for offset, length in chosen:
            data = os.pread(fd, length, offset)
            if len(data) != length:
                raise OSError(f"short read of {memory} at {offset}")
            pieces.append((offset, data))
    finally:
        os.close(fd)
    return resumepack.encode(image_size, pieces)


def seal_pack(parcel_keys: ParcelKeys, payload: bytes) -> bytes:
    """The pack as the version's ``resumepack`` blob (kind 3, like the device state it goes with)."""
    return seal.seal(parcel_keys.parcel_key, seal.KIND_DEVSTATE, payload)


def worth_loading(state: ParcelState, manifest: Manifest) -> bool:
    """Whether the version has a pack and this site's cache lacks some of its memory image's chunks."""
    if resumepack.BLOB_NAME not in manifest.blobs:
        return False
    records = decode_stream(state.base_stream("memory"))[2]
    cover = workingset.coverage(paths.chunk_cache_dir(), records)
    return cover.cached < cover.chunks


def load(remote: Remote, state: ParcelState, manifest: Manifest, parcel_keys: ParcelKeys, vulpes: Vulpes) -> int:
    """Fetch the version's pack, check it and hand it to vulpes; returns its plaintext bytes (0: none used).

    A pack that cannot be had or is damaged is skipped with a warning: the resume fetches those chunks as it
    would without one."""
    try:
        sealed = remote.get_blob(state.parcel, manifest.version, resumepack.BLOB_NAME)
        payload = open_blob(parcel_keys.parcel_key, sealed, manifest, resumepack.BLOB_NAME)
        size = manifest.images["memory"].size
        used = sum(extent.length for extent, _ in resumepack.decode(payload, size))
        vulpes.preload("memory", payload)
    except (IsrError, ParcelError, OSError) as exc:
        log.warning("the resume pack of version %d is not used: %s", manifest.version, exc)
        return 0
    log.info("resume pack: %d bytes of memory served before their chunks (%d bytes crossed the link)", used,
             len(sealed))
    return used
