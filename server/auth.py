"""Passwords, bearer tokens and lock nonces.

Passwords are hashed with scrypt (hashlib) and stored as ``scrypt$<log2n>$<r>$<p>$<salt hex>$<hash hex>``.
Tokens and lock nonces are random strings shown to the client once; the database stores only their
SHA-256, so a leaked database does not hand out sessions or locks.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from typing import Any

SCRYPT_LOG2N = 14
SCRYPT_R = 8
SCRYPT_P = 1
TOKEN_PREFIX = "isr_"
MAX_PASSWORD_BYTES = 1024


def hash_password(password: str, *, log2n: int = SCRYPT_LOG2N) -> str:
    """Hash a password with scrypt and a fresh salt."""
    salt = secrets.token_bytes(16)
    digest = _scrypt(password, salt, log2n, SCRYPT_R, SCRYPT_P)
    return f"scrypt${log2n}${SCRYPT_R}${SCRYPT_P}${salt.hex()}${digest.hex()}"


def verify_password(password: str, stored: str) -> bool:
    """Check a password against a stored hash in constant time; False for a malformed hash."""
    try:
        scheme, log2n, r, p, salt, digest = stored.split("$")
        if scheme != "scrypt":
            return False
        want = bytes.fromhex(digest)
        got = _scrypt(password, bytes.fromhex(salt), int(log2n), int(r), int(p))
    except ValueError:
        return False
    return hmac.compare_digest(want, got)


def _scrypt(password: str, salt: bytes, log2n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(password.encode("utf-8"), salt=salt, n=1 << log2n, r=r, p=p, maxmem=64 * 1024 * 1024, dklen=32)


# A password that is checked when the user does not exist, so a login takes as long either way.
DUMMY_HASH = hash_password("not a real password", log2n=SCRYPT_LOG2N)


def new_token() -> str:
    """A new bearer token: ``isr_`` and 43 URL-safe characters (32 random bytes)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def new_nonce() -> str:
    """A new lock nonce (32 random bytes, URL-safe)."""
    return secrets.token_urlsafe(32)


def secret_hash(secret: str) -> str:
    """What the database stores for a token or nonce: SHA-256 hex of its UTF-8 bytes."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


# --- login throttling (the API's /v1/login and the web sign-in count the same failures) ----------------

#: (subject prefix, failures before logins are delayed). After `limit` failures within `SIGNIN_WINDOW`
#: seconds the next try must wait `SIGNIN_DELAY` seconds, doubled after each further failure, at most
#: `SIGNIN_WINDOW`. The per-address limit is higher: many people may share one address.
SIGNIN_LIMITS = (("user", 5), ("addr", 20))
SIGNIN_WINDOW = 15 * 60
SIGNIN_DELAY = 30.0


def signin_subjects(user: str | None, address: str) -> list[tuple[str, int]]:
    """The (subject, failure limit) pairs a login attempt counts against: the user name (None: not a
    valid user name) and the client address."""
    values = {"user": user or "?", "addr": address}
    return [(f"{kind}:{values[kind]}", limit) for kind, limit in SIGNIN_LIMITS]


def client_address(scope: Mapping[str, Any]) -> str:
    """The client's IP address from an ASGI scope ("-" if unknown)."""
    client = scope.get("client")
    return str(client[0]) if client else "-"
