"""The resume pack: made at suspend from what the guest touched first after its resume, loaded into vulpes at
the next resume at a site whose cache lacks those chunks (doc/parcel-format.md, "Resume pack").

A resumed guest does not need all of each 128 KiB chunk it faults on: before it answers, the test guest
touches 5-16 MiB of its memory image spread over 150-200 chunks (BENCHMARKS.md, "what the resumed guest
touches"). vulpes's trace records the byte ranges of the reads the kernel sent it; the first `PACK_BYTES` of
them after a resume, read back from the memory image at suspend, are the next resume's best prediction of
what its guest touches first, as Firecracker's REAP records them (measured: 89 % of what the next guest
touched in its first 10 s was in the first 16 MiB). They are packed in parts of `PART_BYTES`, in touch
order. The first part crosses the link before QEMU loads the device state; the others follow in the
background while the guest runs on the first, and vulpes serves their bytes from RAM ahead of the chunks.

A session that booted cold makes no pack: what a boot touches says little about what a resume will.
"""
from __future__ import annotations

import logging
import os
import time
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

#: The most plaintext a pack holds: about what a resumed test guest touches before it answers (BENCHMARKS.md;
#: 89 % of what the next guest touched in its first 10 s was in the first 16 MiB).
PACK_BYTES = 16 << 20
#: The plaintext of one part; only the first is fetched before the guest starts (compressed, about a quarter
#: of it crosses the link: 0.1 s at 100 Mbit/s, 1 s at 10).
PART_BYTES = 4 << 20
#: The rest of the parts follow only on a link at least this fast (bytes/s, as the first part came): on
#: slower links they took the link from the chunks the workload wanted next, and the guest answered no
#: sooner (BENCHMARKS.md, "isr: the resume pack, before and after"; 10 and 1 Mbit/s).
REST_MIN_RATE = 4 << 20
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


def build(trace: Path, memory: Path, image_size: int, *, limit: int = PACK_BYTES,
          part: int = PART_BYTES) -> list[bytes]:
    """The pack's part payloads for the memory image at ``memory`` (vulpes's file, read after the guest
    stopped), from this session's ``trace``, first touches first; none if the trace recorded no memory reads."""
    groups: list[list[tuple[int, int]]] = [[]]
    size = 0
    for offset, length in first_touches(trace, "memory", limit):
        if size >= part and len(groups) < resumepack.PARTS_MAX:
            groups.append([])
            size = 0
        groups[-1].append((offset, length))
        size += length
    payloads = []
    fd = os.open(memory, os.O_RDONLY)
    try:
        for group in groups:
            pieces = []
            for offset, length in extents(group, image_size):
                data = os.pread(fd, length, offset)
                if len(data) != length:
                    raise OSError(f"short read of {memory} at {offset}")
                pieces.append((offset, data))
            if pieces:
                payloads.append(resumepack.encode(image_size, pieces))
    finally:
        os.close(fd)
    return payloads


def seal_pack(parcel_keys: ParcelKeys, payload: bytes) -> bytes:
    """The pack as the version's ``resumepack`` blob (kind 3, like the device state it goes with)."""
    return seal.seal(parcel_keys.parcel_key, seal.KIND_DEVSTATE, payload)


def parts(manifest: Manifest) -> list[str]:
    """The blob names of the version's pack parts, in order."""
    names = []
    for index in range(resumepack.PARTS_MAX):
        if resumepack.part_name(index) not in manifest.blobs:
            break
        names.append(resumepack.part_name(index))
    return names


def worth_loading(state: ParcelState, manifest: Manifest) -> bool:
    """Whether the version has a pack and this site's cache lacks some of its memory image's chunks."""
    if not parts(manifest):
        return False
    records = decode_stream(state.base_stream("memory"))[2]
    cover = workingset.coverage(paths.chunk_cache_dir(), records)
    return cover.cached < cover.chunks


def load(remote: Remote, state: ParcelState, manifest: Manifest, parcel_keys: ParcelKeys, vulpes: Vulpes,
         names: list[str]) -> tuple[int, float]:
    """Fetch the pack parts ``names`` in order, check each and hand it to vulpes; returns their plaintext bytes
    and the rate the sealed parts came at (bytes per second).

    A part that cannot be had or is damaged ends the loading with a warning: the resume fetches those chunks
    as it would without a pack."""
    used = moved = 0
    started = time.monotonic()
    for name in names:
        try:
            sealed = remote.get_blob(state.parcel, manifest.version, name)
            moved += len(sealed)
            payload = open_blob(parcel_keys.parcel_key, sealed, manifest, name)
            size = manifest.images["memory"].size
            part = sum(extent.length for extent, _ in resumepack.decode(payload, size))
            vulpes.preload("memory", payload)
        except (IsrError, ParcelError, OSError) as exc:
            log.warning("the resume pack of version %d is not used from %s on: %s", manifest.version, name, exc)
            break
        used += part
        log.info("resume pack %s: %d bytes of memory served before their chunks (%d bytes crossed the link)",
                 name, part, len(sealed))
    return used, moved / max(time.monotonic() - started, 1e-3)
