"""The cryptographic primitives of the parcel format, and the only module that imports `cryptography`.

Everything here is a thin, typed wrapper that turns library exceptions into `parcels.errors` ones, so
the rest of the package never sees a library type. The hash functions use `hashlib`/`hmac`, which call
the same OpenSSL code without an object per call.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt
from cryptography.hazmat.primitives import keywrap

from parcels.errors import FormatError, IntegrityError

KEY_SIZE = 32
GCM_TAG_SIZE = 16
WRAPPED_KEY_SIZE = 40
# Every AES-GCM key in the format encrypts exactly one plaintext (see "Nonces are safe by construction").
ZERO_NONCE = bytes(12)

Bytes = bytes | bytearray | memoryview


def sha256(data: Bytes) -> bytes:
    """Return the 32-byte SHA-256 digest of `data`."""
    return hashlib.sha256(data).digest()


def hmac_sha256(key: Bytes, data: Bytes) -> bytes:
    """Return HMAC-SHA256(key, data), 32 bytes."""
    return hmac.digest(bytes(key), data, "sha256")


def equal(a: Bytes, b: Bytes) -> bool:
    """Compare two byte strings in constant time."""
    return hmac.compare_digest(bytes(a), bytes(b))


def random_bytes(n: int) -> bytes:
    """Return `n` bytes from the operating system's CSPRNG."""
    return secrets.token_bytes(n)


def _check_key(key: Bytes) -> bytes:
    if len(key) != KEY_SIZE:
        raise FormatError(f"an AES-256 key must be {KEY_SIZE} bytes, not {len(key)}")
    return bytes(key)


def aes_gcm_encrypt(key: Bytes, plaintext: Bytes, aad: Bytes) -> bytes:
    """AES-256-GCM with the zero nonce: return ciphertext || 16-byte tag (len(plaintext) + 16 bytes).

    The caller guarantees that `key` encrypts nothing else. Raises FormatError for a key that is not
    32 bytes.
    """
    return AESGCM(_check_key(key)).encrypt(ZERO_NONCE, bytes(plaintext), bytes(aad))


def aes_gcm_decrypt(key: Bytes, data: Bytes, aad: Bytes) -> bytes:
    """Reverse `aes_gcm_encrypt`: `data` is ciphertext || tag. Returns the plaintext only if the tag checks.

    Raises IntegrityError when authentication fails (wrong key, altered ciphertext, tag or AAD) and
    FormatError for a key that is not 32 bytes or data shorter than a tag.
    """
    if len(data) < GCM_TAG_SIZE:
        raise FormatError("AES-GCM input is shorter than its tag")
    try:
        return AESGCM(_check_key(key)).decrypt(ZERO_NONCE, bytes(data), bytes(aad))
    except InvalidTag:
        raise IntegrityError("AES-GCM authentication failed") from None


def aes_key_wrap(kek: Bytes, key: Bytes) -> bytes:
    """RFC 3394 key wrap (default IV) of a 32-byte key under a 32-byte KEK: 40 bytes out.

    Raises FormatError if either key is not 32 bytes.
    """
    return keywrap.aes_key_wrap(_check_key(kek), _check_key(key))


def aes_key_unwrap(kek: Bytes, wrapped: Bytes) -> bytes:
    """Reverse `aes_key_wrap`. Raises IntegrityError when the RFC 3394 integrity check fails (the
    wrapped key was altered or wrapped under another KEK) and FormatError for wrong lengths."""
    if len(wrapped) != WRAPPED_KEY_SIZE:
        raise FormatError(f"a wrapped key must be {WRAPPED_KEY_SIZE} bytes, not {len(wrapped)}")
    try:
        return keywrap.aes_key_unwrap(_check_key(kek), bytes(wrapped))
    except keywrap.InvalidUnwrap:
        raise IntegrityError("AES key unwrap integrity check failed") from None


def scrypt(password: Bytes, salt: Bytes, log2n: int, r: int, p: int, length: int = KEY_SIZE) -> bytes:
    """scrypt(password, salt, N = 2**log2n, r, p) -> `length` bytes.

    The caller validates the cost parameters first (this runs whatever it is given). Raises FormatError
    if the library refuses them.
    """
    try:
        return Scrypt(salt=bytes(salt), length=length, n=1 << log2n, r=r, p=p).derive(bytes(password))
    except (ValueError, MemoryError) as exc:
        raise FormatError(f"scrypt refused its parameters: {exc}") from None
