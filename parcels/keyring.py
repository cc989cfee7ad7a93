"""Keyrings: per image and version, the map from chunk index to (flags, tag, wrapped chunk key).

See "Keyrings" in doc/parcel-format.md. A keyring has two forms: the canonical byte stream that is
sealed, sent and digested (`encode_stream`, `decode_stream`), and the sqlite database a client keeps so
single records can be read and replaced (`Keyring`). Chunk keys are only ever stored wrapped.
"""
from __future__ import annotations

import contextlib
import os
import sqlite3
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from parcels import crypto
from parcels.chunk import FLAG_COMPRESSED, TAG_SIZE, chunk_count, valid_chunk_size
from parcels.errors import FormatError, StoreError

MAGIC = b"ISRK"
VERSION = 1
HEADER = struct.Struct(">4sB3sIQQ")
HEADER_SIZE = HEADER.size
RECORD = struct.Struct(">QB32s40s")
RECORD_SIZE = RECORD.size
APPLICATION_ID = 0x49535231
USER_VERSION = 1
_MAX_U64 = (1 << 64) - 1
_KEYWRAP_LABEL = b"isr-keywrap-v1"
_BATCH = 4096

_SCHEMA = """
CREATE TABLE meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE chunks (
    idx   INTEGER PRIMARY KEY,
    tag   BLOB NOT NULL CHECK (length(tag) = 32),
    wkey  BLOB NOT NULL CHECK (length(wkey) = 40),
    flags INTEGER NOT NULL CHECK (flags BETWEEN 0 AND 255)
);
"""


class KeyringRecord(NamedTuple):
    """One keyring entry: chunk `idx` is stored as the object named `tag`, whose key is `wkey` wrapped."""

    idx: int
    flags: int
    tag: bytes
    wkey: bytes


def _key_wrapping_key(parcel_key: bytes) -> bytes:
    if len(parcel_key) != crypto.KEY_SIZE:
        raise FormatError("the parcel key must be 32 bytes")
    return crypto.hmac_sha256(parcel_key, _KEYWRAP_LABEL)


def wrap_chunk_key(parcel_key: bytes, key: bytes) -> bytes:
    """Wrap a 32-byte chunk key under KW = HMAC(PK, "isr-keywrap-v1"): 40 bytes, deterministic.
    Raises FormatError if either key is not 32 bytes."""
    return crypto.aes_key_wrap(_key_wrapping_key(parcel_key), key)


def unwrap_chunk_key(parcel_key: bytes, wkey: bytes) -> bytes:
    """Unwrap a chunk key. Raises IntegrityError if `wkey` was altered or wrapped under another parcel
    key, FormatError for wrong lengths."""
    return crypto.aes_key_unwrap(_key_wrapping_key(parcel_key), wkey)


def _check_record(record: KeyringRecord, count: int) -> None:
    idx, flags, tag, wkey = record
    if not isinstance(idx, int) or not 0 <= idx < count:
        raise FormatError(f"keyring index {idx} out of range 0..{count - 1}")
    if not isinstance(flags, int) or flags & ~FLAG_COMPRESSED:
        raise FormatError(f"keyring record {idx} has reserved flag bits set ({flags:#x})")
    if len(tag) != TAG_SIZE or len(wkey) != crypto.WRAPPED_KEY_SIZE:
        raise FormatError(f"keyring record {idx} has a tag or wrapped key of the wrong size")


def _check_sizes(chunk_size: int, image_size: int) -> int:
    if not valid_chunk_size(chunk_size):
        raise FormatError(f"invalid chunk size {chunk_size}")
    if not isinstance(image_size, int) or not 0 <= image_size <= _MAX_U64:
        raise FormatError(f"invalid image size {image_size}")
    return chunk_count(chunk_size, image_size)


def encode_stream(chunk_size: int, image_size: int, records: Iterable[KeyringRecord]) -> bytes:
    """Serialize a keyring into its canonical stream.

    Raises FormatError for an invalid chunk or image size, records not in strictly increasing index
    order, an index outside the image, reserved flag bits, or a tag/wrapped key of the wrong size.
    """
    count = _check_sizes(chunk_size, image_size)
    parts = []
    last = -1
    for record in records:
        _check_record(record, count)
        if record.idx <= last:
            raise FormatError(f"keyring records not strictly increasing at index {record.idx}")
        last = record.idx
        parts.append(RECORD.pack(record.idx, record.flags, bytes(record.tag), bytes(record.wkey)))
    header = HEADER.pack(MAGIC, VERSION, bytes(3), chunk_size, image_size, len(parts))
    return header + b"".join(parts)


def decode_stream(data: bytes) -> tuple[int, int, list[KeyringRecord]]:
    """Parse a keyring stream into (chunk size, image size, records in index order).

    Raises FormatError for a stream of the wrong length for its record count, a bad magic number,
    version or reserved bytes, an invalid chunk size, records not strictly increasing, an index out of
    range or reserved flag bits set. Wrapped keys are not unwrapped here.
    """
    data = bytes(data)
    if len(data) < HEADER_SIZE:
        raise FormatError(f"keyring stream of {len(data)} bytes is shorter than its header")
    magic, version, reserved, chunk_size, image_size, m = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FormatError("keyring stream has a bad magic number")
    if version != VERSION:
        raise FormatError(f"keyring stream has unknown format version {version}")
    if reserved != bytes(3):
        raise FormatError("keyring stream has nonzero reserved bytes")
    if not valid_chunk_size(chunk_size):
        raise FormatError(f"keyring stream has invalid chunk size {chunk_size}")
    if len(data) != HEADER_SIZE + RECORD_SIZE * m:
        raise FormatError(f"keyring stream is {len(data)} bytes, but {m} records need "
                          f"{HEADER_SIZE + RECORD_SIZE * m}")
    count = chunk_count(chunk_size, image_size)
    records = []
    last = -1
    for fields in RECORD.iter_unpack(memoryview(data)[HEADER_SIZE:]):
        record = KeyringRecord(*fields)
        _check_record(record, count)
        if record.idx <= last:
            raise FormatError(f"keyring records not strictly increasing at index {record.idx}")
        last = record.idx
        records.append(record)
    return chunk_size, image_size, records


@contextlib.contextmanager
def _sqlite_errors(path: Path) -> Iterator[None]:
    try:
        yield
    except (sqlite3.IntegrityError, OverflowError) as exc:
        # OverflowError: sqlite integers are signed 64-bit, the format's sizes are unsigned.
        raise FormatError(f"keyring database {path}: {exc}") from None
    except sqlite3.OperationalError as exc:
        raise StoreError(f"keyring database {path}: {exc}") from None
    except sqlite3.DatabaseError as exc:
        # "file is not a database", "database disk image is malformed"
        raise FormatError(f"keyring database {path}: {exc}") from None


class Keyring:
    """A keyring kept in an sqlite database with the spec's schema (tables `meta` and `chunks`).

    Single-record changes are committed one at a time; WAL with synchronous=FULL makes each durable when
    the call returns. Other tables in the same database are left alone. Not thread-safe: use one
    Keyring per thread.
    """

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        self._db = db
        self.path = path
        self.chunk_size = 0
        self.image_size = 0
        self._count = 0

    @classmethod
    def _connect(cls, path: Path, create: bool) -> Keyring:
        mode = "rwc" if create else "rw"
        with _sqlite_errors(path):
            db = sqlite3.connect(f"{path.absolute().as_uri()}?mode={mode}", uri=True, isolation_level=None)
        keyring = cls(db, path)
        try:
            with _sqlite_errors(path):
                db.execute("PRAGMA journal_mode = WAL")
                db.execute("PRAGMA synchronous = FULL")
        except BaseException:
            db.close()
            raise
        return keyring

    @classmethod
    def create(cls, path: str | os.PathLike[str], chunk_size: int, image_size: int) -> Keyring:
        """Create a new, empty keyring database at `path` for an image of `image_size` bytes.

        Raises StoreError if `path` exists or cannot be written, FormatError for invalid sizes.
        """
        path = Path(path)
        _check_sizes(chunk_size, image_size)
        if path.exists():
            raise StoreError(f"keyring database {path} already exists")
        keyring = cls._connect(path, create=True)
        try:
            with _sqlite_errors(path), keyring._transaction():
                keyring._db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                keyring._db.execute(f"PRAGMA user_version = {USER_VERSION}")
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        keyring._db.execute(statement)
                keyring._set_meta(chunk_size, image_size)
            keyring._use_sizes(chunk_size, image_size)
        except BaseException:
            keyring.close()
            raise
        return keyring

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Keyring:
        """Open an existing keyring database and check its application_id, user_version, tables and meta.

        Raises StoreError if it does not exist or cannot be read, FormatError if it is not a keyring
        database of this format.
        """
        path = Path(path)
        if not path.is_file():
            raise StoreError(f"keyring database {path} does not exist")
        keyring = cls._connect(path, create=False)
        try:
            with _sqlite_errors(path):
                keyring._validate()
        except BaseException:
            keyring.close()
            raise
        return keyring

    def _validate(self) -> None:
        (app_id,) = self._db.execute("PRAGMA application_id").fetchone()
        (user_version,) = self._db.execute("PRAGMA user_version").fetchone()
        if app_id != APPLICATION_ID or user_version != USER_VERSION:
            raise FormatError(f"{self.path} is not a version-{USER_VERSION} ISR keyring database "
                              f"(application_id {app_id}, user_version {user_version})")
        for table, columns in (("meta", ["name", "value"]), ("chunks", ["idx", "tag", "wkey", "flags"])):
            found = [row[1] for row in self._db.execute(f"PRAGMA table_info({table})")]
            if found != columns:
                raise FormatError(f"{self.path}: table {table} has columns {found}, expected {columns}")
        meta = dict(self._db.execute("SELECT name, value FROM meta"))
        chunk_size, image_size = meta.get("chunk_size"), meta.get("image_size")
        if not isinstance(chunk_size, int) or not isinstance(image_size, int):
            raise FormatError(f"{self.path}: meta lacks chunk_size or image_size")
        _check_sizes(chunk_size, image_size)
        self._use_sizes(chunk_size, image_size)

    def _set_meta(self, chunk_size: int, image_size: int) -> None:
        self._db.executemany("INSERT OR REPLACE INTO meta (name, value) VALUES (?, ?)",
                             [("chunk_size", chunk_size), ("image_size", image_size)])

    def _use_sizes(self, chunk_size: int, image_size: int) -> None:
        self.chunk_size, self.image_size = chunk_size, image_size
        self._count = chunk_count(chunk_size, image_size)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    @property
    def chunk_count(self) -> int:
        """Number of chunks in the image (stored or not)."""
        return self._count

    def get(self, idx: int) -> KeyringRecord | None:
        """Return the record of chunk `idx`, or None if the chunk is all zero (absent).
        Raises StoreError if the database cannot be read."""
        with _sqlite_errors(self.path):
            row = self._db.execute("SELECT idx, flags, tag, wkey FROM chunks WHERE idx = ?",
                                   (idx,)).fetchone()
        return None if row is None else KeyringRecord(*row)

    def put(self, record: KeyringRecord) -> None:
        """Insert or replace one record, durably. Raises FormatError for an invalid record (index out of
        range, reserved flags, wrong sizes), StoreError if the database cannot be written."""
        self.put_many([record])

    def put_many(self, records: Iterable[KeyringRecord]) -> None:
        """Insert or replace several records in one transaction (all or none). Raises as `put`."""
        rows = []
        for record in records:
            _check_record(record, self._count)
            rows.append((record.idx, bytes(record.tag), bytes(record.wkey), record.flags))
        with _sqlite_errors(self.path), self._transaction():
            self._db.executemany("INSERT OR REPLACE INTO chunks (idx, tag, wkey, flags) VALUES (?, ?, ?, ?)",
                                 rows)

    def delete(self, idx: int) -> None:
        """Remove the record of chunk `idx` (the chunk becomes all zero); no error if it is absent.
        Raises StoreError if the database cannot be written."""
        with _sqlite_errors(self.path):
            self._db.execute("DELETE FROM chunks WHERE idx = ?", (idx,))

    def __iter__(self) -> Iterator[KeyringRecord]:
        """Yield every record in increasing index order. Reads in batches, so changes made while
        iterating are seen only for indices not yet reached."""
        last = -1
        while True:
            with _sqlite_errors(self.path):
                rows = self._db.execute("SELECT idx, flags, tag, wkey FROM chunks WHERE idx > ? "
                                        "ORDER BY idx LIMIT ?", (last, _BATCH)).fetchall()
            if not rows:
                return
            for row in rows:
                yield KeyringRecord(*row)
            last = rows[-1][0]

    def __len__(self) -> int:
        with _sqlite_errors(self.path):
            (count,) = self._db.execute("SELECT count(*) FROM chunks").fetchone()
        return int(count)

    def import_stream(self, data: bytes) -> None:
        """Replace the whole keyring (meta and chunks) with a keyring stream, in one transaction.

        Raises FormatError if the stream is invalid (nothing is changed then), StoreError if the database
        cannot be written.
        """
        chunk_size, image_size, records = decode_stream(data)
        with _sqlite_errors(self.path), self._transaction():
            self._db.execute("DELETE FROM chunks")
            self._set_meta(chunk_size, image_size)
            self._db.executemany("INSERT INTO chunks (idx, tag, wkey, flags) VALUES (?, ?, ?, ?)",
                                 [(r.idx, r.tag, r.wkey, r.flags) for r in records])
        self._use_sizes(chunk_size, image_size)

    def export_stream(self) -> bytes:
        """Return the canonical keyring stream of the current contents (a consistent snapshot).

        Raises FormatError if the database holds a record the stream cannot represent, StoreError if it
        cannot be read.
        """
        with _sqlite_errors(self.path):
            self._db.execute("BEGIN")
            try:
                meta = dict(self._db.execute("SELECT name, value FROM meta"))
                records = [KeyringRecord(*row) for row in
                           self._db.execute("SELECT idx, flags, tag, wkey FROM chunks ORDER BY idx")]
            finally:
                self._db.execute("COMMIT")
        return encode_stream(meta.get("chunk_size", 0), meta.get("image_size", -1), records)

    def digest(self) -> bytes:
        """SHA-256 of `export_stream()`: the keyring digest a manifest records."""
        return crypto.sha256(self.export_stream())

    def close(self) -> None:
        """Close the database. Safe to call twice."""
        self._db.close()

    def __enter__(self) -> Keyring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
