"""`isr mount` and `isr umount`: a parcel's disk image through vulpes (FUSE) without running its VM, to copy
a file out, back it up or run fsck.

`mount` starts a vulpes as a resume does (`vulpes.Vulpes`), on the user's directory, which then holds the
files ``disk`` and ``memory`` (the raw images; `mount -o loop,ro DIR/disk` reaches the guest's file system).
Chunks the cache lacks are fetched on demand, so a partly hoarded parcel mounts at once.

- **Read-only** (the default, FUSE ``-o ro``): the parcel's local state if it has one here (its version and
  any changes not checked in yet), else the server's current version, whose keyrings are fetched into a
  scratch directory (``mount/`` in the state directory); no lock is needed.
- **Read-write** (``--rw``) only while this site holds the parcel's lock, and only for a parcel whose VM is
  powered off (a suspended VM's saved memory expects its disk unchanged). It counts as a session: the local
  state says "running" while it is mounted, vulpes records the chunks it writes in the local keyrings as a
  resume would, and after `umount` the parcel is "powered off here, not checked in" (`isr checkin`), or
  unchanged if nothing was written. A vulpes that dies meanwhile leaves it damaged, as a crashed session does.

vulpes inherits the parcel's state lock (`ParcelState.lock_fd`) and holds it while it runs: no resume,
checkin or second mount can touch the parcel meanwhile, and the lock goes with the process, whatever ends
it. ``mount.json`` in the state directory records the mount for `umount` and `isr stat`.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
import uuid
from pathlib import Path
from typing import Any

from parcels.manifest import open_manifest
from parcels.parcel import ParcelKeys

from . import config as configmod
from . import paths
from .checkin import compare
from .checkout import Client
from .detach import process_alive
from .errors import IsrError, StateError
from .keyhoard import fetch_keyrings
from .localstate import DAMAGED, POWEROFF, RUNNING, SUSPENDED, LocalChange, ParcelState
from .vulpes import STOP_TIMEOUT, Vulpes, control_request, is_mounted, release_mount, unmount

MOUNT_FILE = "mount.json"
SCRATCH = "mount"


def info(state: ParcelState) -> dict[str, Any] | None:
    """The parcel's mount as recorded, if its vulpes still runs."""
    try:
        data = json.loads((state.dir / MOUNT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return dict(data) if isinstance(data, dict) and process_alive(int(data.get("pid", 0))) else None


def vulpes_status(state: ParcelState) -> dict[str, Any] | None:
    """The status report of the parcel's mounted vulpes, or None if it is not mounted (any more)."""
    mounted = info(state)
    if mounted is None:
        return None
    try:
        answer = control_request(Path(mounted["control"]), {"op": "status"}, timeout=10)
    except IsrError:
        return None
    return dict(answer["status"]) if answer.get("ok") else None


def mounts() -> list[tuple[ParcelState, dict[str, Any]]]:
    """Every mount recorded at this site (its vulpes may have died since), with its record."""
    root = paths.parcels_dir()
    found = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads((entry / MOUNT_FILE).read_text())
            found.append((ParcelState(entry.name), dict(data)))
    return found


def find(directory: Path) -> tuple[ParcelState, dict[str, Any]]:
    """The parcel mounted on ``directory`` and its record. Raises StateError if none is."""
    target = str(directory.absolute())
    for state, record in mounts():
        if record.get("dir") == target:
            return state, record
    raise StateError(f"{directory} is not where isr mounted a parcel (`isr stat` shows the mounts)")


def mounted_parcel(ref: str | None) -> ParcelState | None:
    """The mounted parcel named ``ref`` (name or UUID; None: the only one mounted), if there is one."""
    found = [state for state, record in mounts() if ref in (None, record.get("name"), state.parcel)
             and info(state) is not None]
    return found[0] if len(found) == 1 else None


def mount(state: ParcelState, parcel: dict[str, Any], parcel_keys: ParcelKeys, directory: Path, *, rw: bool,
          client: Client | None, cfg: configmod.ClientConfig) -> dict[str, Any]:
    """Mount the parcel's images on ``directory`` (see the module docstring); returns the mount's record.
    Raises StateError for what the user can change (a busy parcel, --rw without the lock or of a suspended VM,
    a directory in use), VulpesFailure if vulpes does not come up; nothing is left behind then."""
    directory = directory.absolute()
    name = parcel["name"]
    if directory.exists() and not directory.is_dir():
        raise StateError(f"{directory} is not a directory")
    if is_mounted(directory):
        raise StateError(f"something is mounted on {directory} already")
    if not state.try_lock():
        mounted = info(state)
        where = f"mounted on {mounted['dir']}" if mounted else "in use at this site (a session or another isr)"
        raise StateError(f"{name} is {where}: `isr umount` or `isr suspend` it first")
    scratch = state.dir / SCRATCH
    previous = state.effective_local_change()
    try:
        checkout = state.checkout()
        if previous is not None and previous.state == DAMAGED:
            raise StateError(f"the last session of {name} here did not end cleanly ({previous.reason}): `isr discard "
                             f"{name}` first")
        if rw:
            _check_writable(state, name, parcel_keys, previous)
        if checkout is not None and state.keyring_path("disk").exists():
            state_dir, version = state.dir, checkout.version
        elif client is None:
            raise StateError(f"{name} is not checked out at this site and the server cannot be asked")
        else:
            version = int(client.remote.parcel(parcel["id"]).get("current_version") or 0)
            if version == 0:
                raise StateError(f"{name} has no version to mount")
            state_dir = scratch
            fetch_keyrings(client, parcel["id"], version, parcel_keys, scratch)
        if rw:
            state.save_local_change(LocalChange(state=RUNNING, base_suspended=False))
        directory.mkdir(parents=True, exist_ok=True)
        runtime = paths.parcel_runtime_dir(parcel["id"])
        daemon = Vulpes(mountpoint=directory, state_dir=state_dir, cache_dir=paths.chunk_cache_dir(),
                        control_path=runtime / "mount.sock", log_path=state.dir / "vulpes.log",
                        server=cfg.server, token_file=paths.token_file(), pin=cfg.pin, cache_limit=cfg.cache_limit,
                        extra=[] if rw else ["-o", "ro"], keep_fds=[state.lock_fd] if state.lock_fd is not None else [])
        paths.chunk_cache_dir().mkdir(parents=True, exist_ok=True)
        daemon.start(parcel_keys)
        if rw and state.take_base_moved():
            daemon.control({"op": "checkin-done"})  # as at a resume: the keyrings are the base now
        record = {"parcel": parcel["id"], "name": name, "dir": str(directory), "disk": str(directory / "disk"),
                  "rw": rw, "version": version, "pid": daemon.pid, "control": str(daemon.control_path),
                  "scratch": state_dir == scratch, "previous": previous.to_json() if previous else None,
                  "started": time.time()}
        (state.dir / MOUNT_FILE).write_text(json.dumps(record, indent=1))
        return record
    except BaseException:
        if rw:
            _restore(state, previous)
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        state.unlock()  # vulpes holds its own copy of the lock while it runs


def _check_writable(state: ParcelState, name: str, parcel_keys: ParcelKeys, change: LocalChange | None) -> None:
    checkout = state.checkout()
    if checkout is None or checkout.lock is None:
        raise StateError(f"--rw needs this site to hold the lock of {name}: `isr checkout {name}` first (or mount it "
                         f"read-only)")
    suspended = change.state == SUSPENDED if change is not None else open_manifest(
        parcel_keys.parcel_key, state.base_manifest_sealed(), parcel=uuid.UUID(state.parcel),
        version=checkout.version).suspended
    if suspended:
        raise StateError(f"the VM of {name} is suspended and its saved memory expects its disk unchanged: mount it "
                         f"read-only, or `isr poweroff {name}` first")


def _restore(state: ParcelState, previous: LocalChange | None) -> None:
    if previous is None:
        state.clear_local_change()
    else:
        state.save_local_change(previous)


def umount(directory: Path) -> dict[str, Any]:
    """End the mount on ``directory``: unmount, wait for its vulpes (which makes every write durable on the way
    out), and for --rw record what it changed. Returns the record with ``changed_chunks`` and ``local`` (the
    local state now; the chunks that differ from the version checked out). Raises StateError if nothing isr
    mounted is there or it is still in use."""
    state, record = find(directory)
    pid = int(record["pid"])
    crashed = not process_alive(pid)
    changed = 0
    if not crashed:
        complaint = unmount(directory, lambda: process_alive(pid))
        if complaint and is_mounted(directory):
            raise StateError(f"cannot unmount {directory}: {complaint} (does a program still use a file in it?)")
        deadline = time.monotonic() + STOP_TIMEOUT
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if process_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            crashed = True
    release_mount(directory)
    with state.locked():
        if record.get("rw") and not crashed:
            # What checkin will find: the local keyrings against the base version's (the one way it is told).
            changed = compare(state).total_changed
            previous = LocalChange.from_json(record["previous"]) if record.get("previous") else None
            if previous is None and changed:
                previous = LocalChange(state=POWEROFF, base_suspended=False)
            _restore(state, previous)
        # A crashed --rw mount leaves "running" without its process: read as damaged, like a crashed session.
        shutil.rmtree(state.dir / SCRATCH, ignore_errors=True)
        (state.dir / MOUNT_FILE).unlink(missing_ok=True)
        change = state.effective_local_change()
    return {**record, "changed_chunks": changed, "crashed": crashed,
            "local": change.state if change else ("clean" if state.checkout() else None)}
