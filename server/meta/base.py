"""Records returned by the metadata database and the interface every backend implements."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class UserInfo:
    id: int
    name: str
    admin: bool
    created: float


@dataclass(frozen=True)
class TokenInfo:
    """A bearer token's record (never the token itself)."""

    id: str
    user_id: int
    user: str
    admin: bool
    label: str
    created: float
    expires: float


@dataclass(frozen=True)
class LockInfo:
    """Who holds a parcel's lock, from where, since when, and at which version."""

    parcel: str
    user: str
    host: str
    site: str
    acquired: float
    renewed: float
    expires: float | None
    version: int
    lock_id: str
    # The holder's last report of changes not yet committed (lock renew with a report); None: never reported.
    dirty_chunks: int | None = None
    dirty_bytes: int | None = None
    dirty_reported: float | None = None

    def expired(self, now: float | None = None) -> bool:
        """True if the lock has a lease that ran out (the lock is still held until someone breaks it)."""
        return self.expires is not None and self.expires <= (now if now is not None else time.time())

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("lock_id")
        chunks, size, reported = out.pop("dirty_chunks"), out.pop("dirty_bytes"), out.pop("dirty_reported")
        out["expired"] = self.expired()
        out["dirty"] = None if reported is None else {"dirty_chunks": chunks, "dirty_bytes": size, "reported": reported}
        return out


@dataclass(frozen=True)
class WebSession:
    """A signed-in browser session of the web pages (the cookie itself is never stored, only its SHA-256)."""

    user_id: int
    user: str
    admin: bool
    csrf: str
    created: float
    expires: float


@dataclass(frozen=True)
class VersionInfo:
    parcel: str
    version: int
    parent: int | None
    created: float
    user: str
    host: str
    site: str
    blobs: list[dict[str, Any]] = field(default_factory=list)
    chunk_count: int = 0
    chunk_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ParcelInfo:
    id: str
    owner_id: int
    owner: str
    name: str
    created: float
    current_version: int
    lock: LockInfo | None

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("lock", "owner_id")}
        out["lock"] = self.lock.to_json() if self.lock else None
        return out


@dataclass(frozen=True)
class ChunkRow:
    """The chunk index: every chunk object the store should hold, its size and when it was last
    uploaded or claimed (gc never deletes a recently touched chunk); state 1 means gc is deleting it."""

    tag: str
    size: int
    touched: float
    state: int


@dataclass(frozen=True)
class AuditEntry:
    id: int
    at: float
    actor: str
    action: str
    parcel: str | None
    remote: str
    detail: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class MetaStore:
    """The metadata database. The SQL implementation is `server.meta.sql.SqlMeta`; this class only names
    the backend for messages."""

    backend = "abstract"

    def close(self) -> None:
        """Release connections."""
