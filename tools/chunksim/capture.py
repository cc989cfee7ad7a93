"""Capture a block-access trace from the real test guest (`tools.guest`) running one workload.

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

The boot is traced differently, because this guest's root file system is its initramfs: its disk sees only
the mount of ``/data`` (about ten requests), while the boot itself fills guest RAM. ISR keeps guest RAM in
vulpes's ``memory`` image, so `_capture_boot` boots the guest as an ISR resume of a powered-off parcel
does: a parcel made from the guest's disk (``BOOT_CHUNK_SIZE`` = 4 KiB chunks, so the trace is as fine as a
page), served by vulpes with RAM on MOUNT/memory, traced by vulpes itself from the mount
(`vulpes_accesses`), with both images' sizes and data (``image_size.<image>``, ``data_ranges.<image>``) in
the metadata.

Workloads (scripts on the guest's disk, ``tools/guest/files/``):

``boot``    through vulpes, disk and memory images: from the mount to ready, ``idle`` seconds of doing
            nothing, then the suspend's part (VM stopped, RAM and disk written back through vulpes)
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

import contextlib
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
from typing import TYPE_CHECKING

from .cache import Ranges
from .errors import CaptureError
from .trace import READ, WRITE, Access, Trace, format_ranges, read_trace, write_trace

if TYPE_CHECKING:
    from tools.guest import GuestArtifacts

log = logging.getLogger(__name__)

WORKLOADS = ("boot", "office", "rsd", "testwork")
#: The boot capture's parcel: chunk size (the trace's granularity) and guest RAM.
BOOT_CHUNK_SIZE = 4096
BOOT_RAM_MIB = 256
#: Scaled-down think times (seconds): CDA paused 10 s between operations, RSD 10 s between tasks.
DEFAULT_THINK = {"boot": 0.0, "office": 1.0, "rsd": 2.0, "testwork": 0.0}
DEFAULT_IDLE = 10.0
DESCRIPTIONS = {
    "boot": "boot the test guest from vulpes (disk and RAM images) to ready, idle, stop and write back",
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
            command: str | None = None, chunk_size: int = BOOT_CHUNK_SIZE) -> CaptureResult:
    """Boot the ``variant`` test guest with block tracing, run ``workload``, write its trace to ``dest``.

    ``boot`` is traced by vulpes instead (`_capture_boot`, with ``chunk_size``); the others by QEMU.

    Raises `CaptureError` if the workload is unknown or fails, or if the guest could not be run.
    """
    # Imported here: the simulator itself must not need the guest builder or QEMU.
    from isrctl.errors import IsrError
    from tools.guest import GuestError, booted_guest, build, copy_disk

    if workload not in WORKLOADS:
        raise CaptureError(f"unknown workload {workload!r}: choose one of {', '.join(WORKLOADS)}")
    think = DEFAULT_THINK[workload] if think is None else think
    if think < 0 or idle < 0:
        raise CaptureError("think and idle times must be >= 0 seconds")
    try:
        artifacts = build(variant)
    except GuestError as exc:
        raise CaptureError(f"cannot build the test guest: {exc}") from exc
    command = command or f"python -m tools.chunksim capture {workload} --variant {variant} --think {think:g}"
    if workload == "boot":
        return _capture_boot(artifacts, dest, idle=idle, chunk_size=chunk_size, run_dir=run_dir, command=command)
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
        **_common_metadata(workload, artifacts, command),
        "qemu": _qemu_version() + " (TCG, -m 256, virtio-blk, cache=writeback)",
        "think_s": f"{think:g}",
        "window_s": f"{end - start:.3f}",
        "guest_result": result,
        "image": "disk",
        "image_size": str(image_size),
        "data_ranges": format_ranges(data),
    }
    return _write(Trace(name=workload, accesses=accesses, metadata=metadata), dest, end - start, result)


def _common_metadata(workload: str, artifacts: GuestArtifacts, command: str) -> dict[str, str]:
    return {
        "workload": workload,
        "description": DESCRIPTIONS[workload],
        "guest": f"{artifacts.variant}-{artifacts.key}",
        "kernel": next((f"{k} {v}" for k, v in artifacts.versions.items() if k.startswith("linux-image")), "?"),
        "captured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command,
    }


def _write(trace: Trace, dest: Path, seconds: float, result: str) -> CaptureResult:
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_trace(trace, dest)
    log.info("%s: %d accesses over %.1f s -> %s (%d bytes)", trace.name, len(trace.accesses), seconds, dest,
             dest.stat().st_size)
    return CaptureResult(path=dest, accesses=len(trace.accesses), seconds=seconds, guest_result=result)


# --- boot, traced by vulpes --------------------------------------------------------------------------------

def _capture_boot(artifacts: GuestArtifacts, dest: Path, *, idle: float, chunk_size: int, run_dir: Path | None,
                  command: str) -> CaptureResult:
    """Boot the guest from vulpes as an ISR resume of a powered-off parcel does, tracing in vulpes.

    The parcel (made here with ``chunk_size`` chunks in a local store) is served by vulpes with the store
    as its lookaside directory, so no server is involved; QEMU gets MOUNT/disk as its disk and MOUNT/memory
    as its RAM (``memory-backend-file``, ``share=on``), as isrctl's sessions do. The window runs from the
    mount to the end of the suspend's flush: the boot to the ready marker, ``idle`` seconds, then the VM
    stopped and its RAM and disk written back through vulpes (fsync, then vulpes' flush).
    """
    from isrctl.errors import IsrError
    from isrctl.vulpes import Vulpes
    from parcels import parcel as parcel_ops
    from parcels.errors import ParcelError
    from tools.guest import GuestError, booted_guest
    from parcels.keyring import Keyring
    from parcels.store import DirStore

    with tempfile.TemporaryDirectory(prefix="chunksim-capture-") as tmp:
        work = run_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        try:
            store = DirStore(work / "store")
            keyfile = os.urandom(32)
            parcel = parcel_ops.create_parcel(store, name="chunksim-boot", disk=artifacts.disk, ram_mib=BOOT_RAM_MIB,
                                              keyfile=keyfile, chunk_size=chunk_size, tmpdir=work)
            keys = parcel_ops.unlock(store, parcel, keyfile=keyfile)
            version = parcel_ops.open_version(store, parcel, 1, keys)
        except ParcelError as exc:
            raise CaptureError(f"cannot make the parcel to boot: {exc}") from exc
        state = work / "state"
        state.mkdir(exist_ok=True)
        sizes = {}
        for image in ("disk", "memory"):
            sizes[image] = version.manifest.images[image].size
            (state / f"keyring.{image}").unlink(missing_ok=True)
            with Keyring.create(state / f"keyring.{image}", chunk_size, sizes[image]) as keyring:
                keyring.put_many(version.records(image))
        trace_path = work / "vulpes.trace"
        trace_path.unlink(missing_ok=True)
        vulpes = Vulpes(mountpoint=work / "mnt", state_dir=state, cache_dir=work / "cache",
                        control_path=work / "vulpes.control", log_path=work / "vulpes.log", trace=trace_path,
                        lookaside=[store.root])
        marks: dict[str, float] = {}
        try:
            marks["mount"] = time.time()
            vulpes.start(keys)
            with booted_guest(artifacts, vulpes.disk, memory_file=vulpes.memory, run_dir=work,
                              name="capture-boot", ready_timeout=600) as guest:
                marks["ready"] = time.time()
                uptime = guest.guest_uptime
                guest.console.check(f"sleep {idle:g}", timeout=idle + 60)
                marks["stop"] = time.time()
                guest.vm.stop()
                for image_path in (vulpes.memory, vulpes.disk):
                    fd = os.open(image_path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                vulpes.flush()
                vulpes.trace_stop()
                marks["end"] = time.time()
        except (GuestError, IsrError, OSError) as exc:
            raise CaptureError(f"capture of boot failed: {exc}") from exc
        finally:
            with contextlib.suppress(IsrError):
                vulpes.stop()
            vulpes.kill()
        accesses = vulpes_accesses(trace_path, marks["mount"])
        pristine = scan_data_ranges(artifacts.disk)
    if not accesses:
        raise CaptureError("vulpes traced no accesses during the boot")
    window = marks["end"] - marks["mount"]
    result = f"ready after {uptime:.2f} s guest uptime, idle {idle:g} s"
    metadata = {
        **_common_metadata("boot", artifacts, command),
        "qemu": _qemu_version() + f" (TCG, -m {BOOT_RAM_MIB}, virtio-blk, cache=writeback, RAM on MOUNT/memory)",
        "traced_by": f"vulpes, {chunk_size}-byte chunks, from the mount; consecutive chunks of one request merged",
        "window_s": f"{window:.3f}",
        "ready_s": f"{marks['ready'] - marks['mount']:.3f}",
        "stop_s": f"{marks['stop'] - marks['mount']:.3f}",
        "guest_result": result,
        "image_size.disk": str(sizes["disk"]),
        "image_size.memory": str(sizes["memory"]),
        "data_ranges.disk": format_ranges(pristine),
        "data_ranges.memory": "",
    }
    return _write(Trace(name="boot", accesses=accesses, metadata=metadata), dest, window, result)


def vulpes_accesses(path: Path, origin: float, merge_gap: float = 0.001) -> list[Access]:
    """The records of a vulpes trace (`read_trace`) timed from wall-clock ``origin`` instead of from its first
    record, with each run of consecutive chunks of one image, op and source that follow each other within
    ``merge_gap`` seconds merged into one access: vulpes writes a record per chunk of a request."""
    trace = read_trace(path)
    first = next((float(line.split()[0]) for line in path.read_text(errors="replace").splitlines()
                  if line.strip() and not line.startswith("#")), origin)
    shift = max(first - origin, 0.0)
    merged: list[Access] = []
    last = 0.0
    for a in trace.accesses:
        prev = merged[-1] if merged else None
        if (prev is not None and (prev.image, prev.op, prev.source, prev.end) == (a.image, a.op, a.source, a.offset)
                and a.time - last <= merge_gap):
            merged[-1] = Access(prev.time, prev.offset, prev.length + a.length, a.op, a.image, a.source)
        else:
            merged.append(Access(round(a.time + shift, 6), a.offset, a.length, a.op, a.image, a.source))
        last = a.time
    return merged


def command_line() -> str:
    """This process's command line, for a trace's metadata."""
    return "python -m tools.chunksim " + " ".join(shlex.quote(a) for a in sys.argv[1:])
