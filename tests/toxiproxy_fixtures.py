"""toxiproxy: faults and delay injected in user space on a real TCP path, for the fault tests and the benchmarks.

The kernel here has no netem. A toxiproxy server forwards TCP connections from a listening address to an
upstream one and applies "toxics" to the data: `latency` (delay every piece of data), `bandwidth` (KB/s),
`timeout` (pass nothing; with a timeout of 0 hold the data until the toxic is removed, else close the
connection after that many ms), `reset_peer` (reset with RST), `slow_close` (delay the close), `limit_data`
(close the connection once that many bytes have passed). Toxics act on connections that are already open
as well as new ones. Used by tests/test_vulpes_faults.py and, through ``sys.path``, by bench/ (one copy of
the driver for both; bench/ imports tests/ already).

    with Toxiproxy.start() as toxi:
        proxy = toxi.proxy("site-a", listen=("10.1.1.1", 0), upstream=("127.0.0.1", 8443))
        proxy.set_rtt(40)                                   # milliseconds
        with proxy.toxic("reset_peer", timeout=0):          # every connection is reset while inside
            ...

`./bootstrap setup` (and `test`, `bench`) installs the server as /usr/local/bin/toxiproxy-server.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

BINARY = os.environ.get("TOXIPROXY_SERVER", "toxiproxy-server")


class ToxiproxyError(RuntimeError):
    """toxiproxy is missing or refused a request."""


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Proxy:
    api: httpx.Client
    name: str
    listen: tuple[str, int]
    upstream: tuple[str, int]

    def add_toxic(self, name: str, kind: str, *, stream: str = "downstream", toxicity: float = 1.0,
                  **attributes: int) -> None:
        """Add toxic ``name`` of type ``kind`` on one direction ("downstream": server to client)."""
        r = self.api.post(f"/proxies/{self.name}/toxics", json={
            "name": name, "type": kind, "stream": stream, "toxicity": toxicity, "attributes": attributes})
        if r.status_code >= 300:
            raise ToxiproxyError(f"toxiproxy refused a {kind} toxic on {self.name}: {r.text.strip()}")

    def remove_toxic(self, name: str) -> None:
        """Remove toxic ``name`` (absent is fine)."""
        self.api.delete(f"/proxies/{self.name}/toxics/{name}")

    @contextlib.contextmanager
    def toxic(self, kind: str, *, stream: str = "downstream", toxicity: float = 1.0,
              **attributes: int) -> Iterator[None]:
        """One toxic while inside the block, removed on leaving it (also on an exception)."""
        name = f"{kind}-{stream}"
        self.add_toxic(name, kind, stream=stream, toxicity=toxicity, **attributes)
        try:
            yield
        finally:
            self.remove_toxic(name)

    def set_enabled(self, enabled: bool) -> None:
        """Disabled, the proxy closes every connection and refuses new ones (a link that is down)."""
        r = self.api.post(f"/proxies/{self.name}", json={"enabled": enabled})
        if r.status_code >= 300:
            raise ToxiproxyError(f"toxiproxy refused to {'enable' if enabled else 'disable'} {self.name}: "
                                 f"{r.text.strip()}")

    def set_rtt(self, rtt_ms: float) -> None:
        """Add ``rtt_ms`` of round-trip time: half on the way out, half on the way back (0 removes it)."""
        for stream in ("upstream", "downstream"):
            toxic = f"rtt-{stream}"
            self.remove_toxic(toxic)
            if rtt_ms > 0:
                self.add_toxic(toxic, "latency", stream=stream, latency=int(round(rtt_ms / 2)), jitter=0)

    @property
    def address(self) -> str:
        return f"{self.listen[0]}:{self.listen[1]}"

    def remove(self) -> None:
        """Stop and delete this proxy (absent is fine)."""
        self.api.delete(f"/proxies/{self.name}")


class Toxiproxy:
    """A toxiproxy server on loopback, stopped on exit."""

    def __init__(self, process: subprocess.Popen[bytes], port: int) -> None:
        self.process = process
        self.api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)

    @classmethod
    @contextlib.contextmanager
    def start(cls) -> Iterator[Toxiproxy]:
        binary = shutil.which(BINARY)
        if binary is None:
            raise ToxiproxyError(f"{BINARY} not found: run ./bootstrap setup to build it")
        port = _free_port()
        process = subprocess.Popen([binary, "-host", "127.0.0.1", "-port", str(port)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        toxi = cls(process, port)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    if toxi.api.get("/version").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    raise ToxiproxyError("toxiproxy-server did not start")
                time.sleep(0.05)
            yield toxi
        finally:
            toxi.api.close()
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def proxy(self, name: str, *, listen: tuple[str, int], upstream: tuple[str, int]) -> Proxy:
        """A TCP proxy from ``listen`` (port 0: a free one) to ``upstream``."""
        host, port = listen
        if port == 0:
            port = _free_port(host)
        r = self.api.post("/proxies", json={"name": name, "listen": f"{host}:{port}",
                                            "upstream": f"{upstream[0]}:{upstream[1]}", "enabled": True})
        if r.status_code >= 300:
            raise ToxiproxyError(f"toxiproxy refused proxy {name} on {host}:{port}: {r.text.strip()}")
        return Proxy(self.api, name, (host, port), upstream)


@pytest.fixture(scope="session")
def toxiproxy() -> Iterator[Toxiproxy]:
    """One toxiproxy server for the session; the suite fails (not skips) where it is not installed."""
    try:
        with Toxiproxy.start() as toxi:
            yield toxi
    except ToxiproxyError as e:
        pytest.fail(str(e))
