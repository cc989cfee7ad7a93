"""``python -m tools.chunksim``: chunk-size tables and figures, policy predictions, trace capture.

    python -m tools.chunksim sizes TRACE... [--png OUT] [--json] [--sizes 4K,...,1M]
                                   [--write-policy fetch|whole-no-fetch|both] [--zero-chunks | --isr]
                                   [--capacity SIZE]
    python -m tools.chunksim policy TRACE --bandwidth 10M --rtt 50ms [--state-size SIZE] [--memory-size SIZE]
                                   [--chunk-size 128K] [--launch 1s] [--travel T] [--working-set TRACE]
                                   [--write-policy P] [--all-chunks-stored] [--json] ...
    python -m tools.chunksim capture boot|office|rsd|testwork [-o OUT] [--variant big] [--think S]
                                   [--idle S] [--chunk-size 4K]

See doc/chunksim.md for the model and its assumptions.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cache import DEFAULT_SIZES, WRITE_POLICIES, SizeResult, sweep
from .errors import ChunksimError
from .policy import POLICIES, PolicyParams, Prediction, predict, stored_disk_bytes
from .trace import Trace, read_trace
from .units import format_bandwidth, format_size, parse_bandwidth, parse_duration, parse_size

PROG = "python -m tools.chunksim"
MB = 1 << 20


def _size_list(text: str) -> list[int]:
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise ChunksimError("--sizes needs at least one chunk size")
    return sorted(set(sizes))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="ISR's trace-driven chunk-size and policy simulator")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("sizes", help="demand-fetch each trace with chunk sizes 4K..1M: table, JSON, PNG")
    p.add_argument("traces", nargs="+", type=Path, metavar="TRACE")
    p.add_argument("--png", type=Path, help="draw the figure to this PNG file")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                   help="comma-separated chunk sizes (default 4K..1M in powers of two)")
    p.add_argument("--write-policy", choices=(*WRITE_POLICIES, "both"), default="fetch",
                   help="what a write to an absent chunk does (default: fetch)")
    p.add_argument("--capacity", help="LRU cache capacity (e.g. 64M); default infinite, as in the papers")
    p.add_argument("--zero-chunks", action="store_true",
                   help="fill chunks that held no data (the trace's data_ranges) locally instead of fetching "
                        "them, as ISR does; by default every chunk is stored, as in the papers' Coda")
    p.add_argument("--isr", action="store_true",
                   help="ISR's own behaviour: --write-policy whole-no-fetch --zero-chunks")

    p = sub.add_parser("policy", help="predict resume latency and slowdown of each policy for a trace")
    p.add_argument("trace", type=Path, metavar="TRACE")
    p.add_argument("--bandwidth", required=True, help="link rate, bits/s unless it says B (e.g. 100M, 10M, 1M)")
    p.add_argument("--rtt", required=True, help="round-trip time (e.g. 50ms)")
    p.add_argument("--state-size", help="total VM state, disk + memory image (default: the trace's image "
                                        "size + the memory size)")
    p.add_argument("--memory-size", default="256M", help="memory image moved at resume (default 256M)")
    p.add_argument("--chunk-size", default="128K", help="chunk size (default 128K)")
    p.add_argument("--launch", default="1s", help="time to start the VM once its state is local (default 1s)")
    p.add_argument("--travel", help="time between suspend and resume (t2 + t3); default: ample")
    p.add_argument("--working-set", type=Path, metavar="TRACE",
                   help="trace from which site1 estimates the working set (default: the trace itself)")
    p.add_argument("--write-policy", choices=WRITE_POLICIES, default="whole-no-fetch")
    p.add_argument("--think-gap", default="0.5s", help="gaps at least this long are think time (default 0.5s)")
    p.add_argument("--compute-scale", type=float, default=1.0,
                   help="multiply compute gaps by this (below 1: a faster machine than the capture's)")
    p.add_argument("--writeback-delay", default="10s",
                   help="eager writeback pushes a chunk after this long without writes (default 10s)")
    p.add_argument("--cold-site2", action="store_true",
                   help="site2 has nothing cached: fully proactive must move the whole state in t3")
    p.add_argument("--all-chunks-stored", action="store_true",
                   help="every chunk costs a fetch, even one that held no data (see sizes)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of the policies")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    from .capture import BOOT_CHUNK_SIZE, DEFAULT_IDLE, WORKLOADS
    p = sub.add_parser("capture", help="record a block trace of a workload in the real test guest (QEMU)")
    p.add_argument("workload", choices=WORKLOADS)
    p.add_argument("-o", "--output", type=Path, help="trace file (default tools/chunksim/traces/WORKLOAD.csv.zst)")
    p.add_argument("--variant", default="big", help="test guest variant (default big)")
    p.add_argument("--think", type=float, help="think time in seconds (default: office 1, rsd 2)")
    p.add_argument("--idle", type=float, default=DEFAULT_IDLE, help="boot: seconds to idle after ready")
    p.add_argument("--chunk-size", default=format_size(BOOT_CHUNK_SIZE),
                   help="boot: chunk size of the parcel vulpes serves, the trace's granularity (default 4K)")
    p.add_argument("--keep", type=Path, metavar="DIR", help="keep the disk, QEMU's log and the console here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="chunksim: %(message)s", stream=sys.stderr)
    logging.getLogger("qemu.qmp").setLevel(logging.WARNING)
    try:
        if args.command == "sizes":
            return _sizes(args)
        if args.command == "policy":
            return _policy(args)
        return _capture(args)
    except ChunksimError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


# --- sizes ---------------------------------------------------------------------------------------------

def _sizes(args: argparse.Namespace) -> int:
    sizes = _size_list(args.sizes)
    capacity = parse_size(args.capacity) if args.capacity else None
    if args.isr:
        args.write_policy, args.zero_chunks = "whole-no-fetch", True
    write_policies = WRITE_POLICIES if args.write_policy == "both" else (args.write_policy,)
    traces = [read_trace(path) for path in args.traces]
    names = _unique_names(traces)
    report: dict[str, Any] = {}
    figure: dict[str, list[SizeResult]] = {}
    for trace, name in zip(traces, names):
        entry: dict[str, Any] = {"metadata": trace.metadata, "format": trace.format,
                                 "granularity": trace.granularity, "requests": len(trace.accesses),
                                 "duration_s": trace.duration, "results": {}}
        for write_policy in write_policies:
            rows = sweep(trace, sizes, write_policy=write_policy, capacity=capacity,
                         zero_chunks=args.zero_chunks)
            entry["results"][write_policy] = [r.to_json() for r in rows]
            label = name if len(write_policies) == 1 else f"{name} ({write_policy})"
            figure[label] = rows
            if not args.json:
                print(format_size_table(name, trace, rows, capacity))
                print()
        report[name] = entry
    if args.json:
        print(json.dumps({"traces": report}, indent=2))
    if args.png:
        from .plot import plot_sizes
        stored = "zero chunks not fetched" if args.zero_chunks else "every chunk stored"
        writes = f"write policy {args.write_policy}" if len(write_policies) == 1 else "both write policies"
        cache = f"LRU {format_size(capacity)}" if capacity else "infinite"
        plot_sizes(figure, args.png, title=f"demand fetch into a cold {cache} cache: {writes}, {stored}")
        print(f"figure: {args.png}", file=sys.stderr)
    return 0


def _unique_names(traces: list[Trace]) -> list[str]:
    names: list[str] = []
    for trace in traces:
        name = trace.name
        n = 2
        while name in names:
            name = f"{trace.name}#{n}"
            n += 1
        names.append(name)
    return names


def format_size_table(name: str, trace: Trace, rows: Sequence[SizeResult], capacity: int | None) -> str:
    """The chunk-size table of one trace as text."""
    first = rows[0] if rows else None
    head = (f"{name}: {len(trace.accesses)} requests over {trace.duration:.1f} s, "
            f"{(first.distinct_bytes_read if first else 0) / MB:.1f} MB distinct read, "
            f"{(first.distinct_bytes_written if first else 0) / MB:.1f} MB distinct written; "
            f"write policy {first.write_policy if first else '?'}, "
            f"{'LRU ' + format_size(capacity) if capacity else 'infinite'} cache, "
            f"{'zero chunks not fetched' if first and first.zero_aware else 'every chunk stored'}")
    lines = [head,
             f"{'chunk':>6} {'refs':>7} {'misses':>7} {'miss ratio':>10} {'MB fetched':>10} "
             f"{'MB never used':>13} {'dirty chunks':>12} {'MB upload':>9}"]
    for r in rows:
        note = "  (finer than the trace)" if r.below_trace_granularity else ""
        lines.append(f"{format_size(r.chunk_size):>6} {r.references:>7} {r.misses:>7} {r.miss_ratio:>10.3f} "
                     f"{r.bytes_fetched / MB:>10.2f} {r.bytes_never_used / MB:>13.2f} {r.dirty_chunks:>12} "
                     f"{r.upload_bytes / MB:>9.2f}{note}")
    return "\n".join(lines)


# --- policy --------------------------------------------------------------------------------------------

def _policy(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace)
    working_set = read_trace(args.working_set) if args.working_set else None
    memory = parse_size(args.memory_size)
    chunk_size = parse_size(args.chunk_size)
    disk: int | None
    if args.state_size:
        state = parse_size(args.state_size)
        if state <= memory:
            raise ChunksimError(f"--state-size {args.state_size} must be more than --memory-size {args.memory_size}")
        disk = state - memory
    else:
        disk = stored_disk_bytes(trace, chunk_size) if not args.all_chunks_stored else None
        disk = disk or trace.image_size
        if disk is None:
            raise ChunksimError(f"{args.trace} does not say its image size: give --state-size")
    params = PolicyParams(
        bandwidth=parse_bandwidth(args.bandwidth), rtt=parse_duration(args.rtt), disk_size=disk,
        memory_size=memory, chunk_size=chunk_size, launch=parse_duration(args.launch),
        write_policy=args.write_policy, think_gap=parse_duration(args.think_gap),
        compute_scale=args.compute_scale, travel=parse_duration(args.travel) if args.travel else None,
        site2_synced=not args.cold_site2, writeback_delay=parse_duration(args.writeback_delay),
        zero_chunks=not args.all_chunks_stored)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    predictions = predict(trace, params, working_set=working_set, policies=policies)
    if args.json:
        print(json.dumps({"trace": trace.name, "metadata": trace.metadata,
                          "params": {**params.__dict__},
                          "predictions": [p.to_json() for p in predictions]}, indent=2))
    else:
        print(format_policy_table(trace, params, predictions))
    return 0


def format_policy_table(trace: Trace, params: PolicyParams, predictions: Sequence[Prediction]) -> str:
    """The policy predictions as text."""
    travel = "ample" if params.travel is None else f"{params.travel:g} s"
    lines = [f"{trace.name}: {format_bandwidth(params.bandwidth)}, RTT {params.rtt * 1000:g} ms, "
             f"disk {params.disk_size / MB:.0f} MB + memory {params.memory_size / MB:.0f} MB, "
             f"{format_size(params.chunk_size)} chunks, launch {params.launch:g} s, travel {travel}",
             f"T_local {predictions[0].local_runtime:.1f} s (think gaps >= {params.think_gap:g} s, "
             f"compute x{params.compute_scale:g})",
             f"{'policy':<18} {'resume s':>9} {'runtime s':>9} {'slowdown':>9} {'no-think':>9} {'fetches':>7} "
             f"{'MB demand':>9} {'t2 s':>8} {'t3 s':>8}"]
    for p in predictions:
        lines.append(f"{p.policy:<18} {p.resume_latency:>9.1f} {p.runtime:>9.1f} {p.slowdown * 100:>8.1f}% "
                     f"{p.slowdown_no_think * 100:>8.1f}% {p.demand_fetches:>7} {p.demand_bytes / MB:>9.2f} "
                     f"{p.t2:>8.1f} {p.t3:>8.1f}")
    return "\n".join(lines)


# --- capture -------------------------------------------------------------------------------------------

def _capture(args: argparse.Namespace) -> int:
    from .capture import capture, command_line
    output = args.output or Path(__file__).resolve().parent / "traces" / f"{args.workload}.csv.zst"
    result = capture(args.workload, output, variant=args.variant, think=args.think, idle=args.idle,
                     run_dir=args.keep, command=command_line(), chunk_size=parse_size(args.chunk_size))
    print(f"{result.path}: {result.accesses} requests over {result.seconds:.1f} s ({result.guest_result})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
