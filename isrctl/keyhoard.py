"""Hoarding with the parcel key (`isr hoard` with a credential): vulpes itself fetches the version's chunks,
all of them or its working set, into the shared cache, as a resume here would, and the boot files are
filed. Without the key, `hoard` does it (vulpes-fetch, for `isr hoard --no-key` and the scheduler).

The keyrings come from this site's checkout when it is of the newest version (or this site holds the lock);
otherwise the newest version's keyrings are fetched into a scratch directory, used, and removed.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from isrprogress import Reporter
from parcels.keyring import Keyring
from parcels.manifest import IMAGES, Manifest, open_keyring, open_manifest
from parcels.parcel import ParcelKeys
from parcels.store import KEYRING_FILES, MANIFEST

from . import background, paths, room, workingset
from .checkout import Client, boot_blobs, manifest_and_blobs
from .errors import StateError
from .localstate import POWEROFF, SUSPENDED, ParcelState
from .vulpes import CacheUsage, Vulpes


#: vulpes's ``--max-transfers`` for a hoard (no guest waits on it), so that the cap does not bind before its pacer
#: does (the background window: the link's bandwidth-delay product and 25 ms, in objects of the mean size).
#: With the default (16, 12 of them background) the window stayed at 12 where the objects were small
#: (13-16 KB: well-compressed memory chunks), and the link fell to 47-71 Mbit/s of 100 (+20 ms) for 0.3 s;
#: with this one the window reached 28-34 there and the link stayed at 85-106.
HOARD_TRANSFERS = 52


def hoard_with_key(client: Client, parcel: dict[str, Any], state: ParcelState, parcel_keys: ParcelKeys, *,
                   working_set_only: bool, reporter: Reporter) -> tuple[int, dict[str, Any]]:
    """Hoard the newest version of ``parcel`` (everything, or its working set) with its keys; the caller holds
    the parcel's state lock. Returns the version hoarded and vulpes's final hoard status."""
    checkout = state.checkout()
    change = state.effective_local_change()
    current = int(parcel.get("current_version") or 0)  # the record was just listed (`Client.resolve`)
    if current == 0:
        raise StateError(f"{parcel['name']} has no version to hoard")
    use_local = checkout is not None and (checkout.lock is not None or
                                          (checkout.version == current and change is None))
    # The boot files cross the link while the keyrings come and vulpes starts and hoards the chunks: fetched
    # first, they kept the chunks waiting (at 100 Mbit/s +20 ms the hoard moved 0.62-0.77 of the link's
    # goodput). They start as soon as the manifest is open. vulpes's background window follows the link's
    # delay, so its queued requests do not stall behind them on a slow link.
    boot: list[concurrent.futures.Future[None]] = []

    def start_boot_files(manifest: Manifest) -> None:
        boot.append(background.start("boot-files", _boot_files, client, state, manifest, parcel_keys, reporter))

    if use_local:
        assert checkout is not None
        manifest = open_manifest(parcel_keys.parcel_key, state.base_manifest_sealed(),
                                 parcel=uuid.UUID(state.parcel), version=checkout.version)
        if change is not None and change.state in (SUSPENDED, POWEROFF):
            working_set, problem = workingset.checked(change.working_set, manifest.chunk_counts())
            if problem is not None and working_set_only:
                reporter.say(f"warning: the working set recorded here is ignored ({problem})")
        else:
            working_set = manifest.working_set
        hoard_dir = state.dir
        start_boot_files(manifest)
    else:
        hoard_dir = state.dir / "hoard"
    try:
        if hoard_dir != state.dir:
            manifest = fetch_keyrings(client, parcel["id"], current, parcel_keys, hoard_dir,
                                      on_manifest=start_boot_files)
            working_set = manifest.working_set
        what = "the working set" if working_set_only else "everything"
        reporter.say(f"hoarding {what} of {parcel['name']} version {manifest.version}")
        status = _run(hoard_dir, state, parcel_keys, client, reporter,
                      working_set=working_set if working_set_only else None,
                      what=(parcel["name"], manifest.version, manifest.largest_chunk_size()))
    finally:
        if hoard_dir != state.dir:
            shutil.rmtree(hoard_dir, ignore_errors=True)
    for files in boot:
        files.result()
    return manifest.version, status


def _boot_files(client: Client, state: ParcelState, manifest: Manifest, parcel_keys: ParcelKeys,
                reporter: Reporter) -> None:
    """`checkout.boot_blobs` over a connection of its own (it runs beside the hoard)."""
    with client.new_remote() as remote:
        boot_blobs(state, manifest, parcel_keys, remote=remote, reporter=reporter)


def fetch_keyrings(client: Client, parcel: str, version: int, parcel_keys: ParcelKeys, directory: Path, *,
                   on_manifest: Callable[[Manifest], object] | None = None) -> Manifest:
    """Fetch a version's manifest and keyrings into a scratch ``directory`` (emptied first), where a vulpes can
    serve the version from (its ``--state``); returns the manifest. They come in one request (a bundle), the
    manifest first: ``on_manifest`` gets it as soon as it is open, while the keyrings are still on the way.
    Raises RemoteError, ParcelError (a damaged or substituted blob)."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    keyrings = {KEYRING_FILES[image]: image for image in IMAGES}
    manifest: Manifest | None = None
    with contextlib.closing(manifest_and_blobs(client.remote, parcel, version, parcel_keys, list(keyrings))) as arriving:
        for manifest, name, sealed in arriving:
            if name == MANIFEST:
                if on_manifest is not None:
                    on_manifest(manifest)
                continue
            image = keyrings[name]
            records = open_keyring(parcel_keys.parcel_key, sealed, manifest, image)
            with Keyring.create(directory / f"keyring.{image}", manifest.image_chunk_size(image),
                                manifest.images[image].size) as keyring:
                keyring.put_many(records)
    assert manifest is not None
    return manifest


def _run(state_dir: Path, state: ParcelState, parcel_keys: ParcelKeys, client: Client, reporter: Reporter, *,
         working_set: dict[str, list[int]] | None, what: tuple[str, int, int]) -> dict[str, Any]:
    """Hoard with a vulpes on the keyrings in ``state_dir``; ``what`` is the parcel's name, the version and its
    largest chunk size. Warns first if the cache has no room for it all; raises CacheFull if it ran out of room."""
    runtime = paths.parcel_runtime_dir(state.parcel)
    paths.chunk_cache_dir().mkdir(parents=True, exist_ok=True)
    daemon = Vulpes(mountpoint=runtime / "hoard-mnt", state_dir=state_dir, cache_dir=paths.chunk_cache_dir(),
                    control_path=runtime / "hoard.sock", log_path=state.dir / "vulpes.log",
                    server=client.config.server, token_file=paths.token_file(), pin=client.config.pin,
                    cache_limit=client.config.cache_limit, extra=[f"--max-transfers={HOARD_TRANSFERS}"])
    daemon.start(parcel_keys)
    try:
        _warn_if_no_room(daemon, client, state, state_dir, working_set, what, reporter)
        if working_set is None:
            return daemon.hoard_and_wait(reporter, "hoarding", everything=True)
        return daemon.hoard_and_wait(reporter, "hoarding", disk=working_set.get("disk", []),
                                     memory=working_set.get("memory", []))
    finally:
        daemon.stop()


def _warn_if_no_room(daemon: Vulpes, client: Client, state: ParcelState, state_dir: Path,
                     working_set: dict[str, list[int]] | None, what: tuple[str, int, int], reporter: Reporter) -> None:
    name, version, chunk_size = what
    wanted = []
    for image in IMAGES:
        with Keyring.open(state_dir / f"keyring.{image}") as keyring:
            records = list(keyring)
        wanted += records if working_set is None else workingset.select(records, working_set.get(image, []))
    usage = CacheUsage.from_status(daemon.status()["cache"])
    missing, kept = room.missing_tags(paths.chunk_cache_dir(), wanted)
    need = room.expected_bytes(client.remote, state.parcel, version, missing, chunk_size, usage.room - kept)
    warning = room.shortfall(usage, need, f"hoarding {name}", "the hoard stops when the cache is full", kept=kept)
    if warning:
        reporter.say(warning)
