"""Predict resume latency and slowdown of each ISR state-transfer policy from a trace (seed 003 §5.1-5.2).

The timeline (seed 003 Figure 3): the user works at site1 (t1), suspends; dirty state goes to the server
(t2); site2 may prefetch (t3); at resume the user waits (t4, the *resume latency*); then works at site2 (t5),
possibly slowed down by state still missing (*slowdown*). Slowdown is (T_policy - T_local) / T_local, with
T_local the running time with all state local (seed 001 §6.5.2).

The model, and what it assumes:

- **One trace stands for both sessions**: the work done at site1 before suspend (what it dirtied must reach
  the server in t2) and the work done after resume at site2 (what t5 touches). ``working_set`` may give a
  different trace as site1's estimate of the working set; by default it is the trace itself (a perfect
  prediction: the best case for the working-set policies).
- **State**: ``disk_size`` bytes of disk image in ``chunk_size`` chunks that a whole-state transfer moves,
  plus a memory image of ``memory_size`` bytes that every policy needs before the VM can run (give the size
  that crosses the network, after compression). `with_defaults` takes the disk size from the trace: the
  chunks that hold data (ISR stores no all-zero chunk) when the trace says where its data is, else the
  image size. ``launch`` seconds to start the VM once its state is local.
- **Zero chunks**: with ``zero_chunks`` and a trace that has ``data_ranges``, a chunk with no data costs no
  fetch (see `tools.chunksim.cache`).
- **Network**: one link of ``bandwidth`` bytes/s and round-trip time ``rtt``, shared by all transfers of a
  site. A bulk transfer of N bytes costs rtt + N/bandwidth. A demand fetch of one chunk costs
  rtt + chunk/bandwidth and stalls the guest for all of it: fetches are one at a time, never overlap each
  other or the guest's own work (as in the papers' Vulpes), so the predicted slowdown is an upper bound.
  Uploads do not slow downloads (a full-duplex link).
- **Time in the trace** (the think-time/compute model): the gap before each access is either *think time*
  (a gap of at least ``think_gap`` seconds: the user, unaffected by the machine) or *compute* (shorter gaps:
  the guest working, including its local disk time), and compute gaps are multiplied by ``compute_scale``
  (a trace captured under a slow emulator can stand for a faster machine with a scale below 1). T_local is
  the sum of the gaps up to the last access; stalls add to it. ``slowdown_no_think`` divides the stalls by
  the compute time only, like the papers' "no think time" columns.
- **Demand fetching** follows `tools.chunksim.cache` with ``write_policy`` (default ``whole-no-fetch``:
  vulpes writes a whole chunk without reading it). Misses of an access are fetched before it completes.
- **Travel**: ``travel`` seconds between suspend and resume (t2 + t3); None means ample. Whatever of t2
  (and, for the proactive policies, t3) is not done by then adds to the resume latency.
- **Sites**: ``site2_synced`` means site2's cache held the state as of site1's previous sync, so the fully
  proactive policy only moves what t1 changed; otherwise it moves the whole state in t3.

Policies (seed 003 §5.2), named as ``isr resume --policy`` names them (isrctl/policy.py):

``baseline``         t4 = rtt + (disk + memory)/bw + launch; no slowdown
``proactive``        fully proactive: t3 moves the changed (or, unsynced, the whole) state; t4 = launch; no
                     slowdown
``demand``           pure demand-fetch: t4 = rtt + memory/bw + launch; every chunk of t5 is demand-fetched
``eager-ws``         eager working set: t3 moves the working set and the memory image to a site2 that had
                     nothing cached (with a synced site2, fully proactive is the better choice anyway);
                     t4 = launch; misses outside the set are demand-fetched
``lazy-ws``          lazy working set: t4 as pure demand-fetch; after resume the working set streams in the
                     background in first-touch order whenever no demand fetch uses the link; a demand fetch
                     for a chunk still queued takes priority (bytes of a partly sent chunk are not lost: an
                     optimistic simplification)
``eager-writeback``  t5 as pure demand-fetch; during t1 a dirty chunk is pushed once no write has touched it
                     for ``writeback_delay`` seconds (vulpes flushes dirty chunks and trickles them to the
                     server; the delay stands for both), so t2 only carries the memory image and the chunks
                     written in the last ``writeback_delay`` seconds of the session

The working set is what isrctl/workingset.py records: every chunk the trace touches, in first-touch order,
less those that hold no data.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .cache import ChunkCache, ChunkKey, SizeResult
from .errors import ModelError
from .trace import WRITE, Trace

POLICIES = ("baseline", "proactive", "demand", "eager-ws", "lazy-ws", "eager-writeback")


@dataclass(frozen=True)
class PolicyParams:
    """The environment a prediction is made for (see the module docstring for what each means)."""

    bandwidth: float            # bytes per second
    rtt: float                  # seconds
    disk_size: int              # bytes
    memory_size: int = 256 << 20
    chunk_size: int = 128 << 10
    launch: float = 1.0
    write_policy: str = "whole-no-fetch"
    think_gap: float = 0.5
    compute_scale: float = 1.0
    travel: float | None = None
    site2_synced: bool = True
    writeback_delay: float = 10.0
    #: Skip fetching chunks that held no data (trace metadata data_ranges), as ISR does.
    zero_chunks: bool = True

    def __post_init__(self) -> None:
        if self.bandwidth <= 0:
            raise ModelError("bandwidth must be more than 0 bytes/s")
        for name in ("rtt", "launch", "think_gap", "writeback_delay"):
            if getattr(self, name) < 0:
                raise ModelError(f"{name} must be >= 0")
        if self.compute_scale <= 0:
            raise ModelError("compute scale must be more than 0")
        if self.disk_size <= 0 or self.memory_size < 0:
            raise ModelError("disk size must be more than 0 and memory size >= 0")
        if self.chunk_size <= 0:
            raise ModelError("chunk size must be more than 0")
        if self.travel is not None and self.travel < 0:
            raise ModelError("travel time must be >= 0")

    def transfer(self, nbytes: float) -> float:
        """Seconds for one bulk transfer of ``nbytes`` (0 bytes cost nothing)."""
        return self.rtt + nbytes / self.bandwidth if nbytes > 0 else 0.0


@dataclass
class Prediction:
    """What one policy costs for one trace."""

    policy: str
    #: t4: from "resume" to the user being able to work.
    resume_latency: float
    #: T_local and T_policy: the session's running time with all state local, and under this policy.
    local_runtime: float
    runtime: float
    #: Time spent waiting for demand fetches during t5.
    stall: float
    slowdown: float
    slowdown_no_think: float
    demand_fetches: int
    demand_bytes: int
    #: Bytes moved to site2 before resume (t3) and during resume (t4), and in the background during t5.
    prefetch_bytes: int
    resume_bytes: int
    background_bytes: int
    #: t2: seconds after suspend until the server has site1's state; and the t3 this policy wants.
    t2: float
    t3: float
    #: The least travel time (t2 + t3) for which the resume latency above holds.
    min_travel: float
    upload_bytes_t2: int
    #: Bytes pushed during t1 by eager writeback (0 for the other policies).
    upload_bytes_t1: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Timing:
    """The trace's gaps split into think time and (scaled) compute time."""

    gaps: list[float]
    local_runtime: float
    compute: float


def timing(trace: Trace, params: PolicyParams) -> _Timing:
    """Each access's preceding gap, with compute gaps scaled; the totals T_local and compute time."""
    gaps: list[float] = []
    previous = 0.0
    compute = 0.0
    total = 0.0
    for access in trace.accesses:
        gap = max(access.time - previous, 0.0)
        previous = access.time
        if gap < params.think_gap:
            gap *= params.compute_scale
            compute += gap
        gaps.append(gap)
        total += gap
    return _Timing(gaps, total, compute)


def _cache(trace: Trace, params: PolicyParams) -> ChunkCache:
    return ChunkCache(params.chunk_size, write_policy=params.write_policy, image_sizes=trace.image_sizes(),
                      data_ranges=trace.data_ranges() if params.zero_chunks else None, trace_name=trace.name)


def stored_disk_bytes(trace: Trace, chunk_size: int) -> int | None:
    """Bytes of disk image the server holds after the session: every chunk with data at the start (metadata
    data_ranges) or written by the trace, whole. None if the trace does not say where its data is."""
    ranges = trace.data_ranges()
    if ranges is None:
        return None
    keys: set[ChunkKey] = set()
    for image, spans in ranges.items():
        for start, end in spans:
            keys.update((image, i) for i in range(start // chunk_size, (end - 1) // chunk_size + 1))
    for access in trace.writes():
        keys.update((access.image, i) for i in range(access.offset // chunk_size, (access.end - 1) // chunk_size + 1))
    sizes = trace.image_sizes()
    total = 0
    for image, index in keys:
        limit = sizes.get(image)
        start = index * chunk_size
        total += chunk_size if limit is None or start + chunk_size <= limit else max(limit - start, 1)
    return total


def working_set_order(trace: Trace, params: PolicyParams) -> list[ChunkKey]:
    """The chunks ``trace`` touches, in first-touch order, as isrctl/workingset.py records a working set;
    chunks that hold no data are left out (the server has nothing to send for them)."""
    cache = _cache(trace, params)
    size = params.chunk_size
    seen: set[ChunkKey] = set()
    order: list[ChunkKey] = []
    for access in trace.accesses:
        for index in range(access.offset // size, (access.end - 1) // size + 1):
            key = (access.image, index)
            if key not in seen:
                seen.add(key)
                if not cache.is_zero(key):
                    order.append(key)
    return order


def dirty_state(trace: Trace, params: PolicyParams) -> tuple[int, int, int]:
    """(bytes dirty at suspend, bytes eager writeback still owes at suspend, bytes it pushed during t1).

    Whole chunks. Eager writeback pushes a dirty chunk once ``writeback_delay`` seconds pass with no write
    to it; a chunk written again after a push is pushed again.
    """
    size = params.chunk_size
    sizes = trace.image_sizes()
    end = trace.accesses[-1].time if trace.accesses else 0.0
    writes: dict[ChunkKey, list[float]] = {}
    for access in trace.accesses:
        if access.op == WRITE:
            for index in range(access.offset // size, (access.end - 1) // size + 1):
                writes.setdefault((access.image, index), []).append(access.time)
    dirty = residual = pushed = 0
    for (image, index), times in writes.items():
        limit = sizes.get(image)
        start = index * size
        length = size if limit is None or start + size <= limit else max(limit - start, 1)
        dirty += length
        # Pushed each time the chunk then stays quiet for the delay; still owed if written near the end.
        quiet = sum(1 for a, b in zip(times, times[1:]) if b - a >= params.writeback_delay)
        pushed += quiet * length
        if end - times[-1] >= params.writeback_delay:
            pushed += length
        else:
            residual += length
    return dirty, residual, pushed


def _replay(trace: Trace, params: PolicyParams, gaps: Sequence[float], *, prefetched: Sequence[ChunkKey] = (),
            background: Sequence[ChunkKey] = ()) -> tuple[float, SizeResult, int]:
    """Replay the trace through a cold cache: returns (stall seconds, cache totals, background bytes).

    ``prefetched`` chunks are in the cache at resume; ``background`` chunks stream in, in order, whenever
    the link is not busy with a demand fetch, starting one rtt after resume.
    """
    cache = _cache(trace, params)
    for key in prefetched:
        cache.install(key)
    clock = 0.0
    stall = 0.0
    next_bg = 0
    bg_sent = 0
    for access, gap in zip(trace.accesses, gaps):
        clock += gap
        if next_bg < len(background):
            # Bytes the background stream could have moved by now: the link's idle time since it started.
            budget = params.bandwidth * max(clock - params.rtt - stall, 0.0)
            while next_bg < len(background):
                key = background[next_bg]
                if key in cache or cache.is_zero(key):
                    next_bg += 1
                    continue
                length = cache.chunk_length(key)
                if bg_sent + length > budget:
                    break
                cache.install(key)
                bg_sent += length
                next_bg += 1
        for fetch in cache.touch(access):
            wait = params.rtt + fetch.length / params.bandwidth
            clock += wait
            stall += wait
    return stall, cache.result(), bg_sent


def predict(trace: Trace, params: PolicyParams, *, working_set: Trace | None = None,
            policies: Sequence[str] = POLICIES) -> list[Prediction]:
    """Resume latency and slowdown of each policy in ``policies`` for ``trace`` under ``params``."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ModelError(f"unknown policy {unknown[0]!r}: choose from {', '.join(POLICIES)}")
    if not trace.accesses:
        raise ModelError(f"trace {trace.name} holds no accesses")
    t = timing(trace, params)
    ws_order = working_set_order(working_set or trace, params)
    ws_cache = _cache(working_set or trace, params)
    ws_bytes = sum(ws_cache.chunk_length(key) for key in ws_order)
    dirty, residual, pushed = dirty_state(trace, params)
    memory = params.memory_size
    state = params.disk_size + memory
    t2_plain = params.transfer(dirty + memory)
    t2_eager = params.transfer(residual + memory)
    launch = params.launch

    def late(needed: float) -> float:
        """What of the work due before resume is not done when the user arrives."""
        return 0.0 if params.travel is None else max(needed - params.travel, 0.0)

    def make(policy: str, *, t4: float, t2: float, t3: float, stall: float, fetched: SizeResult | None,
             prefetch: int, resume: int, background: int, uploaded_t2: int, uploaded_t1: int = 0) -> Prediction:
        return Prediction(
            policy=policy, resume_latency=t4 + late(t2 + t3), local_runtime=t.local_runtime,
            runtime=t.local_runtime + stall, stall=stall,
            slowdown=stall / t.local_runtime if t.local_runtime else 0.0,
            slowdown_no_think=stall / t.compute if t.compute else 0.0,
            demand_fetches=fetched.misses if fetched else 0, demand_bytes=fetched.bytes_fetched if fetched else 0,
            prefetch_bytes=prefetch, resume_bytes=resume, background_bytes=background, t2=t2, t3=t3,
            min_travel=t2 + t3, upload_bytes_t2=uploaded_t2, upload_bytes_t1=uploaded_t1)

    results: list[Prediction] = []
    demand: tuple[float, SizeResult, int] | None = None
    for policy in policies:
        if policy == "baseline":
            results.append(make(policy, t4=params.transfer(state) + launch, t2=t2_plain, t3=0.0, stall=0.0,
                                fetched=None, prefetch=0, resume=state, background=0, uploaded_t2=dirty + memory))
        elif policy == "proactive":
            moved = dirty + memory if params.site2_synced else state
            results.append(make(policy, t4=launch, t2=t2_plain, t3=params.transfer(moved), stall=0.0,
                                fetched=None, prefetch=moved, resume=0, background=0, uploaded_t2=dirty + memory))
        elif policy in ("demand", "eager-writeback"):
            demand = demand or _replay(trace, params, t.gaps)
            stall, fetched, _ = demand
            eager = policy == "eager-writeback"
            results.append(make(policy, t4=params.transfer(memory) + launch, t2=t2_eager if eager else t2_plain,
                                t3=0.0, stall=stall, fetched=fetched, prefetch=0, resume=memory, background=0,
                                uploaded_t2=(residual if eager else dirty) + memory,
                                uploaded_t1=pushed if eager else 0))
        elif policy == "eager-ws":
            stall, fetched, _ = _replay(trace, params, t.gaps, prefetched=ws_order)
            results.append(make(policy, t4=launch, t2=t2_plain, t3=params.transfer(ws_bytes + memory), stall=stall,
                                fetched=fetched, prefetch=ws_bytes + memory, resume=0, background=0,
                                uploaded_t2=dirty + memory))
        else:  # lazy-working-set
            stall, fetched, bg = _replay(trace, params, t.gaps, background=ws_order)
            results.append(make(policy, t4=params.transfer(memory) + launch, t2=t2_plain, t3=0.0, stall=stall,
                                fetched=fetched, prefetch=0, resume=memory, background=bg,
                                uploaded_t2=dirty + memory))
    return results


def with_defaults(trace: Trace, **fields: Any) -> PolicyParams:
    """`PolicyParams` for ``trace``; unless given, the disk size is what the server stores of the image
    (`stored_disk_bytes`, when zero chunks are skipped and the trace says where its data is), else the
    trace's ``image_size``."""
    if fields.get("disk_size") is None:
        size = None
        if fields.get("zero_chunks", True):
            size = stored_disk_bytes(trace, fields.get("chunk_size", PolicyParams.chunk_size))
        size = size or trace.image_size
        if size is None:
            raise ModelError(f"trace {trace.name} does not say its image size: give the state size")
        fields["disk_size"] = size
    return PolicyParams(**fields)
