"""The sqlite metadata backend: one database file, one connection per thread.

WAL mode lets readers run while one writer commits; write transactions start with ``BEGIN IMMEDIATE``, so
they take the database's write lock up front and a commit's checks and publish run alone. Several worker
processes may share the file; they wait for each other through sqlite's busy timeout.
"""
from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import StorageError
from .sql import SqlMeta, create_schema

BUSY_TIMEOUT_MS = 30000


class _SqliteCursor:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self.conn.execute(sql, params).rowcount

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        return self.conn.execute(sql, params).fetchone()

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.conn.execute(sql, params).fetchall()


class SqliteMeta(SqlMeta):
    backend = "sqlite"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._local = threading.local()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create {self.path.parent}: {e.strerror}") from None
        with self._tx(write=True) as cur:
            create_schema(cur, "BLOB", "INTEGER PRIMARY KEY AUTOINCREMENT")

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = sqlite3.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000,
                                       check_same_thread=True)
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = NORMAL")
                conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            except sqlite3.Error as e:
                raise StorageError(f"cannot open the sqlite database {self.path}: {e}") from None
            self._local.conn = conn
        return conn

    @contextlib.contextmanager
    def _tx(self, write: bool = False) -> Iterator[_SqliteCursor]:
        conn = self._conn()
        try:
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        except sqlite3.Error as e:
            raise StorageError(f"sqlite database {self.path}: {e}") from None
        try:
            yield _SqliteCursor(conn)
        except sqlite3.Error as e:
            conn.execute("ROLLBACK")
            raise StorageError(f"sqlite database {self.path}: {e}") from None
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        else:
            try:
                conn.execute("COMMIT")
            except sqlite3.Error as e:
                conn.execute("ROLLBACK")
                raise StorageError(f"sqlite database {self.path}: {e}") from None

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
