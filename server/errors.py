"""The exceptions of the server package.

Everything the server package raises on purpose derives from `ServerError`. The subclasses say what kind
of problem it is, and each API-facing one carries its HTTP status (`ApiError`, answered by `server.http`).
Only ``main()`` of ``isr-server`` and ``isr-admin`` turns them into one-line messages.
"""
from __future__ import annotations

from typing import Any


class ServerError(Exception):
    """Root of every exception the server package raises on purpose."""


class ConfigError(ServerError):
    """The configuration file or a command-line flag is invalid; the message says what to change."""


class TLSError(ServerError):
    """A certificate or key cannot be read or created."""


class StorageError(ServerError):
    """The chunk/object store or the metadata database failed (I/O error, unreachable server)."""


class ApiError(ServerError):
    """An error that has an HTTP status and a JSON body: raised by the metadata layer and the app alike.

    `code` is a short machine-readable word (``"locked"``, ``"parent_mismatch"``, …) and `details` are
    extra JSON fields for the client (who holds a lock, which chunks are missing, …).
    """

    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, code: str | None = None, **details: Any) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.details = details

    def body(self) -> dict[str, Any]:
        """The JSON error body sent to the client."""
        out: dict[str, Any] = {"error": str(self), "code": self.code}
        out.update(self.details)
        return out


class BadRequest(ApiError):
    """400: malformed JSON, a bad field, a bad name or tag in the path."""

    status = 400
    code = "bad_request"


class Unauthorized(ApiError):
    """401: no token, an unknown, revoked or expired token, or a wrong user name or password."""

    status = 401
    code = "unauthorized"


class Forbidden(ApiError):
    """403: the parcel exists but belongs to someone else, or the action needs an administrator."""

    status = 403
    code = "forbidden"


class NotFound(ApiError):
    """404: no such parcel, version, blob, chunk, user or route."""

    status = 404
    code = "not_found"


class MethodNotAllowed(ApiError):
    """405: the path exists but not with this method."""

    status = 405
    code = "method_not_allowed"


class Conflict(ApiError):
    """409: the lock is held or was lost, the parent is not the current version, chunks or blobs are
    missing, or a name is taken."""

    status = 409
    code = "conflict"


class TooManyAttempts(ApiError):
    """429: too many failed logins for this user name or client address; ``retry_after`` says when to retry."""

    status = 429
    code = "too_many_attempts"


class TooLarge(ApiError):
    """413: the request body exceeds the limit for this endpoint."""

    status = 413
    code = "too_large"


class Unprocessable(ApiError):
    """422: the body is well-formed but wrong, e.g. its SHA-256 is not the tag it was sent under."""

    status = 422
    code = "unprocessable"


class Unavailable(ApiError):
    """503: a transient condition (a chunk is being garbage-collected right now); retry shortly."""

    status = 503
    code = "unavailable"


class InternalError(ApiError):
    """500: a bug (an exception no handler expected); the details are in the server's log, not the answer."""

    status = 500
    code = "internal"
