"""Talk to the test guest over its serial console: wait for it to boot, run commands, read its counter.

The guest's agent (files/isr-agent) answers a request line ``ISR-RUN <id> <timeout> <base64 command>`` with
``ISR-BEGIN <id>``, the output, and ``ISR-END <id> <status>``. Kernel messages may be printed on the same
console at any time; the host-chosen id keeps the markers unambiguous. Everything the guest prints is kept
as a transcript (and appended to a log file if one is given), because when a boot test fails the console
is usually the only place that says why.
"""
from __future__ import annotations

import base64
import itertools
import logging
import math
import re
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import BinaryIO, Self

from .errors import GuestCommandError, GuestConsoleError, GuestTimeoutError

log = logging.getLogger(__name__)

READY_MARKER = b"ISR-GUEST-READY"
_READY = re.compile(rb"ISR-GUEST-READY uptime=([0-9.]+)")
_GUEST_ERROR = re.compile(rb"ISR-GUEST-ERROR ([^\r\n]*)")
# Fatal kernel messages: no point waiting for a marker after one of these.
_KERNEL_DEATH = re.compile(rb"Kernel panic - not syncing[^\r\n]*")
_WORKLOAD = re.compile(rb"ISR-WORKLOAD (ok|fail) ([^\r\n]*)")
#: How much longer than the guest-side limit the host waits for a command's end marker.
_GRACE = 15.0
#: How often a request the agent did not understand is sent again.
_REQUEST_ATTEMPTS = 3
#: A request that has not started after this long is sent again (the agent ignores a repeat of the id it
#: ran last, so a request that was only slow does not run twice).
_RESEND_AFTER = 10.0
_TRANSCRIPT_TAIL = 3000


class GuestConsole:
    """The guest's serial console, over a connected stream socket (such as `isrctl.qemu.VM.serial`).

    A background thread reads everything the guest prints; methods wait on that record. The console keeps
    a cursor: each marker found moves it forward, so waiting for "ready" after a reboot finds the new
    marker, not the old one.
    """

    def __init__(self, sock: socket.socket, *, log_path: Path | None = None, name: str = "guest") -> None:
        self.name = name
        self._sock = sock
        self._buffer = bytearray()
        self._cursor = 0
        self._closed = False
        self._changed = threading.Condition()
        self._command_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._session = secrets.token_hex(3)
        self._log: BinaryIO | None = open(log_path, "ab") if log_path is not None else None
        self._reader = threading.Thread(target=self._read_loop, name=f"console-{name}", daemon=True)
        self._reader.start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading (the socket itself belongs to whoever passed it in) and close the log file."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None

    # --- the record of what the guest printed ------------------------------------------------------

    def _read_loop(self) -> None:
        while True:
            try:
                data = self._sock.recv(65536)
            except OSError:
                data = b""
            with self._changed:
                if not data:
                    self._closed = True
                    self._changed.notify_all()
                    return
                self._buffer += data
                if self._log is not None:
                    self._log.write(data)
                    self._log.flush()
                self._changed.notify_all()

    def transcript(self) -> str:
        """Everything the guest has printed so far."""
        with self._changed:
            return self._buffer.decode(errors="replace")

    def tail(self, size: int = _TRANSCRIPT_TAIL) -> str:
        """The last ``size`` characters of the transcript (for error messages)."""
        return self.transcript()[-size:]

    def wait_for(self, pattern: re.Pattern[bytes] | bytes, timeout: float, *,
                 what: str | None = None) -> re.Match[bytes]:
        """Wait until ``pattern`` appears after the cursor; move the cursor past it and return the match.

        Raises `GuestTimeoutError` after ``timeout`` seconds, and `GuestConsoleError` at once if the console
        closes (QEMU exited) or the kernel dies.
        """
        regex = re.compile(re.escape(pattern)) if isinstance(pattern, bytes) else pattern
        what = what or regex.pattern.decode(errors="replace")
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                match = regex.search(self._buffer, self._cursor)
                if match is not None:
                    self._cursor = match.end()
                    return match
                death = _KERNEL_DEATH.search(self._buffer, self._cursor)
                if death is not None:
                    raise GuestConsoleError(f"{self.name}: the guest died waiting for {what}: "
                                            f"{death.group().decode(errors='replace')}\n{self._tail_locked()}")
                if self._closed:
                    raise GuestConsoleError(f"{self.name}: console closed (QEMU exited?) waiting for {what}\n"
                                            f"{self._tail_locked()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise GuestTimeoutError(f"{self.name}: no {what} within {timeout} s; console says:\n"
                                            f"{self._tail_locked()}")
                self._changed.wait(min(remaining, 1.0))

    def _tail_locked(self) -> str:
        return self._buffer[-_TRANSCRIPT_TAIL:].decode(errors="replace")

    # --- booting -----------------------------------------------------------------------------------

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Wait for the guest's ready marker; returns the guest's uptime (seconds) when it printed it.

        A line ``ISR-GUEST-ERROR`` printed before it (no disk, a module that did not load) is an error.
        """
        with self._changed:
            since = self._cursor
        match = self.wait_for(_READY, timeout, what="ready marker (ISR-GUEST-READY)")
        with self._changed:
            error = _GUEST_ERROR.search(self._buffer, since, match.start())
        if error is not None:
            raise GuestConsoleError(f"{self.name}: guest reported an error while booting: "
                                    f"{error.group(1).decode(errors='replace')}\n{self.tail()}")
        return float(match.group(1))

    # --- commands ----------------------------------------------------------------------------------

    def send_line(self, line: str) -> None:
        """Send one raw line to the agent (``ISR-RUN`` requests are built by `run`)."""
        if "\n" in line:
            raise ValueError("a console line cannot contain a newline")
        self._sock.sendall(line.encode() + b"\n")

    def run(self, command: str, timeout: float = 60.0, *, check: bool = False) -> tuple[int, str]:
        """Run a shell command in the guest; returns ``(exit status, output)`` (stdout and stderr mixed).

        The guest kills the command after ``timeout`` seconds (status 143). With ``check`` a non-zero
        status raises `GuestCommandError`.
        """
        with self._command_lock:
            limit = max(1, math.ceil(timeout))
            request_id, begin = self._start(command, limit, timeout + _GRACE)
            rid = re.escape(request_id.encode())
            end = self.wait_for(re.compile(rb"\nISR-END " + rid + rb" (\d+)\r?\n"), timeout + _GRACE,
                                what=f"end of command {command!r}")
            with self._changed:
                output = bytes(self._buffer[begin.end():end.start()]).decode(errors="replace")
            status = int(end.group(1))
        if check and status != 0:
            raise GuestCommandError(command, status, output)
        return status, output

    def check(self, command: str, timeout: float = 60.0) -> str:
        """Run a command that must succeed; returns its output."""
        return self.run(command, timeout, check=True)[1]

    def counter(self) -> int:
        """The guest's RAM counter: seconds counted since /init started it; never resets while it runs."""
        output = self.check("cat /run/counter", timeout=20).strip()
        try:
            return int(output)
        except ValueError as exc:
            raise GuestConsoleError(f"{self.name}: unexpected counter value {output!r}") from exc

    def set_token(self, token: str | None = None) -> str:
        """Write a token to RAM only (/run, a tmpfs) and return it: proof that RAM survived a resume."""
        token = token or secrets.token_hex(16)
        self.check(f"echo {token} >/run/token", timeout=20)
        return token

    def token(self) -> str:
        """The RAM-only token written by `set_token` ('' if there is none)."""
        status, output = self.run("cat /run/token 2>/dev/null", timeout=20)
        return output.strip() if status == 0 else ""

    def run_workload(self, timeout: float = 300.0) -> dict[str, str]:
        """Run /data/workload/run.sh; returns the fields of its result line (files, matches, digest, ...)."""
        status, output = self.run("/data/workload/run.sh", timeout)
        match = _WORKLOAD.search(output.encode())
        if match is None or match.group(1) != b"ok" or status != 0:
            raise GuestCommandError("/data/workload/run.sh", status, output)
        fields = dict(item.split("=", 1) for item in match.group(2).decode().split())
        return fields

    def request_poweroff(self) -> None:
        """Ask the guest to unmount /data and power off; QEMU then exits (wait for it with `VM.wait`)."""
        self._send_no_reply("isr-poweroff")

    def request_reboot(self) -> None:
        """Ask the guest to unmount /data and reboot; wait for it with `wait_ready`."""
        self._send_no_reply("isr-reboot")

    def _send_no_reply(self, command: str) -> None:
        # The agent never gets to print the end marker, so only wait for the start.
        with self._command_lock:
            self._start(command, 60, 30)

    def _start(self, command: str, limit: int, timeout: float) -> tuple[str, re.Match[bytes]]:
        """Send ``command`` as a new request and wait for the agent to start it; returns the request id and
        the start marker. With the command lock held."""
        request_id = f"{self._session}.{next(self._ids)}"
        payload = base64.b64encode(command.encode()).decode()
        log.debug("%s: run [%s] %s", self.name, request_id, command)
        started = re.compile(rb"ISR-BEGIN " + re.escape(request_id.encode()) +
                             rb"\r?\n|ISR-AGENT unknown request: [^\n]*\n")
        with self._changed:
            # Whatever arrived since the last reply is noise (kernel messages): a stale complaint from the
            # agent there must not be taken as the answer to this request.
            self._cursor = len(self._buffer)
        deadline = time.monotonic() + timeout
        attempt = 0
        while attempt < _REQUEST_ATTEMPTS:
            self.send_line(f"ISR-RUN {request_id} {limit} {payload}")
            try:
                begin = self.wait_for(started, min(_RESEND_AFTER, max(0.0, deadline - time.monotonic())),
                                      what=f"start of command {command!r}")
            except GuestTimeoutError:
                if time.monotonic() >= deadline:
                    raise
                # Lost on the way, or only slow: the same id again is safe either way.
                log.warning("%s: request %s has not started after %.0f s: sending it again", self.name,
                            request_id, _RESEND_AFTER)
                continue
            if begin.group().startswith(b"ISR-BEGIN"):
                return request_id, begin
            attempt += 1
            # The agent did not understand the line (seen under heavy host load, when the serial line
            # lost the start of a request; CI saw it for isr-poweroff): the command did not run, so
            # sending it again is safe.
            log.warning("%s: the agent garbled request %s (attempt %d): %r", self.name, request_id,
                        attempt, begin.group())
        raise GuestConsoleError(f"{self.name}: the agent did not understand command {command!r} "
                                f"{_REQUEST_ATTEMPTS} times\n{self.tail()}")
