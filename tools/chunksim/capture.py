"""Capture a block-access trace from the real test guest (`parcels.guest`) running one workload.

QEMU logs every block request the guest's virtio disk makes when started with the trace events
``blk_co_preadv`` and ``blk_co_pwritev`` enabled (log back end, ``-D FILE``, ``-msg timestamp=on``)::

    29594@1795324591.133880:blk_co_preadv blk 0x5592d9470f30 bs 0x5592d9471280 offset 1024 bytes 1024 flags 0x8

(pid @ wall-clock seconds : event, then the BlockBackend, the driver state, offset and byte count). Those are
the requests at QEMU's block layer: what an ISR client's vulpes would see at its disk image, before any
chunking. `parse_qemu_log` turns the lines inside a time window into `Access` records; `capture` boots the
guest with tracing on, runs one workload, and writes the window of that workload as a plain CSV trace
(zstd-compressed) with metadata lines saying how it was made. The metadata also says which bytes of the
image held data when the window opened (``data_ranges``: the pristine image's non-zero 4 KiB blocks plus
everything written before the window), because ISR never stores, so never fetches, an all-zero chunk.

Workloads (scripts on the guest's disk, ``parcels/guest/files/``):

``boot``    from the guest's first instruction to ready, then ``idle`` seconds of doing nothing
``office``  ``office.sh run THINK``: documents made by ``office.sh setup`` beforehand (outside the window),
            then the page cache is dropped so the session reads them from the disk, as it would after a
            reboot; 46 operations with THINK seconds between them
``rsd``     ``rsd.sh THINK``: unpack, configure, build, grep, touch and rebuild, checksum, delete, with THINK
            seconds between tasks; the page cache is dropped first
``testwork`` ``run.sh``, the test suite's workload (unpack, grep, checksum, copy, write, delete, then drop the
            page cache and read everything back to verify it): no think time, read-heavy at the end

This is a tool run by hand (and by benchmarks), not by the test suite: a capture of ``rsd`` on the big guest
takes a couple of minutes under TCG.
"""
from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .cache import Ranges
from .errors import CaptureError
from .trace import READ, WRITE, Access, Trace, format_ranges, write_trace

log = logging.getLogger(__name__)

WORKLOADS = ("boot", "office", "rsd", "testwork")
#: Scaled-down think times (seconds): CDA paused 10 s between operations, RSD 10 s between tasks.
DEFAULT_THINK = {"boot": 0.0, "office": 1.0, "rsd": 2.0, "testwork": 0.0}
DEFAULT_IDLE = 10.0
DESCRIPTIONS = {
    "boot": "boot the test guest to ready, then idle",
    "office": "office-like editing session (office.sh run): documents, spreadsheets, mail, web, autosaves",
    "rsd": "software developer (rsd.sh): unpack, configure, build, grep, touch+rebuild, checksum, delete",
    "testwork": "the test workload (run.sh): unpack, grep, checksum, copy, write, delete, drop caches, verify",
}
TRACE_EVENTS = ("blk_co_preadv", "blk_co_pwritev")

_LINE = re.compile(r"^\d+@(\d+\.\d+):blk_co_(preadv|pwritev) blk (0x[0-9a-f]+) bs 0x[0-9a-f]+ "
                   r"offset (\d+) bytes (\d+) flags 0x[0-9a-f]+\s*$")
_GUEST_RESULT = re.compile(r"ISR-(?:OFFICE|RSD|WORKLOAD) (ok|fail)[^\r\n]*")


@dataclass(frozen=True)
class CaptureResult:
    """What `capture` wrote."""

    path: Path
    accesses: int
    seconds: float
    guest_result: str


def trace_arguments(log_path: Path) -> tuple[str, ...]:
    """QEMU arguments that log every guest block request with a wall-clock timestamp to ``log_path``."""
    args: list[str] = []
    for event in TRACE_EVENTS:
        args += ["-trace", f"enable={event}"]
    return (*args, "-D", str(log_path), "-msg", "timestamp=on")


def read_qemu_log(lines: Iterable[str]) -> list[Access]:
    """Every block request in a QEMU trace log, with absolute (wall-clock) times, in log order.

    Lines that are not ``blk_co_preadv``/``blk_co_pwritev`` records are skipped.
    """
    records: list[Access] = []
    for line in lines:
        match = _LINE.match(line)
        if match is None:
            continue
        length = int(match.group(5))
        if length > 0:
            op = READ if match.group(2) == "preadv" else WRITE
            records.append(Access(float(match.group(1)), int(match.group(4)), length, op))
    return records


def window(records: Iterable[Access], start: float, end: float) -> list[Access]:
    """The records between wall-clock times ``start`` and ``end``, times made relative to ``start`` and
    non-decreasing (log order is the order QEMU issued the requests)."""
    accesses: list[Access] = []
    last = 0.0
    for r in records:
        if start <= r.time <= end:
            last = max(last, r.time - start)
            accesses.append(Access(round(last, 6), r.offset, r.length, r.op))
    return accesses


def parse_qemu_log(lines: Iterable[str], start: float, end: float) -> list[Access]:
    """`window` of `read_qemu_log`: the block requests logged between ``start`` and ``end``."""
    return window(read_qemu_log(lines), start, end)


def scan_data_ranges(image: Path, block: int = 4096) -> list[tuple[int, int]]:
    """The byte ranges of a raw image that hold data: blocks of ``block`` bytes that are not all zero.

    Holes are skipped without reading (SEEK_DATA/SEEK_HOLE), so a sparse image costs only its data.
    """
    zero = bytes(1 << 20)
    ranges = Ranges()
    with open(image, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after pos
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            f.seek(start)
            offset = start
            while offset < end:
                data = f.read(min(len(zero), end - offset))
                if not data:
                    break
                if data != zero[:len(data)]:
                    for i in range(0, len(data), block):
                        piece = data[i:i + block]
                        if piece != zero[:len(piece)]:
                            ranges.add(offset + i, offset + i + len(piece))
                offset += len(data)
            pos = end
    return list(zip(ranges.starts, ranges.ends))


def data_ranges_at(pristine: list[tuple[int, int]], records: Iterable[Access], when: float) -> list[tuple[int, int]]:
    """The image's data at wall-clock time ``when``: the pristine data plus every write logged before then
    (a write is taken to store data, not zeros)."""
    ranges = Ranges()
    for start, end in pristine:
        ranges.add(start, end)
    for r in records:
        if r.op == WRITE and r.time < when:
            ranges.add(r.offset, r.end)
    return list(zip(ranges.starts, ranges.ends))


def _qemu_version() -> str:
    try:
        out = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.splitlines()[0].strip() if out.stdout else "unknown"


def capture(workload: str, dest: Path, *, variant: str = "big", think: float | None = None,
            idle: float = DEFAULT_IDLE, run_dir: Path | None = None, timeout: float = 1800.0,
            command: str | None = None) -> CaptureResult:
    """Boot the ``variant`` test guest with block tracing, run ``workload``, write its trace to ``dest``.

    Raises `CaptureError` if the workload is unknown or fails, or if the guest could not be run.
    """
    # Imported here: the simulator itself must not need the guest builder or QEMU.
    from isrctl.errors import IsrError
    from parcels.guest import GuestError, booted_guest, build, copy_disk

    if workload not in WORKLOADS:
        raise CaptureError(f"unknown workload {workload!r}: choose one of {', '.join(WORKLOADS)}")
    think = DEFAULT_THINK[workload] if think is None else think
    if think < 0 or idle < 0:
        raise CaptureError("think and idle times must be >= 0 seconds")
    try:
        artifacts = build(variant)
    except GuestError as exc:
        raise CaptureError(f"cannot build the test guest: {exc}") from exc
    with tempfile.TemporaryDirectory(prefix="chunksim-capture-") as tmp:
        work = run_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        disk = copy_disk(artifacts.disk, work / "disk.img")
        image_size = disk.stat().st_size
        pristine = scan_data_ranges(disk)
        qemu_log = work / "blk-trace.log"
        qemu_log.unlink(missing_ok=True)
        result = ""
        try:
            with booted_guest(artifacts, disk, run_dir=work, name=f"capture-{workload}",
                              extra_args=trace_arguments(qemu_log)) as guest:
                console = guest.console
                if workload == "boot":
                    start = guest.started_wall
                    console.check(f"sleep {idle:g}", timeout=idle + 60)
                    result = f"ready after {guest.guest_uptime:.2f} s guest uptime, idle {idle:g} s"
                else:
                    if workload == "office":
                        log.info("making the office documents (outside the traced window)")
                        log.info("%s", console.check("/data/workload/office.sh setup", timeout=timeout).strip())
                        script = f"/data/workload/office.sh run {think:g}"
                    elif workload == "testwork":
                        script = "/data/workload/run.sh"
                    else:
                        script = f"/data/workload/rsd.sh {think:g}"
                    console.check("sync && echo 3 >/proc/sys/vm/drop_caches", timeout=120)
                    start = time.time()
                    log.info("running %s", script)
                    output = console.check(script, timeout=timeout)
                    match = _GUEST_RESULT.search(output)
                    if match is None or match.group(1) != "ok":
                        raise CaptureError(f"workload {workload} did not report success:\n{output[-2000:]}")
                    result = match.group(0).strip()
                end = time.time()
                log.info("window %.1f s; powering off", end - start)
                try:
                    console.request_poweroff()
                    guest.vm.wait(120)
                except (GuestError, IsrError) as exc:
                    # The window is over and in the log already; leaving booted_guest quits QEMU (which
                    # flushes the log) all the same.
                    log.warning("the guest did not power off cleanly (%s); quitting QEMU", exc)
        except (GuestError, IsrError) as exc:
            raise CaptureError(f"capture of {workload} failed: {exc}") from exc
        try:
            with open(qemu_log, encoding="utf-8", errors="replace") as f:
                records = read_qemu_log(f)
        except OSError as exc:
            raise CaptureError(f"QEMU wrote no trace log {qemu_log}: {exc}") from exc
        accesses = window(records, start, end)
        data = data_ranges_at(pristine, records, start)
    if not accesses:
        raise CaptureError(f"the {workload} window holds no block requests: is QEMU's log trace back end there?")
    metadata = {
        "workload": workload,
        "description": DESCRIPTIONS[workload],
        "guest": f"{artifacts.variant}-{artifacts.key}",
        "kernel": next((f"{k} {v}" for k, v in artifacts.versions.items() if k.startswith("linux-image")), "?"),
        "qemu": _qemu_version() + " (TCG, -m 256, virtio-blk, cache=writeback)",
        "captured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command or f"python -m tools.chunksim capture {workload} --variant {variant} --think {think:g}",
        "think_s": f"{think:g}",
        "window_s": f"{end - start:.3f}",
        "guest_result": result,
        "image": "disk",
        "image_size": str(image_size),
        "data_ranges": format_ranges(data),
    }
    trace = Trace(name=workload, accesses=accesses, metadata=metadata)
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_trace(trace, dest)
    log.info("%s: %d accesses over %.1f s -> %s (%d bytes)", workload, len(accesses), end - start, dest,
             dest.stat().st_size)
    return CaptureResult(path=dest, accesses=len(accesses), seconds=end - start, guest_result=result)


def command_line() -> str:
    """This process's command line, for a trace's metadata."""
    return "python -m tools.chunksim " + " ".join(shlex.quote(a) for a in sys.argv[1:])
