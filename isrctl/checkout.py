"""Getting a parcel from the server to this site: finding it, taking its lock, downloading a version.

`Client` bundles the configuration, the token and a `Remote`. `download_version` fetches a version's
sealed manifest, checks it (and, through a callback, that this PC can run it) before anything big is
fetched, then the keyrings and the device state, verifies each against the manifest and installs them
as the parcel's local base (`localstate.ParcelState.install_version`). Chunks are not downloaded here:
vulpes fetches them on demand or hoards them.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

from isrprogress import NullReporter, Reporter, human_bytes
from parcels import crypto, seal
from parcels.errors import MissingFilesError, ParcelError
from parcels.keyring import encode_stream
from parcels.manifest import DEVSTATE, DEVSTATE_FILES, IMAGES, Manifest, open_blob, open_keyring, open_manifest
from parcels.parcel import ParcelKeys
from parcels.store import KEYRING_FILES, MANIFEST

from . import config as configmod
from . import keys as keymod
from . import stateroms
from .errors import CheckinError, IsrError, LockBroken, LockRefused, StateError
from .localstate import Checkout, LockInfo, ParcelState, write_file
from .remote import LockHeld, LockLost, Remote, RemoteError

log = logging.getLogger(__name__)


def when(ts: float | None) -> str:
    """A Unix time as local 'YYYY-MM-DD HH:MM:SS' ('-' for None)."""
    if not ts:
        return "-"
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def describe_holder(holder: dict[str, Any]) -> str:
    """'alice on laptop (site home) since 2026-11-22 05:02:11, at version 3'."""
    text = f"{holder.get('user', '?')} on {holder.get('host', '?')}"
    if holder.get("site"):
        text += f" (site {holder['site']})"
    text += f" since {when(holder.get('acquired'))}"
    if holder.get("version") is not None:
        text += f", at version {holder['version']}"
    if holder.get("expired"):
        text += " (its lease has expired)"
    return text


class Client:
    """A logged-in connection to the configured server. Use as a context manager."""

    def __init__(self, cfg: configmod.ClientConfig | None = None, *, token: str | None = None,
                 timeout: float = 60.0) -> None:
        self.config = cfg or configmod.load()
        self.token = token or configmod.read_token()
        self.timeout = timeout
        self.remote = self.new_remote()

    def new_remote(self, timeout: float | None = None) -> Remote:
        """Another connection to the server with the same credentials (one per thread)."""
        return Remote(self.config.server, fingerprint=self.config.fingerprint, token=self.token,
                      timeout=timeout or self.timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.remote.close()

    @property
    def host(self) -> str:
        return socket.gethostname() or "unknown"

    # --- parcels ------------------------------------------------------------------------------------

    def resolve(self, ref: str) -> dict[str, Any]:
        """The parcel record for a UUID or a name of one of this user's parcels.

        Raises StateError if there is no such parcel or the name is ambiguous.
        """
        parcels = self.remote.parcels()
        try:
            wanted = str(uuid.UUID(ref))
            matches = [p for p in parcels if p["id"] == wanted]
        except ValueError:
            owner, _, name = ref.rpartition("/")
            matches = [p for p in parcels if p["name"] == name and (not owner or p.get("owner") == owner)]
        if not matches:
            names = ", ".join(sorted(p["name"] for p in parcels)) or "none"
            raise StateError(f"no parcel {ref!r} for user {self.config.user} on {self.config.server} "
                             f"(yours: {names}); `isr ls` lists them")
        if len(matches) > 1:
            raise StateError(f"{ref!r} names several parcels: use the UUID (`isr ls`)")
        return matches[0]

    def unlock(self, parcel: str, credential: keymod.Credential, state: ParcelState | None = None) -> ParcelKeys:
        """Download the key envelope (keeping a copy in the state dir) and open it.
        Raises CredentialError for a wrong passphrase or key file, RemoteError if the server fails."""
        envelope = self.remote.key_envelope(parcel)
        parcel_keys = keymod.unlock(envelope, uuid.UUID(parcel), credential)
        if state is not None:
            state.save_envelope(envelope)
        return parcel_keys

    # --- the lock -----------------------------------------------------------------------------------

    def acquire(self, parcel: dict[str, Any], *, force: bool = False) -> tuple[LockInfo, int]:
        """Take the parcel's lock for this site; returns the lock and the current version.

        Raises LockRefused (with who holds it, where, since when, at which version) if someone has it.
        """
        try:
            reply = self.remote.acquire(parcel["id"], self.host, self.config.site, force=force)
        except LockHeld as exc:
            holder = exc.holder
            raise LockRefused(f"parcel {parcel['name']} is in use: locked by {describe_holder(holder)}. Suspend "
                              f"it there, or break the lock with `isr lock --force {parcel['name']}`", holder) \
                from None
        lock = LockInfo(nonce=reply["nonce"], acquired=time.time(), host=self.host, site=self.config.site,
                        server_acquired=reply["lock"].get("acquired"))
        return lock, int(reply["lock"].get("version") or 0)

    def renew(self, parcel: str, lock: LockInfo, name: str = "") -> int:
        """Check that this site still holds the lock (renewing its lease); returns the current version.

        Raises LockBroken if the lock was broken or taken over.
        """
        try:
            reply = self.remote.renew(parcel, lock.nonce)
        except LockLost:
            raise LockBroken(lock_broken_message(self, parcel, name)) from None
        return int(reply["lock"].get("version") or 0)

    def release(self, parcel: str, lock: LockInfo) -> None:
        """Release the lock; a lock that is already gone is not an error."""
        try:
            self.remote.release(parcel, lock.nonce)
        except LockLost:
            pass

    # --- versions -----------------------------------------------------------------------------------

    def fetch_manifest(self, parcel: str, version: int, parcel_keys: ParcelKeys) -> tuple[bytes, Manifest]:
        """Download and open a version's sealed manifest (checked for parcel and version)."""
        sealed = self.remote.get_blob(parcel, version, MANIFEST)
        return sealed, open_manifest(parcel_keys.parcel_key, sealed, parcel=uuid.UUID(parcel), version=version)

    def download_version(self, state: ParcelState, version: int, parcel_keys: ParcelKeys, *,
                         check: Callable[[Manifest], object] | None = None,
                         reporter: Reporter | None = None) -> Manifest:
        """Fetch version ``version`` into ``state`` as its new base; returns its manifest.

        ``check`` runs on the verified manifest before the keyrings and device state are fetched (the
        compatibility check). Everything is verified against the manifest before it is installed.
        Raises RemoteError, ParcelError (a damaged or substituted blob), or what ``check`` raises.
        """
        reporter = reporter or NullReporter()
        parcel = state.parcel
        sealed_manifest, manifest = self.fetch_manifest(parcel, version, parcel_keys)
        if check is not None:
            check(manifest)
        # The keyrings and the device state in one request, each checked as soon as it has arrived.
        keyrings = {KEYRING_FILES[image]: image for image in IMAGES}
        streams = {}
        devstate = None
        # The device state without the firmware it carries, if this site's QEMU has those files (a few KB
        # instead of a few hundred); kept here sealed whole, as the server has it.
        devstate_name = DEVSTATE_FILES if manifest.blobs.get(DEVSTATE_FILES, False) == manifest.blobs.get(DEVSTATE) \
            else DEVSTATE
        wanted = [*keyrings, *([devstate_name] if manifest.suspended else [])]
        with contextlib.closing(self.remote.get_blobs(parcel, version, wanted)) as arriving:
            for name, sealed in arriving:
                if name == DEVSTATE:
                    open_blob(parcel_keys.parcel_key, sealed, manifest, DEVSTATE)
                    devstate = sealed
                    continue
                if name == DEVSTATE_FILES:
                    try:
                        payload = open_blob(parcel_keys.parcel_key, sealed, manifest, DEVSTATE_FILES,
                                            files=stateroms.lookup)
                    except MissingFilesError as exc:
                        log.info("%s: fetching the whole device state", exc)
                        continue
                    devstate = seal.seal(parcel_keys.parcel_key, seal.KIND_DEVSTATE, payload)
                    del payload
                    log.info("device state: %d bytes fetched, its firmware (%s) taken from this PC's QEMU",
                             len(sealed), ", ".join(name for name, _, _ in seal.files_named(
                                 parcel_keys.parcel_key, sealed, seal.KIND_DEVSTATE)))
                    continue
                image = keyrings[name]
                records = open_keyring(parcel_keys.parcel_key, sealed, manifest, image)
                streams[image] = encode_stream(manifest.image_chunk_size(image), manifest.images[image].size,
                                               records)
                if crypto.sha256(streams[image]) != manifest.images[image].keyring_sha256:
                    raise IsrError(f"the {image} keyring of version {version} does not re-encode to its digest")
        if manifest.suspended and devstate is None:
            devstate = self.remote.get_blob(parcel, version, DEVSTATE)
            open_blob(parcel_keys.parcel_key, devstate, manifest, DEVSTATE)
        state.install_version(manifest_sealed=sealed_manifest, streams=streams, devstate_sealed=devstate)
        reporter.say(f"  version {version}: manifest, keyrings"
                     f"{' and device state' if devstate else ''} verified "
                     f"({manifest.images['disk'].chunks} disk and {manifest.images['memory'].chunks} "
                     f"memory chunks stored)")
        return manifest

    def boot_blobs(self, state: ParcelState, manifest: Manifest, parcel_keys: ParcelKeys,
                   reporter: Reporter | None = None) -> dict[str, bytes]:
        """The payloads of the version's boot files (kernel, initrd), verified against the manifest.

        Sealed copies are kept in the state dir by payload digest, so they are downloaded once per site,
        not once per version.
        """
        return boot_blobs(state, manifest, parcel_keys, remote=self.remote, reporter=reporter)


def manifest_and_blobs(remote: Remote, parcel: str, version: int, parcel_keys: ParcelKeys,
                       names: list[str]) -> Generator[tuple[Manifest, str, bytes], None, None]:
    """A version's manifest and its sealed blobs ``names`` in one request (a bundle, `Remote.get_blobs`), so that
    the link does not idle for a round trip between them: yields (manifest, name, sealed bytes) for each as it
    arrives, the manifest first (name MANIFEST, its own sealed bytes), opened and checked for parcel and version
    before anything else is yielded. The blobs are not opened. Raises RemoteError, ParcelError."""
    manifest: Manifest | None = None
    with contextlib.closing(remote.get_blobs(parcel, version, [MANIFEST, *names])) as arriving:
        for name, sealed in arriving:
            if manifest is None:
                manifest = open_manifest(parcel_keys.parcel_key, sealed, parcel=uuid.UUID(parcel), version=version)
            yield manifest, name, sealed


def boot_blobs(state: ParcelState, manifest: Manifest, parcel_keys: ParcelKeys, *, remote: Remote | None,
               reporter: Reporter | None = None) -> dict[str, bytes]:
    """See `Client.boot_blobs`; with ``remote`` None only the local copies are used (disconnected).
    Raises StateError if a blob is neither local nor downloadable."""
    if manifest.vm.boot is None:
        return {}
    names = [n for n in (manifest.vm.boot.kernel, manifest.vm.boot.initrd) if n]
    return version_blobs(state, manifest, parcel_keys, names, remote=remote, reporter=reporter)


def version_blobs(state: ParcelState, manifest: Manifest, parcel_keys: ParcelKeys, names: list[str], *,
                  remote: Remote | None, reporter: Reporter | None = None) -> dict[str, bytes]:
    """The payloads of the version's kind-4 blobs ``names`` (boot files, a UEFI variable store), verified
    against the manifest: from this site's copies (kept by payload digest) or, with ``remote``, the server.
    Raises StateError if a blob is neither local nor downloadable."""
    reporter = reporter or NullReporter()
    out: dict[str, bytes] = {}
    for name in names:
        info = manifest.blobs[name]
        path = state.blob_path(info.sha256.hex())
        # A keyless hoard keeps what the server serves for this version; it counts once it opens here.
        for candidate in (path, state.version_blob_path(manifest.version, name)):
            if not candidate.exists():
                continue
            try:
                out[name] = open_blob(parcel_keys.parcel_key, candidate.read_bytes(), manifest, name)
            except ParcelError as exc:
                log.warning("local copy %s of boot file %s is unusable (%s)", candidate, name, exc)
                continue
            if candidate != path:
                link_file(candidate, path)
            break
    missing = [name for name in names if name not in out]
    if missing and remote is None:
        raise StateError(f"boot file {missing[0]} of version {manifest.version} is not at this site and the "
                         f"server is not reachable")
    if missing:
        assert remote is not None
        # All in one request: the link does not idle for a round trip between them.
        size = sum(manifest.blobs[name].size for name in missing)
        with reporter.progress(f"fetching boot file{'s' if len(missing) > 1 else ''} {', '.join(missing)}",
                               size) as bar, \
                contextlib.closing(remote.get_blobs(str(manifest.parcel), manifest.version, missing,
                                                    progress=lambda done: bar.update(min(done, size)))) as arriving:
            for name, sealed in arriving:
                out[name] = open_blob(parcel_keys.parcel_key, sealed, manifest, name)
                write_file(state.blob_path(manifest.blobs[name].sha256.hex()), sealed)
            bar.close(f"sealed ({human_bytes(size)} open); kept at this site")
    for name in names:
        # Under the version's name too, so that a keyless hoard of a later version inheriting it finds it.
        link_file(state.blob_path(manifest.blobs[name].sha256.hex()), state.version_blob_path(manifest.version, name))
    return {name: out[name] for name in names}


def link_file(source: Path, target: Path) -> None:
    """Make ``target`` a hard link to ``source`` (replacing what was there atomically); a copy where the file
    system has no hard links."""
    try:
        if target.exists() and os.path.samefile(source, target):
            return
        temporary = target.with_name(f".tmp-{target.name}-{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        os.link(source, temporary)
        os.replace(temporary, target)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP):
            raise
        write_file(target, source.read_bytes())


def lost_lock(lock: LockInfo, at_server: dict[str, Any] | None) -> str | None:
    """Why the lock this site recorded is no longer its own, judged from the lock the server shows now
    (``at_server``: GET …/lock's or the parcel list's ``lock``); None if the server still shows it.
    Read-only: unlike `Client.renew` it neither renews the lease nor needs the nonce to be sent."""
    if at_server is None:
        return "released or broken at the server (the parcel is not locked now)"
    same = at_server.get("host") == lock.host and at_server.get("site") == lock.site
    if lock.server_acquired is not None:
        same = same and at_server.get("acquired") == lock.server_acquired
    if same:
        return None
    return f"released or broken at the server (it is now held by {describe_holder(at_server)})"


def lock_broken_message(client: Client | None, parcel: str, name: str = "") -> str:
    """Why a commit or renewal failed with lock_lost, with who holds the lock now if that can be found."""
    holder_text = ""
    if client is not None:
        try:
            status = client.remote.lock_status(parcel)
            if status.get("lock"):
                holder_text = f" (it is now held by {describe_holder(status['lock'])})"
        except RemoteError:
            pass
    label = name or parcel
    return (f"this site's lock on parcel {label} was broken{holder_text}: the changes made here since the last "
            f"checkin cannot be committed. They stay in this site's local state; run `isr discard {label}` to "
            f"drop them (then `isr checkout {label}` to take the lock again)")


def ensure_checkout(client: Client, state: ParcelState, parcel: dict[str, Any], *, force: bool = False) \
        -> tuple[Checkout, int]:
    """Make sure this site holds the lock and has a checkout record; returns it and the current version.

    A lock recorded in checkout.json is renewed (LockBroken if it was lost); otherwise it is acquired
    (LockRefused if someone holds it). Raises CheckinError if the server's version moved on while this
    site holds local changes (which can only happen after a broken lock).
    """
    checkout = state.checkout()
    current = 0
    if checkout is not None and checkout.lock is not None:
        try:
            current = client.renew(parcel["id"], checkout.lock, parcel["name"])
        except LockBroken:
            if state.effective_local_change() is not None:
                raise
            # Nothing here depends on the lost lock: take a new one.
            checkout.lock = None
    if checkout is None or checkout.lock is None:
        lock, current = client.acquire(parcel, force=force)
        if checkout is None:
            checkout = Checkout(parcel=parcel["id"], name=parcel["name"], server=client.config.server,
                                user=client.config.user, version=0, newest_seen=0, site=client.config.site)
        checkout.lock = lock
        state.save_checkout(checkout)
    if current < checkout.newest_seen:
        raise CheckinError(f"the server offers version {current} of {parcel['name']}, but this site has seen "
                           f"version {checkout.newest_seen}: refusing a rolled-back server")
    if current == 0:
        raise StateError(f"parcel {parcel['name']} has no version yet: create it with isr-admin")
    return checkout, current


@contextlib.contextmanager
def holding_lock(client: Client, state: ParcelState, parcel: dict[str, Any]) -> Iterator[tuple[Any, int, bool]]:
    """The parcel's lock for a short server-side change: this site's lock if it holds one (kept), else one
    taken for the block and released after it. Yields (lock, current version, whether it was held)."""
    before = state.checkout()
    had_lock = before is not None and before.lock is not None
    checkout, current = ensure_checkout(client, state, parcel)
    lock = checkout.lock
    assert lock is not None
    try:
        yield lock, current, had_lock
    finally:
        if not had_lock:
            client.release(parcel["id"], lock)
            checkout = state.require_checkout()
            checkout.lock = None
            state.save_checkout(checkout)
