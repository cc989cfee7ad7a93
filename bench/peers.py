#!/usr/bin/env python3
"""The peers the ISR policies are measured against: the same guest and workload, the same link, no ISR.

    .venv/bin/python bench/peers.py [--rate 10] [--rtt 20] [--peers qemu-curl,nbdkit-curl,copy-in]

As a module (bench/matrix.py): start `peer_origin` once, then call `measure_peer` for each peer at each site.
Standalone: one network namespace behind a tbf-shaped veth link (tests.isr_fixtures.shaped_namespaces), a
toxiproxy proxy on the host's end of the link that adds the round-trip time (tests/toxiproxy_fixtures.py), and one
table. Needs root.

The origin is nginx-light in the host's network namespace (bench/nginx_origin.py: HTTPS with a throwaway
self-signed certificate, HTTP/1.1, byte ranges) serving, from the test guest (`tools.guest`):

- ``disk.raw``: the raw data disk (byte ranges), and ``disk.qcow2``, the same disk as a qcow2 image (which
  qemu-curl and nbdkit-curl read instead with ``image="qcow2"``, ``--image qcow2``);
- ``disk.raw.zst``, ``vmlinux.zst``, ``initrd.zst``: the disk, kernel and initramfs compressed with zstd at
  the level ISR uses for its chunks (3).

The peers, each a cold boot (they carry no RAM state) followed by the guest's workload:

- ``qemu-curl``: QEMU's own https block driver on ``disk.raw`` (sslverify off, readahead 256 KiB, timeout
  60 s instead of its default 5 s, which failed the workload at 10 Mbit/s), under a local qcow2 overlay
  (``qemu-img create -f qcow2 -b json:{...} -F raw``) that takes the guest's writes;
- ``nbdkit-curl``: nbdkit's curl plugin on ``disk.raw`` with the cache filter (``cache-on-read=true``: every
  block read is kept in a local file, 64 KiB blocks) above the retry filter (reopens the plugin on an error,
  5 tries with back-off), served to QEMU over NBD on a Unix socket, under a local qcow2 overlay; nbdkit runs
  in the namespace, QEMU reaches it through the socket. No readahead filter: with Debian's nbdkit 1.32 the
  curl plugin serializes requests and has no cache callback, so the filter says it "won't do anything"
  (measured: the same requests and bytes); 256 KiB cache blocks fetched more and ran the workload slower
  at 10 Mbit/s;
- ``copy-in``: ISR-1 style: download ``disk.raw.zst`` whole (curl in the namespace, decompressed as it
  arrives to a local sparse file), then boot from that file.

The kernel and initramfs have no place on the guest's disk (it boots them with ``-kernel``/``-initrd``), and an
ISR resume fetches them as the parcel's boot files; so every peer fetches ``vmlinux.zst`` and ``initrd.zst``
over the same link before it starts QEMU (``boot_files=False`` uses the local files instead).

Every peer runs QEMU inside the site's namespace with the configuration of an ISR session (isrctl/session.py:
``pc-q35-7.2``, ``qemu64``, TCG, one vCPU, ``ram_mib``, virtio-blk with ``cache=writeback``, a VGA card with VNC
on a Unix socket). ``resume_s`` runs from the first byte fetched to the guest's ready marker, ``workload_s`` is
``run.sh`` right after (its result is checked), and ``link_bytes`` is what nginx logged for the run's own
requests (responses and requests with their HTTP headers; TLS and TCP framing not counted).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # imported as bench.peers
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from nginx_origin import Nginx, stop_process  # noqa: E402
from vulpes_common import table  # noqa: E402  (also puts the repository on sys.path)

from isrctl.errors import IsrError  # noqa: E402
from parcels.compress import DEFAULT_LEVEL  # noqa: E402
from tools.guest import GuestArtifacts, GuestError, booted_guest, build  # noqa: E402
from tests.isr_fixtures import NetSite, shaped_namespaces  # noqa: E402
from tests.toxiproxy_fixtures import Toxiproxy  # noqa: E402
from tests.vulpes_fixtures import make_certificate  # noqa: E402

PEERS = ("qemu-curl", "nbdkit-curl", "copy-in")
MIB = 1 << 20
#: zstd level of the compressed files: the level ISR compresses its chunks and boot files with.
ZSTD_LEVEL = DEFAULT_LEVEL
#: QEMU curl driver's readahead (its default) and request timeout (its default, 5 s, failed at 10 Mbit/s).
CURL_READAHEAD = 256 * 1024
CURL_TIMEOUT = 60
#: nbdkit: the filters, outermost first, and their parameters.
NBDKIT_FILTERS = ("cache", "retry")
NBDKIT_PARAMS = ("cache-on-read=true", "retries=5", "timeout=60")
READY_TIMEOUT = 600.0
WORKLOAD_TIMEOUT = 600.0
FETCH_TIMEOUT = 1800.0


class PeerError(RuntimeError):
    """A peer could not be set up or run (a download, nbdkit, QEMU, the guest)."""


@dataclass
class PeerResult:
    peer: str
    resume_s: float        # command start until the guest's ready marker (the guest is usable)
    workload_s: float      # the guest workload's wall time right after (same workload as the ISR runs)
    link_bytes: int        # bytes that crossed the link for this run (server-side access log)
    note: str = ""
    fetch_s: float = 0.0   # of resume_s, the downloads before QEMU started (boot files; copy-in: the disk)


@dataclass
class PeerOrigin:
    """The running origin: where a proxy forwards to (``host``:``port``), what it serves, its access log."""

    host: str
    port: int
    root: Path
    cert: Path
    nginx: Nginx
    #: Size of the raw disk in bytes (the overlays' virtual size).
    disk_size: int
    #: Served file name -> size in bytes.
    sizes: dict[str, int]

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def url(self, host: str, port: int, name: str, tag: str) -> str:
        """The URL of ``name`` as a client reaching the origin at host:port fetches it in run ``tag``."""
        return f"https://{host}:{port}/r/{tag}/{name}"


def _run(args: list[str], timeout: float = 300) -> None:
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerError(f"{args[0]} failed: {exc}") from exc
    if result.returncode != 0:
        raise PeerError(f"{' '.join(args)} exited with {result.returncode}: {result.stderr.strip()[-1000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def peer_origin(guest: GuestArtifacts, work: Path, *, port: int = 0) -> Iterator[PeerOrigin]:
    """nginx on the host (all addresses, ``port`` or a free one) serving the guest's disk raw, as qcow2 and
    compressed, and its kernel and initramfs compressed; stopped on exit. Proxies forward to
    ``origin.address`` (127.0.0.1)."""
    root = work / "origin"
    root.mkdir(parents=True, exist_ok=True)
    (root / "disk.raw").unlink(missing_ok=True)
    (root / "disk.raw").symlink_to(guest.disk)
    _run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(guest.disk), str(root / "disk.qcow2")])
    for source, name in ((guest.disk, "disk.raw.zst"), (guest.kernel, "vmlinux.zst"), (guest.initrd, "initrd.zst")):
        _run(["zstd", f"-{ZSTD_LEVEL}", "-T0", "-q", "-f", str(source), "-o", str(root / name)])
    (work / "tls").mkdir(exist_ok=True)
    cert, key = make_certificate(work / "tls")
    port = port or _free_port()
    sizes = {p.name: p.stat().st_size for p in root.iterdir()}
    with Nginx(work, root=root, cert=cert, key=key, listen=f"0.0.0.0:{port}", name="peer-origin") as nginx:
        yield PeerOrigin(host="127.0.0.1", port=port, root=root, cert=cert, nginx=nginx,
                         disk_size=guest.disk.stat().st_size, sizes=sizes)


# --- one run ---------------------------------------------------------------------------------------------------

def _in_namespace(site: NetSite, args: list[str]) -> list[str]:
    return ["nsenter", f"--net={site.path}", *args]


def _fetch_all(site: NetSite, downloads: list[tuple[str, Path]]) -> None:
    """Download and decompress each (url of a .zst file, local file) at once, curl inside the namespace and
    zstd writing a sparse file as the bytes arrive."""
    pipelines: list[tuple[str, subprocess.Popen[bytes], subprocess.Popen[bytes]]] = []
    try:
        for url, dest in downloads:
            curl = subprocess.Popen(_in_namespace(site, ["curl", "-sS", "--fail", "--insecure", "--http1.1", url]),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert curl.stdout is not None
            unzstd = subprocess.Popen(["zstd", "-d", "-q", "-f", "--sparse", "-o", str(dest)], stdin=curl.stdout,
                                      stderr=subprocess.PIPE)
            curl.stdout.close()  # zstd holds the read end now
            pipelines.append((url, curl, unzstd))
        deadline = time.monotonic() + FETCH_TIMEOUT
        for url, curl, unzstd in pipelines:
            for proc in (curl, unzstd):
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise PeerError(f"fetching {url} took more than {FETCH_TIMEOUT:g} s") from None
                if proc.returncode != 0:
                    err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
                    raise PeerError(f"fetching {url}: {'curl' if proc is curl else 'zstd'} exited with "
                                    f"{proc.returncode}: {err[-500:]}")
    finally:
        for _, curl, unzstd in pipelines:
            for proc in (curl, unzstd):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


@contextlib.contextmanager
def _nbdkit(site: NetSite, url: str, socket_path: Path, cache_dir: Path, log_path: Path) -> Iterator[None]:
    """nbdkit (curl plugin, `NBDKIT_FILTERS`) in the namespace, serving ``url`` read-only on a Unix socket."""
    filters = [f"--filter={f}" for f in NBDKIT_FILTERS]
    args = _in_namespace(site, ["env", f"TMPDIR={cache_dir}", "nbdkit", "--foreground", "--readonly",
                                "--exit-with-parent", "--unix", str(socket_path), *filters,
                                "curl", f"url={url}", "sslverify=false", *NBDKIT_PARAMS])
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not socket_path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise PeerError(f"nbdkit did not start: {log_path.read_text(errors='replace')[-1000:]}")
            time.sleep(0.02)
        yield
    finally:
        stop_process(proc)


def _overlay(path: Path, image_format: str, protocol: dict[str, object], size: int) -> None:
    """A local qcow2 overlay over an ``image_format`` image behind ``protocol`` (block driver options),
    created without opening the backing file."""
    backing = "json:" + json.dumps({"driver": image_format, "file": protocol}, separators=(",", ":"))
    _run(["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", backing, "-F", image_format, str(path), str(size)])


def measure_peer(peer: str, origin: PeerOrigin, *, site: NetSite, host: str, port: int, work: Path,
                 guest: GuestArtifacts, ram_mib: int = 256, boot_files: bool = True, image: str = "raw",
                 keep: bool = False) -> PeerResult:
    """Run one peer at a site: fetch through https://{host}:{port}/ only, QEMU inside ``site``'s namespace.

    ``boot_files``: fetch the kernel and initramfs over the link too (as an ISR resume does), else use the
    local files. ``image``: what qemu-curl and nbdkit-curl read over the link, ``raw`` or ``qcow2``. A failure (a download, nbdkit, QEMU, the guest or its workload) raises `PeerError` saying
    which and where the logs are. ``keep`` keeps the run's downloaded files and overlay in ``work``; logs are
    always kept.
    """
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}: choose one of {', '.join(PEERS)}")
    if image not in ("raw", "qcow2"):
        raise ValueError(f"unknown image format {image!r}: raw or qcow2")
    tag = f"{peer}-{secrets.token_hex(4)}"
    run_dir = work / tag
    run_dir.mkdir(parents=True)
    # Unix socket paths are limited to 107 bytes: the sockets go to a short private directory.
    sock_dir = Path(tempfile.mkdtemp(prefix="isr-peer-"))
    wrapper = run_dir / "qemu-in-namespace"
    wrapper.write_text(f"#!/bin/sh\nexec nsenter --net={site.path} qemu-system-x86_64 \"$@\"\n")
    wrapper.chmod(0o755)
    kernel, initrd = guest.kernel, guest.initrd
    notes = ["cold boot, no RAM state"]
    overrides: dict[str, object] = dict(qemu_binary=str(wrapper), memory_mib=ram_mib,
                                        vnc=f"unix:{sock_dir / 'vnc.sock'}", disk_cache="writeback")
    resume_s = math.nan
    stack = contextlib.ExitStack()
    try:
        started = time.monotonic()
        downloads: list[tuple[str, Path]] = []
        if boot_files:
            kernel, initrd = run_dir / "vmlinux", run_dir / "initrd.cpio"
            downloads += [(origin.url(host, port, "vmlinux.zst", tag), kernel),
                          (origin.url(host, port, "initrd.zst", tag), initrd)]
            notes.append("kernel+initrd fetched (zstd)")
        else:
            notes.append("kernel+initrd local")
        if peer == "copy-in":
            disk, disk_format = run_dir / "disk.raw", "raw"
            downloads.append((origin.url(host, port, "disk.raw.zst", tag), disk))
            notes.append(f"whole disk fetched (zstd, {origin.sizes['disk.raw.zst'] / MIB:.1f} MiB), then boot")
        _fetch_all(site, downloads)
        fetch_s = time.monotonic() - started
        if peer == "qemu-curl":
            disk, disk_format = run_dir / "overlay.qcow2", "qcow2"
            _overlay(disk, image, {"driver": "https", "url": origin.url(host, port, f"disk.{image}", tag),
                                   "sslverify": "off", "readahead": str(CURL_READAHEAD),
                                   "timeout": str(CURL_TIMEOUT)}, origin.disk_size)
            notes.append(f"{image} image, qcow2 overlay, readahead {CURL_READAHEAD // 1024} KiB, "
                         f"timeout {CURL_TIMEOUT} s")
        elif peer == "nbdkit-curl":
            disk, disk_format = run_dir / "overlay.qcow2", "qcow2"
            socket_path = sock_dir / "nbd.sock"
            stack.enter_context(_nbdkit(site, origin.url(host, port, f"disk.{image}", tag), socket_path, run_dir,
                                        run_dir / "nbdkit.log"))
            _overlay(disk, image, {"driver": "nbd", "server": {"type": "unix", "path": str(socket_path)}},
                     origin.disk_size)
            notes.append(f"{image} image, filters {'+'.join(NBDKIT_FILTERS)} ({', '.join(NBDKIT_PARAMS)}), "
                         "qcow2 overlay")
        with booted_guest(guest, disk, run_dir=run_dir, name="qemu", ready_timeout=READY_TIMEOUT,
                          disk_format=disk_format, kernel=kernel, initrd=initrd, **overrides) as booted:
            resume_s = time.monotonic() - started
            t0 = time.monotonic()
            result = booted.console.run_workload(timeout=WORKLOAD_TIMEOUT)
            workload_s = time.monotonic() - t0
            if result.get("digest") != guest.expected.digest:
                raise PeerError(f"the workload's digest {result.get('digest')} is not the expected "
                                f"{guest.expected.digest}")
    except (PeerError, GuestError, IsrError, OSError) as exc:
        qemu_log = run_dir / "qemu.log"
        tail = qemu_log.read_text(errors="replace").strip()[-300:] if qemu_log.exists() else ""
        where = "during the workload" if not math.isnan(resume_s) else "before the guest was ready"
        raise PeerError(f"{peer} failed {where}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                        + (f" (QEMU log: {tail!r})" if tail else "") + f"; logs in {run_dir}") from exc
    finally:
        stack.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
        if not keep:
            for name in ("vmlinux", "initrd.cpio", "disk.raw", "overlay.qcow2"):
                (run_dir / name).unlink(missing_ok=True)
    time.sleep(0.2)  # nginx logs a request when its response is done: let the last ones land
    traffic = origin.nginx.traffic(tag)
    notes.append(f"{traffic.requests} requests")
    return PeerResult(peer, resume_s, workload_s, traffic.total, "; ".join(notes), fetch_s)


# --- standalone -------------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=10, help="link rate in Mbit/s each way (default 10)")
    parser.add_argument("--rtt", type=float, default=20, help="added round-trip time in ms (default 20)")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset of " + ", ".join(PEERS))
    parser.add_argument("--ram-mib", type=int, default=256)
    parser.add_argument("--image", choices=("raw", "qcow2"), default="raw",
                        help="what qemu-curl and nbdkit-curl read over the link (default raw)")
    parser.add_argument("--local-boot-files", action="store_true",
                        help="boot the local kernel and initramfs instead of fetching them over the link")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="work in DIR and keep everything there")
    args = parser.parse_args()
    peers = [p for p in args.peers.split(",") if p]
    for p in peers:
        if p not in PEERS:
            parser.error(f"unknown peer {p!r}: choose from {', '.join(PEERS)}")
    guest = build("small")
    rows = []
    work = args.keep or Path(tempfile.mkdtemp(prefix="isr-peers-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        with peer_origin(guest, work) as origin, Toxiproxy.start() as toxi, \
                shaped_namespaces(1, rate=f"{args.rate:g}mbit") as (site,):
            proxy = toxi.proxy("peers", listen=(site.host_ip, 0), upstream=origin.address)
            proxy.set_rtt(args.rtt)
            for peer in peers:
                try:
                    r = measure_peer(peer, origin, site=site, host=proxy.listen[0], port=proxy.listen[1],
                                     work=work, guest=guest, ram_mib=args.ram_mib,
                                     boot_files=not args.local_boot_files, image=args.image,
                                     keep=args.keep is not None)
                except PeerError as exc:
                    print(exc, flush=True)
                    rows.append([peer, "failed", "failed", "-", str(exc)[:300]])
                    continue
                print(f"{peer}: resume {r.resume_s:.1f} s (downloads {r.fetch_s:.1f} s), workload {r.workload_s:.1f} s, "
                      f"{r.link_bytes / MIB:.1f} MiB ({r.note})", flush=True)
                rows.append([peer, f"{r.resume_s:.1f} ({r.fetch_s:.1f})", f"{r.workload_s:.1f}",
                             f"{r.link_bytes / MIB:.1f}", r.note])
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nLink {args.rate:g} Mbit/s each way (tbf), RTT +{args.rtt:g} ms (toxiproxy), guest {guest.variant}, "
          f"{args.ram_mib} MiB RAM, TCG:\n")
    print(table(["peer", "resume (s) (of which downloads)", "workload (s)", "link (MiB)", "note"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
