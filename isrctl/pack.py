"""The resume pack: made at suspend from what the guest touched first after its resume, loaded into vulpes at
the next resume at a site whose cache lacks those chunks (doc/parcel-format.md, "Resume pack").

A resumed guest does not need all of each 128 KiB chunk it faults on: before it answers, the test guest
touches about 1,500 pages (6 MiB) of its memory image, spread over 150-250 chunks (BENCHMARKS.md, "the
memory mount and a page-exact resume pack"). QEMU maps the image from vulpes's memory mount, whose kernel
readahead is off, so vulpes's trace records each page the guest faulted on, one 4 KiB read each; the first
of those pages after a resume (`limit`: 1.5 s of the link, `PACK_BYTES` to `PACK_BYTES_MAX`), read
back from the memory image at suspend, are the next resume's best prediction of what its guest touches first,
as Firecracker's REAP records them (measured: 96 % of the pages the next guest touched in its first 10 s were
among the first 2,048 of them). They are packed in touch order, each page in one part: a first part of
`FIRST_PART_BYTES`, which crosses the link before QEMU loads the device state and maps the pages of all the
others, then smaller parts of `PART_BYTES`, which follow while the guest runs (`Fetching`); vulpes serves their
pages from RAM ahead of the chunks, and a guest fault on a page whose part is about to come waits for it.

What a guest touched first after its resume misses what moved since: the pages its processes and the kernel
use at the end of the session, which the next resume needs too. So a suspend first drops the guest's mapped
pages (vulpes's ``invalidate``) and lets it run on for `RECENT_SECONDS`: every page it touches then faults
again and reaches the trace, and those the first touches lack go into the pack early, beside the first touches
that follow its first part (`build`). A session
that booted cold packs only those: what a boot touches says little about what a resume will.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from parcels import resumepack, seal
from parcels.compress import StreamReader
from parcels.errors import ParcelError
from parcels.keyring import decode_stream
from parcels.manifest import Manifest, open_blob
from parcels.parcel import ParcelKeys

from . import paths, workingset
from .errors import IsrError
from .localstate import ParcelState
from .remote import Remote
from .vulpes import Vulpes

log = logging.getLogger(__name__)

#: The plaintext a pack holds at least (2,048 pages). Of the pages a hop-2 test guest touched before it
#: answered, 80-90 % were among the first 1,536 its previous session touched, and most of the rest among the
#: next 512 (BENCHMARKS.md, "the memory mount and a page-exact resume pack"): 6 MiB answered at 11.0 s at
#: 10 Mbit/s, 8 MiB at 6.8 s, 16 MiB at 7.6-8.2 s, whose last parts the guest did not need yet and whose pages
#: come again with their chunks.
PACK_BYTES = 8 << 20
#: The plaintext a pack holds at most (16,384 pages). On a fast link the guest reaches pages beyond the first
#: 2,048 (30 chunk misses at 100 Mbit/s, one round trip each) while a longer pack would already be here: with
#: 32 MiB the guest answered after 1.4 s instead of 2.4 s (BENCHMARKS.md, "a map in the resume pack"). And its
#: work after the answer goes on touching pages its previous session touched: the test guest's whole session
#: touched 37.8 MiB, and with all of it in the pack its workload at 100 Mbit/s took 4.2-5.3 s instead of
#: 5.4-6.1 (46-50 memory chunk misses instead of 84-97; BENCHMARKS.md "disk writes that do not wait"). On a 10
#: Mbit/s link a pack beyond `PACK_BYTES` made the answer later (12 MiB: 3.7-3.9 s against 2.8-3.0), which
#: `limit` keeps from happening there.
PACK_BYTES_MAX = 64 << 20
#: A pack costs at most about this much of the link at the suspend that makes it (its upload: vulpes's peak
#: rate is a lower bound of the link's, 4.4-12 MB/s at 100 Mbit/s), and may cost this much at a resume beyond
#: its first `PACK_BYTES` (`Fetching`): on a 10 Mbit/s link 32 MiB would be 8 s at both ends. With 3 s, a 10
#: Mbit/s site made 12 MiB packs, whose guests answered 0.9 s later.
PACK_LINK_SECONDS = 1.5
#: Plaintext per byte on the link (measured: 8 MiB sealed to 2.6-3.0 MB, 32 MiB to 9-12 MB).
PACK_RATIO = 2.8
#: The plaintext of the first part (256 pages), fetched before the guest starts (compressed, about 0.3 MB:
#: 0.03 s at 100 Mbit/s, 0.3 s at 10, 3 s at 1).
FIRST_PART_BYTES = 1 << 20
#: The plaintext of each later part (64 pages, about 80 KB on the link: 65 ms at 10 Mbit/s). A guest miss
#: that comes while one crosses waits for it: with 1 MiB parts, up to 0.3 s at 10 Mbit/s (BENCHMARKS.md,
#: "demand first"). Waiting for the guest to stop missing instead starved the pack (its misses hardly stop
#: before it answers) and doubled the time to the answer.
PART_BYTES = 256 << 10
#: What must have crossed in one request before its pace says what the link carries (vulpes's peak rate,
#: which decides whether the pack's chunks come at once: `Vulpes.preload_end`).
RATE_BYTES_MIN = 1 << 20
#: How long a suspend lets the guest run on once its mapped pages are dropped (vulpes's ``invalidate``), so that
#: the trace records the pages it is using at the end, not only those it touched first after its resume. The
#: test guest's idle touches come in bursts up to 0.8 s apart (a task that wakes every second); of the pages a
#: second before its suspend that its first touches lacked (56-71), the next site's guest read 51-69 before it
#: answered, about half of its reads outside the pack. Longer than Linux's free page reporting delay (2 s): a
#: report the end of the workload made due then runs before the suspend, not in the next resume's first second
#: (with 1 s it came 0.3-0.5 s after the resume, before the answer, and cost 0.07 s in the median at 100
#: Mbit/s; BENCHMARKS.md, "the pages a guest uses at its suspend").
RECENT_SECONDS = 2.5
#: At most this much plaintext of recent pages beyond the first touches (a test guest idling: about 550
#: pages in a second, most of them among its first touches).
RECENT_BYTES = 4 << 20
#: zstd's level for the parts a resume fetches first (`for_transfer`). Measured on a hop-2 test guest's 8 MiB
#: pack (29 parts, BENCHMARKS.md "the device state without its firmware"), each part alone: 2.97 MB at level 3
#: in 0.02 s, 2.86 at 9, 2.79 at 16, 2.63 at 18 in 0.7 s, 2.62 at 19 in 1.1 s. As one stream (another 8.7 MB
#: pack of 31 parts, 2.95 MB each alone at level 3, 2.61 at 18): 2.88 MB at level 3, 2.62 at 9, 2.58 at 15,
#: 2.39 at 18 in 1.3 s (BENCHMARKS.md "recent pages first").
TRANSFER_LEVEL = 18
_PAGE = 4096


def limit(rate_peak: float) -> int:
    """The plaintext of the pack a session makes whose link carried ``rate_peak`` bytes/s at best (vulpes's
    ``fetch.rate_peak``; 0: not measured): what crosses in `PACK_LINK_SECONDS`, whole pages, from `PACK_BYTES`
    to `PACK_BYTES_MAX`."""
    fits = int(rate_peak * PACK_LINK_SECONDS * PACK_RATIO) // _PAGE * _PAGE
    return max(PACK_BYTES, min(PACK_BYTES_MAX, fits))


class _Read(NamedTuple):
    """One read of an image in a trace: when (time.time()), its chunk, its byte range, and whether vulpes traced
    it at the suspend as mapped by QEMU (source ``mapped``)."""
    when: float
    chunk: int
    offset: int
    length: int
    mapped: bool


def _reads(trace: Path, image: str) -> list[_Read]:
    """The reads of ``image`` in ``trace``, in its order, but for those traced as mapped (a version-1 trace, which
    has no ranges, or a missing one: none). vulpes traces the mapped pages at the suspend in address order,
    which says nothing of when the guest touched them; they are put in the order in which the guest first
    reached their chunks (a chunk not here is always reached by a traced read, before the warmer may read it
    ahead), those of chunks it never reached so after the others, in address order. A pack that cannot hold
    them all then leaves out those of the chunks the guest reached last, not the top of its RAM (whose chunks
    the next guest read early: 18 misses at 100 Mbit/s in one run)."""
    out: list[_Read] = []
    try:
        with open(trace, errors="replace") as f:
            header = f.readline()
            if not header.startswith(("# vulpes-trace 2", "# vulpes-trace 3")):     # 3: a chunk size per image
                return []
            for line in f:
                parts = line.split()
                if len(parts) < 7 or parts[1] != image or parts[3] != "r":
                    continue
                try:
                    out.append(_Read(float(parts[0]), int(parts[2]), int(parts[5]), int(parts[6]),
                                     parts[4] == "mapped"))
                except ValueError:
                    continue
    except FileNotFoundError:
        return []
    reached: dict[int, int] = {}                # chunk: the rank of its first traced read
    for read in out:
        if not read.mapped:
            reached.setdefault(read.chunk, len(reached))
    spots = [i for i, read in enumerate(out) if read.mapped]
    ranked = sorted((out[i] for i in spots), key=lambda r: (reached.get(r.chunk, len(reached)), r.offset))
    for i, read in zip(spots, ranked):
        out[i] = read
    return out


def first_touches(trace: Path, image: str, limit: int, *, since: float | None = None, until: float | None = None,
                  mapped: bool = True) -> list[tuple[int, int]]:
    """The byte ranges of ``image`` the trace's reads touched, in first-touch order, until ``limit`` new bytes
    (a version-1 trace, which has no ranges, or a missing one: nothing); with ``since`` and ``until`` (each a
    time.time()), only the reads from ``since`` on and before ``until``; without ``mapped``, not the pages
    vulpes traced at the suspend as mapped by QEMU (source ``mapped``: touched while its warmer had them in the
    page cache, taken in the order `_reads` gives them)."""
    return _first_touches(_reads(trace, image), limit, since=since, until=until, mapped=mapped)


def _first_touches(reads: list[_Read], limit: int, *, since: float | None = None, until: float | None = None,
                   mapped: bool = True) -> list[tuple[int, int]]:
    """first_touches() of reads parsed already."""
    ranges: list[tuple[int, int]] = []
    seen: set[int] = set()               # pages already taken
    total = 0
    for read in reads:
        if (not mapped and read.mapped) or (since is not None and read.when < since) or \
                (until is not None and read.when >= until) or read.length <= 0:
            continue
        new = [p for p in _pages(read.offset, read.length) if p not in seen]
        if not new:
            continue
        seen.update(new)
        ranges.append((read.offset, read.length))
        total += len(new) * _PAGE
        if total >= limit:
            break
    return ranges


def _pages(offset: int, length: int) -> range:
    """The pages a byte range touches."""
    return range(offset // _PAGE, -(-(offset + length) // _PAGE))


def _within(ranges: list[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    """The first of ``ranges`` whose bytes add up to at most ``limit``."""
    out, total = [], 0
    for offset, length in ranges:
        if total + length > limit:
            break
        out.append((offset, length))
        total += length
    return out


def _interleaved(firsts: list[tuple[int, int]], recent: list[tuple[int, int]], head: int) -> list[tuple[int, int]]:
    """``firsts`` until ``head`` bytes (the pack's first part), then the rest of them and ``recent`` in turn, byte
    for byte. A resumed guest's periodic work (a task that wakes every second) touches its recent pages within
    its first seconds, which the end of the first touches reaches only late in a slow link's stream: at the
    end, they were reads of whole chunks (2-6 before the answer at 10 Mbit/s, BENCHMARKS.md "recent pages
    first")."""
    out: list[tuple[int, int]] = []
    size = i = 0
    while i < len(firsts) and size < head:
        out.append(firsts[i])
        size += firsts[i][1]
        i += 1
    rest, j, k, taken_rest, taken_recent = firsts[i:], 0, 0, 0, 0
    while j < len(rest) or k < len(recent):
        if k < len(recent) and (j == len(rest) or taken_recent <= taken_rest):
            out.append(recent[k])
            taken_recent += recent[k][1]
            k += 1
        else:
            out.append(rest[j])
            taken_rest += rest[j][1]
            j += 1
    return out


def extents(ranges: list[tuple[int, int]], image_size: int) -> list[tuple[int, int]]:
    """``ranges`` sorted, page-aligned, within the image, and joined where they overlap or touch (only pages
    the guest read are packed: with the memory image's read-around off, each page fault is one page)."""
    out: list[tuple[int, int]] = []
    for offset, length in sorted(ranges):
        start = offset // _PAGE * _PAGE
        end = min(image_size, -(-(offset + length) // _PAGE) * _PAGE)
        if start >= end:
            continue
        if out and start <= out[-1][0] + out[-1][1]:
            previous = out[-1][0]
            out[-1] = (previous, max(out[-1][0] + out[-1][1], end) - previous)
        else:
            out.append((start, end - start))
    return [(offset, min(length, resumepack.EXTENT_MAX // _PAGE * _PAGE)) for offset, length in out]


def build(trace: Path, memory: Path, image_size: int, *, limit: int = PACK_BYTES, first: int = FIRST_PART_BYTES,
          part: int = PART_BYTES, recent_since: float | None = None, resumed: bool = True) -> list[bytes]:
    """The pack's part payloads for the memory image at ``memory`` (vulpes's file, read after the guest
    stopped), from this session's ``trace``: the pages the guest read first after its resume (none if it
    booted cold, ``resumed`` false), first touches first, up to ``limit``; and its **recent pages**, those it
    read from ``recent_since`` on (`RECENT_SECONDS` before the suspend stopped it, once its mapped pages were
    dropped so that every touch faulted again), that it had not read before, up to `RECENT_BYTES`: after the first
    part, the recent pages and the rest of the first touches take turns (`_interleaved`). The first part
    holds ``first`` bytes and the others ``part`` (the last part takes what is left once there are
    `resumepack.PARTS_MAX`); none if the trace recorded no memory reads. Each page is in one part only, and the
    first part carries the map of the others, so that a resume whose guest reaches a page before its part
    arrives waits for that part."""
    groups: list[list[tuple[int, int]]] = [[]]
    size = 0
    reads = _reads(trace, "memory")
    touched = _first_touches(reads, limit) if resumed else []
    if recent_since is not None:
        # Recent pages go early unless the guest read them before, after its resume: not those it read only in
        # the window (at the first touches' end on a fast link), nor those vulpes traced as mapped at the
        # suspend (its warmer had them in the page cache: last, by when the guest first reached their chunks,
        # `_reads`), whose place says little of when the guest touched them. A page in two parts is in the first
        # only.
        exact = _first_touches(reads, limit, until=recent_since, mapped=False) if resumed else []
        seen = {page for offset, length in exact for page in _pages(offset, length)}
        recent = [(offset, length) for offset, length in _first_touches(reads, RECENT_BYTES + limit,
                                                                           since=recent_since)
                  if any(page not in seen for page in _pages(offset, length))]
        touched = _interleaved(touched, _within(recent, RECENT_BYTES), first)
    for offset, length in touched:
        if size >= (first if len(groups) == 1 else part) and len(groups) < resumepack.PARTS_MAX:
            groups.append([])
            size = 0
        groups[-1].append((offset, length))
        size += length
    taken: set[int] = set()                      # pages of earlier parts
    layouts: list[list[tuple[int, int]]] = []
    for group in groups:
        pages = [page for start, length in extents(group, image_size)
                 for page in _pages(start, length) if page not in taken]
        taken.update(pages)
        layouts.append(extents([(page * _PAGE, _PAGE) for page in pages], image_size))
    layouts = [layout for layout in layouts if layout]
    parts_map = _joined([resumepack.MapEntry(offset, length, index)
                         for index, layout in enumerate(layouts) if index for offset, length in layout])
    payloads = []
    fd = os.open(memory, os.O_RDONLY)
    try:
        for index, layout in enumerate(layouts):
            pieces = []
            for offset, length in layout:
                data = os.pread(fd, length, offset)
                if len(data) != length:
                    raise OSError(f"short read of {memory} at {offset}")
                pieces.append((offset, data))
            payloads.append(resumepack.encode(image_size, pieces, parts_map if index == 0 else ()))
    finally:
        os.close(fd)
    return payloads


def _joined(entries: list[resumepack.MapEntry]) -> list[resumepack.MapEntry]:
    """Map entries sorted, those of one part that touch joined."""
    out: list[resumepack.MapEntry] = []
    for e in sorted(entries, key=lambda e: e.offset):
        last = out[-1] if out else None
        if last and last.part == e.part and last.offset + last.length == e.offset \
                and last.length + e.length <= resumepack.EXTENT_MAX:
            out[-1] = resumepack.MapEntry(last.offset, last.length + e.length, e.part)
        else:
            out.append(e)
    return out


def seal_pack(parcel_keys: ParcelKeys, payload: bytes) -> bytes:
    """The pack as the version's ``resumepack`` blob (kind 3, like the device state it goes with)."""
    return seal.seal(parcel_keys.parcel_key, seal.KIND_DEVSTATE, payload)


def for_transfer(parcel_key: bytes, sealed: list[bytes], sizes: list[int]) -> list[bytes]:
    """The parts as a checkin uploads them: those that hold the first `PACK_BYTES` of plaintext (what every
    resume loads, on a slow link the only ones) sealed again as one zstd stream at `TRANSFER_LEVEL`
    (`seal.seal_stream`: each part compresses against those before it, as a resume reads them) if that is
    smaller, the others as they are.
    The suspend sealed them fast, before the state was safe; this runs while vulpes uploads the chunks.
    ``sizes``: each part's payload length (its manifest size). Raises as `seal.open_sealed`."""
    count, plaintext = 0, 0
    while count < len(sealed) and plaintext < PACK_BYTES:
        plaintext += sizes[count]
        count += 1
    payloads = [seal.open_sealed(parcel_key, blob, seal.KIND_DEVSTATE, size)
                for blob, size in zip(sealed[:count], sizes[:count])]
    chain = seal.seal_stream(parcel_key, seal.KIND_DEVSTATE, payloads, level=TRANSFER_LEVEL) if payloads else []
    del payloads
    first = chain if sum(map(len, chain)) < sum(map(len, sealed[:count])) else sealed[:count]
    return first + sealed[count:]


def parts(manifest: Manifest) -> list[str]:
    """The blob names of the version's pack parts, in order."""
    names = []
    for index in range(resumepack.PARTS_MAX):
        if resumepack.part_name(index) not in manifest.blobs:
            break
        names.append(resumepack.part_name(index))
    return names


def worth_loading(state: ParcelState, manifest: Manifest) -> bool:
    """Whether the version has a pack and this site's cache lacks some of its memory image's chunks."""
    if not parts(manifest):
        return False
    records = decode_stream(state.base_stream("memory"))[2]
    cover = workingset.coverage(paths.chunk_cache_dir(), records)
    return cover.cached < cover.chunks


class Fetching:
    """The pack parts ``names`` fetched in a request that streams them in order (`Remote.get_blobs`), on a
    thread of its own from the moment this is made, each checked as it arrives and kept until it is taken
    (iterate: (name, payload, plaintext of memory in it, bytes that crossed the link), in order, until the
    parts end). A resume makes it as soon as the version's metadata is here: the first part then crosses the
    link while vulpes starts.

    With ``keep``, once that much plaintext has come the fetch stops where the parts still to come would take
    more than ``seconds`` at the pace the parts came so far: a pack made on a fast link would hold a slow
    one's guest misses back (its parts cross while the guest waits for chunks) for pages the guest touches
    far later, if at all.

    A part that cannot be had or is damaged, or an answer that breaks off before it, ends the parts with a
    warning: those before it stay good, and the resume fetches the other chunks as it would without a pack.
    ``remote`` is the thread's alone; it is closed at the end if ``close_remote``.

    With ``hold``, the first part comes alone, and the others in a second request on the same connection once
    `go` is called: a resume asks for them once QEMU has started, whose start reads the disk's first sector
    (its geometry), a demand read that waited 0.45-0.85 s behind the later parts in the link's queue at 10
    Mbit/s (BENCHMARKS.md "recent pages first"). Not reading the one answer's later parts for a while did not
    do: what the server had sent by then filled the link's queue all the same."""

    def __init__(self, remote: Remote, state: ParcelState, manifest: Manifest, parcel_keys: ParcelKeys,
                 names: list[str], *, keep: int | None = None, seconds: float = PACK_LINK_SECONDS,
                 close_remote: bool = False, hold: bool = False) -> None:
        self._remote, self._state, self._manifest, self._keys = remote, state, manifest, parcel_keys
        self.names, self._keep, self._seconds, self._close_remote = names, keep, seconds, close_remote
        self._queue: queue.SimpleQueue[tuple[str, bytes, int, int] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._hold = hold
        self._go = threading.Event()
        if not hold:
            self._go.set()
        self.rate = 0                  # bytes/s the link carried while the parts came (0: not measured)
        self._thread = threading.Thread(target=self._run, name="resume-pack-fetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        used = loaded = opened = 0
        stream = StreamReader()                  # the parts sealed as one zstd stream (`for_transfer`)
        started = time.monotonic()
        names, manifest = self.names, self._manifest
        size = manifest.images["memory"].size
        try:
            for batch in ([names[:1], names[1:]] if self._hold else [names]):
                if not self._go.is_set() and loaded:
                    held = time.monotonic()
                    self._go.wait()
                    started += time.monotonic() - held      # the pace is the link's, not the hold's
                if self._stop.is_set() or not batch:
                    break
                asked, crossed = time.monotonic(), 0
                with contextlib.closing(self._remote.get_blobs(self._state.parcel, manifest.version, batch)) \
                        as arriving:
                    for name, sealed in arriving:
                        if self._stop.is_set():
                            return
                        crossed += len(sealed)
                        if crossed >= RATE_BYTES_MIN:       # enough to say what the link carries
                            self.rate = max(self.rate, int(crossed / max(time.monotonic() - asked, 1e-3)))
                        payload = open_blob(self._keys.parcel_key, sealed, manifest, name, stream=stream)
                        part = sum(extent.length for extent, _ in resumepack.decode(payload, size))
                        self._queue.put((name, payload, part, len(sealed)))
                        used += part
                        loaded += 1
                        opened += len(payload)
                        if self._keep is not None and used >= self._keep and loaded < len(names):
                            rest = sum(manifest.blobs[n].size for n in names[loaded:])   # payloads, as `opened`
                            pace = opened / max(time.monotonic() - started, 1e-3)
                            if rest > pace * self._seconds:
                                log.info("resume pack: its last %d parts (%d bytes of payload) are not fetched: at "
                                         "the pace of the others they would take %.1f s", len(names) - loaded,
                                         rest, rest / pace)
                                return
        except (IsrError, ParcelError, OSError) as exc:
            log.warning("the resume pack of version %d is not used from %s on: %s", manifest.version,
                        names[min(loaded, len(names) - 1)], exc)
        finally:
            if self._close_remote:
                self._remote.close()
            self._queue.put(None)

    def __iter__(self) -> Iterator[tuple[str, bytes, int, int]]:
        while (item := self._queue.get()) is not None:
            yield item
        self._queue.put(None)                   # the end, for the next iteration too

    def go(self) -> None:
        """Ask for the parts after the first (see ``hold``)."""
        self._go.set()

    def close(self) -> None:
        """Stop fetching at the next part (those taken stay good)."""
        self._stop.set()
        self._go.set()


def hand_over(parts: Iterator[tuple[str, bytes, int, int]], vulpes: Vulpes) -> int:
    """The parts (from a `Fetching`) to vulpes, in order, until they end; returns their plaintext of memory. A
    part vulpes refuses ends it with a warning."""
    used = 0
    for name, payload, part, crossed in parts:
        try:
            vulpes.preload("memory", payload, part=resumepack.part_index(name))
        except IsrError as exc:
            log.warning("the resume pack is not used from %s on: %s", name, exc)
            break
        used += part
        log.info("resume pack %s: %d bytes of memory served before their chunks (%d bytes crossed the link)",
                 name, part, crossed)
    return used

