"""nginx-light serving files over HTTPS for the benchmarks' peers, with per-run byte counting.

    with Nginx(work, root=web, cert=cert, key=key, listen="127.0.0.1:8445") as nginx:
        ... clients fetch https://HOST:PORT/NAME or https://HOST:PORT/r/<tag>/NAME ...
        nginx.traffic("run-1")     # what the requests under /r/run-1/ moved

Byte ranges are served as nginx always does; HTTP/1.1 only (QEMU's curl driver hung the guest under
HTTP/2 here: see BENCHMARKS.md, "vulpes: cold boot"). Every request is logged with the bytes it moved, so
a run can count what it fetched: `Nginx.traffic` sums the access log, either every line (and optionally
empties the log) or only the lines of one tag. A run fetches its files under ``/r/<tag>/NAME`` (the same
file as ``/NAME``) to get a count of its own, even when other clients use the same server.

The master runs as root with ``user root``, so it can serve files from any directory the caller owns.
``prefix`` runs nginx under a command such as ``ip netns exec NS``.
"""
from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

#: One line per request: the URI as the client sent it, the status, the response body, the whole response
#: (headers too) and the whole request, in bytes.
LOG_FORMAT = "$request_uri $status $body_bytes_sent $bytes_sent $request_length"


class NginxError(RuntimeError):
    """nginx did not start."""


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds; always reaped."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Traffic:
    """What a set of requests moved, from nginx's access log."""

    requests: int = 0
    #: Response bodies (the file bytes).
    body: int = 0
    #: Responses, headers included.
    sent: int = 0
    #: Requests, headers included.
    received: int = 0

    @property
    def total(self) -> int:
        """Bytes both ways at the HTTP level (TLS and TCP framing not counted)."""
        return self.sent + self.received


class Nginx:
    """One nginx master (``worker_processes`` workers) serving ``root`` over HTTPS on ``listen``."""

    def __init__(self, work: Path, *, root: Path, cert: Path, key: Path, listen: str,
                 prefix: Sequence[str] = (), workers: int = 1, name: str = "nginx") -> None:
        self.work = work
        self.root = root
        self.listen = listen
        self.conf = work / f"{name}.conf"
        self.pid_file = work / f"{name}.pid"
        self.error_log = work / f"{name}.error.log"
        self.access_log = work / f"{name}.access.log"
        self.conf.write_text(f"""
user root root;
worker_processes {workers};
pid {self.pid_file};
error_log {self.error_log};
daemon off;
events {{ worker_connections 512; }}
http {{
    log_format counted '{LOG_FORMAT}';
    access_log {self.access_log} counted;
    sendfile on;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    server {{
        listen {listen} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        root {root};
        location /r/ {{
            rewrite ^/r/[^/]+(/.+)$ $1 break;
        }}
    }}
}}
""")
        self._prefix = list(prefix)
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 15.0) -> Self:
        self.pid_file.unlink(missing_ok=True)
        self._proc = subprocess.Popen([*self._prefix, "nginx", "-c", str(self.conf)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        # nginx writes its pid file once its listening sockets are open.
        while not self.pid_file.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                errors = self.error_log.read_text(errors="replace") if self.error_log.exists() else ""
                raise NginxError(f"nginx did not start on {self.listen}: {errors.strip()[-1000:]}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self._proc is not None:
            stop_process(self._proc)
            self._proc = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def traffic(self, tag: str | None = None, *, reset: bool = False) -> Traffic:
        """The traffic of the requests under ``/r/<tag>/`` (every request if ``tag`` is None); ``reset``
        empties the log afterwards."""
        counted = Traffic()
        prefix = f"/r/{tag}/" if tag is not None else ""
        with contextlib.suppress(FileNotFoundError):
            for line in self.access_log.read_text(errors="replace").splitlines():
                fields = line.split()
                if len(fields) != 5 or not fields[0].startswith(prefix) or not all(f.isdigit() for f in fields[2:]):
                    continue
                counted.requests += 1
                counted.body += int(fields[2])
                counted.sent += int(fields[3])
                counted.received += int(fields[4])
            if reset:
                self.access_log.write_text("")
        return counted
