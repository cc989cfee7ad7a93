"""Committing this site's local state as a new version: upload what the server lacks, seal, commit.

The changes are found by comparing the local keyrings with the base version's keyring streams: every
chunk whose record differs has a new object (vulpes wrote it into the cache when it flushed). The server
is asked which of the new objects it lacks (vulpes may have uploaded some already, with trickle
writeback or its ``upload`` request), those are sent from the cache files, then the keyring streams, the
device state and the manifest (version = base + 1, parent = base, working set, VM configuration with the
QEMU version that saved the state) are sealed and staged, and the commit names every chunk the version
references and, in plaintext, the tags of its working set (so that a site can hoard the working set
without the parcel key; doc/protocol.md says what that reveals). The commit carries the lock nonce: a site whose lock was broken gets ``lock_lost`` and can
never commit over newer state (`LockBroken`; its changes stay local).

On success the local state becomes the new base. ``checkin`` releases the lock, ``sync`` keeps it.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from isrprogress import NullReporter, Reporter
from parcels import crypto, firmware, resumepack, seal
from parcels.compress import StreamReader
from parcels.errors import ParcelError
from parcels.keyring import HEADER_SIZE, RECORD_SIZE, decode_stream
from parcels.manifest import (
    DEVSTATE, DEVSTATE_FILES, IMAGES, BlobInfo, ImageInfo, Manifest, Timestamps, open_manifest, seal_manifest, utc_now,
)
from parcels.parcel import ParcelKeys
from parcels.store import KEYRING_FILES, MANIFEST

from . import background, pack, paths, stateroms, workingset
from .checkout import Client, lock_broken_message
from .errors import CheckinError, LockBroken, LockNotReleased, StateError, VulpesFailure
from .localstate import DAMAGED, POWEROFF, RUNNING, SUSPENDED, Checkout, LocalChange, ParcelState
from .remote import ChunksMissing, LockLost, Remote, RemoteError, RemoteNotFound, RemoteUnreachable, VersionConflict
from .vulpes import cache_object_path, release_pins

log = logging.getLogger(__name__)

UPLOAD_THREADS = 4
T = TypeVar("T")


@dataclass
class Changes:
    """What differs between the local keyrings and the base version's."""

    changed: dict[str, int]          # image -> chunks whose record changed (new, different or now zero)
    new_tags: list[bytes]            # objects referenced now but not by the base (candidates for upload)
    all_tags: list[bytes]            # every object the local state references
    streams: dict[str, bytes]        # the local keyring streams

    @property
    def total_changed(self) -> int:
        return sum(self.changed.values())


def compare(state: ParcelState) -> Changes:
    """Compare the local keyrings with the base streams. Raises StateError if the state is incomplete."""
    streams = state.local_streams()
    changed: dict[str, int] = {}
    base_tags: set[bytes] = set()
    local_tags: dict[bytes, None] = {}
    for image in IMAGES:
        _, _, base_records = decode_stream(state.base_stream(image))
        _, _, local_records = decode_stream(streams[image])
        base = {r.idx: r for r in base_records}
        local = {r.idx: r for r in local_records}
        changed[image] = sum(1 for idx in base.keys() | local.keys() if base.get(idx) != local.get(idx))
        base_tags.update(r.tag for r in base_records)
        for r in local_records:
            local_tags.setdefault(r.tag, None)
    new_tags = [tag for tag in local_tags if tag not in base_tags]
    return Changes(changed=changed, new_tags=new_tags, all_tags=list(local_tags), streams=streams)


def on_connections(client: Client, name: str, items: Sequence[T], work: Callable[[Remote, T], object]) -> None:
    """``work(remote, item)`` for every item, on `UPLOAD_THREADS` threads with a connection each (an httpx
    client is not meant to be shared between threads), so that many small requests do not wait a round trip
    each one after another; raises the first failure once the others are done or cancelled."""
    lock = threading.Lock()
    local = threading.local()
    remotes: list[Remote] = []

    def run(item: T) -> None:
        if not hasattr(local, "remote"):
            local.remote = client.new_remote()
            with lock:
                remotes.append(local.remote)
        work(local.remote, item)

    try:
        with concurrent.futures.ThreadPoolExecutor(UPLOAD_THREADS, thread_name_prefix=name) as pool:
            for future in [pool.submit(run, item) for item in items]:
                future.result()
    finally:
        for remote in remotes:
            remote.close()


def upload_from_cache(client: Client, tags: list[str], reporter: Reporter, *, label: str = "uploading chunks") -> int:
    """Send chunk objects from the local cache; returns the bytes sent. Each object is checked against
    its tag first. Raises CheckinError if one is not in the cache or is damaged there."""
    cache = paths.chunk_cache_dir()
    sizes = {}
    for tag in tags:
        path = cache_object_path(cache, tag)
        try:
            sizes[tag] = path.stat().st_size
        except FileNotFoundError:
            raise CheckinError(f"chunk object {tag} is needed for the new version but is not in the cache "
                               f"{cache}: the local state is damaged; `isr discard` drops it") from None
    total = sum(sizes.values())
    bar = reporter.progress(label, total)
    sent = sent_chunks = 0
    lock = threading.Lock()

    def send(remote: Remote, tag: str) -> None:
        nonlocal sent, sent_chunks
        data = cache_object_path(cache, tag).read_bytes()
        if hashlib.sha256(data).hexdigest() != tag:
            raise CheckinError(f"chunk object {tag} in the cache {cache} is damaged: the local state cannot be "
                               f"checked in; `isr discard` drops it")
        remote.put_chunk(tag, data)
        with lock:
            sent += len(data)
            sent_chunks += 1
            bar.update(sent)

    try:
        on_connections(client, "upload", tags, send)
    finally:
        # Say what was sent, not what was meant to be: an upload cut short says how far it got.
        bar.close(f"{len(tags)} chunks" if sent_chunks == len(tags) else f"{sent_chunks} of {len(tags)} chunks sent")
    return sent


def landed(remote: Remote, parcel: str, parcel_key: bytes, manifest: Manifest) -> bool:
    """Whether the server's version ``manifest.version`` is this ``manifest``'s state: the same images (keyring
    digests) and blobs (payload digests). Its sealed bytes would not do: a checkin run again seals the same
    state with another salt."""
    try:
        theirs = open_manifest(parcel_key, remote.get_blob(parcel, manifest.version, MANIFEST),
                               parcel=manifest.parcel, version=manifest.version)
    except RemoteNotFound:
        return False
    return theirs.images == manifest.images and theirs.blobs == manifest.blobs


def commit(remote: Remote, parcel: str, parcel_key: bytes, manifest: Manifest,
           commit_it: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``commit_it()``, the commit of ``manifest`` (version parent + 1), safe against a lost answer. If the
    connection breaks after the request went out, the server may have committed: then it asks whether it did
    (`landed`), and commits again only if not. A commit refused because the server's current version is no
    longer the parent is this one if that version holds this state (an earlier checkin whose answer was lost):
    that counts as committed. Raises what ``commit_it`` raises otherwise."""
    try:
        return commit_it()
    except RemoteUnreachable as exc:
        lost = exc
    except VersionConflict as conflict:
        try:
            mine = landed(remote, parcel, parcel_key, manifest)
        except (RemoteError, ParcelError):
            raise conflict from None
        if not mine:
            raise
        log.info("version %d of %s holds this checkin already (an earlier answer was lost)", manifest.version, parcel)
        return {"version": manifest.version}
    try:
        if landed(remote, parcel, parcel_key, manifest):
            log.info("the answer to the commit of version %d was lost; the server has it", manifest.version)
            return {"version": manifest.version}
    except (RemoteError, ParcelError):
        raise lost from None
    return commit_it()


def per_suspend(name: str) -> bool:
    """Whether a blob belongs to one suspend (the device state, the resume pack): never inherited."""
    return name in (DEVSTATE, DEVSTATE_FILES) or resumepack.is_part(name)


def new_manifest(base: Manifest, change: LocalChange, streams: dict[str, bytes], qemu_version: str | None,
                 *, devstate_files: bool = False) -> Manifest:
    """The manifest of version base + 1 describing the local state (``devstate_files``: with the device state
    sealed against the firmware it carries too, `stateroms.seal_without_firmware`)."""
    images = {}
    for image in IMAGES:
        stream = streams[image]
        images[image] = ImageInfo(size=base.images[image].size, keyring_sha256=crypto.sha256(stream),
                                  keyring_size=len(stream), chunks=(len(stream) - HEADER_SIZE) // RECORD_SIZE,
                                  chunk_size=base.images[image].chunk_size)
    blobs = {name: info for name, info in base.blobs.items() if not per_suspend(name)}
    suspended = change.state == SUSPENDED
    vm = base.vm
    if suspended:
        assert change.devstate is not None
        blobs[DEVSTATE] = BlobInfo(kind=seal.KIND_DEVSTATE, sha256=bytes.fromhex(change.devstate["sha256"]),
                                   size=int(change.devstate["size"]))
        if devstate_files:
            blobs[DEVSTATE_FILES] = blobs[DEVSTATE]
        for index, part in enumerate(change.resume_pack):
            blobs[resumepack.part_name(index)] = BlobInfo(kind=seal.KIND_DEVSTATE, sha256=bytes.fromhex(part["sha256"]),
                                                          size=int(part["size"]))
        vm = type(base.vm)(**{**base.vm.__dict__, "qemu_version": change.qemu_version or qemu_version})
    if change.nvram:
        # The UEFI variable store as the VM left it (boot entries written by the guest or the firmware).
        blobs[firmware.NVRAM_BLOB] = BlobInfo(kind=seal.KIND_BOOT, sha256=bytes.fromhex(change.nvram["sha256"]),
                                              size=int(change.nvram["size"]))
    now = utc_now()
    working_set, problem = workingset.checked(change.working_set, base.chunk_counts())
    if problem is not None:
        log.warning("the working set recorded at suspend is left out of version %d: %s", base.version + 1, problem)
    manifest = base.replace(version=base.version + 1, parent=base.version, images=images, blobs=blobs, vm=vm,
                            suspended=suspended, working_set=working_set,
                            timestamps=Timestamps(created=now, suspended=change.suspended_at if suspended else None))
    return manifest


@dataclass
class Staged:
    """A new version's blobs, sealed and staged at the server for its commit (`stage`)."""

    base: int                        # the version they were sealed on
    changes: Changes
    manifest: Manifest
    sealed: dict[str, bytes]         # blob name -> sealed bytes, as staged
    devstate_sealed: bytes | None


def stage(client: Client, state: ParcelState, parcel_keys: ParcelKeys) -> Staged:
    """Seal the local state's keyring streams, device state, resume pack and new manifest and stage them at the
    server (over a connection of their own, so that this may run while the chunks upload). Nothing is
    committed: the commit that names them makes them a version; a staging area no commit names is the
    server's to drop. The state must be ready to check in (the VM suspended or powered off).

    Raises FileNotFoundError (the state is incomplete), RemoteError (LockLost if the lock is gone).
    """
    checkout = state.require_checkout()
    change = state.effective_local_change()
    if checkout.lock is None or change is None or change.state not in (SUSPENDED, POWEROFF):
        raise StateError(f"{checkout.name} has no suspended or powered-off state to stage")
    base = open_manifest(parcel_keys.parcel_key, state.base_manifest_sealed(), parcel=state_uuid(state),
                         version=checkout.version)
    changes = compare(state)
    sealed: dict[str, bytes] = {}
    for image in IMAGES:
        sealed[KEYRING_FILES[image]] = seal.seal(parcel_keys.parcel_key, seal.KIND_KEYRING, changes.streams[image])
    devstate_sealed = None
    if change.state == SUSPENDED:
        devstate_sealed = state.local_devstate_path().read_bytes()
        payload = seal.open_sealed(parcel_keys.parcel_key, devstate_sealed, seal.KIND_DEVSTATE,
                                   int(change.devstate["size"]) if change.devstate else 0)
        sealed[DEVSTATE] = devstate_sealed
        without_firmware = stateroms.seal_without_firmware(parcel_keys.parcel_key, payload)
        del payload
        if without_firmware is not None:
            sealed[DEVSTATE_FILES] = without_firmware
        sizes = [int(part["size"]) for part in change.resume_pack]
        local = [state.local_pack_path(index).read_bytes() for index in range(len(sizes))]
        stream = StreamReader()                  # the parts sealed as one stream, read in their order
        for index, pack_sealed in enumerate(pack.for_transfer(parcel_keys.parcel_key, local, sizes)):
            seal.open_sealed(parcel_keys.parcel_key, pack_sealed, seal.KIND_DEVSTATE, sizes[index], stream=stream)
            sealed[resumepack.part_name(index)] = pack_sealed
    if change.nvram:
        sealed[firmware.NVRAM_BLOB] = state.local_nvram_path().read_bytes()
        seal.open_sealed(parcel_keys.parcel_key, sealed[firmware.NVRAM_BLOB], seal.KIND_BOOT, int(change.nvram["size"]))
    manifest = new_manifest(base, change, changes.streams, change.qemu_version,
                            devstate_files=DEVSTATE_FILES in sealed)
    sealed[MANIFEST] = seal_manifest(parcel_keys.parcel_key, manifest)
    # In parallel: a resume pack has up to 256 parts, one request each.
    nonce = checkout.lock.nonce
    on_connections(client, "stage", list(sealed.items()),
                   lambda remote, blob: remote.put_blob(checkout.parcel, blob[0], blob[1], nonce))
    return Staged(base=base.version, changes=changes, manifest=manifest, sealed=sealed,
                  devstate_sealed=devstate_sealed)


def _say_changed(reporter: Reporter, checkout: Checkout, changes: Changes) -> None:
    reporter.say(f"checking in {checkout.name}: {changes.changed['disk']} disk and {changes.changed['memory']} "
                 f"memory chunks changed since version {checkout.version}")


def checkin(client: Client, state: ParcelState, parcel_keys: ParcelKeys, *, keep_lock: bool = False,
            reporter: Reporter | None = None, staged: concurrent.futures.Future[Staged] | None = None,
            settle: Callable[[], object] | None = None) -> int:
    """Commit the local state as a new version; returns the version now current at this site.

    ``staged``: the version's blobs, being staged already (`stage`) while something else (vulpes) uploads the
    chunks; the commit then names every chunk without asking first which the server lacks, and uploads those
    it says are missing. ``settle`` is called once the version is committed, before the local state becomes the
    new base (a session stops vulpes beside the commit and waits for it there).

    With no local changes nothing is committed (the lock is still released unless ``keep_lock``).
    Raises StateError (not checked out, no lock, a crashed or running session), LockBroken (the lock was
    broken: nothing can be committed), CheckinError (the server's version moved on, or a chunk object is
    missing locally), RemoteError (the server is unreachable or refused; the local state is kept).
    """
    reporter = reporter or NullReporter()
    checkout = state.require_checkout()
    if checkout.lock is None:
        raise StateError(f"this site does not hold the lock of {checkout.name}: `isr checkout {checkout.name}` "
                         f"first")
    change = state.effective_local_change()
    if change is not None and change.state == DAMAGED:
        raise StateError(f"the last session of {checkout.name} here crashed ({change.reason}); its state cannot be "
                         f"checked in: `isr discard {checkout.name}` goes back to version {checkout.version}")
    if change is not None and change.state == RUNNING:
        raise StateError(f"{checkout.name} is running at this site: `isr suspend` it first")
    remote = client.remote
    parcel = checkout.parcel
    lock = checkout.lock
    started = time.monotonic()
    if change is None:
        reporter.say(f"no changes since version {checkout.version}")
        if not keep_lock:
            release(client, state, checkout)
            reporter.say(f"lock of {checkout.name} released")
        return checkout.version

    base = open_manifest(parcel_keys.parcel_key, state.base_manifest_sealed(), parcel=state_uuid(state),
                         version=checkout.version)
    try:
        if staged is None:
            # The blobs cross the link while the chunks the server lacks do (one connection each).
            staging = background.start("stage", stage, client, state, parcel_keys)
            changes = compare(state)
            _say_changed(reporter, checkout, changes)
            missing = remote.missing([t.hex() for t in changes.new_tags])
            if missing:
                upload_from_cache(client, missing, reporter)
            ready = staging.result()
        else:
            ready = staged.result()
            changes = ready.changes
            _say_changed(reporter, checkout, changes)
        if ready.base != base.version:
            raise CheckinError(f"the blobs staged for {checkout.name} were sealed on version {ready.base}, not "
                               f"{base.version}: check in again")
        manifest, sealed = ready.manifest, ready.sealed
        inherit = [name for name in manifest.blobs if not per_suspend(name) and name not in sealed]
        tags = [t.hex() for t in changes.all_tags]
        working = workingset.tags(manifest.working_set,
                                  {image: workingset.stream_records(changes.streams[image]) for image in IMAGES})
        def commit_it() -> dict[str, Any]:
            return remote.commit(parcel, lock.nonce, base.version, list(sealed), tags, inherit, working)

        try:
            record = commit(remote, parcel, parcel_keys.parcel_key, manifest, commit_it)
        except ChunksMissing as exc:
            log.info("server lacks %d chunks at commit: uploading them", len(exc.missing))
            upload_from_cache(client, exc.missing, reporter, label="uploading the chunks the server lacks")
            record = commit(remote, parcel, parcel_keys.parcel_key, manifest, commit_it)
    except LockLost:
        raise LockBroken(lock_broken_message(client, parcel, checkout.name)) from None
    except VersionConflict as exc:
        raise CheckinError(f"the server's current version of {checkout.name} is {exc.details.get('current')}, not "
                           f"{base.version}: someone committed after this site's lock was broken. The changes made "
                           f"here stay local; `isr discard {checkout.name}` drops them") from None
    except FileNotFoundError as exc:
        raise StateError(f"the local state of {checkout.name} is incomplete ({exc.filename} is missing): "
                         f"`isr discard {checkout.name}`") from None
    new_version = int(record["version"])
    if settle is not None:
        settle()
    state.accept_local_as_base(manifest_sealed=sealed[MANIFEST], streams=changes.streams,
                               devstate_sealed=ready.devstate_sealed)
    try:
        # The server has every object of the version now: a full cache may drop them.
        release_pins(paths.chunk_cache_dir(), state.dir)
    except VulpesFailure as exc:
        log.warning("the cache keeps %s's objects pinned until its next resume: %s", checkout.name, exc)
    checkout.version = new_version
    if keep_lock:
        state.save_checkout(checkout)
    else:
        release(client, state, checkout, committed=new_version)
    reporter.say(f"committed version {new_version} of {checkout.name} in {time.monotonic() - started:.1f} s"
                 f"{'' if keep_lock else '; lock released'}")
    return new_version


def release(client: Client, state: ParcelState, checkout: Checkout, *, committed: int | None = None) -> None:
    """Release the lock ``checkout`` records and forget it locally (saving ``checkout`` either way).

    If the server does not release it (unreachable, failing), the record is kept, since the server still
    holds the lock for this site and only its nonce can release it without ``--force``: raises
    LockNotReleased, which says what was committed (``committed``) and how to release the lock later.
    """
    assert checkout.lock is not None
    try:
        client.release(checkout.parcel, checkout.lock)
    except RemoteError as exc:
        state.save_checkout(checkout)
        done = f"committed version {committed} of {checkout.name}, but " if committed is not None else ""
        raise LockNotReleased(f"{done}the lock could not be released ({exc}): this site still holds the lock; "
                              f"`isr checkin {checkout.name}` releases it when the server answers") from None
    checkout.lock = None
    state.save_checkout(checkout)


def state_uuid(state: ParcelState) -> uuid.UUID:
    return uuid.UUID(state.parcel)


__all__ = ["Changes", "compare", "checkin", "upload_from_cache", "new_manifest", "POWEROFF"]
