"""The guest's serial console, relayed from QEMU to a Unix socket, and `isr console`, which attaches to it.

Any number of clients at once: each sees what the guest prints, and what any of them sends goes to the
guest. What the guest printed since QEMU started is kept (up to 1 MiB) and replayed to each new client, and
the whole transcript is appended to a log file.

`attach` is the client: on a terminal it puts the terminal in raw mode (every key goes to the guest, Ctrl-C
too) until the detach key, Ctrl-], or a signal, and always restores it; otherwise it relays its input and
output as they are, for scripts, and ends once its input has ended and the guest has been quiet for a moment.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import termios
import threading
import tty
from pathlib import Path
from typing import TextIO

from .paths import listen_private

#: The relay's socket, in the session's runtime directory.
CONSOLE_SOCKET = "console.sock"
_CONSOLE_HISTORY = 1 << 20
_CONSOLE_SEND_TIMEOUT = 10.0


class ConsoleRelay:
    """Relays the guest's serial console to whoever connects to ``path`` (any number of clients).

    Everything the guest printed since QEMU started is kept (up to 1 MiB) and replayed to each new client,
    so that a client that connects late still sees, say, a boot message. The transcript is also appended
    to ``log_path``.
    """

    def __init__(self, serial: socket.socket, path: Path, log_path: Path) -> None:
        self.serial = serial
        self.path = path
        self.history = bytearray()
        self.clients: list[socket.socket] = []
        self.lock = threading.Lock()
        self.log = open(log_path, "ab")
        self.listener = listen_private(path, 8)
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
                for client in list(self.clients):
                    try:
                        client.sendall(data)
                    except OSError:
                        self.clients.remove(client)
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
                try:
                    client.sendall(bytes(self.history))
                    self.clients.append(client)
                except OSError:
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
            if client in self.clients:
                self.clients.remove(client)
        with contextlib.suppress(OSError):
            client.close()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with self.lock:
            for client in self.clients:
                with contextlib.suppress(OSError):
                    client.close()
            self.clients.clear()
            self.log.close()


#: The key that ends `isr console` on a terminal (Ctrl-], as in telnet and virsh), and its name.
DETACH_KEY = b"\x1d"
DETACH_NAME = "Ctrl-]"
#: Without a terminal: once the input has ended, how long the guest must be quiet before `attach` returns.
QUIET_AFTER_INPUT = 1.0


class _Signalled(Exception):
    """A signal (SIGTERM, SIGHUP) ended `attach`; the terminal is restored on the way out."""


def attach(path: Path, name: str, *, stdin: int = 0, stdout: int = 1, stderr: TextIO = sys.stderr) -> str:
    """Relay the console at ``path`` to this process's stdin and stdout until detached; returns why it ended.

    Raises OSError if the console cannot be reached.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        if not os.isatty(stdin):
            return _relay(sock, stdin, stdout, detach=None)
        saved = termios.tcgetattr(stdin)
        previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP)}

        def on_signal(signum: int, _frame: object) -> None:
            raise _Signalled(signal.Signals(signum).name)

        print(f"connected to the console of {name}; {DETACH_NAME} detaches", file=stderr, flush=True)
        try:
            for signum in previous:
                signal.signal(signum, on_signal)
            tty.setraw(stdin)
            why = _relay(sock, stdin, stdout, detach=DETACH_KEY)
        except _Signalled as exc:
            why = f"ended by {exc}"
        finally:
            termios.tcsetattr(stdin, termios.TCSADRAIN, saved)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        print(f"\n{why}", file=stderr, flush=True)
        return why
    finally:
        sock.close()


def _relay(sock: socket.socket, stdin: int, stdout: int, *, detach: bytes | None) -> str:
    """Copy the console to ``stdout`` and ``stdin`` to the console until the detach key (on a terminal), the
    console closing, or the end of the input followed by `QUIET_AFTER_INPUT` seconds of silence."""
    input_open = True
    while True:
        readers: list[socket.socket | int] = [sock, stdin] if input_open else [sock]
        ready, _, _ = select.select(readers, [], [], None if input_open else QUIET_AFTER_INPUT)
        if not ready:
            return "end of input"
        if sock in ready:
            data = sock.recv(65536)
            if not data:
                return "the console closed (the VM stopped)"
            _write_all(stdout, data)
        if stdin in ready:
            data = os.read(stdin, 4096)
            if not data:
                input_open = False
                continue
            if detach is not None and detach in data:
                sock.sendall(data[:data.index(detach)])
                return "detached"
            sock.sendall(data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
