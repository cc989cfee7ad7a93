"""Where the ISR client keeps things: XDG base directories, one place for every path.

Layout (``$XDG_*`` with the usual defaults)::

    ${XDG_CONFIG_HOME:-~/.config}/isr/config.toml         server URL, user, pinned certificate, site
    ${XDG_CONFIG_HOME:-~/.config}/isr/schedule.toml       site rules, calendars, hoard scheduling settings
    ${XDG_DATA_HOME:-~/.local/share}/isr/token            bearer token (mode 0600)
    ${XDG_DATA_HOME:-~/.local/share}/isr/schedule-state.json   hoards done, measured throughput
    ${XDG_DATA_HOME:-~/.local/share}/isr/hoard.log        vulpes-fetch's messages (keyless hoards)
    ${XDG_DATA_HOME:-~/.local/share}/isr/parcels/<uuid>/  per-parcel state (vulpes --state, checkout.json, ...)
    ${XDG_CACHE_HOME:-~/.cache}/isr/chunks/               chunk cache shared by all parcels (vulpes --cache)
    ${XDG_RUNTIME_DIR:-/tmp}/isr-<uid>/<uuid8>/           sockets and the mountpoint of a running session

Tests and the demo give each "site" its own directories by setting these variables. Nothing here
creates anything except `runtime_dir` and `parcel_runtime_dir`, which make their directory (mode 0700)
because sockets must live in a private place.
"""
from __future__ import annotations

import contextlib
import os
import socket
import uuid
from pathlib import Path

#: Unix socket paths are limited to 107 bytes; a runtime directory longer than this cannot hold them.
_SOCKET_ROOM = 107 - len("/session.sock")


def _xdg(variable: str, default: Path) -> Path:
    value = os.environ.get(variable)
    # The XDG spec says relative paths are invalid and must be ignored.
    return Path(value) if value and os.path.isabs(value) else default


def config_dir() -> Path:
    """``${XDG_CONFIG_HOME:-~/.config}/isr``."""
    return _xdg("XDG_CONFIG_HOME", Path.home() / ".config") / "isr"


def config_file() -> Path:
    """The client configuration, ``config_dir()/config.toml``."""
    return config_dir() / "config.toml"


def schedule_file() -> Path:
    """Hoard scheduling: site rules, calendars, settings (`isr site`, `isr schedule`)."""
    return config_dir() / "schedule.toml"


def data_dir() -> Path:
    """``${XDG_DATA_HOME:-~/.local/share}/isr``."""
    return _xdg("XDG_DATA_HOME", Path.home() / ".local" / "share") / "isr"


def token_file() -> Path:
    """The bearer token from `isr login` (mode 0600)."""
    return data_dir() / "token"


def schedule_state_file() -> Path:
    """What `isr schedule run` remembers across restarts: hoards done, throughput measured."""
    return data_dir() / "schedule-state.json"


def parcels_dir() -> Path:
    """Where each parcel's local state lives, one directory per UUID."""
    return data_dir() / "parcels"


def parcel_state_dir(parcel: uuid.UUID | str) -> Path:
    """The local state of one parcel: vulpes's ``--state`` directory plus isrctl's own files."""
    return parcels_dir() / str(uuid.UUID(str(parcel)))


def cache_dir() -> Path:
    """``${XDG_CACHE_HOME:-~/.cache}/isr``: what ISR can rebuild."""
    return _xdg("XDG_CACHE_HOME", Path.home() / ".cache") / "isr"


def chunk_cache_dir() -> Path:
    """The chunk cache shared by every parcel of this user (vulpes ``--cache``)."""
    return cache_dir() / "chunks"


def runtime_dir() -> Path:
    """``${XDG_RUNTIME_DIR:-/tmp}/isr-<uid>``, created with mode 0700.

    Raises OSError if it cannot be created or belongs to someone else.
    """
    path = _xdg("XDG_RUNTIME_DIR", Path("/tmp")) / f"isr-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        raise OSError(f"{path} belongs to another user")
    return path


def parcel_runtime_dir(parcel: uuid.UUID | str) -> Path:
    """The runtime directory of one parcel's session (sockets, the vulpes mountpoint), created 0700.

    The directory is named by the first 8 hex digits of the UUID to leave room for socket names.
    Raises OSError if it cannot be created, or if the path is too long for Unix sockets.
    """
    path = runtime_dir() / str(uuid.UUID(str(parcel)))[:8]
    if len(str(path)) > _SOCKET_ROOM:
        raise OSError(f"runtime directory {path} is too long for Unix sockets: set XDG_RUNTIME_DIR to a "
                      f"shorter path")
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def listen_private(path: Path, backlog: int) -> socket.socket:
    """A listening Unix socket at ``path`` (mode 0600, in a private runtime directory), replacing a stale one."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(backlog)
    return listener


def memory_file(name: str, data: bytes) -> tuple[int, Path]:
    """An anonymous in-memory file holding ``data`` and a path another process (QEMU, vulpes) can open it by,
    so that plaintext (boot files, a resume pack) is handed on without touching a disk. Close the descriptor
    once the other process has read it."""
    fd = os.memfd_create(f"isr-{name}", os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    return fd, Path(f"/proc/{os.getpid()}/fd/{fd}")
