"""zstd compression for chunk objects and sealed blobs, and the only module that imports `zstandard`.

A sealed blob may be compressed against a dictionary (its reader must have the same bytes): raw content, as
zstd's "raw content dictionaries" take any bytes and let the frame copy from them as from earlier input.

A sealed blob may also be one piece of a zstd frame that runs across several blobs read in order (`StreamWriter`,
`StreamReader`): each piece ends at a block boundary, so it decodes whole once the pieces before it have, and
later pieces copy from the earlier pieces' output as from earlier input in one frame.

Decompression is where untrusted lengths meet memory, so `decompress` is told the exact output length
and never produces more: a frame that would expand past it, stop short of it, or carry bytes after its
end is refused before any output is returned.
"""
from __future__ import annotations

from typing import Any

import zstandard

from parcels.errors import FormatError

DEFAULT_LEVEL = 3
#: The largest window a stream's reader accepts (zstd level 19 on large input uses 8 MiB).
STREAM_WINDOW_MAX = 1 << 25
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# A zstd block header is 3 bytes and an RLE block adds 1 byte but can stand for up to 128 KiB, so feeding
# this many input bytes at a time caps how far past the limit one step can go at 16 blocks (2 MiB).
_FEED_SIZE = 64

Bytes = bytes | bytearray | memoryview


def _dictionary(dictionary: Bytes | None) -> zstandard.ZstdCompressionDict | None:
    if not dictionary:
        return None
    return zstandard.ZstdCompressionDict(bytes(dictionary), dict_type=zstandard.DICT_TYPE_RAWCONTENT)


def compress(data: Bytes, level: int = DEFAULT_LEVEL, *, content_size: bool = True, checksum: bool = False,
             dictionary: Bytes | None = None) -> bytes:
    """Compress `data` into one zstd frame, with no dictionary or with ``dictionary``'s raw content.

    Writers use the defaults: the content size in the frame header and no checksum (the format
    authenticates every byte with AES-GCM already). The test-vector generator turns them off and on to
    make valid frames other writers might produce. Raises FormatError for a level zstd does not know.
    """
    try:
        compressor = zstandard.ZstdCompressor(level=level, write_content_size=content_size,
                                              write_checksum=checksum, dict_data=_dictionary(dictionary))
        return compressor.compress(data)
    except zstandard.ZstdError as exc:
        raise FormatError(f"zstd refused to compress: {exc}") from None


def decompress(frame: Bytes, length: int, *, dictionary: Bytes | None = None) -> bytes:
    """Decompress exactly one zstd frame that must produce exactly `length` bytes (compressed against
    ``dictionary``'s raw content, if given: with other bytes there the result is wrong, which the caller's
    digest must catch).

    Guarantees: the result is `length` bytes long; at most about `length` + 2 MiB is ever held in memory;
    a skippable frame, a second frame, trailing bytes, a truncated frame or a header content size other
    than `length` is refused. Raises FormatError for all of these.
    """
    frame = bytes(frame)
    if length < 0:
        raise FormatError("negative decompressed length")
    if frame[:4] != ZSTD_MAGIC:
        raise FormatError("compressed data is not a zstd frame")
    try:
        content_size = zstandard.get_frame_parameters(frame).content_size
    except zstandard.ZstdError as exc:
        raise FormatError(f"bad zstd frame header: {exc}") from None
    if content_size != zstandard.CONTENTSIZE_UNKNOWN and content_size != length:
        raise FormatError(f"zstd frame holds {content_size} bytes, expected {length}")
    try:
        if content_size == length and length > 0:
            # The one-shot call decodes into a buffer of exactly `length` bytes and refuses trailing
            # input when the header states the size (it does not when the size is unknown, hence the
            # streaming path below).
            out = zstandard.ZstdDecompressor(dict_data=_dictionary(dictionary)).decompress(
                frame, allow_extra_data=False)
        else:
            out = _decompress_streaming(frame, length, dictionary)
    except zstandard.ZstdError as exc:
        raise FormatError(f"bad zstd frame: {exc}") from None
    if len(out) != length:
        raise FormatError(f"zstd frame decompressed to {len(out)} bytes, expected {length}")
    return out


def _decompress_streaming(frame: bytes, length: int, dictionary: Bytes | None) -> bytes:
    decoder = zstandard.ZstdDecompressor(dict_data=_dictionary(dictionary)).decompressobj()
    out, ended = _feed(decoder, frame, length, "zstd frame")
    if not ended:
        raise FormatError("zstd frame is truncated")
    return out


def _feed(decoder: Any, data: bytes, length: int, what: str) -> tuple[bytes, bool]:
    """Feed ``data`` to a streaming ``decoder`` a few bytes at a time, so that a small input cannot expand into
    a huge allocation: its output (more than ``length`` bytes is a FormatError naming ``what``), and whether
    the frame ended there (FormatError if bytes follow its end)."""
    out = bytearray()
    for pos in range(0, len(data), _FEED_SIZE):
        out += decoder.decompress(data[pos:pos + _FEED_SIZE])
        if len(out) > length:
            raise FormatError(f"{what} decompresses to more than {length} bytes")
        if decoder.eof:
            if decoder.unused_data or pos + _FEED_SIZE < len(data):
                raise FormatError("trailing data after the zstd frame")
            return bytes(out), True
    return bytes(out), False


class StreamWriter:
    """One zstd frame written in pieces (`piece`), each ending at a block boundary; the last ends the frame."""

    def __init__(self, level: int = DEFAULT_LEVEL) -> None:
        try:
            self._compressor = zstandard.ZstdCompressor(level=level, write_content_size=False).compressobj()
        except zstandard.ZstdError as exc:
            raise FormatError(f"zstd refused to compress: {exc}") from None
        self._ended = False

    def piece(self, data: Bytes, *, last: bool = False) -> bytes:
        """The frame's bytes for ``data``: all of them, so that a reader with the pieces before decodes it whole."""
        if self._ended:
            raise FormatError("the zstd stream has ended")
        self._ended = last
        out = self._compressor.compress(bytes(data))
        return out + self._compressor.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH if last
                                            else zstandard.COMPRESSOBJ_FLUSH_BLOCK)


class StreamReader:
    """Decodes the pieces of one zstd frame (a `StreamWriter`'s), in order, each to exactly its length.

    Guarantees as `decompress`: a piece that would expand past its length, stop short of it (the piece ends
    inside a block, or the wrong piece came), or follow the frame's end is refused, and so is every piece
    after a refused one. The frame may use a window of at most `STREAM_WINDOW_MAX`."""

    def __init__(self) -> None:
        self._decoder = zstandard.ZstdDecompressor(max_window_size=STREAM_WINDOW_MAX).decompressobj()
        self._started = self._ended = self._failed = False

    def piece(self, data: Bytes, length: int) -> bytes:
        if self._failed:
            raise FormatError("the zstd stream broke off at an earlier piece")
        if self._ended:
            raise FormatError("a piece after the end of the zstd stream")
        self._failed = True                       # until this piece has decoded whole
        data = bytes(data)
        if not self._started and data[:4] != ZSTD_MAGIC:
            raise FormatError("compressed data does not start a zstd frame")
        self._started = True
        try:
            out, self._ended = _feed(self._decoder, data, length, "zstd stream piece")
        except zstandard.ZstdError as exc:
            raise FormatError(f"bad zstd stream: {exc}") from None
        if len(out) != length:
            raise FormatError(f"zstd stream piece decompressed to {len(out)} bytes, expected {length}")
        self._failed = False
        return out
