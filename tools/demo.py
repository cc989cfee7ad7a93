"""The demo behind `./bootstrap demo`: Internet Suspend/Resume end to end, with the time of each phase.

1. The real test guest (a Debian kernel, a busybox userland, an ext4 disk with source files) is packed into
   an encrypted parcel on a local isr-server running on its embedded defaults (sqlite, a directory store,
   a self-signed certificate), with isr-admin.
2. Two "sites", each with its own `isr` configuration, chunk cache and network namespace behind a
   shaped link (tbf), log in with the server's pinned certificate.
3. Site A resumes the parcel (it boots: version 1 is powered off), runs the guest's workload, leaves a
   RAM-only token, and suspends: a new version is checked in.
4. Site B resumes it with demand fetch: the guest continues exactly where it stopped (the counter in
   its RAM goes on, the token is still in RAM, the workload's files are on its disk). B suspends too.

Without network namespaces (not root), both sites use loopback. Run: `python -m tools.demo [--keep DIR]`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isrctl.detach import process_alive
from isrctl.errors import IsrError
from parcels.errors import ParcelError
from tools.guest import GuestConsole, GuestError, build
from tools.guest.boot import KERNEL_CMDLINE

USER = "demo"
PASSWORD = "demo-password"
LINK_RATES = {"A": "100mbit", "B": "50mbit"}


def _say(text: str) -> None:
    print(text, flush=True)


@contextmanager
def _phase(title: str) -> Iterator[None]:
    _say(f"\n\033[1m▶ {title}\033[0m")
    started = time.monotonic()
    yield
    _say(f"  ({time.monotonic() - started:.1f} s)")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _run(args: list[str], *, env: dict[str, str] | None = None, input_text: str | None = None,
         timeout: float = 600) -> str:
    result = subprocess.run(args, capture_output=True, text=True, env=env, input=input_text, timeout=timeout)
    if result.returncode != 0:
        raise IsrError(f"{' '.join(args[:4])} ... failed ({result.returncode}):\n{result.stderr}{result.stdout}")
    return result.stdout


class Server:
    """isr-server on its embedded defaults, in a data directory of its own."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.fingerprint = ""
        self.port = 0

    def admin(self, *args: str, input_text: str | None = None) -> str:
        return _run([sys.executable, "-m", "server.admin", "--data-dir", str(self.data_dir), *args],
                    input_text=input_text)

    def start(self, listen: str) -> None:
        log = open(self.data_dir.parent / "server.log", "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "server.main", "--data-dir", str(self.data_dir),
                                      "--listen", listen], stdout=subprocess.PIPE, stderr=log, text=True,
                                     start_new_session=True)
        log.close()
        assert self.proc.stdout is not None
        lines: list[str] = []

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.append(line)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 60
        while not (self.url and self.fingerprint):
            for line in list(lines):
                if "listening on " in line:
                    self.url = line.split("listening on ", 1)[1].strip()
                elif "certificate fingerprint " in line:
                    self.fingerprint = line.split("certificate fingerprint ", 1)[1].strip()
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise IsrError(f"isr-server did not start:\n{''.join(lines)}")
            time.sleep(0.05)
        self.port = int(self.url.rsplit(":", 1)[1])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)


@dataclass
class Site:
    """One PC: its own XDG directories and (when possible) its own network namespace."""

    name: str
    root: Path
    netns: str | None
    server_host: str
    runtime: Path

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(XDG_CONFIG_HOME=str(self.root / "config"), XDG_DATA_HOME=str(self.root / "data"),
                   XDG_CACHE_HOME=str(self.root / "cache"), XDG_RUNTIME_DIR=str(self.runtime),
                   ISR_DEMO_PASSWORD=PASSWORD)
        return env

    def isr(self, *args: str) -> str:
        prefix = ["nsenter", f"--net=/run/netns/{self.netns}"] if self.netns else []
        return _run([*prefix, sys.executable, "-m", "isrctl.cli", *args], env=self.env())

    def session(self) -> dict[str, object]:
        for path in (self.root / "data" / "isr" / "parcels").glob("*/session.json"):
            return dict(json.loads(path.read_text()))
        raise IsrError(f"no session is running at site {self.name}")

    @contextmanager
    def console(self) -> Iterator[GuestConsole]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(self.session()["console"]))
        console = GuestConsole(sock, name=f"site-{self.name}")
        try:
            yield console
        finally:
            console.close()
            sock.close()

    def wait_session_end(self, timeout: float = 120) -> None:
        with contextlib.suppress(IsrError):
            pid = int(str(self.session()["pid"]))
            deadline = time.monotonic() + timeout
            while process_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)

    def logs(self) -> str:
        """The tails of this site's session, vulpes and QEMU logs (printed when the demo fails)."""
        out = []
        for state in (self.root / "data" / "isr" / "parcels").glob("*"):
            for name in ("session.log", "vulpes.log", "qemu/vm.log", "qemu/console.log"):
                path = state / name
                if path.exists():
                    out.append(f"--- site {self.name}: {name}\n{path.read_text(errors='replace')[-2500:]}")
        return "\n".join(out)

    def cleanup(self) -> None:
        """Kill whatever the site still runs (only after a failure) and detach its mounts."""
        for path in (self.root / "data" / "isr" / "parcels").glob("*/session.json"):
            with contextlib.suppress(OSError, ValueError):
                info = json.loads(path.read_text())
                for key in ("pid", "qemu_pid", "vulpes_pid"):
                    if info.get(key):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(info[key]), 9)
        with contextlib.suppress(OSError):
            with open("/proc/self/mounts") as f:
                mounts = [line.split()[1] for line in f if str(self.runtime) in line]
            for mount in mounts:
                subprocess.run(["fusermount3", "-u", "-z", mount], capture_output=True, timeout=30)
        shutil.rmtree(self.runtime, ignore_errors=True)


@contextmanager
def _namespaces(names: list[str]) -> Iterator[dict[str, tuple[str, str]]]:
    """A network namespace per site, joined to this host by a veth link shaped with tbf in both directions.
    Yields {site: (namespace, address of the host end)}; empty when namespaces cannot be made here."""
    made: list[tuple[str, str]] = []
    out: dict[str, tuple[str, str]] = {}
    tag = secrets.token_hex(2)
    net = 100 + secrets.randbelow(100)
    try:
        try:
            _make_links(names, tag, net, made, out)
        except IsrError as exc:
            if os.geteuid() == 0:
                raise
            _say(f"  (no network namespaces without root: {exc.args[0].splitlines()[0]}; both sites use loopback)")
            out.clear()
        yield out
    finally:
        for ns, host_if in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            subprocess.run(["ip", "link", "del", host_if], capture_output=True)


def _make_links(names: list[str], tag: str, net: int, made: list[tuple[str, str]],
                out: dict[str, tuple[str, str]]) -> None:
    def ip(*args: str) -> None:
        _run(["ip", *args])

    for i, name in enumerate(names):
        ns, host_if, ns_if = f"isr-demo-{tag}-{name}", f"vd{tag}{i}h", f"vd{tag}{i}n"
        host_ip, ns_ip = f"10.{net}.{i + 1}.1", f"10.{net}.{i + 1}.2"
        ip("netns", "add", ns)
        made.append((ns, host_if))
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip("link", "set", ns_if, "netns", ns)
        ip("addr", "add", f"{host_ip}/24", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/24", "dev", ns_if)
        ip("netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        tbf = ["tbf", "rate", LINK_RATES[name], "burst", "256kb", "latency", "400ms"]
        _run(["tc", "qdisc", "add", "dev", host_if, "root", *tbf])
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", ns_if, "root", *tbf])
        out[name] = (ns, host_ip)


def _quote(output: str) -> None:
    for line in output.rstrip().splitlines():
        _say(f"  | {line}")


def run(workdir: Path) -> None:
    _say("Internet Suspend/Resume — your whole PC as a virtual machine that follows you.")
    _say(f"Working in {workdir}")

    with _phase("Build the test guest (a Debian kernel, a busybox userland, an ext4 disk with real source files)"):
        guest = build("small")
        _say(f"  kernel {guest.kernel.name}, disk {_mib(guest.disk.stat().st_size)} (cached in {guest.directory})")

    server = Server(workdir / "server")
    sites: list[Site] = []
    try:
        _run_sites(workdir, guest, server, sites)
    except BaseException:
        for site in sites:
            print(site.logs(), file=sys.stderr)
        raise


def _run_sites(workdir: Path, guest: Any, server: Server, sites: list[Site]) -> None:
    with contextlib.ExitStack() as stack:
        stack.callback(server.stop)
        with _phase("Start isr-server on its embedded defaults and create the parcel with isr-admin"):
            (workdir / "server").mkdir()
            server.admin("user", "add", USER, "--password-file", "-", input_text=PASSWORD + "\n")
            keyfile = workdir / "parcel.key"
            keyfile.write_bytes(os.urandom(32))
            created = json.loads(server.admin(
                "--json", "parcel", "create", "--owner", USER, "--name", "demo", "--disk", str(guest.disk),
                "--ram", "256", "--machine", "pc-q35-7.2", "--kernel", str(guest.kernel), "--initrd",
                str(guest.initrd), "--cmdline", KERNEL_CMDLINE, "--key-file", str(keyfile)))
            store = workdir / "server" / "store"
            stored = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
            server.start("0.0.0.0:0")
            _say(f"  {server.url}, certificate {server.fingerprint[:23]}…")
            _say(f"  parcel demo ({created['id']}), version 1: {_mib(stored)} of ciphertext in the store "
                 f"(disk chunks compressed and encrypted; the server never sees a key)")

        nets = stack.enter_context(_namespaces(["A", "B"]))
        for name in ("A", "B"):
            netns, host = nets.get(name, (None, "127.0.0.1"))
            site = Site(name, workdir / f"site-{name}", netns, host, Path(tempfile.mkdtemp(prefix="isr-demo-rt-")))
            sites.append(site)
            stack.callback(site.cleanup)
        site_a, site_b = sites
        with _phase("Two sites log in, each pinning the server's certificate"):
            for site in sites:
                site.isr("login", f"https://{site.server_host}:{server.port}", "--user", USER, "--fingerprint",
                         server.fingerprint, "--site", f"site-{site.name}", "--password-env", "ISR_DEMO_PASSWORD")
                link = f"own network namespace, link shaped to {LINK_RATES[site.name]}" if site.netns else "loopback"
                _say(f"  site {site.name}: own config, cache and state ({link})")

        with _phase("Site A: isr resume (version 1 is powered off, so the guest boots)"):
            _quote(site_a.isr("resume", "demo", "--detach", "--vnc", "unix", "--key-file", str(keyfile)))
            with site_a.console() as console:
                console.wait_ready(90)
        with _phase("Site A: the user works (the guest's workload) and leaves a token in RAM"):
            with site_a.console() as console:
                result = console.run_workload(timeout=300)
                _say(f"  workload: {result['files']} files unpacked, searched and checksummed, "
                     f"digest {result['digest'][:16]}… in {result.get('seconds', '?')} s")
                ok = result["digest"] == guest.expected.digest
                _say(f"  digest {'matches' if ok else 'DOES NOT MATCH'} the one computed on the host")
                token = console.set_token()
                count_a = console.counter()
                files_a = console.check("find /data/work -type f | wc -l").strip()
                _say(f"  RAM token {token[:12]}…, RAM counter at {count_a}, {files_a} files in /data/work")
            if not ok:
                raise IsrError("the guest's workload result differs from the host's")
        with _phase("Site A: isr suspend (save the device state, make RAM and disk durable, check in)"):
            _quote(site_a.isr("suspend", "demo"))
            site_a.wait_session_end()
            suspended_at = time.monotonic()

        with _phase("Site B: isr resume --policy demand (only the device state now; chunks on first touch)"):
            out = site_b.isr("resume", "demo", "--detach", "--vnc", "unix", "--policy", "demand", "--key-file",
                             str(keyfile))
            _quote(out)
            match = re.search(r"resumed in ([0-9.]+) s", out)
        with _phase("Site B: the guest carries on where it stopped"):
            with site_b.console() as console:
                count_b = console.counter()
                same_token = console.token() == token
                files_b = console.check("find /data/work -type f | wc -l").strip()
            _say(f"  RAM counter {count_a} -> {count_b} (it kept counting; {time.monotonic() - suspended_at:.0f} s "
                 f"passed on the host since the suspend)")
            _say(f"  RAM token {'still there' if same_token else 'LOST'}; {files_b} files in /data/work")
            if not same_token or count_b < count_a or files_b != files_a:
                raise IsrError("the guest did not continue where it stopped")
            status = json.loads(site_b.isr("stat", "demo", "--json"))["parcels"][0]
            fetch = (status.get("session_status") or {}).get("vulpes", {}).get("fetch", {})
            _say(f"  demand-fetched so far: {fetch.get('fetches', '?')} chunks, {_mib(int(fetch.get('bytes', 0)))}")
        with _phase("Site B: isr suspend"):
            _quote(site_b.isr("suspend", "demo"))
            site_b.wait_session_end()
        _quote(site_b.isr("ls", "-l"))
        if match:
            _say(f"\nResume latency at site B (t4, demand fetch): {match.group(1)} s.")
    _say("\nDone. Next: isr hoard and --policy proactive make the resume instant; see doc/isrctl.md.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="work in DIR and keep it afterwards (default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="isr-demo-"))
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        run(workdir)
        return 0
    except (IsrError, ParcelError, GuestError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
