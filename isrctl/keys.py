"""The parcel's secrets: getting the passphrase or key file, opening the key envelope, handing keys on.

The passphrase (or key file) opens the parcel's key envelope; what comes out, the parcel key PK and the
convergence secret CS, lives only in the memory of the process that needs it. vulpes gets ``PK || CS``
through an inherited pipe (`key_pipe`, vulpes ``--key-fd``), never through a file or a command line.

Credential sources (one of): ``--passphrase-file FILE|-``, ``--passphrase-env VAR``, ``--key-file FILE``
(read by `parcels.secretsource`, as isr-admin reads them), and otherwise a prompt on the terminal (getpass).
Without a terminal and without any of them, there is nothing to ask, and `obtain_credential` says so.
"""
from __future__ import annotations

import getpass
import os
import sys
import uuid
from dataclasses import dataclass

from parcels import envelope, secretsource
from parcels.errors import FormatError, IntegrityError, WrongKeyError
from parcels.parcel import ParcelKeys

from .errors import CredentialError

KEYS_LEN = 64


@dataclass(frozen=True)
class Credential:
    """Exactly one of a passphrase or the contents of a key file."""

    passphrase: str | None = None
    keyfile: bytes | None = None

    def __repr__(self) -> str:  # never show the secret in a traceback or log
        return "Credential(passphrase)" if self.passphrase is not None else "Credential(keyfile)"


def obtain_credential(*, passphrase_file: str | None = None, passphrase_env: str | None = None,
                      key_file: str | os.PathLike[str] | None = None,
                      prompt: str = "parcel passphrase: ") -> Credential:
    """Get the credential from a file, an environment variable, a key file, or a terminal prompt.

    Raises SecretSourceError (a ParcelError) if a named source gives nothing, and CredentialError if two
    sources are given, or none and stdin is not a terminal.
    """
    if key_file and (passphrase_file or passphrase_env):
        raise CredentialError("give either a passphrase (--passphrase-file, --passphrase-env) or --key-file, not both")
    if key_file:
        return Credential(keyfile=secretsource.read_key_file(key_file))
    passphrase = secretsource.read_secret(file=passphrase_file, env=passphrase_env, option="--passphrase")
    if passphrase is not None:
        return Credential(passphrase=passphrase)
    if not sys.stdin.isatty():
        raise CredentialError("no passphrase: run from a terminal, or give --passphrase-file FILE|-, "
                              "--passphrase-env VAR or --key-file FILE")
    try:
        value = getpass.getpass(prompt)
    except (EOFError, KeyboardInterrupt):
        raise CredentialError("no passphrase given") from None
    if not value:
        raise CredentialError("no passphrase given")
    return Credential(passphrase=value)


def unlock(envelope_bytes: bytes, parcel: uuid.UUID, credential: Credential) -> ParcelKeys:
    """Open a key envelope and return the parcel key and convergence secret.

    Raises CredentialError for a wrong passphrase or key file (or a damaged envelope: the format cannot
    tell them apart), for a credential of the wrong kind, and for an envelope of another parcel.
    """
    try:
        _, parcel_key, secret = envelope.unwrap_envelope(envelope_bytes, passphrase=credential.passphrase,
                                                         keyfile=credential.keyfile, expect_uuid=parcel)
    except WrongKeyError as exc:
        raise CredentialError(f"{exc}: try again") from None
    except (IntegrityError, FormatError) as exc:
        raise CredentialError(f"the key envelope of parcel {parcel} is unusable: {exc}") from None
    return ParcelKeys(parcel_key, secret)


def pack(keys: ParcelKeys) -> bytes:
    """``PK || CS``, the 64 bytes vulpes and a detached session read."""
    return bytes(keys.parcel_key) + bytes(keys.convergence_secret)


def unpack(data: bytes) -> ParcelKeys:
    """The inverse of `pack`. Raises CredentialError unless ``data`` is 64 bytes."""
    if len(data) != KEYS_LEN:
        raise CredentialError(f"expected {KEYS_LEN} key bytes, got {len(data)}")
    return ParcelKeys(data[:32], data[32:])


def key_pipe(keys: ParcelKeys) -> int:
    """A pipe whose read end holds ``PK || CS`` and then end of file; returns the read end.

    The caller passes it to a child (``pass_fds``) and closes it afterwards. 64 bytes fit in any pipe
    buffer, so writing never blocks.
    """
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, pack(keys))
    finally:
        os.close(write_fd)
    return read_fd


def read_keys_fd(fd: int) -> ParcelKeys:
    """Read exactly 64 key bytes from ``fd`` (then end of file) and close it. Raises CredentialError."""
    data = b""
    try:
        while len(data) <= KEYS_LEN:
            block = os.read(fd, KEYS_LEN + 1 - len(data))
            if not block:
                break
            data += block
    finally:
        os.close(fd)
    return unpack(data)
