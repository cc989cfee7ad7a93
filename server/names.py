"""Validation of every name that reaches the server from outside: tags, parcel ids, blob names, users.

Each check returns the canonical value or raises `BadRequest`, so nothing unchecked is ever used to build
a storage key or a file path (this is what keeps path tricks out of the store).
"""
from __future__ import annotations

import re
import uuid
from collections import Counter

from .errors import BadRequest

TAG_RE = re.compile(r"[0-9a-f]{64}")
BLOB_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
USER_RE = re.compile(r"[a-z_][a-z0-9_.-]{0,31}")
NONCE_RE = re.compile(r"[A-Za-z0-9_-]{16,128}")
REQUIRED_BLOBS = ("manifest", "keyring.disk", "keyring.memory")
#: Names that are path segments of the API under a version (``…/versions/{n}/chunks``), so never a blob's.
RESERVED_BLOB_NAMES = ("chunks",)
KEYENVELOPE_SIZE = 148
#: The most blobs one bundle (GET …/versions/{n}/_bundle?names=…) names: a resume pack's parts, or a version's
#: keyrings and device state, with room to spare; as many 64-character names (a 20 KB query) still pass the
#: HTTP layers (tests/test_server_api.py sends them).
BUNDLE_MAX = 300


def tag(text: object) -> str:
    """A chunk tag: 64 lowercase hex digits."""
    if not isinstance(text, str) or not TAG_RE.fullmatch(text):
        raise BadRequest(f"not a chunk tag (64 lowercase hex digits): {_show(text)}", code="bad_tag")
    return text


def parcel_id(text: object) -> str:
    """A parcel UUID in lowercase canonical form."""
    if isinstance(text, str) and len(text) == 36:
        try:
            value = str(uuid.UUID(text))
        except ValueError:
            value = ""
        if value == text:
            return value
    raise BadRequest(f"not a parcel id (a lowercase UUID): {_show(text)}", code="bad_parcel_id")


def blob_name(text: object) -> str:
    """A version blob name as in the manifest's rules: ``[a-z0-9][a-z0-9._-]{0,63}``."""
    if not isinstance(text, str) or not BLOB_RE.fullmatch(text):
        raise BadRequest(f"not a blob name ([a-z0-9][a-z0-9._-]{{0,63}}): {_show(text)}", code="bad_blob_name")
    if text in RESERVED_BLOB_NAMES:
        raise BadRequest(f"{text!r} is reserved by the API and cannot name a blob", code="bad_blob_name")
    return text


def blob_names(text: object) -> list[str]:
    """The ``names`` query of a bundle: 1 to `BUNDLE_MAX` distinct blob names, separated by commas."""
    if not isinstance(text, str) or not text:
        raise BadRequest("a bundle needs names=NAME,NAME,... (the blobs it returns, in order)", code="bad_names")
    out = text.split(",")
    if len(out) > BUNDLE_MAX:
        raise BadRequest(f"a bundle names at most {BUNDLE_MAX} blobs, not {len(out)}", code="bad_names",
                         limit=BUNDLE_MAX)
    for name in out:
        try:
            blob_name(name)
        except BadRequest as e:
            raise BadRequest(f"names: {e}", code="bad_names") from None
    twice = sorted(name for name, count in Counter(out).items() if count > 1)
    if twice:
        raise BadRequest(f"names: a bundle names each blob once, not {', '.join(twice)} twice", code="bad_names")
    return out


def user_name(text: object) -> str:
    """A user name: ``[a-z_][a-z0-9_.-]{0,31}``."""
    if not isinstance(text, str) or not USER_RE.fullmatch(text):
        raise BadRequest(f"not a user name ([a-z_][a-z0-9_.-]{{0,31}}): {_show(text)}", code="bad_user_name")
    return text


def parcel_name(text: object) -> str:
    """A parcel's human name: 1–64 printable characters."""
    if not isinstance(text, str) or not 1 <= len(text) <= 64 or not text.isprintable():
        raise BadRequest(f"not a parcel name (1-64 printable characters): {_show(text)}", code="bad_parcel_name")
    return text


def label(text: object, what: str, limit: int = 255) -> str:
    """A free-text field such as a host or site name: printable, at most `limit` characters."""
    if not isinstance(text, str) or len(text) > limit or not text.isprintable():
        raise BadRequest(f"{what} must be a printable string of at most {limit} characters", code=f"bad_{what}")
    return text


def version(text: object) -> int:
    """A version number (path segment or JSON int) >= 1."""
    if isinstance(text, str) and text.isdigit() and len(text) <= 12:
        text = int(text)
    if isinstance(text, bool) or not isinstance(text, int) or not 1 <= text < 10**12:
        raise BadRequest(f"not a version number: {_show(text)}", code="bad_version")
    return text


def nonce(text: object) -> str:
    """A lock nonce as handed out by the server."""
    if not isinstance(text, str) or not NONCE_RE.fullmatch(text):
        raise BadRequest("the ISR-Lock header must carry the nonce returned by the lock acquire call",
                         code="bad_nonce")
    return text


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
