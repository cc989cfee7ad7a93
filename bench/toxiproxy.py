"""Round-trip time injected in user space: a toxiproxy server and its TCP proxies, for the benchmarks.

The kernel here has no netem, so tbf shapes the bandwidth of a link and toxiproxy adds its delay. A proxy
listens on one address and forwards to another; `Proxy.set_rtt` adds half the round-trip time to each
direction (toxiproxy's "latency" toxic delays every piece of data it passes on by that much).

    with Toxiproxy.start() as toxi:
        proxy = toxi.proxy("site-a", listen=("10.1.1.1", 0), upstream=("127.0.0.1", 8443))
        proxy.set_rtt(40)          # milliseconds
        ... clients connect to proxy.listen ...

`./bootstrap bench` installs the server as /usr/local/bin/toxiproxy-server.
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

    def set_rtt(self, rtt_ms: float) -> None:
        """Add ``rtt_ms`` of round-trip time: half on the way out, half on the way back (0 removes it)."""
        for stream in ("upstream", "downstream"):
            toxic = f"rtt-{stream}"
            self.api.delete(f"/proxies/{self.name}/toxics/{toxic}")  # absent is fine
            if rtt_ms > 0:
                r = self.api.post(f"/proxies/{self.name}/toxics", json={
                    "name": toxic, "type": "latency", "stream": stream, "toxicity": 1.0,
                    "attributes": {"latency": int(round(rtt_ms / 2)), "jitter": 0}})
                if r.status_code >= 300:
                    raise ToxiproxyError(f"toxiproxy refused a latency toxic on {self.name}: {r.text.strip()}")

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
            raise ToxiproxyError(f"{BINARY} not found: run ./bootstrap bench to build it")
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
