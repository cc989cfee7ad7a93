"""The resume pack: plaintext extents of a version's memory image that its guest touched first after its last
resume, so that the next resume serves them before any chunk of them arrives (doc/parcel-format.md,
"Resume pack"). It travels in parts, in first-touch order, as sealed kind-3 blobs named `part_name(0)`,
`part_name(1)`, ... (at most `PARTS_MAX`); opened, it lives only in RAM.

Payload: a header (magic ``ISRP``, the version, three zero bytes, the image size, the extent count:
``>4sB3sQQ``; version 2 adds the map's entry count, ``>Q``), the extents (offset, length: ``>QI``) in strictly
increasing, non-overlapping order, in version 2 the map (offset, length, part: ``>QII``, in the same kind of
order), then the extents' bytes in their order. The map says which later part holds which bytes, so that a
reader whose guest reaches bytes still on their way can wait for their part instead of fetching their chunk.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import FormatError

BLOB_NAME = "resumepack"
#: The most parts a pack has (vulpes takes this many; PACK_PARTS_MAX in vulpes/src/pack.h).
PARTS_MAX = 256
HEADER = struct.Struct(">4sB3sQQ")
#: Version 2's header: the map's entry count after the extent count.
HEADER_V2 = struct.Struct(">4sB3sQQQ")
EXTENT = struct.Struct(">QI")
MAP_ENTRY = struct.Struct(">QII")
MAGIC = b"ISRP"
#: Version 1 has no map; a payload is written as version 2 only when it carries one.
VERSIONS = (1, 2)
#: The longest extent the format allows (its length is 32 bits).
EXTENT_MAX = (1 << 32) - 1


def part_name(index: int) -> str:
    """The blob name of part ``index`` (0: ``resumepack``, then ``resumepack.1``, ...)."""
    if not 0 <= index < PARTS_MAX:
        raise FormatError(f"a resume pack has at most {PARTS_MAX} parts, not part {index}")
    return BLOB_NAME if index == 0 else f"{BLOB_NAME}.{index}"


def part_index(name: str) -> int:
    """The index of the part named ``name`` (the inverse of `part_name`); raises FormatError for another name."""
    if name == BLOB_NAME:
        return 0
    if is_part(name):
        index = int(name[len(BLOB_NAME) + 1:])
        if 0 < index < PARTS_MAX and part_name(index) == name:
            return index
    raise FormatError(f"{name!r} does not name a resume pack part")


def is_part(name: str) -> bool:
    """Whether a blob name is a part of a resume pack."""
    return name == BLOB_NAME or (name.startswith(BLOB_NAME + ".") and name[len(BLOB_NAME) + 1:].isdigit())


@dataclass(frozen=True)
class Extent:
    """``length`` bytes of the image at ``offset``."""

    offset: int
    length: int


@dataclass(frozen=True)
class MapEntry:
    """``length`` bytes of the image at ``offset`` are in part ``part`` (1 to PARTS_MAX - 1)."""

    offset: int
    length: int
    part: int


def _check_order(ranges: Iterable[tuple[int, int]], image_size: int, what: str) -> None:
    end = 0
    for i, (offset, length) in enumerate(ranges):
        if length <= 0 or length > EXTENT_MAX or offset < end or offset + length > image_size:
            raise FormatError(f"resume pack {what} {i} is empty, out of order, overlapping, too long or beyond the "
                              f"image ({length} bytes at {offset})")
        end = offset + length


def _check_map(entries: list[MapEntry], image_size: int) -> None:
    _check_order(((e.offset, e.length) for e in entries), image_size, "map entry")
    for e in entries:
        if not 1 <= e.part < PARTS_MAX:
            raise FormatError(f"a resume pack map entry names part {e.part} (1 to {PARTS_MAX - 1})")


def encode(image_size: int, extents: Iterable[tuple[int, bytes]], parts_map: Iterable[MapEntry] = ()) -> bytes:
    """The payload of a pack holding ``(offset, data)`` pieces of an image of ``image_size`` bytes, and, if
    given, the map of the parts to come (a version-2 payload; without one, version 1).

    The pieces, and the map's entries, must be in increasing order and not overlap; raises FormatError
    otherwise."""
    pieces = list(extents)
    entries = list(parts_map)
    _check_order(((offset, len(data)) for offset, data in pieces), image_size, "extent")
    _check_map(entries, image_size)
    if entries:
        header = HEADER_V2.pack(MAGIC, 2, b"\0\0\0", image_size, len(pieces), len(entries))
    else:
        header = HEADER.pack(MAGIC, 1, b"\0\0\0", image_size, len(pieces))
    return b"".join([header, *(EXTENT.pack(offset, len(data)) for offset, data in pieces),
                     *(MAP_ENTRY.pack(e.offset, e.length, e.part) for e in entries),
                     *(data for _, data in pieces)])


def decode(payload: bytes, image_size: int) -> list[tuple[Extent, memoryview]]:
    """The extents of a pack and views of their bytes; raises FormatError if it breaks the format or is for an
    image of another size."""
    return _decode(payload, image_size)[0]


def decode_map(payload: bytes, image_size: int) -> list[MapEntry]:
    """The map of the parts to come that a pack carries (none in version 1); raises as `decode`."""
    return _decode(payload, image_size)[1]


def _decode(payload: bytes, image_size: int) -> tuple[list[tuple[Extent, memoryview]], list[MapEntry]]:
    if len(payload) < HEADER.size:
        raise FormatError("a resume pack is shorter than its header")
    magic, version, reserved, size, count = HEADER.unpack_from(payload)
    if magic != MAGIC or version not in VERSIONS or reserved != b"\0\0\0":
        raise FormatError("a resume pack has a wrong magic, version or reserved bytes")
    header = HEADER.size if version == 1 else HEADER_V2.size
    if len(payload) < header:
        raise FormatError("a resume pack is shorter than its header")
    entries = 0 if version == 1 else HEADER_V2.unpack_from(payload)[5]
    if size != image_size:
        raise FormatError(f"a resume pack is for an image of {size} bytes, not {image_size}")
    if count > (len(payload) - header) // EXTENT.size or \
            entries > (len(payload) - header - count * EXTENT.size) // MAP_ENTRY.size:
        raise FormatError(f"{count} resume pack extents and {entries} map entries do not fit in "
                          f"{len(payload)} bytes")
    table = [Extent(*EXTENT.unpack_from(payload, header + i * EXTENT.size)) for i in range(count)]
    at = header + count * EXTENT.size
    parts_map = [MapEntry(*MAP_ENTRY.unpack_from(payload, at + i * MAP_ENTRY.size)) for i in range(entries)]
    _check_order(((e.offset, e.length) for e in table), image_size, "extent")
    _check_map(parts_map, image_size)
    at += entries * MAP_ENTRY.size
    view = memoryview(payload)
    result: list[tuple[Extent, memoryview]] = []
    for extent in table:
        result.append((extent, view[at:at + extent.length]))
        at += extent.length
    if at != len(payload):
        data = len(payload) - header - count * EXTENT.size - entries * MAP_ENTRY.size
        raise FormatError(f"a resume pack's extents hold {sum(e.length for e in table)} bytes, but {data} "
                          f"follow them")
    return result, parts_map
