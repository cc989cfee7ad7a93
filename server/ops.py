"""Operations on whole parcels and on the whole store, shared by the API and isr-admin.

Everything that creates a version goes through the same path as a client's commit: take the lock, stage
blobs, `MetaStore.commit_version` with `publisher`, release. So the admin tool obeys the lock and the
parent rule exactly like a client does, and works the same on every backend.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from isrprogress import NullReporter, Reporter, human_bytes

from parcels import devices
from parcels import firmware as firmware_files
from parcels import qemuimg
from parcels.envelope import DEFAULT_LOG2N, unwrap_envelope, wrap_envelope
from parcels.errors import FormatError
from parcels.image import check_disk
from parcels.manifest import Manifest, Timestamps, VMConfig, open_manifest, seal_manifest, utc_now
from parcels.parcel import create_parcel as build_parcel
from parcels.store import DirStore

from . import auth
from .errors import BadRequest, Conflict, NotFound, ServerError, StorageError
from .meta import MetaStore, unpack_tags
from .names import TAG_RE
from .store import ObjectStore, chunk_key, envelope_key, staging_prefix, version_prefix
from .store.base import parcel_prefix
from .store.directory import DirectoryStore

Progress = Callable[[int, int], None]
ADMIN_ACTOR = "isr-admin"


def admin_host() -> str:
    return f"isr-admin@{socket.gethostname()}"


def publisher(store: ObjectStore, parcel: str, staging: str, blobs: Sequence[str], inherit: Sequence[str],
              parent: int) -> Callable[[int], None]:
    """The publish step of a commit: copy inherited blobs from the parent, drop staged blobs the commit
    does not list, and move the staging area to versions/<new>/ (one rename on a file system)."""

    def publish(new_version: int) -> None:
        for name in inherit:
            store.copy(version_prefix(parcel, parent) + name, staging + name)
        for info in list(store.list(staging)):
            name = info.key[len(staging):]
            if name not in blobs and name not in inherit:
                store.delete(info.key)
        store.move_prefix(staging, version_prefix(parcel, new_version))

    return publish


def store_chunk(meta: MetaStore, store: ObjectStore, tag: str, data: bytes, timeout: float = 30.0) -> bool:
    """Store a chunk object and record it in the index (the synchronous twin of the API's chunk PUT).
    Return True if it was not stored before."""
    if hashlib.sha256(data).hexdigest() != tag:
        raise ServerError(f"chunk {tag}: content does not match its tag")
    key = chunk_key(tag)
    existed = store.size(key) == len(data)
    deadline = time.monotonic() + timeout
    while True:
        if not existed:
            store.put_bytes(key, data)
        if meta.chunk_add(tag, len(data)):
            return not existed
        while meta.chunk_state(tag) == 1:
            if time.monotonic() > deadline:
                raise ServerError(f"chunk {tag} stayed marked for deletion by gc for {timeout:.0f} s")
            time.sleep(0.05)
        existed = False


def commit_local_version(meta: MetaStore, store: ObjectStore, parcel: str, owner_id: int,
                         blobs: dict[str, bytes | str], tags: Sequence[str], *, force: bool = False) -> int:
    """Commit a new version made by the admin tool: lock, stage, commit, release.

    `blobs` maps blob names to their bytes, or to the store key of an existing object to copy.
    Refused with `Conflict` if a client holds the lock (unless `force`, which breaks it).
    """
    nonce = auth.new_nonce()
    nonce_hash = auth.secret_hash(nonce)
    lock, old = meta.acquire_lock(parcel, owner_id, nonce_hash, admin_host(), "admin", 0, ADMIN_ACTOR, "",
                                  force=force)
    if old is not None:
        store.delete_prefix(staging_prefix(parcel, old.lock_id))
    staging = staging_prefix(parcel, lock.lock_id)
    try:
        sizes = {}
        for name, value in blobs.items():
            if isinstance(value, bytes):
                store.put_bytes(staging + name, value)
                sizes[name] = len(value)
            else:
                store.copy(value, staging + name)
                sizes[name] = store.size(staging + name) or 0
        blob_list = [{"name": n, "size": s} for n, s in sizes.items()]
        parent = meta.get_parcel(parcel).current_version
        version = meta.commit_version(parcel, nonce_hash, parent, tags, blob_list, lock.host, lock.site,
                                      ADMIN_ACTOR, "", publisher(store, parcel, staging, list(blobs), [], parent))
        return version.version
    finally:
        try:
            meta.release_lock(parcel, nonce_hash, ADMIN_ACTOR, "")
        except Conflict:
            pass
        store.delete_prefix(staging)


# --- parcels ------------------------------------------------------------------------------------------


def create_parcel(meta: MetaStore, store: ObjectStore, *, owner: str, name: str, disk: str | os.PathLike[str],
                  ram_mib: int, passphrase: str | None = None, keyfile: bytes | None = None,
                  vm: dict[str, Any] | None = None, boot: dict[str, Any] | None = None,
                  chunk_size: int | None = None, memory_chunk_size: int | None = None, log2n: int | None = None,
                  reporter: Reporter | None = None, tmpdir: str | None = None, disk_format: str | None = None,
                  firmware: str = "bios", force: bool = False) -> str:
    """Create a parcel for `owner` from a raw, qcow2, vmdk, vdi or vhdx disk image, encrypted under the
    owner's passphrase or key file, and import it as version 1. Returns the new parcel's UUID.
    ``reporter`` shows the encryption and the import of the chunks. `disk_format` and `firmware` are as
    `parcels.parcel.create_parcel` takes them; a disk without `boot` that could not boot under `firmware`
    is refused unless `force`.

    The image is checked first (readable, whole, in a known format; `parcels.qemuimg.inspect`), and so is
    the room for its data, here and in the store: a refused image leaves nothing behind. The parcel is
    then built by `parcels.parcel.create_parcel` in a temporary local store (the server never keeps the
    keys), and its chunks, key envelope and version 1 are put into the configured backend.
    """
    reporter = reporter or NullReporter()
    found = meta.get_user(owner)
    if found is None:
        raise NotFound(f"no user {owner}")
    user = found[0]
    for parcel_info in meta.list_parcels(user.id):
        if parcel_info.name == name:
            raise Conflict(f"user {owner} already has a parcel named {name!r}", code="parcel_exists")
    # Every refusal comes before any work (and any progress line): a refused image leaves nothing behind.
    if firmware == "uefi":
        firmware_files.ovmf_file(firmware_files.VARS)
    _check_room(check_disk(disk, disk_format, firmware, bootable=not boot and not force, tmpdir=tmpdir), store,
                tmpdir)
    with tempfile.TemporaryDirectory(prefix="isr-admin-create.", dir=tmpdir) as tmp:
        local = DirStore(Path(tmp) / "store")
        kwargs: dict[str, Any] = {}
        if chunk_size is not None:
            kwargs["chunk_size"] = chunk_size
        if log2n is not None:
            kwargs["log2n"] = log2n
        with reporter.progress(f"encrypting {Path(disk).name}", 0) as bar:
            parcel_uuid = build_parcel(local, name=name, disk=disk, ram_mib=ram_mib, vm=vm, boot=boot,
                                       memory_chunk_size=memory_chunk_size,
                                       passphrase=passphrase, keyfile=keyfile, progress=bar.update, tmpdir=tmp,
                                       disk_format=disk_format, firmware=firmware, **kwargs)
        parcel = str(parcel_uuid)
        root = Path(tmp) / "store"
        with reporter.progress("storing chunks", 0) as bar:
            tags = import_chunks(meta, store, root, progress=bar.update)
        vdir = root / "parcels" / parcel / "versions" / "1"
        blobs: dict[str, bytes | str] = {p.name: p.read_bytes() for p in sorted(vdir.iterdir()) if p.is_file()}
        envelope = (root / "parcels" / parcel / "keyenvelope").read_bytes()
    store.put_bytes(envelope_key(parcel), envelope)
    meta.create_parcel(parcel, owner, name)
    try:
        commit_local_version(meta, store, parcel, user.id, blobs, tags)
    except BaseException:
        remove_parcel(meta, store, parcel, force=True)
        raise
    return parcel


def _check_room(image: qemuimg.DiskImage, store: ObjectStore, tmpdir: str | None) -> None:
    """Refuse an image whose data would not fit: the chunks are built in a temporary store (``tmpdir``,
    else the system's) and then copied into the object store, so both need room for them. The data's
    uncompressed size is the bound (compression is not known before); a store that cannot say how much room
    it has (S3) is not asked."""
    places = [("the temporary directory", Path(tmpdir or tempfile.gettempdir()))]
    if isinstance(store, DirectoryStore):
        places.append(("the store", store.root))
    for what, path in places:
        free = shutil.disk_usage(path).free
        if image.data_bytes > free:
            raise StorageError(f"disk image {image.path} holds {human_bytes(image.data_bytes)} of data but {what} "
                               f"({path}) has {human_bytes(free)} free: make room there, or import a smaller image")


def import_chunks(meta: MetaStore, store: ObjectStore, local_root: Path, progress: Progress | None = None) -> list[str]:
    """Put every chunk object of a local parcel store into the server's store; return their tags.
    ``progress`` gets the bytes stored so far and the total."""
    files = [p for p in (local_root / "chunks").glob("*/*/*") if TAG_RE.fullmatch(p.name)]
    total = sum(p.stat().st_size for p in files)
    tags = []
    done = 0
    for path in files:
        data = path.read_bytes()
        store_chunk(meta, store, path.name, data)
        tags.append(path.name)
        done += len(data)
        if progress is not None:
            progress(done, total)
    return tags


def remove_parcel(meta: MetaStore, store: ObjectStore, parcel: str, *, force: bool = False) -> None:
    """Delete a parcel, its versions and blobs (its chunks go at the next gc). Refused while it is
    locked unless `force`."""
    info = meta.get_parcel(parcel)
    if info.lock is not None and not force:
        raise Conflict(f"parcel {parcel} is locked by {info.lock.user} on {info.lock.host}; use --force",
                       code="locked", holder=info.lock.to_json())
    meta.remove_parcel(parcel)
    store.delete_prefix(parcel_prefix(parcel))
    store.delete_prefix(f"staging/{parcel}/")


def _keys(store: ObjectStore, parcel: str, passphrase: str | None, keyfile: bytes | None) -> tuple[bytes, bytes]:
    _, parcel_key, secret = unwrap_envelope(store.get_bytes(envelope_key(parcel)), passphrase=passphrase,
                                            keyfile=keyfile, expect_uuid=uuid.UUID(parcel))
    return parcel_key, secret


def _resealed_manifest(store: ObjectStore, parcel: str, version: int, parcel_key: bytes, *, new_parcel: str,
                       new_version: int, parent: int | None,
                       change_vm: Callable[[Manifest], VMConfig] | None = None) -> bytes:
    manifest = open_manifest(parcel_key, store.get_bytes(version_prefix(parcel, version) + "manifest"),
                             parcel=uuid.UUID(parcel), version=version)
    changed = dataclasses.replace(manifest, parcel=uuid.UUID(new_parcel), version=new_version, parent=parent,
                                  timestamps=Timestamps(created=utc_now(), suspended=manifest.timestamps.suspended),
                                  vm=change_vm(manifest) if change_vm else manifest.vm)
    return seal_manifest(parcel_key, changed)


def set_devices(meta: MetaStore, store: ObjectStore, parcel: str, changes: dict[str, str], *,
                passphrase: str | None = None, keyfile: bytes | None = None) -> int:
    """Make a new version whose content is the current one's with these ``vm.devices`` changed (a value ""
    removes the role); the manifest is re-sealed, which needs the parcel key. The VM's hardware (`devices.HARDWARE`:
    the NIC, the rng, ...) cannot change under a suspended VM, whose saved state needs it as it was; the
    forwards can. Returns the new version number."""
    info = meta.get_parcel(parcel)
    if info.current_version == 0:
        raise Conflict(f"parcel {parcel} has no version to change", code="no_versions")
    parcel_key, _ = _keys(store, parcel, passphrase, keyfile)
    current = info.current_version

    def change_vm(manifest: Manifest) -> VMConfig:
        new = {**manifest.vm.devices, **changes}
        new = {role: model for role, model in new.items() if model}
        try:
            devices.check(new)
        except FormatError as exc:
            raise BadRequest(str(exc)) from None
        moved = [role for role in devices.HARDWARE if new.get(role) != manifest.vm.devices.get(role)]
        if manifest.suspended and moved:
            raise Conflict(f"version {current} holds a suspended VM, whose saved state needs its {', '.join(moved)} "
                           f"device as it is: power it off first (`isr poweroff`)", code="suspended")
        return dataclasses.replace(manifest.vm, devices=new)

    source = meta.get_version(parcel, current)
    blobs: dict[str, bytes | str] = {b["name"]: version_prefix(parcel, current) + b["name"] for b in source.blobs}
    blobs["manifest"] = _resealed_manifest(store, parcel, current, parcel_key, new_parcel=parcel,
                                           new_version=current + 1, parent=current, change_vm=change_vm)
    return commit_local_version(meta, store, parcel, info.owner_id, blobs, meta.version_tags(parcel, current))


def rollback(meta: MetaStore, store: ObjectStore, parcel: str, target: int, *, passphrase: str | None = None,
             keyfile: bytes | None = None, force: bool = False) -> int:
    """Make a new version whose content is version `target`'s (the manifest is re-sealed with the new
    version number, which needs the parcel key). Returns the new version number."""
    info = meta.get_parcel(parcel)
    source = meta.get_version(parcel, target)
    if target == info.current_version:
        raise Conflict(f"version {target} is already the current version", code="current_version")
    parcel_key, _ = _keys(store, parcel, passphrase, keyfile)
    new_version = info.current_version + 1
    blobs: dict[str, bytes | str] = {b["name"]: version_prefix(parcel, target) + b["name"] for b in source.blobs}
    blobs["manifest"] = _resealed_manifest(store, parcel, target, parcel_key, new_parcel=parcel,
                                           new_version=new_version, parent=info.current_version)
    tags = meta.version_tags(parcel, target)
    return commit_local_version(meta, store, parcel, info.owner_id, blobs, tags, force=force)


def copy_parcel(meta: MetaStore, store: ObjectStore, parcel: str, *, owner: str, name: str,
                passphrase: str | None = None, keyfile: bytes | None = None, new_passphrase: str | None = None,
                new_keyfile: bytes | None = None, log2n: int | None = None) -> str:
    """Copy the current version of a parcel into a new parcel (new UUID, version 1) for `owner`.

    The chunks are shared (nothing is re-encrypted); the manifest is re-sealed for the new UUID and the
    key envelope re-wrapped under the new credential (default: the same one)."""
    info = meta.get_parcel(parcel)
    if info.current_version == 0:
        raise Conflict(f"parcel {parcel} has no version to copy", code="no_versions")
    found = meta.get_user(owner)
    if found is None:
        raise NotFound(f"no user {owner}")
    parcel_key, secret = _keys(store, parcel, passphrase, keyfile)
    new = str(uuid.uuid4())
    version = meta.get_version(parcel, info.current_version)
    blobs: dict[str, bytes | str] = {b["name"]: version_prefix(parcel, version.version) + b["name"]
                                     for b in version.blobs}
    blobs["manifest"] = _resealed_manifest(store, parcel, version.version, parcel_key, new_parcel=new,
                                           new_version=1, parent=None)
    if new_passphrase is None and new_keyfile is None:
        new_passphrase, new_keyfile = passphrase, keyfile
    envelope = wrap_envelope(uuid.UUID(new), parcel_key, secret, passphrase=new_passphrase, keyfile=new_keyfile,
                             log2n=log2n or DEFAULT_LOG2N)
    store.put_bytes(envelope_key(new), envelope)
    meta.create_parcel(new, owner, name)
    try:
        commit_local_version(meta, store, new, found[0].id, blobs, meta.version_tags(parcel, version.version))
    except BaseException:
        remove_parcel(meta, store, new, force=True)
        raise
    return new


def prune(meta: MetaStore, store: ObjectStore, parcel: str, keep: int) -> list[int]:
    """Delete all but the newest `keep` versions; return the deleted version numbers."""
    if keep < 1:
        raise ServerError("keep at least one version")
    versions = [v.version for v in meta.list_versions(parcel)]
    doomed = versions[:-keep] if len(versions) > keep else []
    for number in doomed:
        meta.delete_version(parcel, number)
        store.delete_prefix(version_prefix(parcel, number))
    return doomed


# --- whole-store maintenance --------------------------------------------------------------------------


#: gc deletes an object that has no index row only once it is this many seconds old (see `gc`).
ORPHAN_MIN_AGE = 60.0


def gc(meta: MetaStore, store: ObjectStore, grace: float, reporter: Reporter | None = None,
       dry_run: bool = False) -> dict[str, Any]:
    """Delete chunk objects no version references, and stale staging areas.

    Safe while clients upload and commit: a chunk uploaded or claimed (missing-query, commit) within
    `grace` seconds is kept, and the mark/delete protocol of `server.meta.sql` makes a commit that races
    with gc either protect its chunks or fail with ``chunks_missing`` (never commit a hole).
    """
    started = time.time()
    cutoff = started - grace
    referenced: set[bytes] = set()
    for _parcel, _version, packed in meta.all_version_tags():
        referenced.update(packed[i:i + 32] for i in range(0, len(packed), 32))
    candidates = [row.tag for row in meta.chunk_rows()
                  if row.state == 0 and row.touched < cutoff and bytes.fromhex(row.tag) not in referenced]
    stats: dict[str, Any] = {"referenced": len(referenced), "candidates": len(candidates), "deleted": 0,
                             "deleted_bytes": 0, "orphans_deleted": 0, "staging_deleted": 0, "dry_run": dry_run}
    if dry_run:
        return stats
    meta.chunk_doom(candidates, cutoff)
    # Also finish what an interrupted gc left marked.
    doomed = meta.chunk_doomed()
    sizes = meta.chunk_sizes(doomed)
    with (reporter or NullReporter()).progress("deleting unreferenced chunks", len(doomed), "chunks") as bar:
        for i, tag in enumerate(doomed):
            store.delete(chunk_key(tag))
            bar.update(i + 1)
    meta.chunk_forget(doomed, only_doomed=True)
    stats["deleted"] = len(doomed)
    stats["deleted_bytes"] = sum(sizes.values())
    # Objects without an index row (an upload that died between writing the file and the row). A live
    # upload also has an object and no row for a moment, and an object store may round modification
    # times down to whole seconds: so never younger than ORPHAN_MIN_AGE, whatever the grace.
    known = {row.tag for row in meta.chunk_rows()}
    orphan_cutoff = started - max(grace, ORPHAN_MIN_AGE)
    for tag, info in store.iter_chunks():
        if tag not in known and info.mtime < orphan_cutoff:
            store.delete(info.key)
            stats["orphans_deleted"] += 1
    # Staging areas of locks that no longer exist.
    live = meta.lock_ids()
    stale_prefixes = set()
    for info in store.list("staging/"):
        parts = info.key.split("/")
        if len(parts) >= 4 and parts[2] not in live and info.mtime < cutoff:
            stale_prefixes.add(f"staging/{parts[1]}/{parts[2]}/")
    for prefix in stale_prefixes:
        stats["staging_deleted"] += store.delete_prefix(prefix)
    meta.audit(ADMIN_ACTOR, "gc", None, "", {k: v for k, v in stats.items() if k != "dry_run"})
    return stats


def fsck(meta: MetaStore, store: ObjectStore, reporter: Reporter | None = None, repair: bool = False
         ) -> dict[str, Any]:
    """Re-hash every stored chunk object; report corrupt, missing and unindexed ones, and every version
    that is not complete (a missing blob or chunk). With `repair`, corrupt objects are deleted and their
    index rows dropped, so the next upload of that chunk stores it again."""
    rows = {row.tag: row for row in meta.chunk_rows()}
    objects = list(store.iter_chunks())
    corrupt: list[str] = []
    unindexed: list[str] = []
    present: set[str] = set()
    hashed = 0
    with (reporter or NullReporter()).progress("re-hashing chunks", sum(info.size for _, info in objects)) as bar:
        for tag, info in objects:
            data = store.get_bytes(info.key)
            if hashlib.sha256(data).hexdigest() != tag:
                corrupt.append(tag)
            else:
                present.add(tag)
            if tag not in rows:
                unindexed.append(tag)
            hashed += len(data)
            bar.update(hashed)
    missing = sorted(tag for tag, row in rows.items() if row.state == 0 and tag not in present and tag not in corrupt)
    bad = set(corrupt) | set(missing)
    incomplete: list[dict[str, Any]] = []
    versions_checked = 0
    for parcel_info in meta.list_parcels():
        for version in meta.list_versions(parcel_info.id):
            versions_checked += 1
            problems: list[str] = []
            prefix = version_prefix(parcel_info.id, version.version)
            stored = {info.key[len(prefix):]: info.size for info in store.list(prefix)}
            for blob in version.blobs:
                if blob["name"] not in stored:
                    problems.append(f"blob {blob['name']} missing")
                elif stored[blob["name"]] != blob["size"]:
                    problems.append(f"blob {blob['name']} has {stored[blob['name']]} bytes, not {blob['size']}")
            tags = meta.version_tags(parcel_info.id, version.version)
            lost = [t for t in tags if t in bad or t not in rows]
            if lost:
                problems.append(f"{len(lost)} chunk(s) missing or corrupt")
            if problems:
                incomplete.append({"parcel": parcel_info.id, "version": version.version, "problems": problems,
                                   "chunks": lost[:100]})
        if store.size(envelope_key(parcel_info.id)) is None:
            incomplete.append({"parcel": parcel_info.id, "version": None, "problems": ["key envelope missing"],
                               "chunks": []})
    if repair:
        for tag in corrupt:
            store.delete(chunk_key(tag))
        meta.chunk_forget(corrupt + missing, only_doomed=False)
    report = {"chunks_checked": len(objects), "corrupt": corrupt, "missing": missing, "unindexed": unindexed,
              "versions_checked": versions_checked, "incomplete_versions": incomplete, "repaired": repair,
              "ok": not (corrupt or missing or incomplete)}
    meta.audit(ADMIN_ACTOR, "fsck", None, "", {"corrupt": len(corrupt), "missing": len(missing),
                                                "incomplete": len(incomplete), "repair": repair})
    return report


def usage(meta: MetaStore) -> dict[str, Any]:
    """Bytes stored in total and per user; the dedup ratio is the bytes all versions reference, counted
    once per version, over the bytes actually stored."""
    sizes = {row.tag: row.size for row in meta.chunk_rows() if row.state == 0}
    owners = {p.id: p.owner for p in meta.list_parcels()}
    per_user: dict[str, dict[str, Any]] = {}
    for user in meta.list_users():
        per_user[user.name] = {"parcels": 0, "versions": 0, "logical_bytes": 0, "unique_chunk_bytes": 0,
                               "blob_bytes": 0, "_tags": set()}
    for parcel, owner in owners.items():
        per_user[owner]["parcels"] += 1
        for version in meta.list_versions(parcel):
            entry = per_user[owner]
            entry["versions"] += 1
            entry["logical_bytes"] += version.chunk_bytes
            entry["blob_bytes"] += sum(b["size"] for b in version.blobs if not b.get("inherited"))
    for parcel, _version, packed in meta.all_version_tags():
        tag_owner = owners.get(parcel)
        if tag_owner is not None:
            per_user[tag_owner]["_tags"].update(unpack_tags(packed))
    for entry in per_user.values():
        tags = entry.pop("_tags")
        entry["unique_chunk_bytes"] = sum(sizes.get(t, 0) for t in tags)
        entry["dedup_ratio"] = round(entry["logical_bytes"] / entry["unique_chunk_bytes"], 3) \
            if entry["unique_chunk_bytes"] else None
    stored = sum(sizes.values())
    logical = sum(e["logical_bytes"] for e in per_user.values())
    return {"chunks": len(sizes), "chunk_bytes": stored, "logical_bytes": logical,
            "dedup_ratio": round(logical / stored, 3) if stored else None, "users": per_user}
