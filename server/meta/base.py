"""Records returned by the metadata database and the interface every backend implements."""
from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


def unpack_tags(data: bytes) -> list[str]:
    """A version's chunk references as stored (`MetaStore.all_version_tags`): 32-byte tags concatenated."""
    return [data[i:i + 32].hex() for i in range(0, len(data), 32)]


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


class MetaStore(abc.ABC):
    """The metadata database: every operation the API, the web pages and isr-admin use. The backends
    (sqlite and PostgreSQL) run the same SQL, `server.meta.sql.SqlMeta`; callers type against this class.

    Every method may raise `StorageError` (the database failed) and the `ApiError` subclasses it names."""

    backend = "abstract"

    def close(self) -> None:
        """Release connections."""

    # --- users ------------------------------------------------------------------------------------

    @abc.abstractmethod
    def add_user(self, name: str, pwhash: str, admin: bool = False) -> UserInfo:
        """Add a user with a password hash (`Conflict` ``user_exists`` if the name is taken)."""

    @abc.abstractmethod
    def get_user(self, name: str) -> tuple[UserInfo, str] | None:
        """The user and their password hash, or None."""

    @abc.abstractmethod
    def list_users(self) -> list[UserInfo]:
        """Every user, by name."""

    @abc.abstractmethod
    def set_password(self, name: str, pwhash: str, *, actor: str = "isr-admin", remote: str = "",
                     revoke_tokens: bool = True) -> None:
        """Change a password and end every web session of the user; revoke their API tokens too unless
        `revoke_tokens` is false (a change on the web page, where the user chooses). Audited as
        ``user.password`` by `actor`."""

    @abc.abstractmethod
    def remove_user(self, name: str) -> None:
        """Remove a user who owns no parcels (their tokens go with them)."""

    # --- tokens -----------------------------------------------------------------------------------

    @abc.abstractmethod
    def add_token(self, token_id: str, token_hash: str, user_id: int, label: str, ttl: int) -> TokenInfo:
        """Record a new bearer token (only its hash) valid for `ttl` seconds."""

    @abc.abstractmethod
    def lookup_token(self, token_hash: str) -> TokenInfo | None:
        """The unexpired token with this hash, or None."""

    @abc.abstractmethod
    def list_tokens(self, user_id: int) -> list[TokenInfo]:
        """The user's unexpired tokens."""

    @abc.abstractmethod
    def revoke_token(self, user_id: int, token_id: str) -> None:
        """Revoke one of the user's tokens (`NotFound` if the user has no such token)."""

    # --- parcels ----------------------------------------------------------------------------------

    @abc.abstractmethod
    def create_parcel(self, parcel: str, owner: str, name: str) -> ParcelInfo:
        """Record a new parcel of `owner` (its versions come with `commit_version`)."""

    @abc.abstractmethod
    def get_parcel(self, parcel: str) -> ParcelInfo:
        """A parcel with its lock (`NotFound` if there is none)."""

    @abc.abstractmethod
    def find_parcel(self, owner: str, name: str) -> ParcelInfo:
        """A parcel by owner and name."""

    @abc.abstractmethod
    def list_parcels(self, owner_id: int | None = None) -> list[ParcelInfo]:
        """Every parcel of one user (or of everyone), with its lock."""

    @abc.abstractmethod
    def remove_parcel(self, parcel: str, actor: str = "isr-admin") -> None:
        """Forget a parcel, its versions and its lock."""

    # --- versions ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def list_versions(self, parcel: str) -> list[VersionInfo]:
        """A parcel's versions, oldest first."""

    @abc.abstractmethod
    def get_version(self, parcel: str, version: int) -> VersionInfo:
        """One version of a parcel (`NotFound` if there is none)."""

    @abc.abstractmethod
    def version_tags(self, parcel: str, version: int) -> list[str]:
        """Every chunk tag a version references."""

    @abc.abstractmethod
    def version_chunk_tags(self, parcel: str, version: int, which: str) -> tuple[bool, list[str]]:
        """The tags of a version's chunk set ``which``: "all" (sorted) or "working" (the working set the
        committing client reported, in its order). Returns (whether the set was recorded, the tags)."""

    @abc.abstractmethod
    def all_version_tags(self) -> Iterator[tuple[str, int, bytes]]:
        """(parcel, version, packed tags) for every version (for gc, fsck and usage)."""

    @abc.abstractmethod
    def delete_version(self, parcel: str, version: int, actor: str = "isr-admin") -> None:
        """Forget an old version (never the current one)."""

    @abc.abstractmethod
    def commit_version(self, parcel: str, nonce_hash: str, parent: int, tags: Sequence[str],
                       blobs: list[dict[str, Any]], host: str, site: str, actor: str, remote: str,
                       publish: Callable[[int], None], working_tags: Sequence[str] | None = None) -> VersionInfo:
        """Commit version parent+1 atomically. ``working_tags`` (a subset of ``tags``, in first-touch order)
        is the working set the client reports, or None if it reports none.

        Refused with `Conflict` if the nonce is not the lock's (``lock_lost``), `parent` is not the current
        version (``parent_mismatch``), or a referenced chunk is not in the index (``chunks_missing``).
        After the checks, inside the transaction, `publish(new_version)` moves the staged blobs into place;
        if it raises, nothing is committed."""

    # --- locks ------------------------------------------------------------------------------------

    @abc.abstractmethod
    def get_lock(self, parcel: str) -> LockInfo | None:
        """Who holds the parcel's lock, or None."""

    @abc.abstractmethod
    def check_lock(self, parcel: str, nonce_hash: str) -> LockInfo:
        """The lock if `nonce_hash` holds it, else `Conflict` (``lock_lost``)."""

    @abc.abstractmethod
    def acquire_lock(self, parcel: str, user_id: int, nonce_hash: str, host: str, site: str, lease: int,
                     actor: str, remote: str, force: bool = False, take_expired: bool = False
                     ) -> tuple[LockInfo, LockInfo | None]:
        """Acquire a parcel's lock; return (new lock, the lock it replaced if any).

        Exactly one of several concurrent acquires inserts the lock row. A held lock is replaced only with
        `force` (the caller checked the owner or an administrator asked) or, with `take_expired`, if its
        lease ran out; otherwise `Conflict` (``locked``) names the holder."""

    @abc.abstractmethod
    def renew_lock(self, parcel: str, nonce_hash: str, lease: int, actor: str, remote: str,
                   dirty: tuple[int, int, float] | None = None) -> LockInfo:
        """Extend the lease; with `dirty` = (chunks, bytes, reported) also record the holder's report of
        changes it has not committed yet (a renew without a report keeps the previous one)."""

    @abc.abstractmethod
    def release_lock(self, parcel: str, nonce_hash: str, actor: str, remote: str) -> LockInfo:
        """Give the lock back; return what was released (`Conflict` ``lock_lost`` if `nonce_hash` does not hold it)."""

    @abc.abstractmethod
    def break_lock(self, parcel: str, actor: str, remote: str, reason: str = "",
                   expect_lock_id: str | None = None) -> LockInfo:
        """Remove whoever holds the lock; return what was removed (`NotFound` if it was not locked).

        With `expect_lock_id` only that very lock is broken: if the lock changed hands since the caller
        looked (`Conflict`, ``lock_changed``), nothing happens."""

    @abc.abstractmethod
    def lock_ids(self) -> set[str]:
        """The lock ids (staging area names) of every held lock."""

    # --- the chunk index --------------------------------------------------------------------------

    @abc.abstractmethod
    def chunk_add(self, tag: str, size: int) -> bool:
        """Record an uploaded chunk (or refresh its touch time). Return False if gc is deleting it right
        now (state 1): the caller must wait until `chunk_state` is None and upload again."""

    @abc.abstractmethod
    def chunks_add(self, chunks: Sequence[tuple[str, int]]) -> set[str]:
        """`chunk_add` for many (tag, size) pairs in one transaction, so that a batch of uploads costs one
        commit (`server.groupcommit`); every row gets the transaction's time as its touch time. Return the
        tags gc is deleting right now."""

    @abc.abstractmethod
    def chunk_state(self, tag: str) -> int | None:
        """The chunk's index state (0: stored, 1: gc is deleting it), or None if it is not in the index."""

    @abc.abstractmethod
    def chunk_claim(self, tags: Sequence[str]) -> set[str]:
        """Which of `tags` are stored (and not being deleted); touch those so gc keeps them."""

    @abc.abstractmethod
    def chunk_rows(self) -> Iterator[ChunkRow]:
        """Every row of the chunk index."""

    @abc.abstractmethod
    def chunk_sizes(self, tags: Sequence[str]) -> dict[str, int]:
        """The sizes of those of `tags` that are in the index."""

    @abc.abstractmethod
    def chunk_doom(self, tags: Sequence[str], cutoff: float) -> list[str]:
        """gc step 1: mark unreferenced chunks not touched since `cutoff` as being deleted; return those
        actually marked (a chunk touched meanwhile is skipped)."""

    @abc.abstractmethod
    def chunk_doomed(self) -> list[str]:
        """gc step 2: every chunk marked as being deleted."""

    @abc.abstractmethod
    def chunk_forget(self, tags: Sequence[str], only_doomed: bool = True) -> int:
        """gc step 3 (only_doomed) or fsck repair: remove chunk rows."""

    # --- web sessions and sign-in throttling ------------------------------------------------------

    @abc.abstractmethod
    def add_web_session(self, session_hash: str, user_id: int, csrf: str, ttl: int, remote: str) -> WebSession:
        """Record a browser session (only the SHA-256 of its cookie) with its CSRF token."""

    @abc.abstractmethod
    def lookup_web_session(self, session_hash: str) -> WebSession | None:
        """The unexpired session whose cookie has this hash, or None."""

    @abc.abstractmethod
    def delete_web_session(self, session_hash: str) -> None:
        """End a browser session (no error if it does not exist)."""

    @abc.abstractmethod
    def signin_wait(self, keys: Sequence[tuple[str, int]], window: float, base_delay: float) -> float:
        """Seconds until a sign-in for these (key, limit) pairs may be tried again (0: now).

        A key with `limit` or more failures, the last less than `window` seconds ago, must wait
        `base_delay` seconds, doubled for every further failure, at most `window`."""

    @abc.abstractmethod
    def signin_failed(self, keys: Sequence[str], window: float) -> None:
        """Count a failed sign-in against each key (a count older than `window` starts again)."""

    @abc.abstractmethod
    def signin_succeeded(self, key: str) -> None:
        """Clear the failure count of a key after a successful sign-in."""

    # --- the audit log ----------------------------------------------------------------------------

    @abc.abstractmethod
    def audit(self, actor: str, action: str, parcel: str | None, remote: str, detail: dict[str, Any]) -> None:
        """Record an audit entry in its own transaction (for refusals and admin actions)."""

    @abc.abstractmethod
    def list_audit(self, parcel: str | None = None, limit: int = 100, before: int | None = None, *,
                   owner_id: int | None = None, skip_actions: Sequence[str] = ()) -> list[AuditEntry]:
        """The newest `limit` entries (of one parcel; of the parcels `owner_id` owns), older than entry id
        `before` if given, without the actions in `skip_actions`; oldest first."""
