"""The object store interface shared by the directory and S3 backends.

Keys are built only by the helpers below from validated names (see `server.names`), never from raw
client input, so a key cannot leave the store.
"""
from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..names import TAG_RE


def chunk_key(tag: str) -> str:
    """``chunks/ab/cd/<tag>``."""
    return f"chunks/{tag[0:2]}/{tag[2:4]}/{tag}"


def envelope_key(parcel: str) -> str:
    return f"parcels/{parcel}/keyenvelope"


def version_prefix(parcel: str, version: int) -> str:
    return f"parcels/{parcel}/versions/{version}/"


def parcel_prefix(parcel: str) -> str:
    return f"parcels/{parcel}/"


def staging_prefix(parcel: str, lock_id: str) -> str:
    return f"staging/{parcel}/{lock_id}/"


@dataclass(frozen=True)
class Staged:
    """An object written by `ObjectStore.stage` that is not yet durable under its key."""

    key: str
    path: Path


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its key, size in bytes and modification time (Unix seconds)."""

    key: str
    size: int
    mtime: float


class Upload(abc.ABC):
    """A streamed upload: `write` pieces, then `commit` under a key, or `abort`."""

    size: int = 0

    @abc.abstractmethod
    def write(self, data: bytes) -> None:
        """Append bytes."""

    @abc.abstractmethod
    def commit(self, key: str) -> None:
        """Make the uploaded bytes the object `key` (replacing any), durably."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Throw the uploaded bytes away."""


class ObjectStore(abc.ABC):
    """Stores immutable objects by key. Every method may raise `StorageError`; missing objects give
    `NotFound` where documented."""

    kind = "abstract"

    def local_path(self, key: str) -> Path | None:
        """A file path the web server may send directly (zero-copy), or None if the backend has none."""
        return None

    def presigned_url(self, key: str, seconds: int) -> str | None:
        """A URL a client may GET the object from for `seconds`, or None if the backend has none."""
        return None

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Store `data` under `key` durably (temp + fsync + rename on file systems)."""

    def stage(self, key: str, data: bytes) -> Staged | None:
        """Write `data` for `key` without its durability point, which `publish` then gives a whole batch
        at once (group commit). None: the object is durable under its key already; this default stores it
        with `put_bytes` (an S3 PUT is durable when it returns, so there is nothing to batch)."""
        self.put_bytes(key, data)
        return None

    def publish(self, staged: Sequence[Staged]) -> None:
        """Make staged objects durable under their keys, with one durability point for all of them where
        the backend allows; when it raises, none of them may be relied on (the temporary copies are gone)."""
        if staged:
            raise NotImplementedError(f"the {self.kind} store stages nothing")

    @abc.abstractmethod
    def new_upload(self) -> Upload:
        """Start a streamed upload (for blobs that should not be held in memory)."""

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Read a whole object; raise `NotFound` if it does not exist."""

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size, or None if it does not exist."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete an object; no error if it does not exist."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under `prefix` (which ends in ``/``); return how many."""

    @abc.abstractmethod
    def copy(self, src: str, dst: str) -> None:
        """Copy an object (cheaply where the backend allows: a hard link, a server-side copy)."""

    @abc.abstractmethod
    def move_prefix(self, src: str, dst: str) -> None:
        """Move every object under prefix `src` to prefix `dst`; `dst` must hold nothing afterwards but
        what was moved (it is emptied first). On a file system this is one atomic directory rename."""

    @abc.abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under `prefix`, in no particular order."""

    def close(self) -> None:
        """Release connections."""

    def iter_chunks(self) -> Iterator[tuple[str, ObjectInfo]]:
        """(tag, info) for every object under chunks/ whose name is a well-formed tag."""
        for info in self.list("chunks/"):
            name = info.key.rsplit("/", 1)[-1]
            if TAG_RE.fullmatch(name) and info.key == chunk_key(name):
                yield name, info
