"""vulpes on the path users run (libcurl, HTTP/2 over TLS, to the real isr-server) with faults injected in
between by toxiproxy: connections reset, stalled, cut part way through a chunk, closed slowly, and delayed in
spikes; and, with tc in a network namespace, a connection whose path dies silently. Reads through FUSE either
get the right bytes after a retry or wait and go on once the fault clears: never an I/O error for a transient
outage, never a wrong byte; hoard and upload resume and finish."""
from __future__ import annotations

import hashlib
import random
import secrets
import socket
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.conftest import wait_until
from tests.test_vulpes import pending_tags
from tests.toxiproxy_fixtures import Proxy, Toxiproxy, toxiproxy  # noqa: F401  (toxiproxy: pytest fixture)
from tests.vulpes_fixtures import (CHUNK_SIZE, IsrServer, Vulpes, chunk_path, isr_server,  # noqa: F401
                                   make_state, random_image, read_all, spki_pin, vulpes_binary)

pytestmark = pytest.mark.timeout(180)

MIB = 1 << 20
TROUBLE = r"server trouble \(.*\): retrying, reads wait"


@pytest.fixture
def proxy(toxiproxy: Toxiproxy, isr_server: IsrServer) -> Iterator[Proxy]:  # noqa: F811
    """A TCP proxy on loopback in front of the real isr-server, for one test."""
    url = urlsplit(isr_server.url)
    assert url.hostname and url.port
    made = toxiproxy.proxy(f"vulpes-{uuid.uuid4().hex[:8]}", listen=("127.0.0.1", 0),
                           upstream=(url.hostname, url.port))
    try:
        yield made
    finally:
        made.remove()


def proxied_vulpes(binary: Path, tmp_path: Path, state, server: IsrServer, proxy: Proxy, **kwargs) -> Vulpes:
    return Vulpes(binary, tmp_path / "mnt", state, tmp_path / "cache", server=f"https://{proxy.address}",
                  token_file=server.token_file, ca=server.ca, **kwargs)


class Reader:
    """Reads a whole image in a thread (as a guest would, through FUSE), keeping the bytes or the error."""

    def __init__(self, path: Path) -> None:
        self.data: bytes | None = None
        self.error: OSError | None = None
        self.thread = threading.Thread(target=self._run, args=(path,), daemon=True)
        self.thread.start()

    def _run(self, path: Path) -> None:
        try:
            self.data = read_all(path)
        except OSError as e:
            self.error = e

    def result(self, timeout: float) -> bytes:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the read did not finish within {timeout} s"
        assert self.error is None, f"the read failed: {self.error!r}"
        assert self.data is not None
        return self.data


def test_the_proxied_path_is_http2_over_tls(isr_server: IsrServer, proxy: Proxy) -> None:  # noqa: F811
    """What these tests put faults on is what vulpes uses: TLS to isr-server, which offers HTTP/2 (ALPN)."""
    context = ssl.create_default_context(cafile=str(isr_server.ca))
    context.set_alpn_protocols(["h2", "http/1.1"])
    with socket.create_connection(proxy.listen, timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        assert tls.selected_alpn_protocol() == "h2"


#: (toxic type, attributes, what it does to the open HTTP/2 connection and every new one)
OUTAGES = {
    "reset": ("reset_peer", {"timeout": 0}),            # RST at once
    "stall": ("timeout", {"timeout": 0}),               # nothing passes; the data is held until it clears
    "stall-then-close": ("timeout", {"timeout": 500}),  # nothing passes, closed after 0.5 s
    "cut-mid-chunk": ("limit_data", {"bytes": 100_000}),  # closed after 100 kB: less than one chunk object
}


@pytest.mark.parametrize("outage", OUTAGES)
def test_reads_wait_through_an_outage_and_get_the_right_bytes(outage: str, vulpes_binary: Path,  # noqa: F811
                                                               isr_server: IsrServer, proxy: Proxy,  # noqa: F811
                                                               tmp_path: Path) -> None:
    """The fault starts on the open connection, with a read under way: the read waits (no EIO), vulpes says
    it is waiting or has a transfer out, and once the fault clears the read returns exactly the image."""
    kind, attributes = OUTAGES[outage]
    content = random_image(3 * MIB, seed=1601, data_fraction=1.0)
    state = make_state(tmp_path / "state", content, 1 * MIB)
    state.publish(isr_server.store)
    with proxied_vulpes(vulpes_binary, tmp_path, state, isr_server, proxy, expected_output=[TROUBLE]) as v:
        with open(v.path("disk"), "rb", buffering=0) as f:       # the HTTP/2 connection is up
            assert f.read(CHUNK_SIZE) == content[:CHUNK_SIZE]
        with proxy.toxic(kind, **attributes):
            reader = Reader(v.path("disk"))
            if kind == "timeout" and attributes["timeout"] == 0:
                # A stall fails nothing (until 20 s without a byte): the transfers are simply out.
                wait_until(lambda: v.status()["fetch"]["active"] > 0, 30, "a transfer on the stalled link")
            else:
                wait_until(lambda: v.status()["fetch"]["waiting"], 30, "vulpes to report that it is waiting")
            time.sleep(1)
            assert reader.thread.is_alive(), "the read must wait for the server, not fail or finish"
        assert reader.result(60) == content
        status = v.status()
        assert status["errors"] == 0 and status["fetch"]["bad"] == 0, status
        wait_until(lambda: not v.status()["fetch"]["waiting"], 30, "vulpes to stop waiting")


def test_transfers_cut_part_way_still_deliver_every_byte(vulpes_binary: Path, isr_server: IsrServer,  # noqa: F811
                                                         proxy: Proxy, tmp_path: Path) -> None:
    """Every connection is closed after 300 kB, in the middle of some chunk object's body, for the whole
    read: each cut transfer is retried on a new connection, and what the reader gets is the image."""
    content = random_image(4 * MIB, seed=1602, data_fraction=1.0)
    state = make_state(tmp_path / "state", content, 1 * MIB)
    state.publish(isr_server.store)
    with proxied_vulpes(vulpes_binary, tmp_path, state, isr_server, proxy, expected_output=[TROUBLE]) as v:
        with proxy.toxic("limit_data", bytes=300_000):
            assert Reader(v.path("disk")).result(120) == content
            status = v.status()
        assert status["errors"] == 0 and status["fetch"]["bad"] == 0 and status["fetch"]["retries"] > 0, status


def test_a_hoard_stalls_through_resets_and_slow_closes_then_completes(vulpes_binary: Path,  # noqa: F811
                                                                     isr_server: IsrServer,  # noqa: F811
                                                                     proxy: Proxy, tmp_path: Path) -> None:
    """A hoard under connection resets waits, then finishes complete once they stop; then, with every
    connection cut mid-transfer and its close held back 1 s (slow_close), a second hoard finishes too."""
    content = random_image(3 * MIB, seed=1603, data_fraction=1.0)
    memory = random_image(1 * MIB, seed=1604, data_fraction=1.0)
    state = make_state(tmp_path / "state", content, 1 * MIB, memory=memory)
    state.publish(isr_server.store)
    cache = tmp_path / "cache"
    with proxied_vulpes(vulpes_binary, tmp_path, state, isr_server, proxy, expected_output=[TROUBLE]) as v:
        with proxy.toxic("reset_peer", timeout=0):
            assert v.control({"op": "hoard", "disk": "all"})["ok"]
            wait_until(lambda: v.status()["fetch"]["waiting"], 30, "the hoard to wait for the server")
            assert v.status()["hoard"]["state"] == "running"
        hoard = wait_until(lambda: (h := v.status()["hoard"])["state"] == "done" and h, 60, "the hoard to finish")
        assert hoard["complete"] and hoard["chunks_failed"] == 0
        assert hoard["chunks_done"] == hoard["chunks_total"] == len(state.records["disk"])
        with proxy.toxic("limit_data", bytes=200_000), proxy.toxic("slow_close", delay=1000):
            response = v.control({"op": "hoard", "memory": "all", "wait": True}, timeout=120)
        assert response["ok"] and response["status"]["hoard"]["complete"], response
        for image in ("disk", "memory"):
            for index, record in state.records[image].items():
                assert chunk_path(cache, record.tag).read_bytes() == state.objects[record.tag], (image, index)
        assert v.status()["errors"] == 0


def test_an_upload_through_resets_and_cut_bodies_finishes(vulpes_binary: Path, isr_server: IsrServer,  # noqa: F811
                                                          proxy: Proxy, tmp_path: Path) -> None:
    """`upload` (what a checkin waits for) while the link resets, then while every request body is cut part
    way (on the way to the server): it waits, and answers once the fault clears, with every object on the
    server intact."""
    content = random_image(2 * MIB, seed=1605, data_fraction=1.0)
    state = make_state(tmp_path / "state", content, 1 * MIB)
    state.publish(isr_server.store)
    rng = random.Random(1606)
    with proxied_vulpes(vulpes_binary, tmp_path, state, isr_server, proxy, expected_output=[TROUBLE]) as v:
        for kind, attributes in (("reset_peer", {"timeout": 0}), ("limit_data", {"bytes": 60_000})):
            written = rng.randbytes(3 * CHUNK_SIZE)
            with open(v.path("disk"), "r+b", buffering=0) as f:
                f.seek(rng.randrange(8) * CHUNK_SIZE)
                f.write(written)
            assert v.control({"op": "flush"})["ok"]
            tags = pending_tags(state.state_dir)
            assert len(tags) == 3
            answer: dict[str, Any] = {}
            with proxy.toxic(kind, stream="upstream", **attributes):
                uploader = threading.Thread(target=lambda: answer.update(v.control({"op": "upload"}, timeout=120)))
                uploader.start()
                wait_until(lambda: v.status()["fetch"]["waiting"], 30, "the upload to wait for the server")
                time.sleep(0.5)
                assert uploader.is_alive(), f"upload answered during the fault ({kind}): {answer}"
            uploader.join(90)
            assert answer == {"ok": True, "uploaded": 3}, (kind, answer)
            assert v.status()["images"]["disk"]["pending_uploads"] == 0
            for tag in tags:
                assert hashlib.sha256(chunk_path(isr_server.store, tag).read_bytes()).digest() == tag


def test_latency_spikes_slow_reads_and_hoards_but_change_nothing(vulpes_binary: Path,  # noqa: F811
                                                                  isr_server: IsrServer, proxy: Proxy,  # noqa: F811
                                                                  tmp_path: Path) -> None:
    """Delays of 0 to 400 ms on every piece of data, both ways, and a link of 2 MB/s: demand reads and a
    hoard running at the same time get the right bytes, with no retry at all."""
    content = random_image(3 * MIB, seed=1607, data_fraction=1.0)
    memory = random_image(1 * MIB, seed=1608, data_fraction=1.0)
    state = make_state(tmp_path / "state", content, 1 * MIB, memory=memory)
    state.publish(isr_server.store)
    with proxied_vulpes(vulpes_binary, tmp_path, state, isr_server, proxy) as v, \
            proxy.toxic("latency", stream="upstream", latency=200, jitter=200), \
            proxy.toxic("latency", latency=200, jitter=200), proxy.toxic("bandwidth", rate=2048):
        assert v.control({"op": "hoard", "memory": "all"})["ok"]
        assert Reader(v.path("disk")).result(120) == content
        hoard = wait_until(lambda: (h := v.status()["hoard"])["state"] == "done" and h, 60, "the hoard to finish")
        assert hoard["complete"]
        assert read_all(v.path("memory")) == memory
        status = v.status()
        assert status["errors"] == 0 and status["fetch"]["retries"] == 0, status["fetch"]


# --- a connection whose path dies silently ------------------------------------------------------------------

@dataclass
class SilentLink:
    """A network namespace for vulpes behind a veth pair whose qdiscs (htb) can swallow one TCP connection:
    its packets, both ways, go to a class of 8 bit/s, so that it dies without a RST or FIN (as behind a NAT
    that forgot it) while new connections pass. toxiproxy cannot do that: its toxics act on every connection
    of a proxy."""

    namespace: str
    host_if: str
    ns_if: str
    host_ip: str

    def run(self, *args: str, inside: bool = False) -> str:
        prefix = ["ip", "netns", "exec", self.namespace] if inside else []
        return subprocess.run([*prefix, *args], check=True, capture_output=True, text=True, timeout=30).stdout

    def local_ports(self) -> list[str]:
        """The local ports of the established TCP connections in the namespace."""
        lines = self.run("ss", "-tnH", "state", "established", inside=True).splitlines()
        return [line.split()[2].rsplit(":", 1)[1] for line in lines]

    def swallow(self, port: str) -> None:
        for inside, dev, match in ((True, self.ns_if, "sport"), (False, self.host_if, "dport")):
            self.run("tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                     "match", "ip", match, port, "0xffff", "flowid", "1:2", inside=inside)


@pytest.fixture
def silent_link() -> Iterator[SilentLink]:
    tag = secrets.token_hex(3)
    net = 200 + secrets.randbelow(50)
    link = SilentLink(f"isrt-silent-{tag}", f"vsh{tag}", f"vsn{tag}", f"10.{net}.0.1")
    try:
        link.run("ip", "netns", "add", link.namespace)
        link.run("ip", "link", "add", link.host_if, "type", "veth", "peer", "name", link.ns_if)
        link.run("ip", "link", "set", link.ns_if, "netns", link.namespace)
        link.run("ip", "addr", "add", f"{link.host_ip}/24", "dev", link.host_if)
        link.run("ip", "link", "set", link.host_if, "up")
        link.run("ip", "addr", "add", f"10.{net}.0.2/24", "dev", link.ns_if, inside=True)
        link.run("ip", "link", "set", link.ns_if, "up", inside=True)
        for inside, dev in ((True, link.ns_if), (False, link.host_if)):
            link.run("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1", inside=inside)
            for classid, rate in (("1:1", "1gbit"), ("1:2", "8bit")):
                link.run("tc", "class", "add", "dev", dev, "parent", "1:", "classid", classid, "htb", "rate", rate,
                         "ceil", rate, inside=inside)
        yield link
    finally:
        subprocess.run(["ip", "netns", "del", link.namespace], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", link.host_if], capture_output=True, timeout=30)


def test_a_connection_that_dies_silently_is_replaced(vulpes_binary: Path, isr_server: IsrServer,  # noqa: F811
                                                     toxiproxy: Toxiproxy, silent_link: SilentLink,  # noqa: F811
                                                     tmp_path: Path) -> None:
    """vulpes's HTTP/2 connection stops passing anything, both ways, with a read under way; a new connection
    would work. The stalled transfers time out after 20 s and vulpes opens a new connection, and the read
    completes (it used to retry on the dead connection for as long as the kernel kept it, about 15 minutes:
    curl only resets the stream of a transfer that timed out, and reuses the connection)."""
    url = urlsplit(isr_server.url)
    assert url.hostname and url.port
    # toxiproxy is only the way from the namespace to isr-server on the host's loopback here.
    proxy = toxiproxy.proxy(f"silent-{uuid.uuid4().hex[:8]}", listen=(silent_link.host_ip, 0),
                            upstream=(url.hostname, url.port))
    content = random_image(3 * MIB, seed=1609, data_fraction=1.0)
    state = make_state(tmp_path / "state", content, 1 * MIB)
    state.publish(isr_server.store)
    v = Vulpes(vulpes_binary, tmp_path / "mnt", state, tmp_path / "cache", server=f"https://{proxy.address}",
               token_file=isr_server.token_file, pin=spki_pin(isr_server.ca), expected_output=[TROUBLE])
    v.args[:0] = ["nsenter", f"--net=/run/netns/{silent_link.namespace}"]
    try:
        with v:
            with open(v.path("disk"), "rb", buffering=0) as f:
                assert f.read(CHUNK_SIZE) == content[:CHUNK_SIZE]
            (port,) = silent_link.local_ports()
            silent_link.swallow(port)
            reader = Reader(v.path("disk"))
            wait_until(lambda: v.status()["fetch"]["waiting"], 60, "the stalled transfers to time out")
            assert reader.result(60) == content
            assert port not in silent_link.local_ports()
            assert v.status()["errors"] == 0
    finally:
        proxy.remove()
