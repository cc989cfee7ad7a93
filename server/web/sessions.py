"""Browser sessions, CSRF protection and sign-in throttling for the web pages.

- A session is a random secret in the cookie ``__Host-isr_session`` (``Secure; HttpOnly; SameSite=Strict;
  Path=/``); the database keeps only its SHA-256, like API tokens, plus the session's CSRF token. Sessions
  live in the database, not in a signed cookie (Starlette's SessionMiddleware), so that signing out, a
  password change or removing the user ends them on the server, and every worker and server process
  shares them without sharing a signing key.
- Every POST must come from a page of this server: its ``Origin`` (or, failing that, ``Referer``) must be
  this server's own origin, and its form must carry the session's CSRF token (a synchronizer token). The
  sign-in form, which has no session yet, carries the value of a second cookie, ``__Host-isr_signin``
  (double submit), so another site cannot sign a browser in to an account of its choosing.
- Failed sign-ins are counted in the database per user name and per client address, so the limit holds
  across worker processes and servers, together with the API's logins (see `server.auth.SIGNIN_LIMITS`).
"""
from __future__ import annotations

import hmac
import re
import secrets
import urllib.parse

from starlette.requests import Request
from starlette.responses import Response

SESSION_COOKIE = "__Host-isr_session"
SIGNIN_COOKIE = "__Host-isr_signin"
SIGNIN_COOKIE_SECONDS = 3600


_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{16,128}")


def new_secret() -> str:
    """A new session secret or CSRF token: 32 random bytes, URL-safe (fits a cookie unquoted)."""
    return secrets.token_urlsafe(32)


def set_cookie(response: Response, name: str, value: str, max_age: int) -> None:
    """Set a ``__Host-`` cookie: Secure, HttpOnly, SameSite=Strict, Path=/, no Domain."""
    response.set_cookie(name, value, max_age=max_age, path="/", secure=True, httponly=True, samesite="strict")


def clear_cookie(response: Response, name: str) -> None:
    response.delete_cookie(name, path="/", secure=True, httponly=True, samesite="strict")


def cookie_token(request: Request, name: str) -> str | None:
    """The request's cookie `name` if it holds a token we could have handed out, else None (checked
    before it is hashed or looked up)."""
    value = request.cookies.get(name)
    return value if is_token(value) else None


def is_token(value: str | None) -> bool:
    """True if `value` looks like a token we hand out (checked before it is hashed or looked up)."""
    return value is not None and _TOKEN_RE.fullmatch(value) is not None


def same_token(given: str | None, expected: str) -> bool:
    """Constant-time comparison of a submitted token with the expected one."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def own_origin(request: Request) -> str | None:
    """This server's origin as the browser sees it: ``https://`` and the Host (or HTTP/2 :authority)."""
    host = request.headers.get("host") or request.headers.get(":authority")
    if not host:
        return None
    return "https://" + host.lower()


def same_origin(request: Request) -> bool:
    """True if the request comes from a page of this server: by ``Origin``, or by ``Referer`` when a
    browser sent no ``Origin``. A request with neither is refused."""
    expected = own_origin(request)
    if expected is None:
        return False
    origin = request.headers.get("origin")
    if origin is not None:
        return origin.lower() == expected
    referer = request.headers.get("referer")
    if not referer:
        return False
    parts = urllib.parse.urlsplit(referer)
    return f"{parts.scheme}://{parts.netloc}".lower() == expected
