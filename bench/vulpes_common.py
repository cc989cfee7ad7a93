"""Shared pieces of the vulpes benchmarks: a shaped network namespace with a real isr-server in it, parcel
state for vulpes (via tests.vulpes_fixtures), and updating one section of BENCHMARKS.md.

Only namespace-local addresses are used (10.231.0.0/24 on a veth pair). Everything is torn down in
``finally`` blocks: the namespace, the server, the mounts.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BIN = Path(sys.executable).parent
NETNS = "isrbench"
HOST_IF, NS_IF = "isrb0", "isrb1"
HOST_ADDR, NS_ADDR = "10.231.0.1", "10.231.0.2"


def run(*cmd: str, ns: bool = False, check: bool = True) -> subprocess.CompletedProcess[str]:
    full = (["ip", "netns", "exec", NETNS] if ns else []) + list(cmd)
    return subprocess.run(full, capture_output=True, text=True, check=check, timeout=60)


def machine() -> str:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, Linux {platform.release()}"


def shape(mbit: float | None) -> None:
    """tbf on both ends of the veth pair (None: unshaped)."""
    for dev, ns in ((HOST_IF, False), (NS_IF, True)):
        run("tc", "qdisc", "del", "dev", dev, "root", ns=ns, check=False)
        if mbit:
            burst = max(16 * 1024, int(mbit * 1e6 / 8 / 100))
            run("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst),
                "latency", "400ms", ns=ns)


@contextlib.contextmanager
def netns() -> Iterator[None]:
    run("ip", "netns", "del", NETNS, check=False)
    run("ip", "link", "del", HOST_IF, check=False)
    run("ip", "netns", "add", NETNS)
    try:
        run("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        run("ip", "link", "set", NS_IF, "netns", NETNS)
        run("ip", "addr", "add", f"{HOST_ADDR}/24", "dev", HOST_IF)
        run("ip", "link", "set", HOST_IF, "up")
        run("ip", "addr", "add", f"{NS_ADDR}/24", "dev", NS_IF, ns=True)
        run("ip", "link", "set", NS_IF, "up", ns=True)
        run("ip", "link", "set", "lo", "up", ns=True)
        yield
    finally:
        run("ip", "link", "del", HOST_IF, check=False)
        run("ip", "netns", "del", NETNS, check=False)


def use_namespace(name: str, host_if: str, ns_if: str, subnet: str) -> None:
    """Use namespace ``name``, veth pair ``host_if``/``ns_if`` and ``subnet``.1/.2 (e.g. "10.232.0") instead of
    the defaults in everything below, so that a benchmark can run while another one uses the defaults
    (``netns()`` deletes a namespace of its name before it starts)."""
    global NETNS, HOST_IF, NS_IF, HOST_ADDR, NS_ADDR
    NETNS, HOST_IF, NS_IF, HOST_ADDR, NS_ADDR = name, host_if, ns_if, f"{subnet}.1", f"{subnet}.2"


def link_bandwidth(seconds: float = 4.0, *, namespace: str | None = None, ns_addr: str | None = None) -> float:
    """Measured bulk TCP goodput from the network namespace ``namespace`` (address ``ns_addr``; default: the
    current namespace of this module) to the host, in Mbit/s (one connection)."""
    namespace = namespace or NETNS
    ns_addr = ns_addr or NS_ADDR
    port = 5399
    sender = subprocess.Popen(
        ["ip", "netns", "exec", namespace, sys.executable, "-c",
         "import socket,time\n"
         f"s=socket.create_server(('{ns_addr}',{port}));c,_=s.accept();buf=b'x'*65536\n"
         f"end=time.monotonic()+{seconds + 2}\n"
         "try:\n while time.monotonic()<end: c.sendall(buf)\nexcept OSError: pass\n"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                conn = socket.create_connection((ns_addr, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        with conn:
            # Skip the first second (slow start, tbf bucket), then count.
            start = time.monotonic()
            while time.monotonic() - start < 1.0:
                conn.recv(1 << 20)
            total, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < seconds:
                data = conn.recv(1 << 20)
                if not data:
                    break
                total += len(data)
            elapsed = time.monotonic() - t0
    finally:
        sender.kill()
        sender.wait()
    return total * 8 / elapsed / 1e6


@dataclass
class NsServer:
    url: str
    pin: str
    token_file: Path
    store: Path
    cert: Path
    proc: subprocess.Popen[str]

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


def start_server(work: Path, workers: int = 2) -> NsServer:
    """A real isr-server (sqlite, directory store) inside the namespace, a user and its token."""
    from isrctl.remote import Remote
    from tests.vulpes_fixtures import spki_pin

    data = work / "server"
    data.mkdir(parents=True, exist_ok=True)
    settings = {"server.listen": f"{NS_ADDR}:8443", "server.workers": workers, "server.data_dir": str(data)}
    sections: dict[str, list[str]] = {}
    for key, value in settings.items():
        section, _, name = key.partition(".")
        sections.setdefault(section, []).append(f"{name} = {json.dumps(value)}")
    config = data / "isr-server.toml"
    config.write_text("".join(f"[{s}]\n" + "\n".join(v) + "\n" for s, v in sections.items()))
    subprocess.run([str(BIN / "isr-admin"), "-c", str(config), "user", "add", "bench", "--password-file", "-"],
                   input="bench-password\n", text=True, check=True, capture_output=True, timeout=60)
    proc = subprocess.Popen(["ip", "netns", "exec", NETNS, str(BIN / "isr-server"), "-c", str(config)],
                            stdout=subprocess.PIPE, stderr=open(data / "server.log", "w"), text=True,
                            start_new_session=True)
    url = fingerprint = ""
    stdout = proc.stdout
    assert stdout is not None
    for line in stdout:
        if "listening on " in line:
            url = line.split("listening on ", 1)[1].strip()
        elif "certificate fingerprint " in line:
            fingerprint = line.split("certificate fingerprint ", 1)[1].strip()
        if url and fingerprint:
            break
    if not url:
        proc.kill()
        raise SystemExit(f"isr-server did not start:\n{(data / 'server.log').read_text()}")
    threading.Thread(target=lambda: [None for _ in stdout], daemon=True).start()
    deadline = time.monotonic() + 30
    while True:
        try:
            with Remote(url, fingerprint=fingerprint) as client:
                token = client.login("bench", "bench-password", label="bench")
            break
        except Exception:  # noqa: BLE001
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.1)
    token_file = work / "token"
    token_file.write_text(token + "\n")
    cert = data / "tls" / "server.crt"
    return NsServer(url, spki_pin(cert), token_file, data / "store", cert, proc)


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def update_section(title: str, body: str) -> None:
    """Replace (or append) the '## title' section of BENCHMARKS.md."""
    path = REPO / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n\nMeasured numbers only, each with its machine, date and command.\n"
    section = f"## {title}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)


def today() -> str:
    return datetime.date.today().isoformat()


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
