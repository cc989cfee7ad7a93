"""Demand-fetch simulation of a client chunk cache, one chunk size at a time (what the papers did with Dinero IV).

The image is cut into chunks of ``chunk_size`` bytes; a request that crosses chunk boundaries makes one
*reference* per chunk it touches. The cache starts empty, as at a resume site with a cold cache, and is
either infinite (the papers' assumption: "client chunk cache large enough to contain the entire set of
chunks") or an LRU of ``capacity`` bytes.

- A **read** of an absent chunk is a miss: the whole chunk is fetched.
- A **write** to an absent chunk depends on the *write policy*:

  ``fetch``            every write miss fetches the chunk first (write-allocate with fetch: the chunk must be
                       whole before it can be encrypted and stored again), even if the write covers all of it;
  ``whole-no-fetch``   a write that covers the whole chunk installs it without fetching (vulpes' ``new``
                       tier); a partial write still fetches it. In a vulpes trace, which records chunks, only
                       a write whose source is ``new`` counts as whole.

- A write makes the chunk dirty: at suspend every dirty chunk is uploaded whole (``upload_bytes``), and with
  a finite cache a dirty chunk is written back whole when it is evicted.
- **Bytes fetched but never used**: a fetched byte counts as used once the guest reads it before overwriting
  it, while that fetched copy is still cached. ``bytes_never_used`` = bytes fetched - bytes used; for a trace
  of reads only and an infinite cache that is exactly bytes fetched - distinct bytes read.

- **Zero chunks**: ISR never stores an all-zero chunk (doc/parcel-format.md), so when the trace says which
  bytes held data at its start (metadata ``data_ranges`` or ``data_ranges.<image>``, written by `capture`),
  an absent chunk with no data in it is filled with zeros locally: no fetch, not a miss (counted as
  ``zero_fills``). Without that
  metadata, or with ``zero_chunks=False``, every chunk is assumed stored, as in the papers' Coda.

The last chunk of an image is shorter when the image size is known (trace metadata ``image_size``, or
``image_size.<image>`` in a trace of several images).
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import ModelError
from .trace import READ, Access, Trace

WRITE_POLICIES = ("fetch", "whole-no-fetch")
#: 4 KB to 1 MB in powers of two, as in the papers' figures.
DEFAULT_SIZES = tuple(4096 << i for i in range(9))

ChunkKey = tuple[str, int]


class Ranges:
    """A set of byte offsets kept as sorted, disjoint, non-adjacent half-open intervals."""

    __slots__ = ("starts", "ends", "total")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.total = 0

    def add(self, start: int, end: int) -> int:
        """Add [start, end); returns how many bytes were not in the set before."""
        if end <= start:
            return 0
        i = bisect.bisect_left(self.ends, start)          # first interval that ends at or after start
        j = bisect.bisect_right(self.starts, end)         # intervals before j start at or before end
        if i == j:
            self.starts.insert(i, start)
            self.ends.insert(i, end)
            self.total += end - start
            return end - start
        covered = sum(min(e, end) - max(s, start) for s, e in zip(self.starts[i:j], self.ends[i:j])
                      if min(e, end) > max(s, start))
        new_start = min(start, self.starts[i])
        new_end = max(end, self.ends[j - 1])
        removed = sum(e - s for s, e in zip(self.starts[i:j], self.ends[i:j]))
        self.starts[i:j] = [new_start]
        self.ends[i:j] = [new_end]
        self.total += (new_end - new_start) - removed
        return (end - start) - covered

    def gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of [start, end) that are not in the set."""
        out: list[tuple[int, int]] = []
        pos = start
        i = bisect.bisect_right(self.ends, start)
        while pos < end and i < len(self.starts):
            s, e = self.starts[i], self.ends[i]
            if s >= end:
                break
            if s > pos:
                out.append((pos, s))
            pos = max(pos, e)
            i += 1
        if pos < end:
            out.append((pos, end))
        return out


def distinct_bytes(accesses: Iterable[Access]) -> int:
    """How many distinct bytes (per image) ``accesses`` touch."""
    by_image: dict[str, list[tuple[int, int]]] = {}
    for a in accesses:
        by_image.setdefault(a.image, []).append((a.offset, a.end))
    total = 0
    for spans in by_image.values():
        spans.sort()
        cur_start, cur_end = spans[0]
        for s, e in spans[1:]:
            if s > cur_end:
                total += cur_end - cur_start
                cur_start, cur_end = s, e
            else:
                cur_end = max(cur_end, e)
        total += cur_end - cur_start
    return total


@dataclass
class SizeResult:
    """What demand-fetching a trace with one chunk size costs."""

    trace: str
    chunk_size: int
    write_policy: str
    #: Cache capacity in bytes; None = infinite.
    capacity: int | None
    requests: int = 0
    references: int = 0
    read_references: int = 0
    write_references: int = 0
    read_misses: int = 0
    #: Write references to an absent chunk that fetched it.
    write_misses: int = 0
    #: Write references that installed a whole absent chunk without fetching it (policy whole-no-fetch).
    whole_chunk_writes: int = 0
    bytes_fetched: int = 0
    bytes_never_used: int = 0
    #: Chunks installed ahead of demand by a policy (working-set prefetch); not in bytes_fetched.
    bytes_prefetched: int = 0
    #: Absent chunks that held no data, so were filled with zeros locally instead of fetched.
    zero_fills: int = 0
    #: Whether zero chunks were known (the trace's data_ranges) and taken into account.
    zero_aware: bool = False
    distinct_chunks: int = 0
    evictions: int = 0
    #: Dirty chunks written back because they were evicted (finite cache only), and their bytes.
    dirty_evictions: int = 0
    bytes_written_back: int = 0
    #: Chunks dirty at the end of the trace: uploaded at suspend, whole.
    dirty_chunks: int = 0
    dirty_bytes: int = 0
    distinct_bytes_read: int = 0
    distinct_bytes_written: int = 0
    #: True when the chunk size is smaller than what the trace can tell apart (vulpes traces).
    below_trace_granularity: bool = False

    @property
    def misses(self) -> int:
        """References that had to fetch their chunk."""
        return self.read_misses + self.write_misses

    @property
    def miss_ratio(self) -> float:
        return self.misses / self.references if self.references else 0.0

    @property
    def upload_bytes(self) -> int:
        """Bytes sent to the server: dirty chunks at suspend plus dirty evictions, whole chunks."""
        return self.dirty_bytes + self.bytes_written_back

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(misses=self.misses, miss_ratio=self.miss_ratio, upload_bytes=self.upload_bytes)
        return data


@dataclass
class _Chunk:
    length: int
    dirty: bool = False
    #: The chunk's contents came from the server (a fetch or a prefetch), not from a whole-chunk write.
    fetched: bool = False
    #: Fetched bytes the guest has read before overwriting them.
    used: Ranges = field(default_factory=Ranges)
    #: Bytes written since the fetch: reading them is no use of the fetched copy.
    overwritten: Ranges = field(default_factory=Ranges)


@dataclass(frozen=True)
class Fetch:
    """One chunk the cache had to fetch on demand."""

    key: ChunkKey
    length: int


class ChunkCache:
    """The client's chunk cache, fed one access at a time (`touch`). `result` sums up."""

    def __init__(self, chunk_size: int, *, write_policy: str = "fetch", capacity: int | None = None,
                 image_sizes: dict[str, int] | None = None, data_ranges: dict[str, list[tuple[int, int]]] | None = None,
                 trace_name: str = "") -> None:
        if chunk_size <= 0:
            raise ModelError(f"chunk size {chunk_size} must be positive")
        if write_policy not in WRITE_POLICIES:
            raise ModelError(f"write policy {write_policy!r} is not one of {', '.join(WRITE_POLICIES)}")
        if capacity is not None and capacity < chunk_size:
            raise ModelError(f"cache capacity {capacity} bytes cannot hold one {chunk_size}-byte chunk")
        self.chunk_size = chunk_size
        self.write_policy = write_policy
        self.max_chunks = capacity // chunk_size if capacity is not None else None
        self.image_sizes = image_sizes or {}
        self._chunks: OrderedDict[ChunkKey, _Chunk] = OrderedDict()
        self._seen: set[ChunkKey] = set()
        #: image -> (starts, ends) of the bytes that hold data; images not listed are all data.
        self._data = {image: ([s for s, _ in ranges], [e for _, e in ranges])
                      for image, ranges in (data_ranges or {}).items()}
        self.stats = SizeResult(trace=trace_name, chunk_size=chunk_size, write_policy=write_policy,
                                capacity=capacity, zero_aware=data_ranges is not None)

    def is_zero(self, key: ChunkKey) -> bool:
        """Whether the chunk held no data at the start (so the server stores nothing for it)."""
        data = self._data.get(key[0])
        if data is None:
            return False
        starts, ends = data
        start = key[1] * self.chunk_size
        i = bisect.bisect_right(ends, start)       # first range ending after the chunk starts
        return i >= len(starts) or starts[i] >= start + self.chunk_length(key)

    def chunk_length(self, key: ChunkKey) -> int:
        size = self.image_sizes.get(key[0])
        start = key[1] * self.chunk_size
        if size is None or start + self.chunk_size <= size:
            return self.chunk_size
        return max(size - start, 1)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._chunks

    def install(self, key: ChunkKey) -> bool:
        """Put a chunk in the cache ahead of demand (a prefetch); False if it was already there."""
        if key in self._chunks:
            return False
        if self.is_zero(key):
            self._insert(key, _Chunk(self.chunk_length(key)))
            return True
        chunk = _Chunk(self.chunk_length(key), fetched=True)
        self._insert(key, chunk)
        self.stats.bytes_prefetched += chunk.length
        return True

    def _insert(self, key: ChunkKey, chunk: _Chunk) -> None:
        self._chunks[key] = chunk
        self._seen.add(key)
        if self.max_chunks is not None:
            while len(self._chunks) > self.max_chunks:
                old_key, old = self._chunks.popitem(last=False)
                self._retire(old)
                self.stats.evictions += 1
                if old.dirty:
                    self.stats.dirty_evictions += 1
                    self.stats.bytes_written_back += old.length

    def _retire(self, chunk: _Chunk) -> None:
        if chunk.fetched:
            self.stats.bytes_never_used += chunk.length - chunk.used.total

    def touch(self, access: Access) -> list[Fetch]:
        """Apply one access; returns the chunks it had to fetch (in order)."""
        size = self.chunk_size
        stats = self.stats
        stats.requests += 1
        fetches: list[Fetch] = []
        first = access.offset // size
        last = (access.end - 1) // size
        reading = access.op == READ
        for index in range(first, last + 1):
            key = (access.image, index)
            base = index * size
            lo = max(access.offset, base) - base
            hi = min(access.end, base + size) - base
            stats.references += 1
            chunk = self._chunks.get(key)
            if chunk is not None:
                if self.max_chunks is not None:
                    self._chunks.move_to_end(key)
            else:
                length = self.chunk_length(key)
                # A vulpes trace only knows chunks: its write covered the chunk whole only if vulpes
                # said so (source "new"); any other write record may have been partial.
                whole = lo == 0 and hi >= length and access.source in ("", "new")
                if not reading and whole and self.write_policy == "whole-no-fetch":
                    chunk = _Chunk(length)
                    stats.whole_chunk_writes += 1
                elif self.is_zero(key):
                    chunk = _Chunk(length)
                    stats.zero_fills += 1
                else:
                    chunk = _Chunk(length, fetched=True)
                    if reading:
                        stats.read_misses += 1
                    else:
                        stats.write_misses += 1
                    stats.bytes_fetched += length
                    fetches.append(Fetch(key, length))
                self._insert(key, chunk)
            if reading:
                stats.read_references += 1
                if chunk.fetched:
                    if chunk.overwritten.total:
                        for s, e in chunk.overwritten.gaps(lo, hi):
                            chunk.used.add(s, e)
                    else:
                        chunk.used.add(lo, hi)
            else:
                stats.write_references += 1
                chunk.dirty = True
                if chunk.fetched:
                    chunk.overwritten.add(lo, hi)
        return fetches

    def result(self, accesses: Sequence[Access] = ()) -> SizeResult:
        """The totals so far, counting cached chunks' unread bytes as never used and dirty ones as uploads.

        ``accesses`` (the whole trace) fills in the distinct bytes read and written.
        """
        stats = SizeResult(**{k: v for k, v in self.stats.__dict__.items()})
        for chunk in self._chunks.values():
            if chunk.fetched:
                stats.bytes_never_used += chunk.length - chunk.used.total
            if chunk.dirty:
                stats.dirty_chunks += 1
                stats.dirty_bytes += chunk.length
        stats.distinct_chunks = len(self._seen)
        reads = [a for a in accesses if a.op == READ]
        writes = [a for a in accesses if a.op != READ]
        stats.distinct_bytes_read = distinct_bytes(reads) if reads else 0
        stats.distinct_bytes_written = distinct_bytes(writes) if writes else 0
        return stats


def simulate(trace: Trace, chunk_size: int, *, write_policy: str = "fetch", capacity: int | None = None,
             zero_chunks: bool = True) -> SizeResult:
    """Demand-fetch ``trace`` through a cold cache of ``chunk_size`` chunks; see the module docstring.

    ``zero_chunks``: use the trace's data_ranges (if it has them) to skip fetching chunks with no data.
    """
    cache = ChunkCache(chunk_size, write_policy=write_policy, capacity=capacity, image_sizes=trace.image_sizes(),
                       data_ranges=trace.data_ranges() if zero_chunks else None, trace_name=trace.name)
    for access in trace.accesses:
        cache.touch(access)
    result = cache.result(trace.accesses)
    result.below_trace_granularity = chunk_size < trace.granularity
    return result


def sweep(trace: Trace, sizes: Iterable[int] = DEFAULT_SIZES, **options: Any) -> list[SizeResult]:
    """`simulate` for each chunk size."""
    return [simulate(trace, size, **options) for size in sizes]
