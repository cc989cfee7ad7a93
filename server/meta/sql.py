"""The metadata database in SQL, shared by the sqlite and PostgreSQL backends.

Statements use ``?`` placeholders; the PostgreSQL backend rewrites them to ``%s``. The backends provide
only connections and transactions (`SqlMeta._tx`) and their DDL.

Concurrency rules, relied on by the API and by gc:

- A parcel's lock is one row in ``locks`` with the parcel id as primary key. Acquiring inserts it with
  ``ON CONFLICT DO NOTHING``: of two concurrent requests the database lets exactly one insert. Renew,
  release and commit are conditional on the holder's nonce hash, so a broken lock's old holder is refused.
- Commit, acquire and break take the parcel row first (``BEGIN IMMEDIATE`` in sqlite, ``SELECT … FOR
  UPDATE`` in PostgreSQL), so a commit's check-then-publish runs alone for its parcel.
- Chunks: an upload or a claim sets ``touched``; gc marks unreferenced, untouched chunks ``state = 1``
  with a conditional update, deletes the objects, then the rows. An upload that meets a row in state 1
  waits for gc to finish with it (see `chunk_add`).
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from ..errors import Conflict, NotFound
from .base import (AuditEntry, ChunkRow, LockInfo, MetaStore, ParcelInfo, TokenInfo, UserInfo, VersionInfo,
                   WebSession, unpack_tags)

BATCH = 500
SCHEMA_VERSION = 3

_LOCK_COLUMNS = ("l.parcel_id, u.name, l.host, l.site, l.acquired, l.renewed, l.expires, l.version, l.nonce_hash, "
                 "l.dirty_chunks, l.dirty_bytes, l.dirty_reported")
_PARCEL_COLUMNS = "p.id, p.owner_id, o.name, p.name, p.created, p.current_version"
_VERSION_COLUMNS = ("v.parcel_id, v.version, v.parent, v.created, u.name, v.host, v.site, v.blobs, "
                    "v.chunk_count, v.chunk_bytes")


class Cursor(Protocol):
    """What a backend's transaction yields."""

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Execute a statement; return the number of rows it changed."""

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        """Execute a query; return its first row or None."""

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Execute a query; return every row."""


def pack_tags(tags: Iterable[str]) -> bytes:
    """The stored form of a version's chunk references: sorted, distinct 32-byte tags concatenated."""
    return b"".join(sorted({bytes.fromhex(t) for t in tags}))


def pack_ordered_tags(tags: Iterable[str]) -> bytes:
    """A version's working set as stored: distinct 32-byte tags concatenated in the client's order
    (first touch first), which is the order a hoard should fetch them in."""
    return b"".join(bytes.fromhex(t) for t in dict.fromkeys(tags))


def _lock(row: tuple[Any, ...] | None) -> LockInfo | None:
    if row is None:
        return None
    return LockInfo(parcel=row[0], user=row[1], host=row[2], site=row[3], acquired=row[4], renewed=row[5],
                    expires=row[6], version=row[7], lock_id=row[8][:32], dirty_chunks=row[9], dirty_bytes=row[10],
                    dirty_reported=row[11])


def _parcel(row: tuple[Any, ...], lock: LockInfo | None) -> ParcelInfo:
    """A row of _PARCEL_COLUMNS and the parcel's lock."""
    return ParcelInfo(id=row[0], owner_id=row[1], owner=row[2], name=row[3], created=row[4], current_version=row[5],
                      lock=lock)


def _version(row: tuple[Any, ...]) -> VersionInfo:
    return VersionInfo(parcel=row[0], version=row[1], parent=row[2], created=row[3], user=row[4] or "?",
                       host=row[5], site=row[6], blobs=json.loads(row[7]), chunk_count=row[8],
                       chunk_bytes=row[9])


class SqlMeta(MetaStore):
    """Every metadata operation of `MetaStore` (documented there), in SQL common to sqlite and PostgreSQL."""

    #: appended to the SELECT that takes a parcel row for a write transaction
    for_update = ""

    # --- provided by the backends -----------------------------------------------------------------

    def _tx(self, write: bool = False) -> contextlib.AbstractContextManager[Cursor]:
        raise NotImplementedError

    # --- helpers ----------------------------------------------------------------------------------

    def _audit(self, cur: Cursor, actor: str, action: str, parcel: str | None, remote: str,
               detail: dict[str, Any]) -> None:
        cur.run("INSERT INTO audit (at, actor, action, parcel, remote, detail) VALUES (?, ?, ?, ?, ?, ?)",
                (time.time(), actor, action, parcel, remote, json.dumps(detail, sort_keys=True)))

    def _parcel_for_update(self, cur: Cursor, parcel: str) -> tuple[int, int]:
        row = cur.one("SELECT owner_id, current_version FROM parcels WHERE id = ?" + self.for_update, (parcel,))
        if row is None:
            raise NotFound(f"no parcel {parcel}")
        return row[0], row[1]

    def _get_lock(self, cur: Cursor, parcel: str) -> LockInfo | None:
        return _lock(cur.one(f"SELECT {_LOCK_COLUMNS} FROM locks l JOIN users u ON u.id = l.user_id "
                             "WHERE l.parcel_id = ?", (parcel,)))

    # --- users ------------------------------------------------------------------------------------

    def add_user(self, name: str, pwhash: str, admin: bool = False) -> UserInfo:
        now = time.time()
        with self._tx(write=True) as cur:
            if cur.one("SELECT 1 FROM users WHERE name = ?", (name,)):
                raise Conflict(f"user {name} already exists", code="user_exists")
            row = cur.one("INSERT INTO users (name, pwhash, admin, created) VALUES (?, ?, ?, ?) RETURNING id",
                          (name, pwhash, 1 if admin else 0, now))
            assert row is not None
            self._audit(cur, "isr-admin", "user.add", None, "", {"user": name, "admin": admin})
        return UserInfo(row[0], name, admin, now)

    def get_user(self, name: str) -> tuple[UserInfo, str] | None:
        with self._tx() as cur:
            row = cur.one("SELECT id, name, admin, created, pwhash FROM users WHERE name = ?", (name,))
        if row is None:
            return None
        return UserInfo(row[0], row[1], bool(row[2]), row[3]), row[4]

    def list_users(self) -> list[UserInfo]:
        with self._tx() as cur:
            rows = cur.all("SELECT id, name, admin, created FROM users ORDER BY name")
        return [UserInfo(r[0], r[1], bool(r[2]), r[3]) for r in rows]

    def set_password(self, name: str, pwhash: str, *, actor: str = "isr-admin", remote: str = "",
                     revoke_tokens: bool = True) -> None:
        with self._tx(write=True) as cur:
            row = cur.one("SELECT id FROM users WHERE name = ?", (name,))
            if row is None:
                raise NotFound(f"no user {name}")
            cur.run("UPDATE users SET pwhash = ? WHERE id = ?", (pwhash, row[0]))
            if revoke_tokens:
                cur.run("DELETE FROM tokens WHERE user_id = ?", (row[0],))
            cur.run("DELETE FROM web_sessions WHERE user_id = ?", (row[0],))
            self._audit(cur, actor, "user.password", None, remote,
                        {"user": name, "tokens": "revoked" if revoke_tokens else "kept"})

    def remove_user(self, name: str) -> None:
        with self._tx(write=True) as cur:
            row = cur.one("SELECT id FROM users WHERE name = ?", (name,))
            if row is None:
                raise NotFound(f"no user {name}")
            owned = cur.one("SELECT count(*) FROM parcels WHERE owner_id = ?", (row[0],))
            if owned and owned[0]:
                raise Conflict(f"user {name} still owns {owned[0]} parcel(s); remove them first",
                               code="user_has_parcels")
            cur.run("DELETE FROM tokens WHERE user_id = ?", (row[0],))
            cur.run("DELETE FROM web_sessions WHERE user_id = ?", (row[0],))
            cur.run("DELETE FROM locks WHERE user_id = ?", (row[0],))
            cur.run("UPDATE versions SET user_id = NULL WHERE user_id = ?", (row[0],))
            cur.run("DELETE FROM users WHERE id = ?", (row[0],))
            self._audit(cur, "isr-admin", "user.remove", None, "", {"user": name})

    # --- tokens -----------------------------------------------------------------------------------

    def add_token(self, token_id: str, token_hash: str, user_id: int, label: str, ttl: int) -> TokenInfo:
        now = time.time()
        with self._tx(write=True) as cur:
            cur.run("DELETE FROM tokens WHERE expires < ?", (now,))
            cur.run("INSERT INTO tokens (id, hash, user_id, label, created, expires) VALUES (?, ?, ?, ?, ?, ?)",
                    (token_id, token_hash, user_id, label, now, now + ttl))
            row = cur.one("SELECT name, admin FROM users WHERE id = ?", (user_id,))
        assert row is not None
        return TokenInfo(token_id, user_id, row[0], bool(row[1]), label, now, now + ttl)

    def lookup_token(self, token_hash: str) -> TokenInfo | None:
        with self._tx() as cur:
            row = cur.one("SELECT t.id, t.user_id, u.name, u.admin, t.label, t.created, t.expires "
                          "FROM tokens t JOIN users u ON u.id = t.user_id WHERE t.hash = ? AND t.expires > ?",
                          (token_hash, time.time()))
        if row is None:
            return None
        return TokenInfo(row[0], row[1], row[2], bool(row[3]), row[4], row[5], row[6])

    def list_tokens(self, user_id: int) -> list[TokenInfo]:
        with self._tx() as cur:
            rows = cur.all("SELECT t.id, t.user_id, u.name, u.admin, t.label, t.created, t.expires FROM tokens t "
                           "JOIN users u ON u.id = t.user_id WHERE t.user_id = ? AND t.expires > ? ORDER BY t.created",
                           (user_id, time.time()))
        return [TokenInfo(r[0], r[1], r[2], bool(r[3]), r[4], r[5], r[6]) for r in rows]

    def revoke_token(self, user_id: int, token_id: str) -> None:
        with self._tx(write=True) as cur:
            if cur.run("DELETE FROM tokens WHERE id = ? AND user_id = ?", (token_id, user_id)) == 0:
                raise NotFound(f"no token {token_id}")

    # --- parcels ----------------------------------------------------------------------------------

    def create_parcel(self, parcel: str, owner: str, name: str) -> ParcelInfo:
        now = time.time()
        with self._tx(write=True) as cur:
            row = cur.one("SELECT id FROM users WHERE name = ?", (owner,))
            if row is None:
                raise NotFound(f"no user {owner}")
            if cur.one("SELECT 1 FROM parcels WHERE owner_id = ? AND name = ?", (row[0], name)):
                raise Conflict(f"user {owner} already has a parcel named {name!r}", code="parcel_exists")
            cur.run("INSERT INTO parcels (id, owner_id, name, created, current_version) VALUES (?, ?, ?, ?, 0)",
                    (parcel, row[0], name, now))
            self._audit(cur, "isr-admin", "parcel.create", parcel, "", {"owner": owner, "name": name})
        return ParcelInfo(parcel, row[0], owner, name, now, 0, None)

    def get_parcel(self, parcel: str) -> ParcelInfo:
        with self._tx() as cur:
            row = cur.one(f"SELECT {_PARCEL_COLUMNS} FROM parcels p JOIN users o ON o.id = p.owner_id "
                          "WHERE p.id = ?", (parcel,))
            if row is None:
                raise NotFound(f"no parcel {parcel}")
            lock = self._get_lock(cur, parcel)
        return _parcel(row, lock)

    def find_parcel(self, owner: str, name: str) -> ParcelInfo:
        with self._tx() as cur:
            row = cur.one("SELECT p.id FROM parcels p JOIN users o ON o.id = p.owner_id "
                          "WHERE o.name = ? AND p.name = ?", (owner, name))
        if row is None:
            raise NotFound(f"user {owner} has no parcel named {name!r}")
        return self.get_parcel(row[0])

    def list_parcels(self, owner_id: int | None = None) -> list[ParcelInfo]:
        where, params = ("WHERE p.owner_id = ?", (owner_id,)) if owner_id is not None else ("", ())
        with self._tx() as cur:
            rows = cur.all(f"SELECT {_PARCEL_COLUMNS} FROM parcels p JOIN users o ON o.id = p.owner_id "
                           f"{where} ORDER BY o.name, p.name", params)
            locks = {lock.parcel: lock for lock in map(_lock, cur.all(
                f"SELECT {_LOCK_COLUMNS} FROM locks l JOIN users u ON u.id = l.user_id")) if lock}
        return [_parcel(r, locks.get(r[0])) for r in rows]

    def remove_parcel(self, parcel: str, actor: str = "isr-admin") -> None:
        with self._tx(write=True) as cur:
            self._parcel_for_update(cur, parcel)
            cur.run("DELETE FROM locks WHERE parcel_id = ?", (parcel,))
            cur.run("DELETE FROM versions WHERE parcel_id = ?", (parcel,))
            cur.run("DELETE FROM parcels WHERE id = ?", (parcel,))
            self._audit(cur, actor, "parcel.remove", parcel, "", {})

    # --- versions ---------------------------------------------------------------------------------

    def list_versions(self, parcel: str) -> list[VersionInfo]:
        with self._tx() as cur:
            rows = cur.all(f"SELECT {_VERSION_COLUMNS} FROM versions v LEFT JOIN users u ON u.id = v.user_id "
                           "WHERE v.parcel_id = ? ORDER BY v.version", (parcel,))
        return [_version(r) for r in rows]

    def get_version(self, parcel: str, version: int) -> VersionInfo:
        with self._tx() as cur:
            row = cur.one(f"SELECT {_VERSION_COLUMNS} FROM versions v LEFT JOIN users u ON u.id = v.user_id "
                          "WHERE v.parcel_id = ? AND v.version = ?", (parcel, version))
        if row is None:
            raise NotFound(f"parcel {parcel} has no version {version}")
        return _version(row)

    def version_tags(self, parcel: str, version: int) -> list[str]:
        with self._tx() as cur:
            row = cur.one("SELECT tags FROM versions WHERE parcel_id = ? AND version = ?", (parcel, version))
        if row is None:
            raise NotFound(f"parcel {parcel} has no version {version}")
        return unpack_tags(bytes(row[0]))

    def version_chunk_tags(self, parcel: str, version: int, which: str) -> tuple[bool, list[str]]:
        column = {"all": "tags", "working": "working_tags"}[which]
        with self._tx() as cur:
            row = cur.one(f"SELECT {column} FROM versions WHERE parcel_id = ? AND version = ?", (parcel, version))
        if row is None:
            raise NotFound(f"parcel {parcel} has no version {version}")
        if row[0] is None:
            return False, []
        return True, unpack_tags(bytes(row[0]))

    def all_version_tags(self) -> Iterator[tuple[str, int, bytes]]:
        with self._tx() as cur:
            keys = cur.all("SELECT parcel_id, version FROM versions ORDER BY parcel_id, version")
        for parcel, version in keys:
            with self._tx() as cur:
                row = cur.one("SELECT tags FROM versions WHERE parcel_id = ? AND version = ?", (parcel, version))
            if row is not None:
                yield parcel, version, bytes(row[0])

    def delete_version(self, parcel: str, version: int, actor: str = "isr-admin") -> None:
        with self._tx(write=True) as cur:
            _owner, current = self._parcel_for_update(cur, parcel)
            if version == current:
                raise Conflict(f"version {version} is the current version of {parcel}", code="current_version")
            if cur.run("DELETE FROM versions WHERE parcel_id = ? AND version = ?", (parcel, version)) == 0:
                raise NotFound(f"parcel {parcel} has no version {version}")
            self._audit(cur, actor, "version.prune", parcel, "", {"version": version})

    def commit_version(self, parcel: str, nonce_hash: str, parent: int, tags: Sequence[str],
                       blobs: list[dict[str, Any]], host: str, site: str, actor: str, remote: str,
                       publish: Callable[[int], None], working_tags: Sequence[str] | None = None) -> VersionInfo:
        distinct = sorted(set(tags))
        now = time.time()
        with self._tx(write=True) as cur:
            _owner, current = self._parcel_for_update(cur, parcel)
            lock = cur.one("SELECT nonce_hash, user_id FROM locks WHERE parcel_id = ?", (parcel,))
            if lock is None or lock[0] != nonce_hash:
                raise Conflict("you do not hold the lock of this parcel (it was released or broken)",
                               code="lock_lost")
            if parent != current:
                raise Conflict(f"version {parent} is not the current version {current}", code="parent_mismatch",
                               current=current)
            found: dict[str, int] = {}
            for start in range(0, len(distinct), BATCH):
                batch = distinct[start:start + BATCH]
                marks = ",".join("?" * len(batch))
                # Touching the rows protects them from a concurrent gc (see the module docstring).
                cur.run(f"UPDATE chunks SET touched = ? WHERE state = 0 AND tag IN ({marks})", (now, *batch))
                for tag, size in cur.all(f"SELECT tag, size FROM chunks WHERE state = 0 AND tag IN ({marks})",
                                         batch):
                    found[tag] = size
            if len(found) != len(distinct):
                missing = [t for t in distinct if t not in found]
                raise Conflict(f"{len(missing)} referenced chunk(s) are not on the server", code="chunks_missing",
                               missing=missing[:1000], missing_count=len(missing))
            new = current + 1
            publish(new)
            cur.run("INSERT INTO versions (parcel_id, version, parent, created, user_id, host, site, blobs, tags, "
                    "chunk_count, chunk_bytes, working_tags) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (parcel, new, current or None, now, lock[1], host, site, json.dumps(blobs),
                     pack_tags(distinct), len(distinct), sum(found.values()),
                     None if working_tags is None else pack_ordered_tags(working_tags)))
            cur.run("UPDATE parcels SET current_version = ? WHERE id = ?", (new, parcel))
            cur.run("UPDATE locks SET version = ? WHERE parcel_id = ?", (new, parcel))
            self._audit(cur, actor, "version.commit", parcel, remote,
                        {"version": new, "parent": current or None, "host": host, "site": site,
                         "chunks": len(distinct), "blobs": [b["name"] for b in blobs]})
        return self.get_version(parcel, new)

    # --- locks ------------------------------------------------------------------------------------

    def get_lock(self, parcel: str) -> LockInfo | None:
        with self._tx() as cur:
            return self._get_lock(cur, parcel)

    def check_lock(self, parcel: str, nonce_hash: str) -> LockInfo:
        lock = self.get_lock(parcel)
        if lock is None or lock.lock_id != nonce_hash[:32]:
            raise Conflict("you do not hold the lock of this parcel (it was released or broken)", code="lock_lost")
        return lock

    def acquire_lock(self, parcel: str, user_id: int, nonce_hash: str, host: str, site: str, lease: int,
                     actor: str, remote: str, force: bool = False, take_expired: bool = False
                     ) -> tuple[LockInfo, LockInfo | None]:
        now = time.time()
        expires = now + lease if lease else None
        with self._tx(write=True) as cur:
            _owner, current = self._parcel_for_update(cur, parcel)
            inserted = cur.run(
                "INSERT INTO locks (parcel_id, nonce_hash, user_id, host, site, acquired, renewed, expires, version) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (parcel_id) DO NOTHING",
                (parcel, nonce_hash, user_id, host, site, now, now, expires, current))
            old = None
            if inserted != 1:
                old = self._get_lock(cur, parcel)
                assert old is not None
                if not (force or (take_expired and old.expired(now))):
                    raise Conflict(f"the parcel is locked by {old.user} on {old.host} ({old.site})", code="locked",
                                   holder=old.to_json())
                old_hash = cur.one("SELECT nonce_hash FROM locks WHERE parcel_id = ?", (parcel,))
                assert old_hash is not None
                replaced = cur.run(
                    "UPDATE locks SET nonce_hash = ?, user_id = ?, host = ?, site = ?, acquired = ?, renewed = ?, "
                    "expires = ?, version = ?, dirty_chunks = NULL, dirty_bytes = NULL, dirty_reported = NULL "
                    "WHERE parcel_id = ? AND nonce_hash = ?",
                    (nonce_hash, user_id, host, site, now, now, expires, current, parcel, old_hash[0]))
                if replaced != 1:
                    raise Conflict("the lock changed hands while breaking it; try again", code="locked")
                self._audit(cur, actor, "lock.break", parcel, remote,
                            {"reason": "force" if force else "expired", "holder": old.to_json()})
            self._audit(cur, actor, "lock.acquire", parcel, remote, {"host": host, "site": site, "version": current})
            lock = self._get_lock(cur, parcel)
        assert lock is not None
        return lock, old

    def renew_lock(self, parcel: str, nonce_hash: str, lease: int, actor: str, remote: str,
                   dirty: tuple[int, int, float] | None = None) -> LockInfo:
        now = time.time()
        with self._tx(write=True) as cur:
            if dirty is None:
                changed = cur.run("UPDATE locks SET renewed = ?, expires = ? WHERE parcel_id = ? AND nonce_hash = ?",
                                  (now, now + lease if lease else None, parcel, nonce_hash))
            else:
                changed = cur.run("UPDATE locks SET renewed = ?, expires = ?, dirty_chunks = ?, dirty_bytes = ?, "
                                  "dirty_reported = ? WHERE parcel_id = ? AND nonce_hash = ?",
                                  (now, now + lease if lease else None, *dirty, parcel, nonce_hash))
            if changed != 1:
                raise Conflict("you do not hold the lock of this parcel (it was released or broken)", code="lock_lost")
            detail = {} if dirty is None else {"dirty_chunks": dirty[0], "dirty_bytes": dirty[1]}
            self._audit(cur, actor, "lock.renew", parcel, remote, detail)
            lock = self._get_lock(cur, parcel)
        assert lock is not None
        return lock

    def release_lock(self, parcel: str, nonce_hash: str, actor: str, remote: str) -> LockInfo:
        with self._tx(write=True) as cur:
            lock = self._get_lock(cur, parcel)
            if cur.run("DELETE FROM locks WHERE parcel_id = ? AND nonce_hash = ?", (parcel, nonce_hash)) != 1:
                raise Conflict("you do not hold the lock of this parcel (it was released or broken)", code="lock_lost")
            self._audit(cur, actor, "lock.release", parcel, remote, {})
        assert lock is not None
        return lock

    def break_lock(self, parcel: str, actor: str, remote: str, reason: str = "",
                   expect_lock_id: str | None = None) -> LockInfo:
        with self._tx(write=True) as cur:
            self._parcel_for_update(cur, parcel)
            lock = self._get_lock(cur, parcel)
            if lock is not None and expect_lock_id is not None and lock.lock_id != expect_lock_id:
                raise Conflict("the lock changed hands since you looked at it", code="lock_changed",
                               holder=lock.to_json())
            if lock is None or cur.run("DELETE FROM locks WHERE parcel_id = ?", (parcel,)) != 1:
                raise NotFound(f"parcel {parcel} is not locked", code="not_locked")
            self._audit(cur, actor, "lock.break", parcel, remote, {"reason": reason, "holder": lock.to_json()})
        return lock

    def lock_ids(self) -> set[str]:
        with self._tx() as cur:
            return {row[0][:32] for row in cur.all("SELECT nonce_hash FROM locks")}

    # --- chunk index ------------------------------------------------------------------------------

    def chunk_add(self, tag: str, size: int) -> bool:
        return tag not in self.chunks_add([(tag, size)])

    def chunks_add(self, chunks: Sequence[tuple[str, int]]) -> set[str]:
        refused: set[str] = set()
        now = time.time()
        with self._tx(write=True) as cur:
            for tag, size in chunks:
                if cur.run("INSERT INTO chunks (tag, size, touched, state) VALUES (?, ?, ?, 0) "
                           "ON CONFLICT (tag) DO UPDATE SET touched = excluded.touched WHERE chunks.state = 0",
                           (tag, size, now)) != 1:
                    refused.add(tag)
        return refused

    def chunk_state(self, tag: str) -> int | None:
        with self._tx() as cur:
            row = cur.one("SELECT state FROM chunks WHERE tag = ?", (tag,))
        return None if row is None else row[0]

    def chunk_claim(self, tags: Sequence[str]) -> set[str]:
        present: set[str] = set()
        now = time.time()
        distinct = sorted(set(tags))
        with self._tx(write=True) as cur:
            for start in range(0, len(distinct), BATCH):
                batch = distinct[start:start + BATCH]
                marks = ",".join("?" * len(batch))
                cur.run(f"UPDATE chunks SET touched = ? WHERE state = 0 AND tag IN ({marks})", (now, *batch))
                present.update(r[0] for r in cur.all(f"SELECT tag FROM chunks WHERE state = 0 AND tag IN ({marks})",
                                                     batch))
        return present

    def chunk_rows(self) -> Iterator[ChunkRow]:
        with self._tx() as cur:
            rows = cur.all("SELECT tag, size, touched, state FROM chunks")
        for row in rows:
            yield ChunkRow(*row)

    def chunk_sizes(self, tags: Sequence[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        with self._tx() as cur:
            for start in range(0, len(tags), BATCH):
                batch = list(tags[start:start + BATCH])
                marks = ",".join("?" * len(batch))
                out.update(cur.all(f"SELECT tag, size FROM chunks WHERE tag IN ({marks})", batch))
        return out

    def chunk_doom(self, tags: Sequence[str], cutoff: float) -> list[str]:
        doomed: list[str] = []
        for start in range(0, len(tags), BATCH):
            batch = list(tags[start:start + BATCH])
            marks = ",".join("?" * len(batch))
            with self._tx(write=True) as cur:
                cur.run(f"UPDATE chunks SET state = 1 WHERE state = 0 AND touched < ? AND tag IN ({marks})",
                        (cutoff, *batch))
                doomed.extend(r[0] for r in cur.all(f"SELECT tag FROM chunks WHERE state = 1 AND tag IN ({marks})",
                                                    batch))
        return doomed

    def chunk_doomed(self) -> list[str]:
        with self._tx() as cur:
            return [r[0] for r in cur.all("SELECT tag FROM chunks WHERE state = 1")]

    def chunk_forget(self, tags: Sequence[str], only_doomed: bool = True) -> int:
        count = 0
        for start in range(0, len(tags), BATCH):
            batch = list(tags[start:start + BATCH])
            marks = ",".join("?" * len(batch))
            cond = "state = 1 AND " if only_doomed else ""
            with self._tx(write=True) as cur:
                count += cur.run(f"DELETE FROM chunks WHERE {cond}tag IN ({marks})", batch)
        return count

    # --- web sessions and sign-in throttling ---------------------------------------------------------

    def add_web_session(self, session_hash: str, user_id: int, csrf: str, ttl: int, remote: str) -> WebSession:
        now = time.time()
        with self._tx(write=True) as cur:
            cur.run("DELETE FROM web_sessions WHERE expires < ?", (now,))
            cur.run("INSERT INTO web_sessions (hash, user_id, csrf, created, expires, remote) VALUES (?, ?, ?, ?, ?, ?)",
                    (session_hash, user_id, csrf, now, now + ttl, remote))
            row = cur.one("SELECT name, admin FROM users WHERE id = ?", (user_id,))
        assert row is not None
        return WebSession(user_id, row[0], bool(row[1]), csrf, now, now + ttl)

    def lookup_web_session(self, session_hash: str) -> WebSession | None:
        with self._tx() as cur:
            row = cur.one("SELECT s.user_id, u.name, u.admin, s.csrf, s.created, s.expires FROM web_sessions s "
                          "JOIN users u ON u.id = s.user_id WHERE s.hash = ? AND s.expires > ?",
                          (session_hash, time.time()))
        if row is None:
            return None
        return WebSession(row[0], row[1], bool(row[2]), row[3], row[4], row[5])

    def delete_web_session(self, session_hash: str) -> None:
        with self._tx(write=True) as cur:
            cur.run("DELETE FROM web_sessions WHERE hash = ?", (session_hash,))

    def signin_wait(self, keys: Sequence[tuple[str, int]], window: float, base_delay: float) -> float:
        now = time.time()
        wait = 0.0
        with self._tx() as cur:
            for key, limit in keys:
                row = cur.one("SELECT failures, last_failure FROM signin_failures WHERE subject = ?", (key,))
                if row is None or now - row[1] >= window or row[0] < limit:
                    continue
                delay = min(base_delay * 2 ** min(row[0] - limit, 30), window)
                wait = max(wait, row[1] + delay - now)
        return max(wait, 0.0)

    def signin_failed(self, keys: Sequence[str], window: float) -> None:
        now = time.time()
        with self._tx(write=True) as cur:
            cur.run("DELETE FROM signin_failures WHERE last_failure < ?", (now - window,))
            for key in keys:
                cur.run("INSERT INTO signin_failures (subject, failures, last_failure) VALUES (?, 1, ?) "
                        "ON CONFLICT (subject) DO UPDATE SET failures = signin_failures.failures + 1, "
                        "last_failure = excluded.last_failure", (key, now))

    def signin_succeeded(self, key: str) -> None:
        with self._tx(write=True) as cur:
            cur.run("DELETE FROM signin_failures WHERE subject = ?", (key,))

    # --- audit ------------------------------------------------------------------------------------

    def audit(self, actor: str, action: str, parcel: str | None, remote: str, detail: dict[str, Any]) -> None:
        with self._tx(write=True) as cur:
            self._audit(cur, actor, action, parcel, remote, detail)

    def list_audit(self, parcel: str | None = None, limit: int = 100, before: int | None = None, *,
                   owner_id: int | None = None, skip_actions: Sequence[str] = ()) -> list[AuditEntry]:
        conditions: list[str] = []
        params: list[Any] = []
        if parcel:
            conditions.append("parcel = ?")
            params.append(parcel)
        if owner_id is not None:
            conditions.append("parcel IN (SELECT id FROM parcels WHERE owner_id = ?)")
            params.append(owner_id)
        if skip_actions:
            conditions.append(f"action NOT IN ({', '.join('?' * len(skip_actions))})")
            params.extend(skip_actions)
        if before is not None:
            conditions.append("id < ?")
            params.append(before)
        where = ("WHERE " + " AND ".join(conditions)) if conditions else ""
        with self._tx() as cur:
            rows = cur.all(f"SELECT id, at, actor, action, parcel, remote, detail FROM audit {where} "
                           "ORDER BY id DESC LIMIT ?", (*params, limit))
        return [AuditEntry(r[0], r[1], r[2], r[3], r[4], r[5], json.loads(r[6])) for r in reversed(rows)]


def schema(blob: str, serial: str) -> list[str]:
    """The DDL, with the backend's names for a binary column and an auto-increment key."""
    return [
        "CREATE TABLE IF NOT EXISTS schema_info (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
        f"CREATE TABLE IF NOT EXISTS users (id {serial}, name TEXT NOT NULL UNIQUE, pwhash TEXT NOT NULL, "
        "admin INTEGER NOT NULL DEFAULT 0, created DOUBLE PRECISION NOT NULL)",
        "CREATE TABLE IF NOT EXISTS tokens (id TEXT PRIMARY KEY, hash TEXT NOT NULL UNIQUE, "
        "user_id BIGINT NOT NULL REFERENCES users(id), label TEXT NOT NULL, created DOUBLE PRECISION NOT NULL, "
        "expires DOUBLE PRECISION NOT NULL)",
        "CREATE TABLE IF NOT EXISTS parcels (id TEXT PRIMARY KEY, owner_id BIGINT NOT NULL REFERENCES users(id), "
        "name TEXT NOT NULL, created DOUBLE PRECISION NOT NULL, current_version BIGINT NOT NULL DEFAULT 0, "
        "UNIQUE (owner_id, name))",
        "CREATE TABLE IF NOT EXISTS versions (parcel_id TEXT NOT NULL REFERENCES parcels(id), "
        "version BIGINT NOT NULL, parent BIGINT, created DOUBLE PRECISION NOT NULL, user_id BIGINT, host TEXT NOT NULL, "
        f"site TEXT NOT NULL, blobs TEXT NOT NULL, tags {blob} NOT NULL, chunk_count BIGINT NOT NULL, "
        f"chunk_bytes BIGINT NOT NULL, working_tags {blob}, PRIMARY KEY (parcel_id, version))",
        "CREATE TABLE IF NOT EXISTS locks (parcel_id TEXT PRIMARY KEY REFERENCES parcels(id), "
        "nonce_hash TEXT NOT NULL, user_id BIGINT NOT NULL REFERENCES users(id), host TEXT NOT NULL, "
        "site TEXT NOT NULL, acquired DOUBLE PRECISION NOT NULL, renewed DOUBLE PRECISION NOT NULL, "
        "expires DOUBLE PRECISION, version BIGINT NOT NULL, dirty_chunks BIGINT, dirty_bytes BIGINT, "
        "dirty_reported DOUBLE PRECISION)",
        "CREATE TABLE IF NOT EXISTS chunks (tag TEXT PRIMARY KEY, size BIGINT NOT NULL, "
        "touched DOUBLE PRECISION NOT NULL, state INTEGER NOT NULL DEFAULT 0)",
        f"CREATE TABLE IF NOT EXISTS audit (id {serial}, at DOUBLE PRECISION NOT NULL, actor TEXT NOT NULL, "
        "action TEXT NOT NULL, parcel TEXT, remote TEXT NOT NULL, detail TEXT NOT NULL)",
        "CREATE INDEX IF NOT EXISTS audit_parcel ON audit (parcel, id)",
        "CREATE TABLE IF NOT EXISTS web_sessions (hash TEXT PRIMARY KEY, user_id BIGINT NOT NULL REFERENCES users(id), "
        "csrf TEXT NOT NULL, created DOUBLE PRECISION NOT NULL, expires DOUBLE PRECISION NOT NULL, remote TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS signin_failures (subject TEXT PRIMARY KEY, failures BIGINT NOT NULL, "
        "last_failure DOUBLE PRECISION NOT NULL)",
        "CREATE INDEX IF NOT EXISTS tokens_user ON tokens (user_id)",
    ]


#: Statements that bring a database of schema version N-1 to version N (new tables need none: the
#: schema's CREATE TABLE IF NOT EXISTS adds them); ``{blob}`` is the backend's binary column type.
MIGRATIONS: dict[int, list[str]] = {
    2: ["ALTER TABLE locks ADD COLUMN dirty_chunks BIGINT", "ALTER TABLE locks ADD COLUMN dirty_bytes BIGINT",
        "ALTER TABLE locks ADD COLUMN dirty_reported DOUBLE PRECISION"],
    3: ["ALTER TABLE versions ADD COLUMN working_tags {blob}"],
}


def create_schema(cur: Cursor, blob: str, serial: str) -> None:
    """Create the tables of a new database, or bring an older one up to `SCHEMA_VERSION` (inside the
    caller's write transaction)."""
    for statement in schema(blob, serial):
        cur.run(statement)
    cur.run("INSERT INTO schema_info (name, value) VALUES ('version', ?) ON CONFLICT (name) DO NOTHING",
            (SCHEMA_VERSION,))
    row = cur.one("SELECT value FROM schema_info WHERE name = 'version'")
    assert row is not None
    for version in range(row[0] + 1, SCHEMA_VERSION + 1):
        for statement in MIGRATIONS.get(version, []):
            cur.run(statement.format(blob=blob))
    if row[0] < SCHEMA_VERSION:
        cur.run("UPDATE schema_info SET value = ? WHERE name = 'version'", (SCHEMA_VERSION,))
