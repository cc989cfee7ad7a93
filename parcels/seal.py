"""Sealed blobs: manifests, keyring streams, device state and boot files encrypted under the parcel key.

See "Sealed blobs" in doc/parcel-format.md. This implementation holds a whole payload in memory and
refuses payloads larger than MAX_PAYLOAD (1 GiB), as the spec asks implementations to state.
"""
from __future__ import annotations

import struct

from parcels import compress as zstd
from parcels import crypto
from parcels.errors import FormatError, IntegrityError

MAGIC = b"ISRB"
VERSION = 1
KIND_MANIFEST = 1
KIND_KEYRING = 2
KIND_DEVSTATE = 3
KIND_BOOT = 4
KINDS = (KIND_MANIFEST, KIND_KEYRING, KIND_DEVSTATE, KIND_BOOT)
COMPRESSION_NONE = 0
COMPRESSION_ZSTD = 1
SALT_SIZE = 32
HEADER = struct.Struct(">4sBBBB32sQ")
HEADER_SIZE = HEADER.size
OVERHEAD = HEADER_SIZE + crypto.GCM_TAG_SIZE
MAX_PAYLOAD = 1 << 30
_KEY_LABEL = b"isr-blob-v1"

Bytes = bytes | bytearray | memoryview


def _blob_key(parcel_key: Bytes, salt: bytes) -> bytes:
    if len(parcel_key) != crypto.KEY_SIZE:
        raise FormatError("the parcel key must be 32 bytes")
    return crypto.hmac_sha256(parcel_key, _KEY_LABEL + salt)


def seal(parcel_key: Bytes, kind: int, payload: Bytes, compress: bool = True, *,
         _salt: bytes | None = None) -> bytes:
    """Seal `payload` as a blob of `kind` under `parcel_key`, with a fresh random salt.

    The payload is zstd-compressed when `compress` is true and that makes it smaller. `_salt` exists only
    so the test-vector generator can be deterministic; everything else must leave it unset, since a
    repeated salt would reuse a GCM key. Raises FormatError for an unknown kind, a parcel key that is not
    32 bytes or a payload above MAX_PAYLOAD.
    """
    if kind not in KINDS:
        raise FormatError(f"unknown sealed blob kind {kind}")
    if len(payload) > MAX_PAYLOAD:
        raise FormatError(f"payload of {len(payload)} bytes exceeds the {MAX_PAYLOAD}-byte limit")
    salt = crypto.random_bytes(SALT_SIZE) if _salt is None else _salt
    if len(salt) != SALT_SIZE:
        raise FormatError("a blob salt must be 32 bytes")
    compression, body = COMPRESSION_NONE, bytes(payload)
    if compress and payload:
        packed = zstd.compress(payload)
        if len(packed) < len(payload):
            compression, body = COMPRESSION_ZSTD, packed
    header = HEADER.pack(MAGIC, VERSION, kind, compression, 0, salt, len(payload))
    return header + crypto.aes_gcm_encrypt(_blob_key(parcel_key, salt), body, header)


def open_sealed(parcel_key: Bytes, blob: Bytes, kind: int, max_length: int, *, what: str = "sealed blob") -> bytes:
    """Check a sealed blob and return its payload; ``what`` names it in every error ("manifest of version 3").

    Guarantees: the blob was sealed under `parcel_key` as `kind`, is unaltered, and its payload is at
    most `max_length` bytes and exactly as long as its header says. Raises FormatError for a malformed
    header, another kind, a payload length above `max_length` (or MAX_PAYLOAD), or a body that does not
    decode to the recorded length; IntegrityError when AES-GCM authentication fails (an altered byte or
    another parcel key).
    """
    blob = bytes(blob)
    if len(blob) < OVERHEAD:
        raise FormatError(f"{what} of {len(blob)} bytes is shorter than {OVERHEAD}")
    magic, version, blob_kind, compression, reserved, salt, length = HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise FormatError(f"{what} has a bad magic number")
    if version != VERSION:
        raise FormatError(f"{what} has unknown format version {version}")
    if blob_kind != kind:
        raise FormatError(f"{what} is of kind {blob_kind}, expected {kind}")
    if compression not in (COMPRESSION_NONE, COMPRESSION_ZSTD):
        raise FormatError(f"{what} has unknown compression {compression}")
    if reserved != 0:
        raise FormatError(f"{what} has a nonzero reserved byte")
    if length > min(max_length, MAX_PAYLOAD):
        raise FormatError(f"{what}: payload of {length} bytes exceeds the limit of {max_length}")
    view = memoryview(blob)
    try:
        body = crypto.aes_gcm_decrypt(_blob_key(parcel_key, salt), view[HEADER_SIZE:], view[:HEADER_SIZE])
    except IntegrityError as e:
        raise IntegrityError(f"{what}: {e} (altered, or sealed under another parcel key)") from None
    if compression == COMPRESSION_NONE:
        if len(body) != length:
            raise FormatError(f"{what}: body is {len(body)} bytes, header says {length}")
        return body
    return zstd.decompress(body, length)
