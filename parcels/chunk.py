"""Chunk objects: the compressed, convergently encrypted form of one slice of an image.

See "Chunk objects" in doc/parcel-format.md. `encode_chunk` turns plaintext into an object, its tag and
its key; `decode_chunk` checks an object in the order the spec prescribes and returns plaintext only when
every check passed.
"""
from __future__ import annotations

import functools
import struct
from typing import NamedTuple

from parcels import compress, crypto
from parcels.errors import FormatError, IntegrityError

MAGIC = b"ISRC"
VERSION = 1
COMPRESSION_NONE = 0
COMPRESSION_ZSTD = 1
FLAG_COMPRESSED = 0x01
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 4194304
#: The chunk size of a new parcel's images. The memory image may have one of its own (`create_parcel`'s
#: ``memory_chunk_size``), but by default has the disk's: a resumed guest faults on single pages, but near
#: each other, and each miss is a round trip; 32 KiB chunks took 3.4 times the misses of 128 KiB ones and the
#: guest answered later (BENCHMARKS.md, "a chunk size for the memory image").
DEFAULT_CHUNK_SIZE = 131072
HEADER = struct.Struct(">4sBBHI")
HEADER_SIZE = HEADER.size
OVERHEAD = HEADER_SIZE + crypto.GCM_TAG_SIZE
TAG_SIZE = 32
_KEY_LABEL = b"isr-chunk-v1"

Bytes = bytes | bytearray | memoryview


class EncodedChunk(NamedTuple):
    """A chunk object and what a keyring records about it."""

    tag: bytes    # SHA-256 of `data`
    key: bytes    # the chunk key K, 32 bytes, in the clear
    flags: int    # keyring flags: FLAG_COMPRESSED or 0
    data: bytes   # the chunk object H || C || T


def valid_chunk_size(n: int) -> bool:
    """True if `n` is a power of two between 4096 and 4194304."""
    return (isinstance(n, int) and not isinstance(n, bool) and MIN_CHUNK_SIZE <= n <= MAX_CHUNK_SIZE
            and n & (n - 1) == 0)


def chunk_count(chunk_size: int, image_size: int) -> int:
    """Number of chunks in an image of `image_size` bytes: ceil(image_size / chunk_size).

    Raises FormatError for an invalid chunk size or a negative image size.
    """
    if not valid_chunk_size(chunk_size):
        raise FormatError(f"invalid chunk size {chunk_size}: must be a power of two in 4096..4194304")
    if image_size < 0:
        raise FormatError(f"negative image size {image_size}")
    return -(-image_size // chunk_size)


def chunk_length(index: int, chunk_size: int, image_size: int) -> int:
    """Length of chunk `index`: `chunk_size` for every chunk but a shorter last one.

    Raises FormatError if `index` is outside the image or the sizes are invalid.
    """
    count = chunk_count(chunk_size, image_size)
    if not 0 <= index < count:
        raise FormatError(f"chunk index {index} out of range 0..{count - 1}")
    return min(chunk_size, image_size - index * chunk_size)


@functools.lru_cache(maxsize=4)
def _zeros(n: int) -> bytes:
    return bytes(n)


def is_zero(buf: Bytes) -> bool:
    """True if every byte of `buf` is zero (an empty buffer counts as zero)."""
    if not isinstance(buf, (bytes, bytearray)):
        # memoryview equality compares element by element in Python; one copy and a memcmp is faster.
        buf = memoryview(buf).tobytes()
    if len(buf) <= MAX_CHUNK_SIZE:
        return buf == _zeros(len(buf))
    return buf.count(0) == len(buf)


def _key(secret: bytes, header: bytes, body: Bytes) -> bytes:
    return crypto.hmac_sha256(secret, _KEY_LABEL + header + bytes(body))


def _assemble(secret: bytes, header: bytes, body: Bytes) -> tuple[bytes, bytes]:
    """Encrypt `body` under the convergent key of `header || body`; return (object, key)."""
    key = _key(secret, header, body)
    return header + crypto.aes_gcm_encrypt(key, body, header), key


def encode_chunk(plaintext: Bytes, secret: bytes, level: int = compress.DEFAULT_LEVEL) -> EncodedChunk:
    """Encode one chunk per the spec's "Encoding" steps.

    Guarantees: the object decodes with `decode_chunk(obj.data, obj.tag, obj.key, len(plaintext))` to
    `plaintext`; the body is zstd-compressed only when that makes it smaller; equal plaintexts under the
    same secret and zstd version give equal objects. Raises FormatError if `plaintext` is empty or longer
    than the largest chunk size, or `secret` is not 32 bytes. The caller must not encode an all-zero
    chunk (it has no object); this function does not refuse one.
    """
    n = len(plaintext)
    if not 1 <= n <= MAX_CHUNK_SIZE:
        raise FormatError(f"chunk plaintext length {n} outside 1..{MAX_CHUNK_SIZE}")
    if len(secret) != crypto.KEY_SIZE:
        raise FormatError("the convergence secret must be 32 bytes")
    packed = compress.compress(plaintext, level)
    if len(packed) < n:
        compression, body = COMPRESSION_ZSTD, packed
    else:
        compression, body = COMPRESSION_NONE, bytes(plaintext)
    header = HEADER.pack(MAGIC, VERSION, compression, 0, n)
    data, key = _assemble(bytes(secret), header, body)
    return EncodedChunk(crypto.sha256(data), key, FLAG_COMPRESSED if compression else 0, data)


def decode_chunk(data: Bytes, tag: bytes, key: bytes, length: int) -> bytes:
    """Check a chunk object and return its `length`-byte plaintext.

    Checks, in the spec's order: SHA-256(data) == tag (IntegrityError); object length, magic, version,
    compression and reserved bytes (FormatError); header length == `length` (FormatError); AES-GCM with
    `key` (IntegrityError); the body decodes to exactly `length` bytes (FormatError). Returns plaintext
    only when all passed, never a part of it. Also raises FormatError for a tag or key that is not 32
    bytes or a `length` outside 1..4194304.
    """
    if len(tag) != TAG_SIZE:
        raise FormatError("a chunk tag must be 32 bytes")
    if len(key) != crypto.KEY_SIZE:
        raise FormatError("a chunk key must be 32 bytes")
    if not 1 <= length <= MAX_CHUNK_SIZE:
        raise FormatError(f"chunk length {length} outside 1..{MAX_CHUNK_SIZE}")
    data = bytes(data)
    if not crypto.equal(crypto.sha256(data), tag):
        raise IntegrityError(f"chunk object does not match its tag {bytes(tag).hex()}")
    if len(data) < OVERHEAD:
        raise FormatError(f"chunk object of {len(data)} bytes is shorter than {OVERHEAD}")
    magic, version, compression, reserved, n = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FormatError("chunk object has a bad magic number")
    if version != VERSION:
        raise FormatError(f"chunk object has unknown format version {version}")
    if compression not in (COMPRESSION_NONE, COMPRESSION_ZSTD):
        raise FormatError(f"chunk object has unknown compression {compression}")
    if reserved != 0:
        raise FormatError("chunk object has nonzero reserved bytes")
    if n != length:
        raise FormatError(f"chunk object holds {n} bytes, expected {length}")
    try:
        body = crypto.aes_gcm_decrypt(key, memoryview(data)[HEADER_SIZE:], memoryview(data)[:HEADER_SIZE])
    except IntegrityError as e:
        raise IntegrityError(f"chunk object {bytes(tag).hex()}: {e} (its keyring record holds another key)") from None
    if compression == COMPRESSION_NONE:
        if len(body) != length:
            raise FormatError(f"uncompressed chunk body is {len(body)} bytes, expected {length}")
        return body
    return compress.decompress(body, length)
