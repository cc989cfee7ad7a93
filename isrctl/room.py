"""Room in the chunk cache: whether what a resume or a hoard is about to fetch fits, the lines that say what
to do when it does not, and a running VM paused while the cache is full (`FullCache`).

The cache makes room by itself (vulpes evicts clean objects, least recently used first, before it refuses a
write; doc/vulpes.md, "Room"), so what counts is `CacheUsage.room`: the free space under the cache plus the
clean objects it may drop, within the cache limit, less what must stay (objects not yet uploaded, pinned).
A resume or hoard that needs more than that is warned about before it starts; a VM that finds no room at
all is paused, and `full_line` is what the session says then.
"""
from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isrprogress import Reporter, human_bytes
from parcels.keyring import KeyringRecord
from parcels.manifest import IMAGES

from .errors import IsrError
from .vulpes import CacheUsage, Vulpes, cache_object_path

if TYPE_CHECKING:  # annotations only: `isr hoard` need not load the QEMU modules through here
    from .qemu import VM
    from .remote import Remote

log = logging.getLogger(__name__)

#: How often a running session asks QEMU whether the VM is paused for lack of room (or, paused, whether
#: there is room to go on), and how often it asks vulpes whether the memory image has room.
SPACE_POLL = 1.0
MEMORY_ROOM_POLL = 5.0
#: Room (in chunk objects) after which a VM paused for lack of it goes on by itself; `isr resume`: one.
ROOM_TO_GO_ON = 8

#: What a chunk object of a chunk may take at most beyond the chunk itself (header, tag, GCM tag, zstd framing).
_OBJECT_OVERHEAD = 4096


def missing_tags(cache_dir: Path, records: Iterable[KeyringRecord]) -> tuple[list[bytes], int]:
    """The distinct tags of ``records`` whose object is not in the cache, and the bytes of those that are:
    what a hoard or a resume keeps, so they are not room it can make for the rest."""
    missing, kept = [], 0
    for tag in dict.fromkeys(record.tag for record in records):
        try:
            kept += cache_object_path(cache_dir, tag).stat().st_size
        except FileNotFoundError:
            missing.append(tag)
    return missing, kept


def expected_bytes(remote: Remote | None, parcel: str, version: int, tags: list[bytes], chunk_size: int,
                   room: int) -> int:
    """The stored bytes of the objects ``tags`` (of ``version`` of ``parcel``). The server is asked for their
    sizes only if they might not fit in ``room`` (each is at most a chunk and a little), so a cache with
    plenty of room costs no request. Objects the server does not list (this site's own changes) count 0;
    without a server each counts as a whole chunk."""
    most = len(tags) * (chunk_size + _OBJECT_OVERHEAD)
    if most <= room:
        return most
    if remote is None:
        return most
    _, listed = remote.version_chunks(parcel, version, "all")
    sizes = dict(listed)
    return sum(sizes.get(tag.hex(), 0) for tag in tags)


def shortfall(usage: CacheUsage, need: int, doing: str, then: str, *, kept: int = 0) -> str | None:
    """The warning for ``doing`` ("resuming p with policy demand", "hoarding p"), which fetches ``need``
    bytes into the cache and keeps ``kept`` bytes of what is there (not room it can make), if they do not
    fit; ``then`` says what happens when the cache is full. None if they fit."""
    room = max(0, usage.room - min(kept, usage.clean_bytes))
    if need <= room:
        return None
    return (f"warning: {doing} fetches {human_bytes(need)} into the chunk cache, which has room for "
            f"{human_bytes(room)} ({usage.describe()}): {usage.what_to_do()} first, or {then}")


def full_line(name: str, usage: CacheUsage, dirty: int, *, disconnected: bool) -> str:
    """What a session says, on one line, when its VM is paused because the cache has no room for its writes:
    that the cache is full, how much of the parcel is not uploaded yet, and what to do."""
    if usage.limit_bound:
        where = f"its limit of {human_bytes(usage.limit)}"
        fix = f"raise the limit (`isr login --cache-limit`, then `isr resume {name}`)"
    else:
        where = f"{human_bytes(usage.fs_free)} free on its file system"
        fix = f"free space under {usage.dir}"
    upload = "" if disconnected else f", or `isr sync {name}` to upload what is dirty so that it can be dropped"
    return (f"{name} is paused: the chunk cache {usage.dir} is full ({where}; {human_bytes(dirty)} of {name} not "
            f"yet uploaded): {fix}{upload}; it continues by itself once there is room (`isr resume {name}` tries "
            f"at once)")


def dirty_bytes(status: dict[str, Any]) -> int:
    """What of the parcel exists only here: objects not uploaded yet, and dirty chunks in vulpes's RAM."""
    return int(status["cache"].get("own_pinned_bytes", 0)) + \
        sum(int(status["images"][i].get("dirty_bytes", 0)) for i in IMAGES)


def _no_room(error: int) -> bool:
    return -error in (errno.ENOSPC, errno.EDQUOT)


def no_room_error(exc: BaseException) -> bool:
    """Whether a failure to make something durable was for lack of room in the cache."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return os.strerror(errno.ENOSPC) in str(exc)


def _flush_found_no_room(status: dict[str, Any]) -> bool:
    return any(_no_room(int(status["images"][i].get("flush_error", 0))) for i in IMAGES)


def _memory_has_no_room(status: dict[str, Any]) -> bool:
    """Whether the guest's RAM has writes vulpes could not reserve room for, or cannot flush: the VM must
    not run on (its memory image's writes would wait, and they come from the kernel's writeback)."""
    memory = status["images"]["memory"]
    return int(memory.get("unreserved_chunks", 0)) > 0 or _flush_found_no_room(status)


class FullCache:
    """A running VM and the room in its chunk cache: notice that the VM is paused for lack of room (QEMU
    stopped it on a disk write vulpes refused, or it is stopped here because the memory image has writes
    without room), say so once, and continue it once there is room again. The session calls `watch` from
    its main loop; `since` and `message` are what `isr stat` shows."""

    def __init__(self, name: str, *, disconnected: bool) -> None:
        self.name = name
        self.disconnected = disconnected
        #: When the VM was paused because the cache had no room (monotonic), None while it runs.
        self.since: float | None = None
        self.message = ""
        self._checked = self._memory_checked = 0.0

    def watch(self, vm: VM, vulpes: Vulpes, reporter: Reporter) -> None:
        """Once a second: notice a VM paused because the cache had no room for a disk write (QEMU stopped it),
        or stop it when vulpes cannot flush the memory image for lack of room; while it is paused, go on
        when there is room again."""
        now = time.monotonic()
        if now < self._checked + SPACE_POLL:
            return
        self._checked = now
        try:
            if self.since is not None:
                self.go_on_if_room(vm, vulpes, ROOM_TO_GO_ON, reporter)
            elif vm.paused_for_space():
                self.paused(vulpes, reporter)
            elif now >= self._memory_checked + MEMORY_ROOM_POLL:
                self._memory_checked = now
                if _memory_has_no_room(vulpes.status()):
                    vm.stop()
                    self.paused(vulpes, reporter)
        except IsrError as exc:
            log.warning("cannot look at the room in the chunk cache: %s", exc)

    def paused(self, vulpes: Vulpes, reporter: Reporter) -> None:
        """The VM is paused for lack of room: say so, once, with the figures after what can be reclaimed."""
        paused_at = time.monotonic()
        self.say_again(vulpes, reclaim=True)
        # Only now: `isr stat` shows the pause with its line, never the pause with an empty line (the reclaim
        # is a round trip to vulpes that a loaded machine makes long).
        self.since = paused_at
        log.warning("%s", self.message)
        reporter.say(self.message)

    def say_again(self, vulpes: Vulpes, *, reclaim: bool = False) -> str:
        """The line that says the cache is full, with today's figures (after what vulpes can reclaim)."""
        status = vulpes.reclaim() if reclaim else vulpes.status()
        self.message = full_line(self.name, CacheUsage.from_status(status["cache"]), dirty_bytes(status),
                                 disconnected=self.disconnected)
        return self.message

    def go_on_if_room(self, vm: VM, vulpes: Vulpes, chunks: int, reporter: Reporter) -> bool:
        """Continue the VM paused for lack of room if the cache has room for ``chunks`` chunk objects and
        every acknowledged write can be made durable; True if it runs (again)."""
        if vm.query_status() == "running":       # continued by someone else
            self.since = None
            return True
        status = vulpes.status()
        chunk = max(int(image["chunk_size"]) for image in status["images"].values())
        if int(status["cache"]["room"]) < chunks * chunk:
            return False
        status = vulpes.reclaim()
        if _memory_has_no_room(status) or _flush_found_no_room(status):
            return False
        vm.cont()
        self.since = None
        usage = CacheUsage.from_status(status["cache"])
        reporter.say(f"{self.name} continues: the chunk cache has room again ({human_bytes(usage.room)})")
        return True
