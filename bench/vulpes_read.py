#!/usr/bin/env python3
"""Warm-cache read throughput through vulpes next to the same image as a plain local file, in one run.

    .venv/bin/python bench/vulpes_read.py [--size-mib 512] [--random-reads 20000] [--trials 3]

The daemon is $ISR_BUILD_DIR/vulpes/vulpes (default build/vulpes/vulpes).

Builds an image (half random, half text-like chunks, no zero chunks), encodes it as a parcel with the
Python reference implementation, and puts every chunk object in the vulpes cache directory (a fully
hoarded parcel: "warm cache"). The plain file has the same bytes on the same file system. Each trial
drops the kernel's page cache first (echo 3 > drop_caches), so both sides read from disk:

- sequential: the whole image in 1 MiB reads;
- random: 4 KiB reads at random 4 KiB-aligned offsets (same offsets for both sides, POSIX_FADV_RANDOM);
- vulpes "RAM warm": the same again without remounting, so vulpes's plaintext RAM cache holds the chunks
  (the kernel page cache is still dropped).

vulpes runs without a server (cache only). Needs root (drop_caches, FUSE).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from vulpes_common import REPO, drop_page_cache, machine, table, today, update_section

from tests.vulpes_fixtures import Vulpes, make_state, random_image  # noqa: E402

MIB = 1 << 20


def sequential(path: Path) -> float:
    fd = os.open(path, os.O_RDONLY)
    total, start = 0, time.monotonic()
    try:
        while True:
            data = os.read(fd, MIB)
            if not data:
                break
            total += len(data)
    finally:
        os.close(fd)
    return total / MIB / (time.monotonic() - start)


def random_reads(path: Path, offsets: list[int]) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        start = time.monotonic()
        for offset in offsets:
            os.pread(fd, 4096, offset)
        return len(offsets) / (time.monotonic() - start)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--random-reads", type=int, default=20000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--no-update", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args()
    load = os.getloadavg()[0]  # before this run adds its own
    binary = Path(os.environ.get("ISR_BUILD_DIR", REPO / "build")) / "vulpes" / "vulpes"
    size = args.size_mib * MIB

    with tempfile.TemporaryDirectory(prefix="vulpes-read-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        print(f"building a {args.size_mib} MiB image and its parcel state ...", flush=True)
        content = random_image(size, seed=7, data_fraction=1.0)
        plain = work / "plain.img"
        plain.write_bytes(content)
        state = make_state(work / "state", content, 4 * MIB)
        state.publish(work / "cache")
        del content
        rng = random.Random(3)
        offsets = [rng.randrange(size // 4096) * 4096 for _ in range(args.random_reads)]
        kinds = ("plain", "vulpes cold", "vulpes page-cached", "vulpes RAM")
        results: dict[str, list[float]] = {f"{k} {w}": [] for w in ("seq", "rand") for k in kinds}
        extra = [f"--ram-cache={args.size_mib + 64}"]
        for trial in range(args.trials):
            for workload, measure in (("seq", sequential), ("rand", lambda p: random_reads(p, offsets))):
                drop_page_cache()
                results[f"plain {workload}"].append(measure(plain))
                with Vulpes(binary, work / "mnt", state, work / "cache", extra=extra) as v:
                    drop_page_cache()
                    results[f"vulpes cold {workload}"].append(measure(v.path("disk")))
                    drop_page_cache()
                    results[f"vulpes RAM {workload}"].append(measure(v.path("disk")))
                # A fresh daemon (empty RAM cache) whose cache files are in the kernel's page cache: what
                # verifying, decrypting and decompressing cost, without the disk.
                with Vulpes(binary, work / "mnt", state, work / "cache", extra=extra) as v:
                                    results[f"vulpes page-cached {workload}"].append(measure(v.path("disk")))
            print(f"trial {trial + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in results.items()), flush=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    rows = []
    for workload, label in (("seq", "sequential, 1 MiB reads (MiB/s)"), ("rand", "random 4 KiB reads (reads/s)")):
        plain_value = med[f"plain {workload}"]
        row = [label, f"{plain_value:.0f}"]
        for kind in kinds[1:]:
            value = med[f"{kind} {workload}"]
            row.append(f"{value:.0f} ({value / plain_value:.2f})")
        rows.append(row)
    header = ["workload", "plain file (disk)", "vulpes, cache files on disk", "vulpes, cache files in page cache",
              "vulpes, RAM cache"]
    out = table(header, rows)
    print(out)
    trials = "; ".join(f"{k}: {', '.join(f'{x:.0f}' for x in v)}" for k, v in results.items())
    body = f"""Warm-cache reads through vulpes next to the same bytes as a plain local file, measured in the same run by
`bench/vulpes_read.py`: a {args.size_mib} MiB image of 128 KiB chunks (half random, half text-like, none zero),
every chunk object already in the vulpes cache (a hoarded parcel), no server. The kernel page cache is
dropped before the plain file and the "cache files on disk" runs: there vulpes opens one cache file per
chunk (chunks/ab/cd/<tag>, cold directories and inodes included), verifies it (SHA-256), decrypts it
(AES-256-GCM) and decompresses it (zstd); on a sequential pattern its readahead workers do that for the
next 8 MiB in parallel (doc/vulpes.md, "Read path"). "Cache files in page cache" is a fresh vulpes (empty RAM cache)
right after; vulpes reads cache files with O_DIRECT where the file system allows it, so on this machine
they are not left in the page cache and this column is a second cold pass.
"RAM cache" is a second pass in the first mount with the page cache dropped: vulpes's plaintext RAM cache
holds every chunk, so it measures the FUSE path. Ratios to the plain file in parentheses. Random reads: {args.random_reads} 4 KiB reads at the same random aligned offsets for both sides.
Median of {args.trials} trials; load average {load:.2f} when the run started. The machine's virtual disk is
cached by the host, so single trials of the plain file swing widely (a trial that finds it in the host's
cache reads at 1–2 GB/s); compare within a trial (all trials are listed).

Machine: {machine()}. Date: {today()}. Command: `.venv/bin/python bench/vulpes_read.py --size-mib {args.size_mib}
--random-reads {args.random_reads} --trials {args.trials}`.

{out}

Trials: {trials}.
"""
    if not args.no_update:
        update_section("vulpes: warm-cache reads", body)


if __name__ == "__main__":
    main()
