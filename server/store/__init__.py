"""Object stores for chunk objects, sealed blobs and key envelopes (ciphertext only).

Keys follow the parcel store layout of doc/parcel-format.md, relative to the store root:

    chunks/ab/cd/<tag>                          chunk objects
    parcels/<uuid>/keyenvelope                  key envelopes
    parcels/<uuid>/versions/<n>/<blob>          committed version blobs
    staging/<uuid>/<lock id>/<blob>             blobs uploaded under a lock, not yet committed

Backends: `DirectoryStore` (a local directory, the default) and `S3Store` (any S3-compatible server).
"""
from __future__ import annotations

from ..config import Config
from .base import ObjectStore, Upload, chunk_key, envelope_key, staging_prefix, version_prefix
from .directory import DirectoryStore


def open_store(config: Config) -> ObjectStore:
    """Open the object store the configuration names."""
    if config["store.backend"] == "s3":
        # Imported only when configured: boto3 takes a fifth of a second to load, on every isr-admin call.
        from .s3 import S3Store

        return S3Store(config)
    return DirectoryStore(config.store_path)


__all__ = ["ObjectStore", "Upload", "open_store", "chunk_key", "envelope_key", "staging_prefix", "version_prefix"]
