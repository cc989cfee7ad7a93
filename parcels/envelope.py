"""Key envelopes: the parcel key and convergence secret, encrypted under a passphrase or a key file.

See "Key envelope" in doc/parcel-format.md.
"""
from __future__ import annotations

import struct
import uuid

from parcels import crypto
from parcels.errors import FormatError, IntegrityError, WrongKeyError

MAGIC = b"ISRE"
VERSION = 1
KDF_SCRYPT = 1
KDF_KEYFILE = 2
SIZE = 148
SALT_SIZE = 32
HEADER = struct.Struct(">4sBBH16s32sB3sII")
HEADER_SIZE = HEADER.size
DEFAULT_LOG2N = 15
DEFAULT_R = 8
DEFAULT_P = 1
MIN_KEYFILE = 32
MAX_KEYFILE = 4096
MAX_SCRYPT_MEMORY = 1 << 30
_KEYFILE_LABEL = b"isr-keyfile-v1"


def check_scrypt_params(log2n: int, r: int, p: int) -> None:
    """Raise FormatError unless log2N in 10..22, r in 1..32, p in 1..16 and 128·r·N·p <= 1 GiB."""
    if not 10 <= log2n <= 22:
        raise FormatError(f"scrypt log2(N) = {log2n} outside 10..22")
    if not 1 <= r <= 32:
        raise FormatError(f"scrypt r = {r} outside 1..32")
    if not 1 <= p <= 16:
        raise FormatError(f"scrypt p = {p} outside 1..16")
    if 128 * r * (1 << log2n) * p > MAX_SCRYPT_MEMORY:
        raise FormatError(f"scrypt parameters log2N={log2n} r={r} p={p} need more than 1 GiB")


def _check_keyfile(keyfile: bytes) -> None:
    if not MIN_KEYFILE <= len(keyfile) <= MAX_KEYFILE:
        raise FormatError(f"a key file must hold {MIN_KEYFILE} to {MAX_KEYFILE} bytes, not {len(keyfile)}")


def _one_credential(passphrase: str | None, keyfile: bytes | None) -> None:
    if (passphrase is None) == (keyfile is None):
        raise FormatError("give exactly one of a passphrase or a key file")


def _passphrase_bytes(passphrase: str) -> bytes:
    try:
        return passphrase.encode("utf-8")
    except UnicodeEncodeError:
        raise FormatError("the passphrase is not valid Unicode text") from None


def new_keyfile() -> bytes:
    """Return the contents of a new key file: 32 random bytes."""
    return crypto.random_bytes(MIN_KEYFILE)


def wrap_envelope(parcel: uuid.UUID, parcel_key: bytes, convergence_secret: bytes, *,
                  passphrase: str | None = None, keyfile: bytes | None = None,
                  log2n: int = DEFAULT_LOG2N, r: int = DEFAULT_R, p: int = DEFAULT_P,
                  _salt: bytes | None = None) -> bytes:
    """Return the 148-byte envelope holding `parcel_key` and `convergence_secret` for `parcel`.

    Exactly one of `passphrase` (scrypt with log2n, r, p) or `keyfile` (its contents) must be given.
    `_salt` exists only for the deterministic test-vector generator. Raises FormatError for keys that are
    not 32 bytes, scrypt parameters a reader would refuse, a key file outside 32..4096 bytes, or not
    exactly one credential.
    """
    _one_credential(passphrase, keyfile)
    if len(parcel_key) != crypto.KEY_SIZE or len(convergence_secret) != crypto.KEY_SIZE:
        raise FormatError("the parcel key and the convergence secret must be 32 bytes each")
    salt = crypto.random_bytes(SALT_SIZE) if _salt is None else _salt
    if len(salt) != SALT_SIZE:
        raise FormatError("an envelope salt must be 32 bytes")
    if passphrase is not None:
        check_scrypt_params(log2n, r, p)
        header = HEADER.pack(MAGIC, VERSION, KDF_SCRYPT, 0, parcel.bytes, salt, log2n, bytes(3), r, p)
        kek = crypto.scrypt(_passphrase_bytes(passphrase), salt, log2n, r, p)
    else:
        assert keyfile is not None
        _check_keyfile(keyfile)
        header = HEADER.pack(MAGIC, VERSION, KDF_KEYFILE, 0, parcel.bytes, salt, 0, bytes(3), 0, 0)
        kek = crypto.hmac_sha256(keyfile, _KEYFILE_LABEL + salt)
    return header + crypto.aes_gcm_encrypt(kek, bytes(parcel_key) + bytes(convergence_secret), header)


def envelope_uuid(data: bytes) -> uuid.UUID:
    """Return the parcel UUID an envelope claims, without authenticating it. Raises FormatError if `data`
    is not the size of an envelope or has a bad magic number."""
    if len(data) != SIZE or data[:4] != MAGIC:
        raise FormatError("not a key envelope")
    return uuid.UUID(bytes=bytes(data[8:24]))


def unwrap_envelope(data: bytes, *, passphrase: str | None = None, keyfile: bytes | None = None,
                    expect_uuid: uuid.UUID | None = None) -> tuple[uuid.UUID, bytes, bytes]:
    """Open an envelope and return (parcel UUID, parcel key, convergence secret).

    Exactly one of `passphrase` or `keyfile` must be given. The scrypt parameters are checked before
    scrypt runs. Raises FormatError for a malformed envelope (size, magic, version, kdf, reserved bytes,
    scrypt parameters, key file size); IntegrityError if `expect_uuid` is given and the envelope belongs
    to another parcel; WrongKeyError when decryption fails, which is both a wrong passphrase or key file
    and an altered byte (they cannot be told apart), and when the credential is of the other kind.
    """
    _one_credential(passphrase, keyfile)
    data = bytes(data)
    if len(data) != SIZE:
        raise FormatError(f"a key envelope is {SIZE} bytes, not {len(data)}")
    magic, version, kdf, reserved, raw_uuid, salt, log2n, reserved2, r, p = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FormatError("key envelope has a bad magic number")
    if version != VERSION:
        raise FormatError(f"key envelope has unknown format version {version}")
    if reserved != 0 or reserved2 != bytes(3):
        raise FormatError("key envelope has nonzero reserved bytes")
    parcel = uuid.UUID(bytes=raw_uuid)
    if expect_uuid is not None and parcel != expect_uuid:
        raise IntegrityError(f"key envelope is for parcel {parcel}, not {expect_uuid}")
    if kdf == KDF_SCRYPT:
        check_scrypt_params(log2n, r, p)
        if passphrase is None:
            raise WrongKeyError("this parcel is protected by a passphrase, not a key file")
        kek = crypto.scrypt(_passphrase_bytes(passphrase), salt, log2n, r, p)
    elif kdf == KDF_KEYFILE:
        if log2n != 0 or r != 0 or p != 0:
            raise FormatError("key-file envelope has nonzero scrypt parameters")
        if keyfile is None:
            raise WrongKeyError("this parcel is protected by a key file, not a passphrase")
        _check_keyfile(keyfile)
        kek = crypto.hmac_sha256(keyfile, _KEYFILE_LABEL + salt)
    else:
        raise FormatError(f"key envelope has unknown kdf {kdf}")
    try:
        secrets = crypto.aes_gcm_decrypt(kek, data[HEADER_SIZE:], data[:HEADER_SIZE])
    except IntegrityError:
        raise WrongKeyError("wrong passphrase or key file, or a damaged key envelope") from None
    return parcel, secrets[:32], secrets[32:]
