"""The resume pack: plaintext extents of a version's memory image that its guest touched first after its last
resume, so that the next resume serves them before any chunk of them arrives (doc/parcel-format.md,
"Resume pack"). It travels in parts, in first-touch order, as sealed kind-3 blobs named `part_name(0)`,
`part_name(1)`, ... (at most `PARTS_MAX`); opened, it lives only in RAM.

Payload: a header (magic ``ISRP``, version 1, three zero bytes, the image size, the extent count: ``>4sB3sQQ``),
the extents (offset, length: ``>QI``) in strictly increasing, non-overlapping order, then their bytes in the
same order.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import FormatError

BLOB_NAME = "resumepack"
#: The most parts a pack has (vulpes takes this many).
PARTS_MAX = 32
HEADER = struct.Struct(">4sB3sQQ")
EXTENT = struct.Struct(">QI")
MAGIC = b"ISRP"
VERSION = 1
#: The longest extent the format allows (its length is 32 bits).
EXTENT_MAX = (1 << 32) - 1


def part_name(index: int) -> str:
    """The blob name of part ``index`` (0: ``resumepack``, then ``resumepack.1``, ...)."""
    if not 0 <= index < PARTS_MAX:
        raise FormatError(f"a resume pack has at most {PARTS_MAX} parts, not part {index}")
    return BLOB_NAME if index == 0 else f"{BLOB_NAME}.{index}"


def is_part(name: str) -> bool:
    """Whether a blob name is a part of a resume pack."""
    return name == BLOB_NAME or (name.startswith(BLOB_NAME + ".") and name[len(BLOB_NAME) + 1:].isdigit())


@dataclass(frozen=True)
class Extent:
    """``length`` bytes of the image at ``offset``."""

    offset: int
    length: int


def encode(image_size: int, extents: Iterable[tuple[int, bytes]]) -> bytes:
    """The payload of a pack holding ``(offset, data)`` pieces of an image of ``image_size`` bytes.

    The pieces must be in increasing order and not overlap; raises FormatError otherwise."""
    pieces = list(extents)
    end = 0
    for offset, data in pieces:
        if not data or len(data) > EXTENT_MAX or offset < end or offset + len(data) > image_size:
            raise FormatError(f"a resume pack extent at {offset} of {len(data)} bytes is empty, too long, out of "
                              f"order, overlapping or beyond the image")
        end = offset + len(data)
    return b"".join([HEADER.pack(MAGIC, VERSION, b"\0\0\0", image_size, len(pieces)),
                     *(EXTENT.pack(offset, len(data)) for offset, data in pieces),
                     *(data for _, data in pieces)])


def decode(payload: bytes, image_size: int) -> list[tuple[Extent, memoryview]]:
    """The extents of a pack and views of their bytes; raises FormatError if it breaks the format or is for an
    image of another size."""
    if len(payload) < HEADER.size:
        raise FormatError("a resume pack is shorter than its header")
    magic, version, reserved, size, count = HEADER.unpack_from(payload)
    if magic != MAGIC or version != VERSION or reserved != b"\0\0\0":
        raise FormatError("a resume pack has a wrong magic, version or reserved bytes")
    if size != image_size:
        raise FormatError(f"a resume pack is for an image of {size} bytes, not {image_size}")
    if count > (len(payload) - HEADER.size) // EXTENT.size:
        raise FormatError(f"{count} resume pack extents do not fit in {len(payload)} bytes")
    view = memoryview(payload)
    at = HEADER.size + count * EXTENT.size
    result: list[tuple[Extent, memoryview]] = []
    end = 0
    for i in range(count):
        offset, length = EXTENT.unpack_from(payload, HEADER.size + i * EXTENT.size)
        if length == 0 or offset < end or offset + length > image_size:
            raise FormatError(f"resume pack extent {i} is empty, out of order, overlapping or beyond the image")
        result.append((Extent(offset, length), view[at:at + length]))
        at += length
        end = offset + length
    if at != len(payload):
        raise FormatError(f"a resume pack's extents hold {at - HEADER.size - count * EXTENT.size} bytes, "
                          f"but {len(payload) - HEADER.size - count * EXTENT.size} follow them")
    return result
