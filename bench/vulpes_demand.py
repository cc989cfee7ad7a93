#!/usr/bin/env python3
"""How long a demand read (a guest waiting) takes while a full hoard runs: vulpes before pacing against now.

    .venv/bin/python bench/vulpes_demand.py [--rates 1,10,100] [--rtt 20] [--reads N] [--old PATH] [--new PATH]

A real isr-server (2 workers, sqlite, directory store) runs in a network namespace behind a veth pair shaped
with tbf on both ends (vulpes_common); a toxiproxy proxy on the host's loopback forwards to it and adds
`--rtt` ms of round-trip time (half each way, as bench/matrix.py does), and vulpes reaches the server only
through the proxy. One parcel of incompressible 128 KiB chunks (disk image only; the memory image is zero,
so both binaries hoard the disk in index order) is sized for the slowest hoard the run needs.

Per rate, the link's bulk TCP goodput is measured (no proxy), then per binary (old: the commit before
pacing, up to 12 hoard transfers at once; new: pace.c): vulpes starts with an empty cache, a full hoard
starts (`{"op":"hoard"}`), `--warmup` seconds later the reads begin: one at a time, 4 KiB with O_DIRECT
at the start of the disk's chunks from the last one backwards (chunks the hoard has not reached, so each is
a miss that becomes a demand GET), each timed from the host around the pread. Between reads the status is
sampled (hoard progress, `hoard_limit`, `rtt_min_us`, `rate`); the hoard's throughput while the reads ran
is its `bytes_fetched` over that time. The target is the issue's: 1 RTT + 2 mean object transmission times
at the measured goodput. Needs root (namespaces, tc, FUSE) and toxiproxy-server (./bootstrap bench).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import mmap
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from vulpes_common import (REPO, link_bandwidth, machine, netns, shape, start_server, table, today, update_section,
                           use_namespace)

from tests.toxiproxy_fixtures import Toxiproxy, ToxiproxyError  # noqa: E402
from tests.vulpes_fixtures import CHUNK_SIZE, ParcelState, Vulpes, make_state  # noqa: E402

MIB = 1 << 20
READ_SIZE = 4096
OLD_DEFAULT = Path("/var/tmp/vb-old/vulpes/vulpes")
OLD_HOARD_TRANSFERS = 12        # before pacing: max_transfers (16) - 4 hoard transfers on any link
HOARD_WINDOW = 64               # vulpes's default --hoard-window: hoard requests queued ahead of the worker
SECTION = "vulpes: demand reads during a hoard"
# Not vulpes_common's default namespace: another benchmark started meanwhile would delete it under this one.
NAMESPACE = ("isrdemand", "isrd0", "isrd1", "10.232.0")


@dataclass
class Run:
    """One binary at one rate: every read's latency and what vulpes reported meanwhile."""

    binary: str
    rate: float
    reads_ms: list[float] = field(default_factory=list)
    hoard_mbit: float = 0.0
    hoard_bytes: int = 0
    link_mbit: float = 0.0
    seconds: float = 0.0
    hoard_limits: list[int] = field(default_factory=list)
    rtt_min_us: int | None = None
    pacer_rate: int | None = None
    demand_histogram: list[dict[str, Any]] | None = None
    hoard_chunks_at_end: int = 0
    stopped_early: str = ""
    load: tuple[float, float] = (0.0, 0.0)


def default_reads(rate: float) -> int:
    """20 at 1 Mbit/s, 40 at 10, 100 at 100."""
    return max(20, min(100, int(round(20 * max(rate, 1.0) ** 0.35 / 10)) * 10))


def object_seconds(object_bytes: float, mbit: float) -> float:
    return object_bytes * 8 / (mbit * 1e6)


def parcel_bytes(rates: list[float], reads: dict[float, int], rtt_ms: float, warmup: float, gap: float,
                 cap_mib: int) -> int:
    """Disk size so that, at every rate, the hoard has not reached the chunks read last when the reads end:
    at least 20 s of hoard, and the old binary's reads at about 13 objects' transmission time each (plus the
    pause before each), with 30 %
    to spare (capped at `cap_mib`; the reads stop early, and say so, if the hoard gets close)."""
    need = 0.0
    for rate in rates:
        per_read = rtt_ms / 1e3 + (OLD_HOARD_TRANSFERS + 1 + gap / 2) * object_seconds(CHUNK_SIZE, rate)
        seconds = max(20.0, warmup + reads[rate] * per_read * 1.3)
        need = max(need, rate * 1e6 / 8 * seconds + (reads[rate] + HOARD_WINDOW + 16) * CHUNK_SIZE)
    return min(cap_mib * MIB, math.ceil(need / CHUNK_SIZE) * CHUNK_SIZE)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def histogram_median_ms(buckets: list[dict[str, Any]] | None) -> str:
    """The upper bound of the bucket holding the median of vulpes's demand latency histogram."""
    if not buckets:
        return "–"
    total = sum(int(b["count"]) for b in buckets)
    if total == 0:
        return "–"
    seen = 0
    for b in buckets:
        seen += int(b["count"])
        if seen * 2 >= total:
            return f"≤ {b['le'] / 1000:g}" if b["le"] is not None else f"> {buckets[-2]['le'] / 1000:g}"
    return "–"


def timed_read(v: Vulpes, fd: int, buf: mmap.mmap, offset: int, limit: float) -> float:
    """One read, timed; after `limit` seconds vulpes is killed (the read would wait forever on a lost link)."""
    watchdog = threading.Timer(limit, v.kill)
    watchdog.start()
    start = time.monotonic()
    try:
        got = os.preadv(fd, [buf], offset)
    except OSError as e:
        raise SystemExit(f"the read at offset {offset} failed after {time.monotonic() - start:.0f} s ({e}); "
                         f"vulpes log: {v.log_path}") from None
    finally:
        watchdog.cancel()
    elapsed = time.monotonic() - start
    if got != READ_SIZE:
        raise SystemExit(f"short read at offset {offset}: {got} bytes")
    return elapsed


def measure(label: str, binary: Path, rate: float, work: Path, state: ParcelState, url: str, server: Any,
            n_reads: int, warmup: float, max_gap: float) -> Run:
    """One vulpes, one hoard, `n_reads` timed reads, each after a pause drawn from 0..`max_gap` seconds (the
    same draws for every binary)."""
    run = Run(label, rate, load=(os.getloadavg()[0], 0.0))
    gaps = random.Random(f"{rate}").uniform
    cache = work / f"cache-{rate:g}-{label}"
    shutil.rmtree(cache, ignore_errors=True)
    chunks = len(state.images["disk"]) // CHUNK_SIZE
    try:
        with Vulpes(binary, work / "mnt", state, cache, server=url, token_file=server.token_file, pin=server.pin,
                    log_path=work / f"vulpes-{rate:g}-{label}.log") as v:
            response = v.control({"op": "hoard"})
            if not response.get("ok"):
                raise SystemExit(f"{label}: the hoard did not start: {response}")
            time.sleep(warmup)
            fd = os.open(v.path("disk"), os.O_RDONLY | os.O_DIRECT)
            buf = mmap.mmap(-1, READ_SIZE)
            try:
                first = v.status()
                t0 = time.monotonic()
                status = first
                for i in range(n_reads):
                    index = chunks - 1 - i
                    hoard = status["hoard"]
                    if hoard.get("state") != "running":
                        run.stopped_early = f"the hoard was {hoard.get('state')} after {i} reads"
                        break
                    if int(hoard["chunks_done"]) + HOARD_WINDOW + 16 >= index:
                        run.stopped_early = f"the hoard came within {HOARD_WINDOW + 16} chunks of the reads after {i}"
                        break
                    time.sleep(gaps(0.0, max_gap))
                    limit = 60 + 30 * object_seconds(CHUNK_SIZE, rate)
                    run.reads_ms.append(timed_read(v, fd, buf, index * CHUNK_SIZE, limit) * 1e3)
                    status = v.status()
                    if "hoard_limit" in status["fetch"]:
                        run.hoard_limits.append(int(status["fetch"]["hoard_limit"]))
                run.seconds = time.monotonic() - t0
            finally:
                os.close(fd)
                buf.close()
            last = v.status()
            run.hoard_bytes = int(last["hoard"]["bytes_fetched"]) - int(first["hoard"]["bytes_fetched"])
            run.hoard_mbit = run.hoard_bytes * 8 / run.seconds / 1e6 if run.seconds > 0 else 0.0
            run.hoard_chunks_at_end = int(last["hoard"]["chunks_done"])
            fetched = int(last["fetch"]["bytes"]) - int(first["fetch"]["bytes"])
            run.link_mbit = fetched * 8 / run.seconds / 1e6 if run.seconds > 0 else 0.0
            fetch = last["fetch"]
            run.rtt_min_us = fetch.get("rtt_min_us")
            run.pacer_rate = fetch.get("rate")
            run.demand_histogram = fetch.get("demand_latency_us")
            v.control({"op": "hoard-stop"})
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    run.load = (run.load[0], os.getloadavg()[0])
    return run


def summary_row(run: Run, goodput: float, target_ms: float) -> list[str]:
    if not run.reads_ms:
        return [run.binary, "0"] + ["–"] * 11
    limits = (f"{min(run.hoard_limits)}–{max(run.hoard_limits)}" if run.hoard_limits and
              min(run.hoard_limits) != max(run.hoard_limits) else
              str(run.hoard_limits[0]) if run.hoard_limits else f"({OLD_HOARD_TRANSFERS}, fixed)")
    within = sum(1 for r in run.reads_ms if r <= target_ms)
    return [run.binary, str(len(run.reads_ms)) + ("*" if run.stopped_early else ""),
            f"{statistics.median(run.reads_ms):.0f}", f"{percentile(run.reads_ms, 90):.0f}",
            f"{max(run.reads_ms):.0f}", f"{target_ms:.0f}", f"{within}/{len(run.reads_ms)}",
            histogram_median_ms(run.demand_histogram),
            f"{run.hoard_mbit:.2f} ({run.hoard_mbit / goodput:.2f})", f"{run.link_mbit / goodput:.2f}", limits,
            f"{run.rtt_min_us / 1000:.1f}" if run.rtt_min_us else "–",
            f"{run.pacer_rate * 8 / 1e6:.2f}" if run.pacer_rate else "–",
            ]


HEADER = ["binary", "reads", "median (ms)", "p90 (ms)", "max (ms)", "target (ms)", "reads ≤ target",
          "vulpes demand histogram: median bucket (ms)", "hoard during the reads: Mbit/s (÷ goodput)",
          "hoard + demand ÷ goodput",
          "hoard_limit seen", "rtt_min (ms)", "pacer rate (Mbit/s)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="1,10,100", help="link rates in Mbit/s (tbf, both directions)")
    parser.add_argument("--rtt", type=float, default=20.0, help="round-trip time toxiproxy adds, in ms")
    parser.add_argument("--reads", type=int, default=0,
                        help="demand reads per binary and rate (default: 20 at 1 Mbit/s, 40 at 10, 100 at 100)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of hoard before the first read")
    parser.add_argument("--gap", type=float, default=2.0,
                        help="pause before each read: random, up to this many object transmission times "
                             "(0: back to back)")
    parser.add_argument("--max-mib", type=int, default=320, help="cap on the parcel's disk image, MiB")
    parser.add_argument("--old", type=Path, default=OLD_DEFAULT, help="vulpes from the commit before pacing")
    parser.add_argument("--new", type=Path, default=REPO / "build" / "vulpes" / "vulpes", help="vulpes to compare")
    parser.add_argument("--json", type=Path, help="write every read's latency and the status samples here")
    parser.add_argument("--no-update", action="store_true", help="print the section, leave BENCHMARKS.md alone")
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", "bench/vulpes_demand.py", *sys.argv[1:]])
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        raise SystemExit(f"--rates: not a list of numbers: {args.rates!r}") from None
    if not args.new.exists():
        raise SystemExit(f"the new vulpes {args.new} does not exist: build it (ninja -C build)")
    binaries: list[tuple[str, Path]] = []
    if args.old.exists():
        binaries.append(("old", args.old))
    else:
        print(f"the old vulpes {args.old} does not exist: measuring the new one only", flush=True)
    binaries.append(("new", args.new))
    if shutil.which("toxiproxy-server") is None and "TOXIPROXY_SERVER" not in os.environ:
        raise SystemExit("toxiproxy-server not found: run ./bootstrap bench to build it")
    use_namespace(*NAMESPACE)
    if NAMESPACE[0] in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split():
        raise SystemExit(f"network namespace {NAMESPACE[0]} exists: another vulpes_demand.py is running (or left it)")
    reads = {rate: args.reads or default_reads(rate) for rate in rates}
    size = parcel_bytes(rates, reads, args.rtt, args.warmup, args.gap, args.max_mib)
    results: dict[float, dict[str, Any]] = {}
    started = time.monotonic()

    with tempfile.TemporaryDirectory(prefix="vulpes-demand-", dir="/var/tmp") as tmp, netns(), \
            Toxiproxy.start() as toxi:
        work = Path(tmp)
        print(f"encoding a {size // MIB} MiB parcel of incompressible chunks ...", flush=True)
        state = make_state(work / "state", os.urandom(size), 1 * MIB)
        object_mean = statistics.fmean(len(o) for o in state.objects.values())
        server = start_server(work)
        state.publish(server.store)
        upstream = urlsplit(server.url)
        proxy = toxi.proxy("vulpes-demand", listen=("127.0.0.1", 0),
                           upstream=(upstream.hostname or "", upstream.port or 443))
        try:
            proxy.set_rtt(args.rtt)
            url = f"https://127.0.0.1:{proxy.listen[1]}"
            for rate in rates:
                shape(rate)
                goodput = link_bandwidth()
                target_ms = args.rtt + 2 * object_seconds(object_mean, goodput) * 1e3
                print(f"{rate:g} Mbit/s: goodput {goodput:.2f} Mbit/s, target {target_ms:.0f} ms, "
                      f"{reads[rate]} reads per binary", flush=True)
                runs = []
                for label, binary in binaries:
                    run = measure(label, binary, rate, work, state, url, server, reads[rate], args.warmup,
                                  args.gap * object_seconds(object_mean, goodput))
                    runs.append(run)
                    print(f"  {label}: " + " ".join(f"{r:.0f}" for r in run.reads_ms) + " ms"
                          + (f" ({run.stopped_early})" if run.stopped_early else ""), flush=True)
                    print("  " + ", ".join(f"{h}: {c}" for h, c in zip(HEADER, summary_row(run, goodput, target_ms))),
                          flush=True)
                results[rate] = {"goodput": goodput, "target_ms": target_ms, "runs": runs}
        except ToxiproxyError as e:
            raise SystemExit(str(e)) from None
        finally:
            with contextlib.suppress(Exception):
                proxy.remove()
            shape(None)
            server.stop()

    minutes = (time.monotonic() - started) / 60
    if args.json:
        args.json.write_text(json.dumps({"command": command, "date": today(), "machine": machine(),
                                         "object_mean": object_mean, "parcel_bytes": size,
                                         "rates": {str(k): {**v, "runs": [asdict(r) for r in v["runs"]]}
                                                   for k, v in results.items()}}, indent=1))
    tables = []
    for rate, res in results.items():
        rows = [summary_row(run, res["goodput"], res["target_ms"]) for run in res["runs"]]
        loads = ", ".join(f"{run.binary} {run.load[0]:.1f}→{run.load[1]:.1f}" for run in res["runs"])
        early = "".join(f" *{run.binary}: {run.stopped_early}." for run in res["runs"] if run.stopped_early)
        tables.append(f"**{rate:g} Mbit/s** (tbf), RTT +{args.rtt:g} ms; link goodput {res['goodput']:.2f} Mbit/s; "
                      f"target {res['target_ms']:.0f} ms = {args.rtt:g} ms + 2 × {object_mean / 1000:.1f} kB at the "
                      f"goodput; load average at start→end: {loads}.{early}\n\n" + table(HEADER, rows))
    gap_text = ("Each read follows the previous one at once (`--gap 0`): a read then starts just as the hoard "
                "transfers started during the previous read have been queued whole at the server, the worst phase."
                if args.gap == 0 else
                f"Before each read a random pause of 0 to {args.gap:g} object transmission times (the same draws "
                f"for both binaries), so the reads arrive at random moments of the hoard's transfers rather than "
                f"just after the previous demand response (back to back is the worst phase: `--gap 0`).")
    old_note = ("" if any(label == "old" for label, _ in binaries) else
                f"\n\nThe old binary ({args.old}) was missing: only the new one was measured.")
    body = f"""Demand reads while a full hoard runs, measured by `bench/vulpes_demand.py`: the old vulpes (built from
the commit before pacing, `{args.old}`: up to {OLD_HOARD_TRANSFERS} hoard transfers in flight on any link) against the new
one (`pace.c`: hoard transfers bounded to about one bandwidth-delay product, at least 2), same run, same link.
A real isr-server (2 workers, directory store) in a network namespace behind a veth pair shaped with tbf on
both ends; a toxiproxy proxy on the host adds {args.rtt:g} ms of round-trip time to the data (in user space: there is
no netem, so TCP's own round trip stays short). vulpes (empty cache) reaches the server only through the
proxy, over one HTTP/2 connection. The parcel: {size // MIB} MiB of incompressible 128 KiB chunks in the disk image
(objects {object_mean / 1000:.1f} kB on average), nothing in the memory image, so both binaries hoard the disk
in index order. Per rate and binary: `{{"op":"hoard"}}` (everything), {args.warmup:g} s later the reads start: one at a
time, 4 KiB with O_DIRECT at the start of a chunk, from the disk's last chunk backwards (chunks the hoard has
not reached, so every read is a miss and a demand GET), each timed on the host around the `pread`; the
status is read between reads. {gap_text} **Target** (the issue): 1 RTT + 2 mean object transmission times at the
measured goodput (one bulk TCP connection over the same link, no proxy). **Hoard** during the reads: the
hoard's `bytes_fetched` from the first read to the last over that time (chunk objects, no headers), and
as a fraction of the goodput. `hoard_limit`, `rtt_min`, `rate`: the pacer's state from the status (the old
binary has none of these, nor the demand-only histogram). The demand histogram's median bucket is vulpes's
own view (request to verified object), without FUSE and the kernel. One trial per cell; other agents' work
(QEMU tests, builds) shared the 2 cores at times: the load averages are given per cell.{old_note}

Machine: {machine()}. Date: {today()}. Command: `{command}` ({minutes:.0f} min).

""" + "\n\n".join(tables) + "\n"
    print()
    print(body)
    if not args.no_update:
        update_section(SECTION, body)
        print(f"wrote the section '{SECTION}' of BENCHMARKS.md")


if __name__ == "__main__":
    main()
