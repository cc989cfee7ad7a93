"""Where a secret given to a command comes from: a file, standard input or an environment variable.

A passphrase or password is never an argument itself (it would show in ``ps``). `isr` and `isr-admin` name
their sources alike, ``--passphrase-file FILE|-``, ``--passphrase-env VAR`` and ``--key-file FILE`` for a
parcel's credential, ``--new-passphrase-...`` and ``--new-key-file`` for a new one, ``--password-file`` and
``--password-env`` for a user's password (doc/isrctl.md "Credentials"), and read them here. A file holds the
secret with or without a final newline; ``-`` reads the first line of standard input.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from .envelope import MAX_KEYFILE, MIN_KEYFILE
from .errors import ParcelError


class SecretSourceError(ParcelError):
    """A named source gives no secret: an unset variable, an unreadable or empty file, two sources."""


def read_secret(*, file: str | None, env: str | None, option: str) -> str | None:
    """The secret from ``file`` (``-``: stdin's first line) or the variable ``env``; None if neither is
    given. ``option`` is the options' common stem (``--passphrase``), for the messages."""
    if file and env:
        raise SecretSourceError(f"give either {option}-file or {option}-env, not both")
    if env:
        value = os.environ.get(env)
        if not value:
            raise SecretSourceError(f"environment variable {env} ({option}-env) is not set")
        return value
    if not file:
        return None
    try:
        text = sys.stdin.readline() if file == "-" else Path(file).read_text(encoding="utf-8")
    except OSError as e:
        raise SecretSourceError(f"cannot read {file} ({option}-file): {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SecretSourceError(f"{file} ({option}-file) is not UTF-8 text (byte {e.start})") from None
    value = text.rstrip("\r\n")
    if not value:
        raise SecretSourceError(f"{'standard input' if file == '-' else file} ({option}-file) holds no "
                                f"{option.rpartition('-')[2]}")
    return value


def read_key_file(path: str | os.PathLike[str], option: str = "--key-file") -> bytes:
    """A key file's contents, checked for its size (doc/parcel-format.md "Key envelopes")."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SecretSourceError(f"cannot read the key file {path} ({option}): {e.strerror}") from None
    if not MIN_KEYFILE <= len(data) <= MAX_KEYFILE:
        raise SecretSourceError(f"the key file {path} ({option}) holds {len(data)} bytes; a key file holds "
                                f"{MIN_KEYFILE} to {MAX_KEYFILE}")
    return data
