"""Hoarding without the parcel key: `isr hoard --no-key` and `isr schedule run`.

An unattended scheduler should not hold the parcel key, and it needs none: everything a resume fetches is
ciphertext, and the server knows which (doc/protocol.md, ``GET …/versions/{n}/chunks``).

- **Chunks.** The server lists a version's chunk tags with their stored sizes, and its working set if the
  committing client reported one (first touch first). vulpes-fetch (C: the libcurl HTTP/2 fetcher of
  vulpes, pinned the same way) fetches those the shared chunk cache lacks and verifies each object against
  its tag before it is stored (temporary file, sync, rename). To vulpes such an object is like any other in
  the cache: it verifies it again when it reads it.
- **Boot files.** The kernel and initrd are sealed blobs of the version. Which blobs they are and their
  payload digests are in the sealed manifest, which needs the key, so a keyless hoard keeps every blob that
  is not per-version metadata (manifest, keyrings, device state: small, and fetched at resume anyway) as
  ``blobs/v<N>.<name>`` in the parcel's state directory. The next resume opens it with the key, checks it
  against the manifest and files it under its payload digest (`checkout.boot_blobs`), so it is not fetched
  again. A blob that the version inherited unchanged from one this site has already is linked, not fetched.

`need` says what this site lacks of a parcel's newest version; `hoard` fetches it and measures the
transfer. `ServerInventory` and `KeylessHoarder` are what `schedule.Runner` plans and hoards with.
"""
from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isrprogress import NullReporter, Reporter, human_bytes
from parcels import resumepack
from parcels.manifest import DEVSTATE, DEVSTATE_FILES
from parcels.store import KEYRING_FILES, MANIFEST

from . import background, paths, room
from . import schedule as schedulemod
from .checkout import Client, link_file
from .errors import HoardStopped, IsrError, StateError
from .localstate import ParcelState, write_file
from .vulpes import ChunkFetch, cache_object_path, cache_usage

log = logging.getLogger(__name__)

#: Blobs every version has of its own and every resume fetches: not worth keeping ahead of time.
PER_VERSION_BLOBS = frozenset({MANIFEST, *KEYRING_FILES.values(), DEVSTATE, DEVSTATE_FILES,
                               *(resumepack.part_name(i) for i in range(resumepack.PARTS_MAX))})
_VERSION_BLOB = re.compile(r"v([0-9]+)\.(.+)")


@dataclass
class Need:
    """What this site lacks of one version of a parcel."""

    parcel: str                                   # UUID
    name: str
    version: int
    working_set: bool                             # the chunks are the working set (else: every chunk)
    chunks: list[tuple[str, int]]                 # missing chunk objects (tag, size), in hoard order
    chunk_count: int                              # chunks in the set, present or not
    blobs: dict[str, int] = field(default_factory=dict)   # sealed blobs to download: name -> size
    links: dict[str, Path] = field(default_factory=dict)  # blobs here under an older version's name
    kept_bytes: int = 0                           # stored bytes of the set's chunks the cache has already

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.chunks) + sum(self.blobs.values())


@dataclass
class HoardResult:
    need: Need
    chunks: int       # chunk objects fetched
    bytes: int        # bytes fetched: chunk objects and sealed blobs
    seconds: float    # from the first transfer to the last


def _sealed_here(state: ParcelState, records: dict[int, dict[str, Any]], version: int, name: str,
                 size: int) -> Path | None:
    """A sealed copy of blob ``name`` of ``version`` at this site: kept under this version's name, or under
    an older version's from which it was inherited unchanged (the server records inheritance)."""
    number: int | None = version
    while number is not None and number in records:
        path = state.version_blob_path(number, name)
        if path.is_file() and path.stat().st_size == size:
            return path
        blob = next((b for b in records[number].get("blobs", []) if b.get("name") == name), None)
        if blob is None or not blob.get("inherited"):
            return None
        number = records[number].get("parent")
    return None


def need(client: Client, parcel: dict[str, Any], mode: str) -> Need:
    """What this site lacks of the parcel's current version: every chunk (``mode`` "full") or the working
    set ("working-set"; every chunk if the version has none recorded), and its boot files.

    ``parcel`` is a record from `Client.resolve`. Raises StateError for a parcel without versions,
    RemoteError if the server fails.
    """
    info = client.remote.parcel(parcel["id"])
    version = int(info.get("current_version") or 0)
    if version == 0:
        raise StateError(f"{parcel['name']} has no version to hoard")
    working = mode == "working-set"
    recorded, chunks = client.remote.version_chunks(parcel["id"], version, "working" if working else "all")
    if working and not recorded:
        log.info("version %d of %s has no recorded working set: hoarding every chunk", version, parcel["name"])
        working = False
        _, chunks = client.remote.version_chunks(parcel["id"], version, "all")
    cache = paths.chunk_cache_dir()
    wanted = Need(parcel=parcel["id"], name=parcel["name"], version=version, working_set=working,
                  chunks=[(tag, size) for tag, size in chunks if not cache_object_path(cache, tag).is_file()],
                  chunk_count=len(chunks))
    wanted.kept_bytes = sum(size for _, size in chunks) - sum(size for _, size in wanted.chunks)
    records = {int(v["version"]): v for v in info.get("versions", [])}
    state = ParcelState(parcel["id"])
    for blob in records.get(version, {}).get("blobs", []):
        name, size = str(blob["name"]), int(blob["size"])
        if name in PER_VERSION_BLOBS:
            continue
        here = _sealed_here(state, records, version, name, size)
        if here is None:
            wanted.blobs[name] = size
        elif here != state.version_blob_path(version, name):
            wanted.links[name] = here
    return wanted


def hoard(client: Client, parcel: dict[str, Any], mode: str, reporter: Reporter | None = None, *,
          fetch: ChunkFetch | None = None) -> HoardResult:
    """Fetch what this site lacks of the parcel's current version (see `need`) without the parcel key.

    ``fetch`` runs the chunk transfer (made from the client's configuration if None; pass one to be able
    to `ChunkFetch.stop` it). Raises HoardStopped if stopped, VulpesFailure if chunks could not be had,
    RemoteError, StateError.
    """
    reporter = reporter or NullReporter()
    wanted = need(client, parcel, mode)
    state = ParcelState(wanted.parcel)
    what = "the working set" if wanted.working_set else "everything"
    reporter.say(f"hoarding {what} of {wanted.name} version {wanted.version} without the key: "
                 f"{len(wanted.chunks)} of {wanted.chunk_count} chunks and {len(wanted.blobs)} boot files missing "
                 f"({human_bytes(wanted.bytes)})")
    warning = room.shortfall(cache_usage(paths.chunk_cache_dir(), limit=client.config.cache_limit),
                             sum(size for _, size in wanted.chunks), f"hoarding {wanted.name}",
                             "the hoard stops when the cache is full", kept=wanted.kept_bytes)
    if warning:
        reporter.say(warning)
    started = time.monotonic()
    for name, source in wanted.links.items():
        link_file(source, state.version_blob_path(wanted.version, name))
    # The boot files cross the link while vulpes-fetch hoards the chunks (see `keyhoard.hoard_with_key`).
    boot = background.start("boot-files", _fetch_blobs, client, wanted, reporter)
    fetched = 0
    chunk_bytes = sum(size for _, size in wanted.chunks)
    count = 0
    if wanted.chunks:
        config = client.config
        fetch = fetch or ChunkFetch(cache_dir=paths.chunk_cache_dir(), server=config.server,
                                    token_file=paths.token_file(), pin=config.pin, cache_limit=config.cache_limit,
                                    log_path=paths.data_dir() / "hoard.log")
        bar = reporter.progress("hoarding", chunk_bytes)
        try:
            result = fetch.run([tag for tag, _ in wanted.chunks],
                               progress=lambda line: bar.update(int(line.get("bytes", 0))))
        finally:
            bar.close()
        fetched += result.bytes
        count = result.fetched
    fetched += boot.result()
    _forget_older_blob_names(state, wanted.version)
    return HoardResult(wanted, count, fetched, time.monotonic() - started)


def _fetch_blobs(client: Client, wanted: Need, reporter: Reporter) -> int:
    """Download the sealed boot files ``wanted`` lists over a connection of their own; returns their bytes."""
    if not wanted.blobs:
        return 0
    state = ParcelState(wanted.parcel)
    fetched = 0
    size = sum(wanted.blobs.values())
    names = list(wanted.blobs)
    # All in one request: the link does not idle for a round trip between them.
    with client.new_remote() as remote, \
            reporter.progress(f"fetching boot file{'s' if len(names) > 1 else ''} {', '.join(names)}", size) as bar, \
            contextlib.closing(remote.get_blobs(wanted.parcel, wanted.version, names,
                                                progress=lambda done: bar.update(min(done, size)))) as arriving:
        for name, sealed in arriving:
            if len(sealed) != wanted.blobs[name]:
                raise IsrError(f"the server sent {len(sealed)} bytes of blob {name} of version {wanted.version}, "
                               f"not the {wanted.blobs[name]} it lists: try again later")
            write_file(state.version_blob_path(wanted.version, name), sealed)
            fetched += len(sealed)
        bar.close("sealed; the next resume checks them")
    return fetched


def _forget_older_blob_names(state: ParcelState, version: int) -> None:
    """Drop the version-named copies of other versions (the files stay where a resume filed them)."""
    folder = state.dir / "blobs"
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        match = _VERSION_BLOB.fullmatch(path.name)
        if match and int(match.group(1)) != version:
            path.unlink(missing_ok=True)


class ServerInventory:
    """`schedule.Inventory` on the server's chunk lists and this site's cache: no key needed.

    A parcel running at this site needs nothing (its user is here): `schedule.RUNNING_HERE`. Parcel lists are
    asked again after ``ttl`` seconds. Each answer is also kept in the schedule state (``known_path``, see
    `schedule.RunnerState.known`), so that a plan can be made from it while the server is away
    (`KnownInventory`).
    """

    def __init__(self, client: Client, ttl: float = 5.0, known_path: Path | None = None) -> None:
        self.client = client
        self.ttl = ttl
        self.known_path = known_path
        self._parcels: list[dict[str, Any]] = []
        self._listed = 0.0

    def parcels(self) -> list[dict[str, Any]]:
        if time.monotonic() - self._listed > self.ttl:
            self._parcels = self.client.remote.parcels()
            self._listed = time.monotonic()
            self._remember(parcels=[p["name"] for p in self._parcels if p.get("current_version")])
        return self._parcels

    def resolve(self, ref: str) -> dict[str, Any]:
        """A parcel record by name or UUID (StateError if there is none)."""
        found = [p for p in self.parcels() if ref in (p["id"], p["name"], f"{p.get('owner')}/{p['name']}")]
        if len(found) != 1:
            return self.client.resolve(ref)  # says why, in its words
        return found[0]

    def missing_bytes(self, parcel: str, mode: str) -> tuple[int, int]:
        record = self.resolve(parcel)
        if ParcelState(record["id"]).busy():
            self._remember(missing={f"{parcel}|{mode}": {"id": record["id"]}})
            return schedulemod.RUNNING_HERE, int(record.get("current_version") or 0)
        wanted = need(self.client, record, mode)
        self._remember(missing={f"{parcel}|{mode}": {"id": record["id"], "bytes": wanted.bytes,
                                                     "version": wanted.version}})
        return wanted.bytes, wanted.version

    def _remember(self, *, parcels: list[str] | None = None, missing: dict[str, Any] | None = None) -> None:
        if self.known_path is None:
            return
        with schedulemod.RunnerState.updating(self.known_path) as state:
            known = state.known
            if known.get("server") != self.client.config.server:
                known.clear()
            known.update(at=time.time(), server=self.client.config.server)
            if parcels is not None:
                known["parcels"] = parcels
            for key, entry in (missing or {}).items():
                known.setdefault("missing", {}).setdefault(key, {}).update(entry)

    def versions(self, refs: list[str]) -> dict[str, int]:
        """The current version of each parcel (for noticing a new checkin)."""
        self._listed = 0.0
        return {ref: int(self.resolve(ref).get("current_version") or 0) for ref in refs}


class KnownInventory:
    """`schedule.Inventory` from what `ServerInventory` last learnt (`schedule.RunnerState.known`): for planning
    while the server is away. A parcel running here is still RUNNING_HERE; one never asked about is an error."""

    def __init__(self, known: dict[str, Any]) -> None:
        self.known = known

    def parcels(self) -> list[str]:
        return list(self.known.get("parcels", []))

    def missing_bytes(self, parcel: str, mode: str) -> tuple[int, int]:
        entry = self.known.get("missing", {}).get(f"{parcel}|{mode}", {})
        if "id" in entry and ParcelState(entry["id"]).busy():
            return schedulemod.RUNNING_HERE, int(entry.get("version", 0))
        if "bytes" not in entry:
            raise schedulemod.ScheduleError(f"nothing is known here of what {parcel} lacks ({mode}): `isr schedule "
                                            f"show` once while the server answers")
        return int(entry["bytes"]), int(entry["version"])


class KeylessHoarder:
    """`schedule.Hoarder` by `hoard`, with progress in the log; `stop` ends a running hoard early."""

    def __init__(self, client: Client, inventory: ServerInventory, reporter: Reporter) -> None:
        self.client = client
        self.inventory = inventory
        self.reporter = reporter
        self._lock = threading.RLock()  # stop() may come from a signal handler
        self._fetch: ChunkFetch | None = None
        self._stopped = False

    def hoard(self, parcel: str, mode: str) -> tuple[int, float]:
        config = self.client.config
        fetch = ChunkFetch(cache_dir=paths.chunk_cache_dir(), server=config.server, token_file=paths.token_file(),
                           pin=config.pin, cache_limit=config.cache_limit, log_path=paths.data_dir() / "hoard.log")
        with self._lock:
            if self._stopped:
                raise HoardStopped("stopping")
            self._fetch = fetch
        try:
            result = hoard(self.client, self.inventory.resolve(parcel), mode, self.reporter, fetch=fetch)
        finally:
            with self._lock:
                self._fetch = None
        return result.bytes, result.seconds

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self._fetch is not None:
                self._fetch.stop()
