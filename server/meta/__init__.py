"""The metadata database: users, tokens, parcels, versions, locks, chunk index and the audit log.

Backends: sqlite (the default, one file) and PostgreSQL (several server processes share it). Both run the
same SQL (`server.meta.sql`); lock exclusivity is the database's job (a unique row per parcel inserted with
``ON CONFLICT DO NOTHING``, conditional updates and deletes), never a Python mutex.
"""
from __future__ import annotations

from ..config import Config
from .base import (AuditEntry, ChunkRow, LockInfo, MetaStore, ParcelInfo, TokenInfo, UserInfo, VersionInfo, WebSession,
                   unpack_tags)
from .sqlite import SqliteMeta


def open_meta(config: Config) -> MetaStore:
    """Open the metadata database the configuration names (the schema is created if missing)."""
    if config["metadata.backend"] == "postgres":
        # Imported only when configured: psycopg takes a tenth of a second to load, on every isr-admin call.
        from .postgres import PostgresMeta

        return PostgresMeta(config["metadata.dsn"], config["metadata.pool_size"])
    return SqliteMeta(config.sqlite_path)


__all__ = ["open_meta", "MetaStore", "UserInfo", "TokenInfo", "ParcelInfo", "VersionInfo", "LockInfo",
           "AuditEntry", "ChunkRow", "WebSession", "unpack_tags"]
