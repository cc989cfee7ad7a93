"""Sealed blobs: manifests, keyring streams, device state and boot files encrypted under the parcel key.

See "Sealed blobs" in doc/parcel-format.md. This implementation holds a whole payload in memory and
refuses payloads larger than MAX_PAYLOAD (1 GiB), as the spec asks implementations to state.
"""
from __future__ import annotations

import re
import struct
from collections.abc import Callable, Sequence

from parcels import compress as zstd
from parcels import crypto
from parcels.errors import FormatError, IntegrityError, MissingFilesError

MAGIC = b"ISRB"
VERSION = 1
KIND_MANIFEST = 1
KIND_KEYRING = 2
KIND_DEVSTATE = 3
KIND_BOOT = 4
KINDS = (KIND_MANIFEST, KIND_KEYRING, KIND_DEVSTATE, KIND_BOOT)
COMPRESSION_NONE = 0
COMPRESSION_ZSTD = 1
#: zstd against files the reader is expected to have (its QEMU's firmware), named in the body; device state only.
COMPRESSION_ZSTD_FILES = 2
#: One piece of a zstd frame that runs across blobs read in order (a resume pack's parts); device state kind only.
COMPRESSION_ZSTD_STREAM = 3
#: At most this many files, each named by `FILE_NAME`, of at most `FILES_MAX_BYTES` together.
FILES_MAX = 8
FILES_MAX_BYTES = 64 << 20
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
#: The level of compression 2: its payload is small once the files are taken out (a 0.9 MB device state
#: compresses to 15 KB in 0.06 s), and every resume at another site fetches it.
FILES_LEVEL = 19
_FILE_ENTRY = struct.Struct(">Q32s")
SALT_SIZE = 32
HEADER = struct.Struct(">4sBBBB32sQ")
HEADER_SIZE = HEADER.size
OVERHEAD = HEADER_SIZE + crypto.GCM_TAG_SIZE
MAX_PAYLOAD = 1 << 30
_KEY_LABEL = b"isr-blob-v1"

Bytes = bytes | bytearray | memoryview
#: (name, size, SHA-256) -> that file's bytes, or None if the reader has no such file.
FileLookup = Callable[[str, int, bytes], "bytes | None"]


def _blob_key(parcel_key: Bytes, salt: bytes) -> bytes:
    if len(parcel_key) != crypto.KEY_SIZE:
        raise FormatError("the parcel key must be 32 bytes")
    return crypto.hmac_sha256(parcel_key, _KEY_LABEL + salt)


def seal(parcel_key: Bytes, kind: int, payload: Bytes, compress: bool = True, *,
         files: Sequence[tuple[str, Bytes]] | None = None, level: int = zstd.DEFAULT_LEVEL,
         _salt: bytes | None = None) -> bytes:
    """Seal `payload` as a blob of `kind` under `parcel_key`, with a fresh random salt.

    The payload is zstd-compressed when `compress` is true and that makes it smaller; with ``files`` (name,
    contents; device state only), compressed against them (compression 2), and its reader needs the same
    files. ``level``: zstd's, for compression 1 (a blob many resumes fetch may be worth a slower one). `_salt` exists only so the test-vector generator can be deterministic; everything else must leave
    it unset, since a repeated salt would reuse a GCM key. Raises FormatError for an unknown kind, a parcel
    key that is not 32 bytes, a payload above MAX_PAYLOAD, or files the format does not allow.
    """
    if kind not in KINDS:
        raise FormatError(f"unknown sealed blob kind {kind}")
    if len(payload) > MAX_PAYLOAD:
        raise FormatError(f"payload of {len(payload)} bytes exceeds the {MAX_PAYLOAD}-byte limit")
    salt = crypto.random_bytes(SALT_SIZE) if _salt is None else _salt
    if len(salt) != SALT_SIZE:
        raise FormatError("a blob salt must be 32 bytes")
    compression, body = COMPRESSION_NONE, bytes(payload)
    if files is not None:
        compression, body = COMPRESSION_ZSTD_FILES, _files_body(kind, payload, files)
    elif compress and payload:
        packed = zstd.compress(payload, level)
        if len(packed) < len(payload):
            compression, body = COMPRESSION_ZSTD, packed
    return _sealed(parcel_key, kind, compression, salt, len(payload), body)


def _sealed(parcel_key: Bytes, kind: int, compression: int, salt: bytes, length: int, body: bytes) -> bytes:
    header = HEADER.pack(MAGIC, VERSION, kind, compression, 0, salt, length)
    return header + crypto.aes_gcm_encrypt(_blob_key(parcel_key, salt), body, header)


def seal_stream(parcel_key: Bytes, kind: int, payloads: Sequence[Bytes], *, level: int = zstd.DEFAULT_LEVEL) \
        -> list[bytes]:
    """Seal ``payloads`` as blobs whose bodies are the pieces of one zstd frame (compression 3; device state
    kind only), each with a fresh salt: a reader opens them in this order (`open_sealed` with one
    `zstd.StreamReader`), and each later one compresses against all before it. Raises as `seal`."""
    if kind != KIND_DEVSTATE:
        raise FormatError("only device state is compressed as a stream across blobs")
    if any(len(payload) > MAX_PAYLOAD for payload in payloads):
        raise FormatError(f"a payload exceeds the {MAX_PAYLOAD}-byte limit")
    writer = zstd.StreamWriter(level)
    return [_sealed(parcel_key, kind, COMPRESSION_ZSTD_STREAM, crypto.random_bytes(SALT_SIZE), len(payload),
                    writer.piece(payload, last=index == len(payloads) - 1))
            for index, payload in enumerate(payloads)]


def _files_body(kind: int, payload: Bytes, files: Sequence[tuple[str, Bytes]]) -> bytes:
    """Compression 2's body: the file list, then the payload's zstd frame against the files' contents."""
    if kind != KIND_DEVSTATE:
        raise FormatError("only device state is compressed against files")
    if not 1 <= len(files) <= FILES_MAX:
        raise FormatError(f"a blob is compressed against 1 to {FILES_MAX} files, not {len(files)}")
    if sum(len(data) for _, data in files) > FILES_MAX_BYTES:
        raise FormatError(f"the files a blob is compressed against exceed {FILES_MAX_BYTES} bytes")
    head = bytearray([len(files)])
    for name, data in files:
        if not FILE_NAME.fullmatch(name):
            raise FormatError(f"{name!r} is not a file name a blob may name")
        head += bytes([len(name)]) + name.encode() + _FILE_ENTRY.pack(len(data), crypto.sha256(data))
    dictionary = b"".join(bytes(data) for _, data in files)
    return bytes(head) + zstd.compress(payload, FILES_LEVEL, dictionary=dictionary)


def files_named(parcel_key: Bytes, blob: Bytes, kind: int, *, what: str = "sealed blob") \
        -> list[tuple[str, int, bytes]]:
    """The files (name, size, SHA-256) a blob sealed with compression 2 was compressed against, checked as
    `open_sealed` checks the blob; [] for another compression. Raises as `open_sealed`."""
    compression, body = _open(parcel_key, blob, kind, MAX_PAYLOAD, what)[:2]
    return _parse_files(body, what)[0] if compression == COMPRESSION_ZSTD_FILES else []


def _parse_files(body: bytes, what: str) -> tuple[list[tuple[str, int, bytes]], int]:
    """Compression 2's file list and where the zstd frame starts."""
    if not body or not 1 <= body[0] <= FILES_MAX:
        raise FormatError(f"{what}: its file list must name 1 to {FILES_MAX} files")
    entries, pos = [], 1
    for _ in range(body[0]):
        length = body[pos] if pos < len(body) else 0
        name_bytes = body[pos + 1:pos + 1 + length]
        end = pos + 1 + length + _FILE_ENTRY.size
        if length == 0 or end > len(body):
            raise FormatError(f"{what}: its file list is truncated")
        name = name_bytes.decode("ascii", errors="replace")
        if not FILE_NAME.fullmatch(name):
            raise FormatError(f"{what}: {name!r} is not a file name a blob may name")
        size, digest = _FILE_ENTRY.unpack_from(body, pos + 1 + length)
        entries.append((name, size, digest))
        pos = end
    if sum(size for _, size, _ in entries) > FILES_MAX_BYTES:
        raise FormatError(f"{what}: the files it names exceed {FILES_MAX_BYTES} bytes")
    return entries, pos


def open_sealed(parcel_key: Bytes, blob: Bytes, kind: int, max_length: int, *, what: str = "sealed blob",
                files: FileLookup | None = None, stream: zstd.StreamReader | None = None) -> bytes:
    """Check a sealed blob and return its payload; ``what`` names it in every error ("manifest of version 3").

    Guarantees: the blob was sealed under `parcel_key` as `kind`, is unaltered, and its payload is at
    most `max_length` bytes and exactly as long as its header says. Raises FormatError for a malformed
    header, another kind, a payload length above `max_length` (or MAX_PAYLOAD), or a body that does not
    decode to the recorded length; IntegrityError when AES-GCM authentication fails (an altered byte or
    another parcel key). A blob compressed against files (compression 2) asks ``files`` for each it names and
    raises MissingFilesError if one is not there (no ``files``: none is); with files of the right size and
    digest, its payload is what was sealed. A piece of a stream (compression 3) needs ``stream``, the reader
    that decoded the blobs before it in their order (FormatError without one, or when it broke off).
    """
    compression, body, length = _open(parcel_key, blob, kind, max_length, what)
    if compression == COMPRESSION_ZSTD_STREAM:
        if stream is None:
            raise FormatError(f"{what} continues a zstd stream: it opens only after the blobs before it")
        try:
            return stream.piece(body, length)
        except FormatError as exc:
            raise FormatError(f"{what}: {exc}") from None
    if compression == COMPRESSION_NONE:
        if len(body) != length:
            raise FormatError(f"{what}: body is {len(body)} bytes, header says {length}")
        return body
    if compression == COMPRESSION_ZSTD:
        return zstd.decompress(body, length)
    entries, start = _parse_files(body, what)
    contents, missing = [], []
    for name, size, digest in entries:
        data = files(name, size, digest) if files is not None else None
        if data is None or len(data) != size or crypto.sha256(data) != digest:
            missing.append(name)
        else:
            contents.append(data)
    if missing:
        raise MissingFilesError(f"{what} is compressed against files this site lacks: {', '.join(missing)}",
                                missing)
    return zstd.decompress(body[start:], length, dictionary=b"".join(contents))


def _open(parcel_key: Bytes, blob: Bytes, kind: int, max_length: int, what: str) -> tuple[int, bytes, int]:
    """Check a sealed blob's header and tag; its compression, decrypted body and payload length."""
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
    if compression not in (COMPRESSION_NONE, COMPRESSION_ZSTD, COMPRESSION_ZSTD_FILES, COMPRESSION_ZSTD_STREAM) \
            or (compression in (COMPRESSION_ZSTD_FILES, COMPRESSION_ZSTD_STREAM) and blob_kind != KIND_DEVSTATE):
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
    return compression, body, length
