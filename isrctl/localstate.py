"""The local state of one parcel at this site: what is checked out, what changed since, and the lock.

A parcel's state directory (`paths.parcel_state_dir`) is vulpes's ``--state`` directory plus isrctl's
own files::

    keyring.disk, keyring.memory   the local keyrings (sqlite, doc/parcel-format.md); vulpes changes them
    checkout.json                  server, base version, lock nonce, site, policy, times  (`Checkout`)
    local.json                     present while the local state differs from the base   (`LocalChange`)
    keyenvelope                    the key envelope (ciphertext), so a disconnected resume can unlock
    base/manifest                  the base version's sealed manifest, as downloaded
    base/devstate                  its sealed device state, if it was suspended
    base/keyring.disk.stream       its keyring streams (tags and wrapped keys only: what changed is
    base/keyring.memory.stream       found by comparing the local keyrings with these)
    local/devstate                 the sealed device state of a local suspend not yet checked in
    blobs/<sha256>                 sealed boot files (kernel, initrd) by payload digest, kept across versions
    blobs/v<N>.<name>              the same files as version N names them (hard links), and those a keyless
                                     hoard fetched, which the next resume verifies against the manifest
    traces/                        vulpes access traces, one per session (the working-set estimate)
    session.json                   the running session: pid and sockets
    vulpes.log, session.log, qemu  logs

Nothing here is plaintext VM state: sealed blobs are ciphertext, keyrings hold only wrapped keys.

Every write is temp + fsync + rename. One process at a time works on a parcel's state: `ParcelState.lock`
takes an exclusive ``flock`` that a resume session holds for its whole life, so a crash (even kill -9)
releases it and a stale ``session.json`` is recognizable.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parcels import resumepack
from parcels.keyring import Keyring
from parcels.manifest import IMAGES

from . import paths
from .config import write_private
from .errors import StateError

CHECKOUT = "checkout.json"
LOCAL = "local.json"
SESSION = "session.json"
ENVELOPE = "keyenvelope"
BASE_MOVED = "base-moved"

#: Local states (`LocalChange.state`): a session is (or was, if it crashed) running; suspended or
#: powered off locally and not checked in yet; damaged by a crash (only discard helps).
RUNNING, SUSPENDED, POWEROFF, DAMAGED = "running", "suspended", "poweroff", "damaged"


@dataclass
class LockInfo:
    """The lock this site holds: its nonce authorizes commits, renewals and the release."""

    nonce: str
    acquired: float
    host: str
    site: str
    #: the server's ``acquired`` time of this lock (None in records written before it was kept): a lock
    #: the server shows with another acquisition time was broken and taken again, if by this same site
    server_acquired: float | None = None


@dataclass
class Checkout:
    """``checkout.json``: which version of which parcel this site has, and the lock if it holds it."""

    parcel: str
    name: str
    server: str
    user: str
    version: int
    newest_seen: int
    site: str
    lock: LockInfo | None = None
    policy: str | None = None
    checked_out: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Checkout:
        lock = data.get("lock")
        return cls(**{**data, "lock": LockInfo(**lock) if lock else None})


@dataclass
class LocalChange:
    """``local.json``: how the local state differs from the base version.

    ``devstate`` is the payload digest and size of ``local/devstate`` (state SUSPENDED), ``resume_pack``
    those of each part of the resume pack the suspend made, in order (``local/resumepack``,
    ``local/resumepack.1``, ...; `isrctl.pack`); ``working_set`` the chunk indices the guest touched first,
    per image; ``reason`` says why the state is DAMAGED. ``nvram`` is the payload digest and size of
    ``local/nvram``, a UEFI VM's variable store as the VM left it, when it differs from the base version's.
    """

    state: str
    since: float = field(default_factory=time.time)
    devstate: dict[str, Any] | None = None
    resume_pack: list[dict[str, Any]] = field(default_factory=list)
    qemu_version: str | None = None
    suspended_at: str | None = None
    working_set: dict[str, list[int]] = field(default_factory=lambda: {"disk": [], "memory": []})
    reason: str | None = None
    base_suspended: bool | None = None
    nvram: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LocalChange:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise StateError(f"{path} is unreadable ({exc}): `isr clean --force` removes this parcel's local state") \
            from None
    if not isinstance(data, dict):
        raise StateError(f"{path} is not a JSON object: `isr clean --force` removes this parcel's local state")
    return data


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_private(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())


def write_file(path: Path, data: bytes) -> None:
    """Write a state file crash-safely (temp + fsync + rename), mode 0600."""
    write_private(path, data)


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _remove_keyring_db(path: Path) -> None:
    for suffix in ("", "-wal", "-shm", "-journal"):
        _remove(path.with_name(path.name + suffix))


class ParcelState:
    """One parcel's state directory. Creating the object touches nothing on disk."""

    def __init__(self, parcel: uuid.UUID | str) -> None:
        self.parcel = str(uuid.UUID(str(parcel)))
        self.dir = paths.parcel_state_dir(self.parcel)
        self._lock_fd: int | None = None

    # --- locking against other isr processes ----------------------------------------------------------

    def try_lock(self) -> bool:
        """Take the exclusive state lock without waiting; False if another process holds it."""
        if self._lock_fd is not None:
            return True
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        self._lock_fd = fd
        return True

    @property
    def lock_fd(self) -> int | None:
        """The descriptor of the held state lock (a process that inherits it holds the lock too: `isr mount`)."""
        return self._lock_fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @contextlib.contextmanager
    def locked(self) -> Iterator[ParcelState]:
        """Hold the state lock for a block; raises StateError if a session (or another isr) holds it."""
        if not self.try_lock():
            session = self.session_info()
            who = f" (session pid {session['pid']})" if session else ""
            raise StateError(f"parcel {self.parcel} is busy at this site{who}: suspend the running session "
                             f"with `isr suspend`, or wait for the other isr command to finish")
        try:
            yield self
        finally:
            self.unlock()

    def busy(self) -> bool:
        """Whether another process holds the state lock right now."""
        if self._lock_fd is not None:
            return False
        if not self.dir.exists():
            return False
        if self.try_lock():
            self.unlock()
            return False
        return True

    # --- checkout.json and local.json ---------------------------------------------------------------

    def exists(self) -> bool:
        return (self.dir / CHECKOUT).exists()

    def checkout(self) -> Checkout | None:
        data = _read_json(self.dir / CHECKOUT)
        return Checkout.from_json(data) if data is not None else None

    def require_checkout(self) -> Checkout:
        found = self.checkout()
        if found is None:
            raise StateError(f"parcel {self.parcel} is not checked out at this site: `isr checkout` it first")
        return found

    def save_checkout(self, checkout: Checkout) -> None:
        checkout.updated = time.time()
        checkout.newest_seen = max(checkout.newest_seen, checkout.version)
        self.dir.mkdir(parents=True, exist_ok=True)
        _write_json(self.dir / CHECKOUT, checkout.to_json())

    def local_change(self) -> LocalChange | None:
        data = _read_json(self.dir / LOCAL)
        return LocalChange.from_json(data) if data is not None else None

    def save_local_change(self, change: LocalChange) -> None:
        _write_json(self.dir / LOCAL, change.to_json())

    def clear_local_change(self) -> None:
        _remove(self.dir / LOCAL)
        _remove(self.local_devstate_path())
        for part in (self.dir / "local").glob(f"{resumepack.BLOB_NAME}*"):
            _remove(part)

    def effective_local_change(self) -> LocalChange | None:
        """`local_change`, except that a RUNNING state whose session is gone is reported as DAMAGED (the
        session crashed: its disk and memory images no longer match any saved device state)."""
        change = self.local_change()
        if change is not None and change.state == RUNNING and not self.busy():
            change.state = DAMAGED
            change.reason = change.reason or "the session at this site ended without suspending (crash or kill)"
        return change

    # --- files ----------------------------------------------------------------------------------------

    def keyring_path(self, image: str) -> Path:
        return self.dir / f"keyring.{image}"

    def base_stream_path(self, image: str) -> Path:
        return self.dir / "base" / f"keyring.{image}.stream"

    def base_stream(self, image: str) -> bytes:
        try:
            return self.base_stream_path(image).read_bytes()
        except FileNotFoundError:
            raise StateError(f"the local state of parcel {self.parcel} is incomplete (no base {image} keyring): "
                             f"`isr clean --force` and check it out again") from None

    def base_manifest_sealed(self) -> bytes:
        try:
            return (self.dir / "base" / "manifest").read_bytes()
        except FileNotFoundError:
            raise StateError(f"the local state of parcel {self.parcel} has no manifest: check it out again") from None

    def base_devstate_path(self) -> Path:
        return self.dir / "base" / "devstate"

    def local_devstate_path(self) -> Path:
        return self.dir / "local" / "devstate"

    def local_nvram_path(self) -> Path:
        """The sealed UEFI variable store of a local session not yet checked in (`LocalChange.nvram`)."""
        return self.dir / "local" / "nvram"

    def local_pack_path(self, index: int) -> Path:
        """Part ``index`` of the sealed resume pack of a local suspend not yet checked in."""
        return self.dir / "local" / resumepack.part_name(index)

    def envelope(self) -> bytes | None:
        with contextlib.suppress(FileNotFoundError):
            return (self.dir / ENVELOPE).read_bytes()
        return None

    def save_envelope(self, data: bytes) -> None:
        write_file(self.dir / ENVELOPE, data)

    def blob_path(self, sha256_hex: str) -> Path:
        return self.dir / "blobs" / sha256_hex

    def version_blob_path(self, version: int, name: str) -> Path:
        """A sealed blob as the server serves it for ``version``, kept by a keyless hoard (which cannot open
        the manifest to learn its digest); the next resume checks it against the manifest and files it
        under `blob_path`."""
        return self.dir / "blobs" / f"v{version}.{name}"

    def trace_dir(self) -> Path:
        return self.dir / "traces"

    def local_streams(self) -> dict[str, bytes]:
        """The canonical streams of the local keyrings as they are now."""
        out = {}
        for image in IMAGES:
            with Keyring.open(self.keyring_path(image)) as keyring:
                out[image] = keyring.export_stream()
        return out

    def install_version(self, *, manifest_sealed: bytes, streams: dict[str, bytes], devstate_sealed: bytes | None) \
            -> None:
        """Make a downloaded (and already verified) version the base and the local state.

        The local keyrings are recreated from the streams; base files are replaced; local changes,
        traces of older versions and a remembered hoard request are dropped. The caller must have checked
        that there are no local changes worth keeping.
        """
        base = self.dir / "base"
        base.mkdir(parents=True, exist_ok=True)
        for image in IMAGES:
            path = self.keyring_path(image)
            _remove_keyring_db(path)
            tmp = path.with_name(f".new-{path.name}")
            _remove_keyring_db(tmp)
            with Keyring.create(tmp, 4096, 0) as keyring:
                keyring.import_stream(streams[image])
            for suffix in ("-wal", "-shm"):
                _remove(tmp.with_name(tmp.name + suffix))
            os.replace(tmp, path)
            write_file(self.base_stream_path(image), streams[image])
        if devstate_sealed is not None:
            write_file(self.base_devstate_path(), devstate_sealed)
        else:
            _remove(self.base_devstate_path())
        write_file(base / "manifest", manifest_sealed)
        _remove(self.dir / "hoard.request")
        self.clear_local_change()

    def restore_base(self) -> None:
        """Throw away local changes: the keyrings go back to the base streams (discard)."""
        streams = {image: self.base_stream(image) for image in IMAGES}
        devstate = self.base_devstate_path()
        self.install_version(manifest_sealed=self.base_manifest_sealed(), streams=streams,
                             devstate_sealed=devstate.read_bytes() if devstate.exists() else None)

    def accept_local_as_base(self, *, manifest_sealed: bytes, streams: dict[str, bytes],
                             devstate_sealed: bytes | None) -> None:
        """After a commit: the local state becomes the new base (the keyrings stay as they are)."""
        base = self.dir / "base"
        base.mkdir(parents=True, exist_ok=True)
        for image in IMAGES:
            write_file(self.base_stream_path(image), streams[image])
        if devstate_sealed is not None:
            write_file(self.base_devstate_path(), devstate_sealed)
        else:
            _remove(self.base_devstate_path())
        write_file(base / "manifest", manifest_sealed)
        self.clear_local_change()
        # vulpes counts changed chunks since "the base" in its own table; tell the next vulpes the base moved.
        write_file(self.dir / BASE_MOVED, b"")

    def take_base_moved(self) -> bool:
        """Whether the base moved (a commit) since vulpes last ran on these keyrings; clears the mark."""
        try:
            (self.dir / BASE_MOVED).unlink()
            return True
        except FileNotFoundError:
            return False

    # --- the running session ------------------------------------------------------------------------

    def session_info(self) -> dict[str, Any] | None:
        """The running session's pid and sockets, or None if no session runs (a stale file is ignored)."""
        data = _read_json(self.dir / SESSION)
        if data is None:
            return None
        if self._lock_fd is None and not self.busy():
            return None
        return data

    def save_session_info(self, info: dict[str, Any]) -> None:
        _write_json(self.dir / SESSION, info)

    def clear_session_info(self) -> None:
        _remove(self.dir / SESSION)

    def remove(self) -> None:
        """Delete the whole state directory (`isr clean`)."""
        shutil.rmtree(self.dir, ignore_errors=True)

    def forget_unfinished_checkout(self) -> bool:
        """Delete the state directory if all it holds is a first checkout that never finished: a
        ``checkout.json`` at version 0 (no version was ever fetched completely) without a lock, no local
        change and no session. The next command then finds no local state rather than an incomplete one.
        Returns whether it deleted it."""
        try:
            checkout = self.checkout()
            change = self.local_change()
        except StateError:
            return False
        if checkout is None or checkout.version != 0 or checkout.lock is not None or change is not None \
                or self.busy():
            return False
        self.remove()
        return True


def local_parcels() -> list[ParcelState]:
    """Every parcel that has local state at this site."""
    root = paths.parcels_dir()
    if not root.is_dir():
        return []
    out = []
    for entry in sorted(root.iterdir()):
        try:
            uuid.UUID(entry.name)
        except ValueError:
            continue
        state = ParcelState(entry.name)
        if state.exists():
            out.append(state)
    return out
