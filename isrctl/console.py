"""The guest's serial console, relayed from QEMU to a Unix socket (`isr console` connects to it).

One client at a time; a new client takes the console over from the old one. What the guest printed since
QEMU started is kept (up to 1 MiB) and replayed to each new client, and the whole transcript is appended
to a log file.
"""
from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

from .paths import listen_private

#: The relay's socket, in the session's runtime directory.
CONSOLE_SOCKET = "console.sock"
_CONSOLE_HISTORY = 1 << 20
_CONSOLE_SEND_TIMEOUT = 10.0


class ConsoleRelay:
    """Relays the guest's serial console to whoever connects to ``path`` (one client at a time).

    Everything the guest printed since QEMU started is kept (up to 1 MiB) and replayed to each new client,
    so that a client that connects late still sees, say, a boot message. The transcript is also appended
    to ``log_path``.
    """

    def __init__(self, serial: socket.socket, path: Path, log_path: Path) -> None:
        self.serial = serial
        self.path = path
        self.history = bytearray()
        self.client: socket.socket | None = None
        self.lock = threading.Lock()
        self.log = open(log_path, "ab")
        self.listener = listen_private(path, 2)
        self.closed = False
        threading.Thread(target=self._from_guest, args=(serial,), name="console-out", daemon=True).start()
        threading.Thread(target=self._accept, name="console-accept", daemon=True).start()

    def attach(self, serial: socket.socket) -> None:
        """Relay a new QEMU's serial console (the guest was started again): the client stays connected."""
        self.serial = serial
        threading.Thread(target=self._from_guest, args=(serial,), name="console-out", daemon=True).start()

    def _from_guest(self, serial: socket.socket) -> None:
        while True:
            try:
                data = serial.recv(65536)
            except OSError:
                data = b""
            if not data:
                return
            with self.lock:
                self.history += data
                if len(self.history) > _CONSOLE_HISTORY:
                    del self.history[:len(self.history) - _CONSOLE_HISTORY]
                with contextlib.suppress(OSError, ValueError):
                    self.log.write(data)
                    self.log.flush()
                # Sent under the lock, so that it can never interleave with a new client's backlog.
                client = self.client
                if client is not None:
                    try:
                        client.sendall(data)
                    except OSError:
                        self.client = None
                        with contextlib.suppress(OSError):
                            client.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            # A client that stops reading must not stall the guest's console for long.
            client.settimeout(_CONSOLE_SEND_TIMEOUT)
            with self.lock:
                old, self.client = self.client, client
                try:
                    client.sendall(bytes(self.history))
                except OSError:
                    self.client = None
            if old is not None:
                with contextlib.suppress(OSError):
                    old.close()
            if self.client is not client:
                with contextlib.suppress(OSError):
                    client.close()
                continue
            threading.Thread(target=self._to_guest, args=(client,), name="console-in", daemon=True).start()

    def _to_guest(self, client: socket.socket) -> None:
        while True:
            try:
                data = client.recv(65536)
            except TimeoutError:
                continue          # the timeout is for sending; a quiet client is fine
            except OSError:
                data = b""
            if not data:
                self._drop(client)
                return
            try:
                self.serial.sendall(data)
            except OSError:
                return

    def _drop(self, client: socket.socket) -> None:
        with self.lock:
            if self.client is client:
                self.client = None
        with contextlib.suppress(OSError):
            client.close()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with self.lock:
            if self.client is not None:
                with contextlib.suppress(OSError):
                    self.client.close()
                self.client = None
            self.log.close()
