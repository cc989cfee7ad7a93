"""The VM's VNC display: where QEMU shows it, whether it takes a password, and how a viewer reaches it.

`isr resume --vnc` chooses where: ``auto`` (the first free ``127.0.0.1:N``), ``unix`` (a socket in the
session's runtime directory, mode 0600 by its directory), ``none``, or a QEMU ``-vnc`` argument. A display
that only this PC can reach (a Unix socket, a loopback address) has no password; any other TCP display gets
``password=on`` and a random password, set over QMP after each QEMU start (QEMU refuses every client until
then) and kept in a 0600 file of the runtime directory for `isr viewer`.

`isr viewer` starts the first VNC viewer it finds (`VIEWERS`) when there is a graphical session, and
otherwise prints how to connect.
"""
from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import socket
import string
from dataclasses import dataclass
from pathlib import Path

from .errors import SessionError

#: The display's Unix socket, and the file with a TCP display's password, in the session's runtime directory.
VNC_SOCKET = "vnc.sock"
PASSWORD_FILE = "vnc.password"
#: VNC authentication uses the first 8 characters of a password.
_PASSWORD_LENGTH = 8
_VNC_BASE_PORT = 5900


@dataclass(frozen=True)
class Display:
    """Where a VM's VNC display is: a Unix socket (``path``) or a TCP ``host:port``; ``password`` if it has one."""

    qemu_arg: str
    host: str = ""
    port: int = 0
    path: str = ""
    password: str | None = None

    @property
    def local_only(self) -> bool:
        """Whether only this PC can reach it (no password is needed then)."""
        if self.path:
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"

    def describe(self) -> str:
        """One line: where it is and who can reach it."""
        if self.path:
            return f"vnc unix:{self.path} (this PC only)"
        where = f"{self.host or '0.0.0.0'}:{self.port}"
        if self.local_only:
            return f"vnc {where} (this PC only, no password)"
        return f"vnc {where} (password: `isr viewer`)"

    def to_json(self) -> dict[str, object]:
        """What the session records for `isr viewer` (never the password itself)."""
        return {"qemu_arg": self.qemu_arg, "host": self.host, "port": self.port, "path": self.path,
                "password": self.password is not None}


def choose(option: str, runtime: Path) -> Display | None:
    """The display for ``isr resume --vnc OPTION`` (None for ``none``); raises SessionError on a bad one."""
    if option == "none":
        return None
    if option == "auto":
        return _tcp(_free_display(), "127.0.0.1")
    if option == "unix":
        path = str(runtime / VNC_SOCKET)
        return Display(qemu_arg=f"unix:{path}", path=path)
    head, _, _options = option.partition(",")
    if head.startswith("unix:"):
        return Display(qemu_arg=option, path=head[len("unix:"):])
    host, sep, number = head.rpartition(":")
    if not sep or not number.isdigit() or int(number) > 65535 - _VNC_BASE_PORT:
        raise SessionError(f"--vnc {option!r} is not auto, unix, none, unix:PATH or HOST:DISPLAY (e.g. 127.0.0.1:3)")
    return _tcp(option, host.strip("[]"))


def _tcp(qemu_arg: str, host: str) -> Display:
    head = qemu_arg.partition(",")[0]
    port = _VNC_BASE_PORT + int(head.rpartition(":")[2])
    display = Display(qemu_arg=qemu_arg, host=host, port=port)
    if display.local_only:
        return display
    password = "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(_PASSWORD_LENGTH))
    if "password=" not in qemu_arg:
        qemu_arg += ",password=on"
    return Display(qemu_arg=qemu_arg, host=host, port=port, password=password)


def _free_display() -> str:
    for number in range(0, 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", _VNC_BASE_PORT + number))
            except OSError:
                continue
            return f"127.0.0.1:{number}"
    raise SessionError("no free VNC display on 127.0.0.1:5900-5999: give --vnc HOST:DISPLAY or --vnc unix")


def save_password(display: Display, runtime: Path) -> None:
    """Keep a display's password where `isr viewer` finds it (mode 0600)."""
    if display.password is None:
        return
    path = runtime / PASSWORD_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(display.password + "\n")


def load(recorded: dict[str, object], runtime: Path) -> Display:
    """The display a session recorded (`Display.to_json`), with its password read back."""
    password = None
    if recorded.get("password"):
        try:
            password = (runtime / PASSWORD_FILE).read_text().strip()
        except OSError as exc:
            raise SessionError(f"cannot read the display's password: {exc}") from None
    return Display(qemu_arg=str(recorded.get("qemu_arg", "")), host=str(recorded.get("host", "")),
                   port=int(str(recorded.get("port", 0))), path=str(recorded.get("path", "")), password=password)


#: VNC viewers `isr viewer` starts, in order of preference: the program and how it is told where to connect.
VIEWERS = ("remote-viewer", "vncviewer", "xtightvncviewer", "gvncviewer")


def viewer_command(display: Display, path: str | None = None) -> list[str] | None:
    """The command line of the first installed viewer that can show ``display`` (None: none here).
    ``path`` is the search path (default $PATH)."""
    for name in VIEWERS:
        program = shutil.which(name, path=path)
        if program is None:
            continue
        if display.path:
            if name == "remote-viewer":
                return [program, f"vnc+unix://{display.path}"]
            if name == "vncviewer":           # TigerVNC takes a socket path
                return [program, display.path]
            continue
        host = display.host if display.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        if name == "remote-viewer":
            return [program, f"vnc://{host}:{display.port}"]
        if name == "gvncviewer":              # takes a display number
            return [program, f"{host}:{display.port - _VNC_BASE_PORT}"]
        return [program, f"{host}::{display.port}"]
    return None


def how_to_connect(display: Display) -> list[str]:
    """The lines that tell a person how to reach ``display`` with a viewer of their own."""
    if display.path:
        return [f"VNC display on the Unix socket {display.path} (this PC only)",
                f"  remote-viewer vnc+unix://{display.path}     or  vncviewer {display.path} (TigerVNC)"]
    host = display.host or "0.0.0.0"
    lines = [f"VNC display at {host}:{display.port} (display :{display.port - _VNC_BASE_PORT})"
             + (", this PC only" if display.local_only else ""),
             f"  vncviewer {'127.0.0.1' if host in ('0.0.0.0', '::') else host}::{display.port}"]
    if display.password is not None:
        lines.append(f"  password: {display.password}")
    elif display.local_only:
        lines.append("  no password: only this PC can connect")
    return lines
