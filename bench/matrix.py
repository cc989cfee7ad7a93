#!/usr/bin/env python3
"""The benchmark matrix of issues 5 and 7: ISR policies x link rate x added RTT x guest RAM, and the peers.

Every ISR policy × link rate × added round-trip time × guest RAM size, the peers on the same links, hoard and
checkin throughput, the chunksim model's predictions and the seeds' own figures, in one run.

    .venv/bin/python bench/matrix.py --quick          # a few minutes: 10 Mbit/s, 20 ms, demand and proactive
    .venv/bin/python bench/matrix.py --full           # everything (about 1 3/4 hours; see bench/README.md)
        [--rates 100,10,1] [--rtts 0,50] [--policies demand,...] [--ram 256,1024]
        [--peers qemu-curl,...|--no-peers] [--json FILE] [--no-update] [--timeout S] [--keep]
        [--guest small|diskboot]    # diskboot: a PC disk booted through its own bootloader (issue 17)
    .venv/bin/python bench/matrix.py --report FILE.json [--no-update]   # the sections again, from raw results
    .venv/bin/python bench/matrix.py --spread A.json B.json [--no-update]   # cells both runs measured
    .venv/bin/python bench/matrix.py --compare BEFORE.json AFTER.json      # two versions of the code

`./bootstrap bench ARGS` installs toxiproxy and nbdkit first, then runs this. Needs root. Not part of the
test suite.

How it measures (doc/isrctl.md has the ISR timeline t1..t5):

- One real isr-server in the host namespace; two sites, each in its own network namespace behind a veth pair
  shaped with tbf to the link rate in both directions. Between each site and the server a toxiproxy proxy
  listens on the site's host-side address and adds the round-trip time (half each way); the site's `isr`
  (and its vulpes) talk to the server only through it.
- The local baseline, once per run and RAM size: the same guest from a local copy of its disk, no network
  and no vulpes, runs the workload twice after a cold boot; the second run is T_local (site B's workload is
  the guest's second run too) and its block trace (QEMU trace events) feeds the chunksim policy model and
  the chunk-size table. Then it is saved to a local file and resumed from it in a new QEMU (all its RAM
  loaded first) and runs the workload a third time: what any resume costs the workload here, where TCG
  translates the guest's code again in a new QEMU (`workload_resumed_s`).
- Per link rate: the bulk TCP goodput of the link (one connection, namespace to host, no proxy).
- Per rate, RTT and RAM size: site A resumes a fresh parcel (a cold boot, demand fetch), runs the workload,
  suspends and checks in (t2); then, for each policy, a fresh site B (empty cache) hoards if the policy wants
  it (t3), resumes (t4: what `isr resume` reports, and until the guest first answers on its console), runs
  the workload (t5), suspends without checkin and gives the lock back, so the next policy's B resumes the
  same version. Only eager writeback needs its own site A run (it trickles during t1). After every B an
  untimed site F resumes the same version with vulpes's warmer off, for the pages the guest reads: the floor.
- Bytes are counted on the site's veth (everything that crossed the link, headers included) and by vulpes
  (chunk objects fetched).
- Per rate and RTT, at the first RAM size: the peers (bench/peers.py) on site B's link, through their own
  proxy with the same RTT.

Every cell runs in try/except: a failure is recorded as "failed: reason" and the matrix goes on. Raw results
go to --json (default: next to the work directory, /var/tmp/isr-matrix-*.json).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vulpes_common import link_bandwidth, machine, today

import matrix_report  # noqa: E402
from isrctl.policy import POLICIES as ISR_POLICIES  # noqa: E402
from isrctl.vulpes import binary as vulpes_binary  # noqa: E402
from tools.guest import GuestArtifacts, booted_guest, build, copy_disk, resumed_guest  # noqa: E402
from isrctl import pack  # noqa: E402
from parcels.chunk import chunk_length  # noqa: E402
from parcels.compress import compress  # noqa: E402
from parcels.keyring import Keyring  # noqa: E402
from parcels.parcel import latest_version, open_version, read_chunk, unlock  # noqa: E402
from parcels.store import DirStore  # noqa: E402
from tests.isr_fixtures import IsrEnv, NetSite, Parcel, Site, shaped_namespaces, start_isr_env  # noqa: E402
from tests.toxiproxy_fixtures import Proxy, Toxiproxy  # noqa: E402
from tools.chunksim.capture import (data_ranges_at, read_qemu_log, scan_data_ranges,  # noqa: E402
                                    trace_arguments, window)
from tools.chunksim.policy import PolicyParams, predict, stored_disk_bytes  # noqa: E402
from tools.chunksim.trace import Trace, format_ranges  # noqa: E402

try:
    import peers as peer_bench
except ImportError:  # bench/peers.py is optional: without it the peers are reported as not run
    peer_bench = None  # type: ignore[assignment]

POLICIES = list(ISR_POLICIES)
#: The test guests the matrix can run (tools/guest/README.md).
GUESTS = ("small", "diskboot")
ALL_PEERS: tuple[str, ...] = peer_bench.PEERS if peer_bench else ("qemu-curl", "nbdkit-curl", "copy-in")
MODES: dict[str, dict[str, list[Any]]] = {
    "quick": {"rates": [10], "rtts": [20], "policies": ["demand", "proactive"], "ram": [256],
              "peers": ["qemu-curl"]},
    "full": {"rates": [100, 10, 1], "rtts": [0, 50], "policies": POLICIES, "ram": [256, 1024],
             "peers": list(ALL_PEERS)},
}
#: In --full mode, links this slow (Mbit/s) run only the first RTT: a cell there takes about 6 minutes, and
#: an RTT of tens of milliseconds is lost in transfers of minutes (an explicit --rtts applies to every rate).
FULL_ONE_RTT_AT_OR_BELOW = 1
#: ... and, for RAM sizes after the first, only these policies: the question a second RAM size answers is
#: whether resume grows with RAM, which demand fetch shows; the rest would add about 40 minutes per size.
FULL_SLOW_LATER_RAM_POLICIES = ["demand"]
MIB = 1 << 20
#: A failure's reason in a table: its first line, this long at most.
REASON_CHARS = 160
CELL_FAILURES = (Exception, pytest.fail.Exception)


def say(text: str) -> None:
    print(f"[matrix {time.strftime('%H:%M:%S')}] {text}", flush=True)


def reason(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    return first[:REASON_CHARS]


def attempt(what: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``, or {"status": "failed: reason", "error": details} if it raises; never raises but ^C."""
    try:
        result = fn()
        result.setdefault("status", "ok")
        return result
    except CELL_FAILURES as exc:
        say(f"{what}: failed: {reason(exc)}")
        return {"status": f"failed: {reason(exc)}", "error": f"{exc}\n{traceback.format_exc()}"[-6000:]}


# --- what crossed a link ------------------------------------------------------------------------------------

class LinkCounter:
    """Bytes on a site's veth, counted by the kernel on the host side: ``down`` went to the site, ``up``
    came from it (headers and TLS included)."""

    def __init__(self, net: NetSite) -> None:
        self.stats = Path("/sys/class/net") / net.host_if / "statistics"
        self.down0, self.up0 = self._read()

    def _read(self) -> tuple[int, int]:
        return int((self.stats / "tx_bytes").read_text()), int((self.stats / "rx_bytes").read_text())

    def delta(self) -> tuple[int, int]:
        """(down, up) since this counter was made."""
        down, up = self._read()
        return down - self.down0, up - self.up0


# --- parsing what isr prints ------------------------------------------------------------------------------------

def number_after(pattern: str, text: str) -> float | None:
    match = re.search(pattern, text)
    return float(match.group(1)) if match else None


def resume_phases(text: str) -> dict[str, float]:
    """The phase times `isr resume` prints: '... resumed in 1.2 s (t4, policy P: lock 0.05 s, ...)'."""
    match = re.search(r"\(t4, policy [^:]+: ([^)]*)\)", text)
    if not match:
        return {}
    return {name.strip(): float(value) for name, value in re.findall(r"([^,]+?) ([0-9.]+) s", match.group(1))}


def boot_file_bytes(text: str) -> int:
    """The sealed sizes of the boot files a command fetched, from the summary line of each one's progress bar
    ('fetching boot file kernel: 12.5 MiB in 0.4 s (31.2 MiB/s), sealed ...')."""
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    return int(sum(float(x) * units[unit]
                   for x, unit in re.findall(r"fetching boot file \S+: ([0-9.]+) (B|KiB|MiB|GiB) in ", text)))


def server_chunks(traces: Path, split: float) -> dict[str, dict[str, int]]:
    """Chunks vulpes fetched from the server per image, before and after the wall-clock time ``split``, from
    its access traces (vulpes/src/trace.c: '<time> <image> <index> <r|w> <source>')."""
    counts: dict[str, dict[str, int]] = {}
    for path in sorted(traces.glob("*.trace")):
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split()
            if line.startswith("#") or len(parts) < 5 or parts[4] != "server":
                continue
            when = "before" if float(parts[0]) < split else "after"
            image = counts.setdefault(parts[1], {"before": 0, "after": 0})
            image[when] += 1
    return counts


#: Chunk sizes the page-level trace is folded to, to see what a smaller memory chunk size would fetch.
TOUCH_CHUNK_SIZES = (4096, 16384, 32768, 65536, 131072)


def memory_compression(keyring: Path, store: Path) -> float | None:
    """The stored bytes of the memory image's chunk objects over their plaintext (the site's local keyring
    names each chunk's object; the server's directory store has it), or None if there are none."""
    stored = plain = 0
    objects = DirStore(store)
    with Keyring.open(keyring) as records:
        chunk_size = records.chunk_size
        for record in records:
            path = objects.chunk_path(record.tag)
            if path.exists():
                stored += path.stat().st_size
                plain += chunk_size
    return stored / plain if plain else None


def touched(traces: Path, answered: float, finished: float) -> tuple[dict[str, dict[str, Any]],
                                                                      dict[str, dict[str, list[int]]]]:
    """What the resumed guest touched, per image, from vulpes's version-2 traces (byte ranges): the distinct
    4 KiB pages until the guest answered (``before``) and during the workload (``workload``: from the answer to
    ``finished``, pages not touched before), and for ``before`` how many chunks those pages fall in at each of
    TOUCH_CHUNK_SIZES. A version-1 trace has no byte ranges: its images are left out. Also returns, per image
    and phase, the pages whose first touch was a read (those a site must have been sent; a page the guest
    wrote first needs nothing), in the order the guest read them."""
    pages: dict[str, dict[str, dict[int, None]]] = {}      # ordered sets
    read_first: dict[str, dict[int, bool]] = {}
    for path in sorted(traces.glob("*.trace")):
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split()
            if line.startswith("#") or len(parts) != 7:
                continue
            when = float(parts[0])
            phase = "before" if when < answered else "workload" if when < finished else None
            if phase is None:
                continue
            offset, length = int(parts[5]), int(parts[6])
            image_pages = pages.setdefault(parts[1], {"before": {}, "workload": {}})
            span = range(offset // 4096, (offset + length - 1) // 4096 + 1)
            image_pages[phase].update(dict.fromkeys(span))
            first = read_first.setdefault(parts[1], {})
            for page in span:
                first.setdefault(page, parts[3] == "r")
    out: dict[str, dict[str, Any]] = {}
    ordered: dict[str, dict[str, list[int]]] = {}
    for image, phases in pages.items():
        before = phases["before"]
        workload = [page for page in phases["workload"] if page not in before]
        out[image] = {"before_pages": len(before), "workload_pages": len(workload),
                      "before_chunks": {str(size): len({p * 4096 // size for p in before})
                                        for size in TOUCH_CHUNK_SIZES}}
        ordered[image] = {"before": [page for page in before if read_first[image][page]],
                          "workload": [page for page in workload if read_first[image][page]]}
    return out, ordered


def touched_bytes(store: Path, parcel: Parcel, pages: dict[str, dict[str, list[int]]]) -> dict[str, dict[str, int]]:
    """The least a transfer of the ``pages`` the guest read, so compressed, could move: per image and phase,
    those pages of the version the site resumed (the newest: site B checks nothing in), in the order the guest
    touched them, compressed as one stream at the resume pack's level (pack.TRANSFER_LEVEL). Pages of chunks
    the version does not hold are zeros, and cost nothing but are counted in the stream as such."""
    objects = DirStore(store)
    uid = uuid.UUID(parcel.id)
    keys = unlock(objects, uid, keyfile=parcel.keyfile.read_bytes())
    contents = open_version(objects, uid, latest_version(objects, uid), keys)
    out: dict[str, dict[str, int]] = {}
    for image, phases in pages.items():
        size = contents.manifest.images[image].size
        chunk_size = contents.manifest.image_chunk_size(image)
        records = {record.idx: record for record in contents.records(image)}
        plain: dict[int, bytes] = {}
        out[image] = {}
        for phase, ordered in phases.items():
            stream = bytearray()
            for page in ordered:
                idx = page * 4096 // chunk_size
                if idx not in plain:
                    record = records.get(idx)
                    plain[idx] = read_chunk(objects, keys, record, chunk_length(idx, chunk_size, size)) \
                        if record is not None else b""
                start = page * 4096 - idx * chunk_size
                stream += plain[idx][start:start + 4096].ljust(4096, b"\0")
            out[image][phase] = len(compress(bytes(stream), pack.TRANSFER_LEVEL))
    return out


# --- the local baseline -------------------------------------------------------------------------------------

def local_baseline(guest: GuestArtifacts, work: Path, ram: int, timeout: float) -> tuple[dict[str, Any], Trace]:
    """The workload on a local copy of the disk (no network, no vulpes): a cold boot, the workload once
    (as site A runs it), then again (as site B does), block-traced; then the guest is saved to a local file
    and resumed from it in a new QEMU (its whole RAM loaded before it continues), and runs the workload a
    third time: what any resume costs the workload here (a new QEMU translates the guest's code again under
    TCG), with nothing fetched and no page faults. Returns the times and the second run's trace (with the
    data ranges at its start, for the model)."""
    work.mkdir(parents=True, exist_ok=True)
    disk = copy_disk(guest.disk, work / "disk.img")
    pristine = scan_data_ranges(disk)
    log = work / "blk-trace.log"
    with booted_guest(guest, disk, run_dir=work, name="local", ready_timeout=timeout, memory_mib=ram,
                      extra_args=trace_arguments(log)) as booted:
        started = time.monotonic()
        check_workload(booted.console.run_workload(timeout=timeout), guest)
        first = time.monotonic() - started
        wall, started = time.time(), time.monotonic()
        check_workload(booted.console.run_workload(timeout=timeout), guest)
        second = time.monotonic() - started
        end = time.time()
        boot = booted.boot_seconds
        state = work / "local-state.zst"
        booted.vm.save_state(state, sync=False)
    with resumed_guest(guest, disk, state, run_dir=work, name="local-resumed", memory_mib=ram) as resumed:
        started = time.monotonic()
        check_workload(resumed.console.run_workload(timeout=timeout), guest)
        after_resume = time.monotonic() - started
    state.unlink()
    with open(log, encoding="utf-8", errors="replace") as f:
        records = read_qemu_log(f)
    trace = Trace(name=f"testwork-local-{ram}M", accesses=window(records, wall, end), metadata={
        "workload": "testwork (run.sh), second run after a cold boot", "image": "disk",
        "image_size": str(disk.stat().st_size), "data_ranges": format_ranges(data_ranges_at(pristine, records, wall))})
    disk.unlink()
    return {"boot_s": boot, "workload_first_s": first, "workload_s": second,
            "workload_resumed_s": after_resume, "trace_requests": len(trace.accesses),
            "trace_seconds": trace.duration}, trace


def check_workload(result: dict[str, str], guest: GuestArtifacts) -> None:
    if result.get("digest") != guest.expected.digest:
        raise RuntimeError(f"the workload's digest {result.get('digest')} is not {guest.expected.digest}")


# --- ISR: site A and site B -------------------------------------------------------------------------------------

@contextlib.contextmanager
def site(env: IsrEnv, name: str, root: Path, net: NetSite, server: str, parcel: Parcel,
         timeout: float, extra_env: dict[str, str] | None = None) -> Iterator[Site]:
    """A logged-in site that talks to the server through ``server``; afterwards everything it started is
    killed, its hold on the parcel (lock, local state) is given up, so the next site can resume, and its
    chunk cache is removed (a full run makes a hundred sites); its logs and traces are kept in root/logs."""
    made = Site(name, root, env, net, server=server, extra_env=dict(extra_env or {}))
    try:
        made.login()
        yield made
    finally:
        made.cleanup()
        keep_logs(made.state_dir(parcel), root / "logs")
        with contextlib.suppress(subprocess.TimeoutExpired):
            if made.isr("clean", "--force", "--yes", parcel.name, check=False, timeout=timeout).returncode:
                made.isr("lock", parcel.name, "--force", "--yes", "--reason", "bench/matrix.py: a failed site",
                         check=False, timeout=timeout)
        shutil.rmtree(root / "cache", ignore_errors=True)


def keep_logs(state: Path, dest: Path) -> None:
    """Copy a parcel's session, vulpes and QEMU logs and its access traces out of its state directory (which
    `isr clean` removes)."""
    for name in ("session.log", "vulpes.log", "qemu/vm.log", "qemu/console.log", "traces"):
        source = state / name
        target = dest / name.replace("/", "-")
        dest.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            if source.is_dir():
                shutil.copytree(source, target, dirs_exist_ok=True)
            elif source.exists():
                shutil.copyfile(source, target)


def run_site_a(env: IsrEnv, guest: GuestArtifacts, parcel: Parcel, root: Path, net: NetSite, server: str,
               policy: str, timeout: float) -> dict[str, Any]:
    """Site A: resume (a cold boot of version 1), the workload, a RAM token, suspend and check in (t2)."""
    with site(env, "A", root, net, server, parcel, timeout) as a:
        link = LinkCounter(net)
        started = time.monotonic()
        out = a.isr("resume", parcel.name, "--detach", "--vnc", "unix", "--keyfile", str(parcel.keyfile),
                    "--policy", policy, timeout=timeout).stdout
        with a.console(parcel) as console:
            console.wait_ready(timeout)
            boot = time.monotonic() - started
            started = time.monotonic()
            check_workload(console.run_workload(timeout=timeout), guest)
            workload = time.monotonic() - started
            console.set_token()
        work_down = link.delta()[0]
        link = LinkCounter(net)
        started = time.monotonic()
        suspend = a.isr("suspend", parcel.name, timeout=timeout).stdout
        a.wait_session_end(parcel, timeout=timeout)
        t2 = time.monotonic() - started
        down, up = link.delta()
    safe = number_after(r"safe at this site after ([0-9.]+) s", suspend)
    devstate = number_after(r"device state [0-9.]+ MiB \(([0-9.]+) MiB sealed\)", suspend)
    with env.server.client("alice") as client:
        versions = client.versions(parcel.id)["versions"]
    stored = next((int(v.get("chunk_bytes") or 0) for v in versions if int(v["version"]) == 2), 0)
    upload_s = t2 - safe if safe is not None else None
    # The session's own clock from the safe state to the commit and the lock's release (t2 - safe above also
    # holds the exit of the `isr suspend` command, and in older trees its start); older trees do not say it.
    committed = number_after(r"checked in ([0-9.]+) s after the state was safe", suspend)
    return {"policy_a": policy, "boot_s": boot, "t4_boot": number_after(r"booted cold in ([0-9.]+) s", out),
            "workload_a_s": workload, "t2": t2, "t2_safe": safe, "checkin_s": upload_s, "checkin_session_s": committed,
            "checkin_link_bytes": up,
            "t2_link_down_bytes": down, "t1_link_down_bytes": work_down, "boot_file_bytes": boot_file_bytes(out),
            "devstate_sealed_bytes": int((devstate or 0) * MIB), "version_chunk_bytes": stored}


def run_site_a2(env: IsrEnv, guest: GuestArtifacts, parcel: Parcel, root: Path, net: NetSite, server: str,
                timeout: float) -> dict[str, Any]:
    """With --hops 2, site A2 (a fresh cache on A's link): resume A's version (demand), answer, run the workload,
    suspend and check in. Site B then resumes a version that a resumed session made, as most resumes in
    real use are (only such a session records a resume pack). A2's suspend is timed as A's is (t2): it makes
    and uploads the resume pack, which is what the pack costs."""
    with site(env, "A2", root, net, server, parcel, timeout) as a2:
        started = time.monotonic()
        a2.isr("resume", parcel.name, "--detach", "--vnc", "unix", "--keyfile", str(parcel.keyfile),
               "--policy", "demand", timeout=timeout)
        with a2.console(parcel) as console:
            console.run("true", timeout=timeout)
            answered = time.monotonic() - started
            check_workload(console.run_workload(timeout=timeout), guest)
            console.set_token()
        link = LinkCounter(net)
        started = time.monotonic()
        suspend = a2.isr("suspend", parcel.name, timeout=timeout).stdout
        a2.wait_session_end(parcel, timeout=timeout)
        t2 = time.monotonic() - started
        up = link.delta()[1]
    pack_s = number_after(r"resume pack ([0-9.]+) s", suspend)
    return {"a2_answered_s": answered, "a2_made_pack": pack_s is not None, "a2_pack_s": pack_s, "a2_t2": t2,
            "a2_t2_safe": number_after(r"safe at this site after ([0-9.]+) s", suspend),
            "a2_checkin_link_bytes": up}


def run_site_b(env: IsrEnv, guest: GuestArtifacts, parcel: Parcel, root: Path, net: NetSite, server: str,
               policy: str, timeout: float) -> dict[str, Any]:
    """A fresh site B: hoard (t3) if the policy wants it, resume (t4), the workload (t5), suspend locally."""
    result: dict[str, Any] = {}
    with site(env, f"B-{policy}", root, net, server, parcel, timeout) as b:
        if ISR_POLICIES[policy].expects_hoard:
            link = LinkCounter(net)
            started = time.monotonic()
            b.isr("hoard", parcel.name, "--keyfile", str(parcel.keyfile),
                  *(["--working-set"] if policy == "eager-ws" else []), timeout=timeout)
            result["t3"] = time.monotonic() - started
            result["t3_link_bytes"] = link.delta()[0]
        link = LinkCounter(net)
        started = time.monotonic()
        out = b.isr("resume", parcel.name, "--detach", "--vnc", "unix", "--keyfile", str(parcel.keyfile),
                    "--policy", policy, timeout=timeout).stdout
        result["t4_command"] = time.monotonic() - started
        with b.console(parcel) as console:
            console.run("true", timeout=timeout)
            result["t4_responsive"] = time.monotonic() - started
            answered = time.time()
            result["t4_link_bytes"] = link.delta()[0]
            link = LinkCounter(net)
            started = time.monotonic()
            check_workload(console.run_workload(timeout=timeout), guest)
            result["workload_b_s"] = time.monotonic() - started
            finished = time.time()
        result["t5_link_bytes"] = link.delta()[0]
        status = b.stat(parcel).get("session_status") or {}
        result["vulpes_fetched_bytes"] = int(status.get("vulpes", {}).get("fetch", {}).get("bytes", 0))
        result["vulpes_fetch"] = status.get("vulpes", {}).get("fetch", {})
        b.isr("suspend", parcel.name, "--no-checkin", timeout=timeout)
        b.wait_session_end(parcel, timeout=timeout)
        result["server_chunks"] = server_chunks(b.state_dir(parcel) / "traces", answered)
        result["touched"] = touched(b.state_dir(parcel) / "traces", answered, finished)[0]
        if "memory" in result["touched"]:
            result["touched"]["memory"]["compression"] = memory_compression(
                b.state_dir(parcel) / "keyring.memory", env.store)
    result["t4"] = number_after(r"resumed in ([0-9.]+) s", out)
    result["t4_phases"] = resume_phases(out)
    result["resume_pack_mib"] = number_after(r"resume pack: ([0-9.]+) MiB", out)
    result["boot_file_bytes_b"] = boot_file_bytes(out)
    return result


def vulpes_without_warmer(work: Path) -> Path:
    """A directory whose ``vulpes`` runs this tree's vulpes with its warmer off (``--warm-after=0``), for
    ``ISR_VULPES``; ``vulpes-fetch`` beside it is the real one."""
    real = vulpes_binary()
    folder = work / "vulpes-without-warmer"
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / "vulpes"
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(str(real))} \"$@\" --warm-after=0\n")
    wrapper.chmod(0o755)
    fetch = folder / "vulpes-fetch"
    fetch.unlink(missing_ok=True)
    fetch.symlink_to(vulpes_binary("vulpes-fetch"))
    return wrapper


def run_site_floor(env: IsrEnv, guest: GuestArtifacts, parcel: Parcel, root: Path, net: NetSite, server: str,
                   timeout: float) -> dict[str, Any]:
    """Site F, on B's link after every B and not timed: the same demand resume, answer and workload with
    vulpes's warmer off, so that its trace sees every page the guest reads (a warmed page's touch reaches no
    trace); its floors (`touched_bytes`: those pages compressed) are the least a transfer of them could move
    until the guest answers and during the workload. The guest's reads are its own, whatever the policy."""
    wrapper = vulpes_without_warmer(root.parent)
    with site(env, "F", root, net, server, parcel, timeout, extra_env={"ISR_VULPES": str(wrapper)}) as f:
        f.isr("resume", parcel.name, "--detach", "--vnc", "unix", "--keyfile", str(parcel.keyfile),
              "--policy", "demand", timeout=timeout)
        with f.console(parcel) as console:
            console.run("true", timeout=timeout)
            answered = time.time()
            check_workload(console.run_workload(timeout=timeout), guest)
            finished = time.time()
        f.isr("suspend", parcel.name, "--no-checkin", timeout=timeout)
        f.wait_session_end(parcel, timeout=timeout)
        pages = touched(f.state_dir(parcel) / "traces", answered, finished)[1]
    floors = touched_bytes(env.store, parcel, pages)
    return {image: {"before_read_pages": len(phases["before"]), "workload_read_pages": len(phases["workload"]),
                    "before_bytes": floors[image]["before"], "workload_bytes": floors[image]["workload"]}
            for image, phases in pages.items()}


def run_isr_group(env: IsrEnv, guest: GuestArtifacts, work: Path, nets: list[NetSite], servers: list[str],
                  key: dict[str, Any], policies: list[str], timeout: float, hops: int = 1) -> list[dict[str, Any]]:
    """One site A run (and with ``hops`` 2 a site A2 run after it) and the site B runs that follow; one cell per
    policy (A's failure fails them all)."""
    a_policy = "eager-writeback" if policies == ["eager-writeback"] else "demand"
    tag = f"{key['rate']}m-{key['rtt']}ms-{key['ram']}M-{a_policy}"
    root = work / tag
    say(f"{tag}: site A ({a_policy}) boots, runs the workload, suspends and checks in")

    def make_a() -> dict[str, Any]:
        parcel = env.make_parcel(f"m-{tag}-{int(time.time()) % 100000}", ram_mib=key["ram"])
        result = run_site_a(env, guest, parcel, root / "A", nets[0], servers[0], a_policy, timeout)
        if hops == 2:
            say(f"{tag}: site A2 resumes A's version, runs the workload, suspends and checks in")
            result.update(run_site_a2(env, guest, parcel, root / "A2", nets[0], servers[0], timeout))
        return {"parcel": parcel, **result}

    a = attempt(f"{tag} site A", make_a)
    parcel = a.pop("parcel", None)
    if a["status"] == "ok":
        say(f"{tag}: A booted in {a['boot_s']:.1f} s, workload {a['workload_a_s']:.1f} s, t2 {a['t2']:.1f} s "
            f"(safe after {a['t2_safe']} s), {a['checkin_link_bytes'] / MIB:.1f} MiB up")
        if hops == 2:
            pack = f", its resume pack made in {a['a2_pack_s']} s" if a["a2_made_pack"] else ", no resume pack"
            say(f"{tag}: A2 answered after {a['a2_answered_s']:.1f} s, t2 {a['a2_t2']:.1f} s (safe after "
                f"{a['a2_t2_safe']} s), {a['a2_checkin_link_bytes'] / MIB:.1f} MiB up{pack}")
    cells = []
    for policy in policies:
        cell: dict[str, Any] = {**key, "policy": policy, "site_a": {k: v for k, v in a.items() if k != "error"}}
        if a["status"] != "ok" or parcel is None:
            cell.update(status=f"failed: site A: {a['status'].removeprefix('failed: ')}", error=a.get("error"))
        else:
            say(f"{tag}: site B, policy {policy}")
            def site_b(policy: str = policy) -> dict[str, Any]:
                return run_site_b(env, guest, parcel, root / f"B-{policy}", nets[1], servers[1], policy, timeout)

            cell.update(attempt(f"{tag} {policy}", site_b))
            if cell["status"] == "ok":
                t3 = f"{cell['t3']:.1f} s" if cell.get("t3") is not None else "-"
                say(f"{tag} {policy}: t3 {t3}, t4 {cell['t4']} s (the guest answered after "
                    f"{cell['t4_responsive']:.1f} s), workload {cell['workload_b_s']:.1f} s, "
                    f"{(cell['t4_link_bytes'] + cell['t5_link_bytes']) / MIB:.1f} MiB down")
        cells.append(cell)
    if parcel is not None and any(cell["status"] == "ok" for cell in cells):
        say(f"{tag}: site F resumes as B did with vulpes's warmer off, for the pages the guest reads")
        floor = attempt(f"{tag} floor", lambda: {"floor": run_site_floor(env, guest, parcel, root / "F", nets[1],
                                                                           servers[1], timeout)})
        for cell in cells:
            cell["floor"] = floor.get("floor") if floor["status"] == "ok" else {"status": floor["status"]}
    return cells


# --- the model's predictions -------------------------------------------------------------------------------

def add_prediction(cell: dict[str, Any], trace: Trace | None, local: dict[str, Any] | None,
                   goodput_mbit: float | None) -> None:
    """The chunksim policy model's t2, t3, t4 and t5 for this cell's link, RTT and state sizes."""
    a = cell.get("site_a") or {}
    if cell.get("status") != "ok" or trace is None or local is None or not goodput_mbit:
        return
    try:
        disk = a.get("version_chunk_bytes") or stored_disk_bytes(trace, 128 << 10) or 1
        params = PolicyParams(bandwidth=goodput_mbit * 1e6 / 8, rtt=cell["rtt"] / 1000, disk_size=disk,
                              memory_size=a.get("boot_file_bytes", 0) + a.get("devstate_sealed_bytes", 0),
                              site2_synced=False)
        [p] = predict(trace, params, policies=[cell["policy"]])
    except Exception as exc:  # noqa: BLE001 - a model that cannot run is a note, not a failed cell
        cell["prediction"] = {"error": reason(exc)}
        return
    cell["prediction"] = {"t2": p.t2, "t3": p.t3, "t4": p.resume_latency, "stall": p.stall,
                          "workload_b_s": local["workload_s"] + p.stall, "demand_fetches": p.demand_fetches,
                          "demand_bytes": p.demand_bytes, "params": {
                              "bandwidth_bytes_s": params.bandwidth, "rtt_s": params.rtt,
                              "disk_size": params.disk_size, "memory_size": params.memory_size,
                              "chunk_size": params.chunk_size, "launch": params.launch}}


# --- peers ------------------------------------------------------------------------------------------------------

def run_peers(origin: Any, toxi: Toxiproxy, net: NetSite, key: dict[str, Any], peers: list[str], work: Path,
              guest: GuestArtifacts) -> list[dict[str, Any]]:
    """Each peer on site B's link, through a proxy with the same RTT to the origin."""
    out = []
    proxy = toxi.proxy(f"peer-{net.name}-{key['rtt']}", listen=(net.host_ip, 0), upstream=origin.address)
    try:
        proxy.set_rtt(key["rtt"])
        for peer in peers:
            say(f"{key['rate']} Mbit/s, {key['rtt']} ms: peer {peer}")

            def one(peer: str = peer) -> dict[str, Any]:
                peer_work = work / f"peer-{peer}-{key['rate']}m-{key['rtt']}ms"
                peer_work.mkdir(parents=True, exist_ok=True)
                link = LinkCounter(net)
                result = peer_bench.measure_peer(peer, origin, site=net, host=net.host_ip, port=proxy.listen[1],
                                                 work=peer_work, guest=guest, ram_mib=key["ram"])
                return {"resume_s": result.resume_s, "workload_s": result.workload_s,
                        "fetch_s": getattr(result, "fetch_s", None), "http_bytes": result.link_bytes,
                        "link_bytes": link.delta()[0], "note": result.note}

            cell = {**key, "peer": peer, **attempt(f"peer {peer}", one)}
            if cell["status"] == "ok":
                say(f"peer {peer}: resume {cell['resume_s']:.1f} s, workload {cell['workload_s']:.1f} s, "
                    f"{cell['link_bytes'] / MIB:.1f} MiB")
            out.append(cell)
    finally:
        proxy.remove()
    return out


# --- the run ----------------------------------------------------------------------------------------------------

def int_list(text: str) -> list[int]:
    """'100,10,10' -> [100, 10]: each value once, in order."""
    return list(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))


def name_list(text: str, known: list[str] | tuple[str, ...], what: str) -> list[str]:
    names = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"matrix: unknown {what} {unknown[0]!r}: choose from {', '.join(known)}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", dest="mode", const="quick",
                      help="a few minutes: 10 Mbit/s, 20 ms, demand and proactive, 256 MiB, qemu-curl (default)")
    mode.add_argument("--full", action="store_const", dest="mode", const="full",
                      help="rates 100,10,1 x RTT 0,50 ms x every policy x RAM 256,1024 MiB, every peer (at 1 Mbit/s: "
                           "the first RTT only, and the second RAM size for demand only)")
    parser.add_argument("--rates", help="link rates in Mbit/s, comma-separated (overrides the mode)")
    parser.add_argument("--rtts", help="added round-trip times in ms, comma-separated (0: the proxy adds none)")
    parser.add_argument("--policies", help=f"comma-separated subset of {', '.join(POLICIES)}")
    parser.add_argument("--ram", help="guest RAM sizes in MiB, comma-separated")
    parser.add_argument("--peers", help=f"comma-separated subset of {', '.join(ALL_PEERS)}")
    parser.add_argument("--no-peers", action="store_true", help="skip the peers")
    parser.add_argument("--hops", type=int, choices=(1, 2), default=1,
                        help="1: B resumes the version A checked in after its cold boot; 2: a site A2 resumes that "
                             "version and checks in again first, so B resumes one made by a resumed session")
    parser.add_argument("--guest", choices=GUESTS, default="small",
                        help="the test guest: small (direct kernel boot, the default) or diskboot (a Debian PC disk "
                             "with syslinux, booted by SeaBIOS; its own BENCHMARKS.md section)")
    parser.add_argument("--json", type=Path, help="write the raw results here (default: WORK.json)")
    parser.add_argument("--no-update", action="store_true", help="do not write BENCHMARKS.md")
    parser.add_argument("--timeout", type=float,
                        help="seconds any one step may take (default 600 + 1200 / rate in Mbit/s)")
    parser.add_argument("--work", type=Path, help="work directory (default: a new one under /var/tmp)")
    parser.add_argument("--spread", type=Path, nargs="+", metavar="JSON",
                        help="the cells every one of these runs measured, side by side (section "
                             f"'{matrix_report.SPREAD}')")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"),
                        help="the cells two runs measured (of two versions of the code), before beside after "
                             f"(section '{matrix_report.COMPARE}')")
    parser.add_argument("--report", type=Path, metavar="JSON",
                        help="measure nothing: write the sections from the raw results of an earlier run")
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (logs, traces); it is kept anyway when a cell failed")
    args = parser.parse_args(argv)
    args.mode = args.mode or "quick"
    preset = MODES[args.mode]
    overridden = any(getattr(args, name) for name in ("rates", "rtts", "policies", "ram", "peers")) or args.no_peers
    args.rates = int_list(args.rates) if args.rates else preset["rates"]
    args.explicit_rtts = bool(args.rtts)
    args.rtts = int_list(args.rtts) if args.rtts else preset["rtts"]
    args.ram = int_list(args.ram) if args.ram else preset["ram"]
    args.policies = name_list(args.policies, POLICIES, "policy") if args.policies else preset["policies"]
    args.peers = [] if args.no_peers else (name_list(args.peers, ALL_PEERS, "peer") if args.peers
                                           else preset["peers"])
    args.label = f"{args.mode} mode{' with overrides' if overridden else ''}"
    if not args.rates or any(r <= 0 for r in args.rates) or any(r < 0 for r in args.rtts) or not args.rtts:
        raise SystemExit("matrix: rates must be > 0 Mbit/s and RTTs >= 0 ms")
    return args


def report(results: dict[str, Any], update: bool) -> None:
    sections = matrix_report.sections(results)
    if results["meta"].get("guest", "small") != "small":
        # Another guest's run does not replace the matrix of the test guest: it has a section of its own.
        sections = {matrix_report.DISKBOOT: matrix_report.diskboot(results)}
    for title, body in sections.items():
        print(f"\n## {title}\n\n{body}")
    if update:
        matrix_report.write(sections)
        say("BENCHMARKS.md updated")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        report(json.loads(args.report.read_text()), not args.no_update)
        return 0
    if args.spread or args.compare:
        title = matrix_report.SPREAD if args.spread else matrix_report.COMPARE
        runs = [json.loads(path.read_text()) for path in args.spread or args.compare]
        body = matrix_report.spread(runs) if args.spread else matrix_report.compare(*runs)
        print(f"\n## {title}\n\n{body}")
        if not args.no_update:
            matrix_report.write({title: body})
            say("BENCHMARKS.md updated")
        return 0
    command = "bench/matrix.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    work = args.work or Path(tempfile.mkdtemp(prefix="isr-matrix-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    json_path = args.json or work.with_name(f"{work.name}.json")
    results: dict[str, Any] = {
        "meta": {"machine": machine(), "date": today(), "command": command, "mode": args.label,
                 "rates": args.rates, "rtts": args.rtts, "policies": args.policies, "ram": args.ram,
                 "peers": args.peers, "hops": args.hops, "work": str(work), "guest": args.guest},
        "local": {}, "links": {}, "cells": [], "peers": [], "notes": []}
    say(f"{command}: work directory {work}")
    if args.peers and peer_bench is None:
        results["notes"].append("peers not run: bench/peers.py is not there")
        args.peers = []
    guest = build(args.guest)
    started = time.monotonic()
    traces: dict[int, Trace] = {}
    try:
        for ram in args.ram:
            say(f"local baseline, {ram} MiB RAM")
            timeout = args.timeout or 600

            def local(ram: int = ram) -> dict[str, Any]:
                times, traces[ram] = local_baseline(guest, work / f"local-{ram}M", ram, timeout)
                return times

            results["local"][str(ram)] = attempt(f"local baseline {ram} MiB", local)
            say(f"local baseline {ram} MiB: {results['local'][str(ram)]}")
        run_matrix(args, guest, work, results, traces)
    except KeyboardInterrupt:
        results["notes"].append("interrupted (^C): the results are partial")
        say("interrupted: writing what was measured")
    finally:
        results["meta"]["seconds"] = round(time.monotonic() - started)
        results["chunk_sizes"] = attempt("chunk sizes", lambda: matrix_report.chunk_sizes(traces))
        json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
        say(f"raw results: {json_path}")
    report(results, not args.no_update)
    failed = [c for c in results["cells"] + results["peers"] if c.get("status") != "ok"]
    if args.keep or failed:
        say(f"kept {work} (logs of every site{', and of the failures' if failed else ''})")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def rtts_for(args: argparse.Namespace, rate: int, results: dict[str, Any]) -> list[int]:
    """The RTTs to run at ``rate`` (see FULL_ONE_RTT_AT_OR_BELOW)."""
    if args.mode != "full" or args.explicit_rtts or rate > FULL_ONE_RTT_AT_OR_BELOW or len(args.rtts) == 1:
        return args.rtts
    results["notes"].append(f"at {rate} Mbit/s only RTT +{args.rtts[0]} ms was run (full mode: a cell takes about "
                            f"6 minutes there, and the added RTT is small next to its transfers)")
    return args.rtts[:1]


def policies_for(args: argparse.Namespace, rate: int, ram: int, results: dict[str, Any]) -> list[str]:
    """The policies to run at ``rate`` and ``ram`` (see FULL_SLOW_LATER_RAM_POLICIES)."""
    if args.mode != "full" or rate > FULL_ONE_RTT_AT_OR_BELOW or ram == args.ram[0]:
        return args.policies
    wanted = [p for p in args.policies if p in FULL_SLOW_LATER_RAM_POLICIES]
    if wanted != args.policies:
        results["notes"].append(f"at {rate} Mbit/s with {ram} MiB of RAM only {', '.join(wanted) or 'no policy'} "
                                f"was run (full mode: the other policies would add about 40 minutes; the RAM "
                                f"question is whether a demand resume grows with it)")
    return wanted


def run_matrix(args: argparse.Namespace, guest: GuestArtifacts, work: Path, results: dict[str, Any],
               traces: dict[int, Trace]) -> None:
    env = start_isr_env(None, work / "isr", guest)
    try:
        with Toxiproxy.start() as toxi, contextlib.ExitStack() as stack:
            origin = stack.enter_context(peer_bench.peer_origin(guest, work / "origin")) if args.peers else None
            for rate in args.rates:
                timeout = args.timeout or 600 + 1200 / rate
                with shaped_namespaces(2, rate=f"{rate}mbit") as nets:
                    goodput = attempt(f"link goodput {rate} Mbit/s", lambda: {"goodput_mbit": link_bandwidth(
                        namespace=nets[0].name, ns_addr=nets[0].ns_ip)})
                    results["links"][str(rate)] = goodput
                    say(f"{rate} Mbit/s link: {goodput}")
                    proxies: list[Proxy] = []
                    try:
                        for i, net in enumerate(nets):
                            proxies.append(toxi.proxy(f"isr-{net.name}", listen=(net.host_ip, 0),
                                                      upstream=("127.0.0.1", env.port)))
                        for rtt in rtts_for(args, rate, results):
                            for proxy in proxies:
                                proxy.set_rtt(rtt)
                            for ram in args.ram:
                                key = {"rate": rate, "rtt": rtt, "ram": ram}
                                wanted = policies_for(args, rate, ram, results)
                                groups = [[p for p in wanted if p != "eager-writeback"],
                                          [p for p in wanted if p == "eager-writeback"]]
                                for policies in (g for g in groups if g):
                                    cells = run_isr_group(env, guest, work, nets, [p.address for p in proxies],
                                                          key, policies, timeout, args.hops)
                                    for cell in cells:
                                        add_prediction(cell, traces.get(ram), results["local"].get(str(ram)),
                                                       goodput.get("goodput_mbit"))
                                    results["cells"] += cells
                            if origin is not None:
                                results["peers"] += run_peers(origin, toxi, nets[1],
                                                              {"rate": rate, "rtt": rtt, "ram": args.ram[0]},
                                                              args.peers, work, guest)
                    finally:
                        for proxy in proxies:
                            with contextlib.suppress(Exception):
                                proxy.remove()
    finally:
        env.server.server.stop()


if __name__ == "__main__":
    sys.exit(main())
