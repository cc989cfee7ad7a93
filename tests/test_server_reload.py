"""isr-server reloads on SIGHUP (`systemctl reload isr-server`): it reads its config file and certificate
again, and granian replaces its workers one by one while the listening socket stays open. No connection
is refused during the reload, every request is answered (sent once more if an old worker closed its
connection unanswered, as isr and vulpes do), and afterwards every new connection gets the new certificate
and the new settings. A config file that does not load leaves the server running on the configuration it
has, and isr's HTTP/2 client goes on across the reload."""
from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import ssl
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.tls import make_self_signed
from tests.conftest import wait_until
from tests.server_fixtures import ServerEnv, start_env, write_config

pytestmark = pytest.mark.timeout(300)


class ClosedUnanswered(Exception):
    """The server closed a connection before it answered the request sent on it."""


class Probe:
    """Requests to /v1/health in two threads until stopped: each on a new TLS connection (noting the
    certificate it got), and one after another on a kept-alive HTTP/1.1 connection. Like isr and vulpes, it
    sends a request once more when its connection was closed before an answer (an old worker that accepted
    it in the instant it stopped: granian closes a connection whose handshake or request it has not read
    yet); a refused connection, or a second failure, is a failure."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.sent_again = 0
        self.fingerprints: list[str] = []
        self.kept_alive = 0
        self.threads = [threading.Thread(target=self._fresh, daemon=True),
                        threading.Thread(target=self._keep_alive, daemon=True)]

    def __enter__(self) -> "Probe":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)

    def _fresh_once(self) -> str:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as raw:
            try:
                tls = ctx.wrap_socket(raw)
            except (ConnectionResetError, ssl.SSLEOFError, ssl.SSLZeroReturnError):
                # Closed by the stopping worker, abruptly or with a TLS close_notify.
                raise ClosedUnanswered("closed in the TLS handshake") from None
        with tls:
            der = tls.getpeercert(binary_form=True)
            assert der is not None
            tls.sendall(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            answer = b""
            with contextlib.suppress(ConnectionResetError, ssl.SSLError):
                while chunk := tls.recv(65536):
                    answer += chunk
        if not answer:
            raise ClosedUnanswered("closed before an answer")
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        return "sha256:" + hashlib.sha256(der).hexdigest()

    def fresh_fingerprint(self) -> str:
        """One request on a new connection; the certificate's fingerprint as the server prints it."""
        try:
            return self._fresh_once()
        except ClosedUnanswered:
            self.sent_again += 1
            return self._fresh_once()

    def _fresh(self) -> None:
        while not self.stop.is_set():
            try:
                self.fingerprints.append(self.fresh_fingerprint())
            except (OSError, AssertionError, ClosedUnanswered) as e:
                self.failures.append(f"new connection: {e!r}")
            time.sleep(0.02)

    def _keep_alive(self) -> None:
        with httpx.Client(base_url=f"https://127.0.0.1:{self.port}", verify=False, http2=False, timeout=30) as c:
            while not self.stop.is_set():
                try:
                    try:
                        c.get("/v1/health").raise_for_status()
                    except httpx.RemoteProtocolError:
                        self.sent_again += 1
                        c.get("/v1/health").raise_for_status()
                    self.kept_alive += 1
                except httpx.HTTPError as e:
                    self.failures.append(f"kept-alive connection: {e!r}")
                time.sleep(0.02)


def workers(pid: int) -> set[int]:
    """The worker processes of the isr-server `pid`: its children (granian forks them)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that has just ended
            found.update(int(child) for child in (task / "children").read_text().split())
    return found


def reloaded(env: ServerEnv, count: int) -> bool:
    return sum("isr-server: reloaded" in line for line in env.server.stdout_lines) >= count


def test_sighup_reloads_certificate_and_config_without_refusing_anyone(tmp_path: Path,
                                                                      request: pytest.FixtureRequest) -> None:
    env = start_env("sqlite-directory", tmp_path / "server", request)
    try:
        assert env.server.proc is not None
        port = int(env.server.url.rsplit(":", 1)[1])
        old = env.server.fingerprint
        with env.client() as client:
            assert client.health()["chunk_serving"] == "sendfile"
        # A new certificate where the server keeps its self-signed one, and a changed setting in its file.
        tls = Path(env.settings["server.data_dir"]) / "tls"
        new = make_self_signed(tls / "server.crt", tls / "server.key")
        write_config(env.config, {**env.settings, "server.chunk_serving": "stream"})

        with Probe(port) as probe:
            wait_until(lambda: probe.fingerprints and probe.kept_alive, 30,
                       f"the probes' first answers ({probe.failures[:3]})")
            old_workers = workers(env.server.proc.pid)
            assert len(old_workers) == env.settings["server.workers"], old_workers
            os.kill(env.server.proc.pid, signal.SIGHUP)
            wait_until(lambda: reloaded(env, 1), 60, "isr-server to say it reloaded")
            # granian stops each old worker once its successor runs (3.5 s later): then only the new
            # certificate is served.
            wait_until(lambda: not workers(env.server.proc.pid) & old_workers, 120, "the old workers to stop")
            assert len(workers(env.server.proc.pid)) == env.settings["server.workers"]
            assert all(probe.fresh_fingerprint() == new for _ in range(10))
            answered_during = len(probe.fingerprints)
        assert probe.failures == [], probe.failures
        assert old in probe.fingerprints and new in probe.fingerprints
        assert f"certificate fingerprint {new}" in env.server.output()
        with env.server.client() as client:  # its fingerprint is the one of the reload line
            assert client.health()["chunk_serving"] == "stream"
        print(f"reload: {answered_during} new connections and {probe.kept_alive} kept-alive requests answered, "
              f"none refused; {probe.sent_again} sent again after their connection closed unanswered")

        # A file that does not load: one line in the log, and the server goes on with what it runs. isr's
        # client keeps its HTTP/2 connection across it: the old worker closes it, and the next request goes
        # on a new one (h2 took that GOAWAY for a protocol error, and isr said the server was unreachable).
        with env.server.client(token=env.tokens.get("alice")) as kept:  # its fingerprint: the reload line's
            assert kept.health()["chunk_serving"] == "stream"
            old_workers = workers(env.server.proc.pid)
            assert len(old_workers) == env.settings["server.workers"], old_workers
            env.config.write_text("[server]\nworkers = \"two\"\n")
            os.kill(env.server.proc.pid, signal.SIGHUP)
            wait_until(lambda: "reload: server.workers" in env.server.output(), 60, "the refused reload in the log")
            wait_until(lambda: not workers(env.server.proc.pid) & old_workers, 120, "the old workers to stop")
            assert kept.health()["chunk_serving"] == "stream"
        assert env.server.proc.poll() is None
    finally:
        env.server.stop()
    assert "Traceback" not in env.server.output(), env.server.output()
