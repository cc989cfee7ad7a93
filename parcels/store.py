"""A parcel store on a local file system, in the spec's "Parcel store layout".

    ROOT/chunks/ab/cd/abcd…                      chunk objects, named by tag
    ROOT/parcels/<uuid>/keyenvelope              key envelope
    ROOT/parcels/<uuid>/versions/<n>/manifest    sealed manifest, written last
    ROOT/parcels/<uuid>/versions/<n>/keyring.disk, keyring.memory, <blob name>

Every file is written as a temporary file in its directory (named ".tmp-…", which no object or blob name
can be), fsynced, renamed into place, and the directory fsynced. Chunk objects are never replaced, and a
version is never changed once its manifest exists. A chunk object that fails its tag on read is moved to
ROOT/quarantine/ so that a later `put_chunk` can store a good copy.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path

from parcels import crypto, envelope
from parcels.durable import fsync_path
from parcels.chunk import TAG_SIZE
from parcels.errors import FormatError, IntegrityError, NotFoundError, StoreError
from parcels.manifest import BLOB_NAME, IMAGES, open_keyring, open_manifest

log = logging.getLogger(__name__)

MANIFEST = "manifest"
KEYRING_FILES = {image: f"keyring.{image}" for image in IMAGES}
ENVELOPE = "keyenvelope"
_VERSION_DIR = re.compile(r"[1-9][0-9]*")
_TMP_PREFIX = ".tmp-"


@contextlib.contextmanager
def _os_errors(what: str) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError:
        raise NotFoundError(f"{what}: not found") from None
    except OSError as exc:
        raise StoreError(f"failed to {what}: {exc.strerror or exc}") from None


def _tag_hex(tag: bytes) -> str:
    if len(tag) != TAG_SIZE:
        raise FormatError("a chunk tag must be 32 bytes")
    return bytes(tag).hex()


def chunk_object_name(tag: bytes | str) -> str:
    """Where a chunk object lives under a store's root, ``chunks/ab/cd/<64 hex>`` (doc/parcel-format.md).

    Every place that keeps chunk objects by tag uses this layout: a parcel store, the server's object
    store, and vulpes's chunk cache (so that a cache directory can serve as another machine's lookaside).
    ``tag`` is 32 bytes or their 64 hex digits.
    """
    name = _tag_hex(tag) if isinstance(tag, bytes) else tag
    if len(name) != 2 * TAG_SIZE:
        raise FormatError("a chunk tag must be 32 bytes")
    return f"chunks/{name[:2]}/{name[2:4]}/{name}"


def _check_version(version: int) -> str:
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise FormatError(f"invalid version number {version!r}")
    return str(version)


class DirStore:
    """A parcel store in a directory. Safe for several processes writing at once (creation is atomic
    and chunk objects are content-addressed); not a lock manager."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._known_dirs: set[Path] = set()

    def __repr__(self) -> str:
        return f"DirStore({str(self.root)!r})"

    # --- paths ---------------------------------------------------------------------------------------

    def chunk_path(self, tag: bytes) -> Path:
        """Where the chunk object named `tag` lives."""
        return self.root / chunk_object_name(tag)

    def parcel_dir(self, parcel: uuid.UUID) -> Path:
        return self.root / "parcels" / str(parcel)

    def version_dir(self, parcel: uuid.UUID, version: int) -> Path:
        return self.parcel_dir(parcel) / "versions" / _check_version(version)

    # --- writing ---------------------------------------------------------------------------------------

    def _ensure_dir(self, path: Path) -> None:
        if path in self._known_dirs:
            return
        missing = []
        probe = path
        while not probe.is_dir():
            missing.append(probe)
            probe = probe.parent
        for directory in reversed(missing):
            with contextlib.suppress(FileExistsError):
                directory.mkdir()
            # The new entry in the parent must be durable before anything relies on the child.
            fsync_path(directory.parent)
        self._known_dirs.add(path)

    def _write(self, path: Path, data: bytes, *, replace: bool) -> bool:
        """Write `data` to `path` atomically and durably. Without `replace`, an existing file wins and
        False is returned."""
        self._ensure_dir(path.parent)
        tmp = path.parent / f"{_TMP_PREFIX}{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            if replace:
                os.replace(tmp, path)
            else:
                # link() creates the name only if it is free, so a concurrent writer can never replace
                # an object that is already there (rename would).
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return False
                finally:
                    os.unlink(tmp)
            fsync_path(path.parent)
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def put_chunk(self, tag: bytes, data: bytes) -> bool:
        """Store a chunk object under its tag; return True if written, False if it was already there.

        Guarantees: an existing object is never replaced; when this returns, the object is durable.
        Raises IntegrityError if SHA-256(data) is not `tag`, StoreError if it cannot be written.
        """
        path = self.chunk_path(tag)
        if not crypto.equal(crypto.sha256(data), tag):
            raise IntegrityError(f"chunk object does not match its tag {bytes(tag).hex()}")
        if path.exists():
            return False
        with _os_errors(f"write chunk {path.name}"):
            return self._write(path, bytes(data), replace=False)

    def get_chunk(self, tag: bytes) -> bytes:
        """Return the chunk object named `tag`, verified.

        Raises NotFoundError if absent; IntegrityError if its content does not match `tag` (the file is
        moved to ROOT/quarantine/ first); StoreError if it cannot be read.
        """
        path = self.chunk_path(tag)
        with _os_errors(f"read chunk {path.name}"):
            data = path.read_bytes()
        if not crypto.equal(crypto.sha256(data), tag):
            self._quarantine(path)
            raise IntegrityError(f"chunk object {path.name} is corrupt (moved to quarantine)")
        return data

    def _quarantine(self, path: Path) -> None:
        target = self.root / "quarantine" / f"{path.name}.{secrets.token_hex(4)}"
        try:
            self._ensure_dir(target.parent)
            os.rename(path, target)
            fsync_path(path.parent)
            log.warning("quarantined corrupt chunk object %s as %s", path, target)
        except OSError as exc:
            log.warning("failed to quarantine corrupt chunk object %s: %s", path, exc)

    def has_chunk(self, tag: bytes) -> bool:
        """True if an object named `tag` exists (it is not read or verified)."""
        return self.chunk_path(tag).is_file()

    def put_envelope(self, parcel: uuid.UUID, data: bytes) -> None:
        """Store (or replace, after a passphrase change) the key envelope of `parcel`.

        Raises FormatError if `data` is not a key envelope, IntegrityError if it is another parcel's,
        StoreError if it cannot be written.
        """
        if envelope.envelope_uuid(data) != parcel:
            raise IntegrityError(f"key envelope is not for parcel {parcel}")
        path = self.parcel_dir(parcel) / ENVELOPE
        with _os_errors(f"write {path}"):
            self._write(path, bytes(data), replace=True)

    def get_envelope(self, parcel: uuid.UUID) -> bytes:
        """Return the key envelope of `parcel` (unauthenticated: unwrap it to check it).
        Raises NotFoundError if the store has no such parcel, StoreError if it cannot be read."""
        path = self.parcel_dir(parcel) / ENVELOPE
        with _os_errors(f"read the key envelope of parcel {parcel}"):
            return path.read_bytes()

    def put_blob(self, parcel: uuid.UUID, version: int, name: str, data: bytes) -> None:
        """Store one file of a version: "manifest", "keyring.disk", "keyring.memory" or a blob name.

        Write the manifest last: its presence is what makes a version listed. Raises FormatError for an
        invalid name or version, StoreError if the version already has a manifest (versions are
        immutable) or the file cannot be written.
        """
        if name not in (MANIFEST, *KEYRING_FILES.values()) and BLOB_NAME.fullmatch(name) is None:
            raise FormatError(f"invalid blob name {name!r}")
        directory = self.version_dir(parcel, version)
        if (directory / MANIFEST).exists():
            raise StoreError(f"version {version} of parcel {parcel} is already committed")
        with _os_errors(f"write {directory / name}"):
            self._write(directory / name, bytes(data), replace=True)

    def get_blob(self, parcel: uuid.UUID, version: int, name: str) -> bytes:
        """Return one sealed file of a version (unauthenticated: open it to check it).
        Raises FormatError for an invalid name, NotFoundError if absent, StoreError if unreadable."""
        if name not in (MANIFEST, *KEYRING_FILES.values()) and BLOB_NAME.fullmatch(name) is None:
            raise FormatError(f"invalid blob name {name!r}")
        path = self.version_dir(parcel, version) / name
        with _os_errors(f"read {name} of version {version} of parcel {parcel}"):
            return path.read_bytes()

    def has_blob(self, parcel: uuid.UUID, version: int, name: str) -> bool:
        return (self.version_dir(parcel, version) / name).is_file()

    # --- listing ---------------------------------------------------------------------------------------

    def parcels(self) -> list[uuid.UUID]:
        """UUIDs of the parcels that have a key envelope, sorted. Raises StoreError if unreadable."""
        found = []
        with _os_errors(f"list parcels in {self.root}"):
            try:
                entries = list(os.scandir(self.root / "parcels"))
            except FileNotFoundError:
                return []
            for entry in entries:
                try:
                    parcel = uuid.UUID(entry.name)
                except ValueError:
                    continue
                if str(parcel) == entry.name and (Path(entry.path) / ENVELOPE).is_file():
                    found.append(parcel)
        return sorted(found)

    def versions(self, parcel: uuid.UUID) -> list[int]:
        """Numbers of the committed versions of `parcel` (those with a manifest), ascending.
        Raises StoreError if unreadable; an unknown parcel has no versions."""
        found = []
        with _os_errors(f"list versions of parcel {parcel}"):
            try:
                entries = list(os.scandir(self.parcel_dir(parcel) / "versions"))
            except FileNotFoundError:
                return []
            for entry in entries:
                if _VERSION_DIR.fullmatch(entry.name) and (Path(entry.path) / MANIFEST).is_file():
                    found.append(int(entry.name))
        return sorted(found)

    def missing_pieces(self, parcel: uuid.UUID, version: int, parcel_key: bytes) -> list[str]:
        """What a version lacks to be complete: "manifest", "keyring.disk", a blob name, or
        "chunk <hex>" for each missing chunk object. Empty means complete.

        Raises the errors of `open_manifest`/`open_keyring` if the manifest or a keyring is present but
        does not open, StoreError if the store cannot be read.
        """
        if not self.has_blob(parcel, version, MANIFEST):
            return [MANIFEST]
        manifest = open_manifest(parcel_key, self.get_blob(parcel, version, MANIFEST),
                                 parcel=parcel, version=version)
        missing = []
        for image, filename in KEYRING_FILES.items():
            if not self.has_blob(parcel, version, filename):
                missing.append(filename)
                continue
            records = open_keyring(parcel_key, self.get_blob(parcel, version, filename), manifest, image)
            missing.extend(f"chunk {r.tag.hex()}" for r in records if not self.has_chunk(r.tag))
        missing.extend(name for name in manifest.blobs if not self.has_blob(parcel, version, name))
        return missing
