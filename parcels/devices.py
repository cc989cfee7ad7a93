"""The VM's devices as a manifest's ``vm.devices`` names them: the models isr knows, and port forwards.

``vm.devices`` maps a role to a model, both strings (doc/parcel-format.md). The roles and models:

=========  ==================  ===================================================================
role       models              meaning
=========  ==================  ===================================================================
disk       virtio-blk          the disk image on a virtio block device
net        user, none          QEMU's user-mode network on a virtio-net NIC (the guest is 10.0.2.15,
                               the host 10.0.2.2), or no NIC
rng        virtio, none        a virtio-rng device fed from the host's /dev/urandom, or none
balloon    virtio, none        a virtio-balloon device with free page reporting: the guest reports free
                               memory, QEMU punches it out of the memory image, and those chunks are then
                               neither stored at a checkin nor fetched at a resume; or none
display    vnc, none           a VGA card shown over VNC, or no display
forward    port forwards       host ports that reach the guest through the user-mode network,
                               space separated, each ``PROTO:HOSTADDR:HOSTPORT-GUESTADDR:GUESTPORT``
=========  ==================  ===================================================================

A forward is written ``[tcp:|udp:][HOSTADDR:]HOSTPORT-[GUESTADDR:]GUESTPORT`` (``tcp:2222-:22``); the host
address defaults to 127.0.0.1 (this PC only: ``0.0.0.0`` opens the port to the network) and the guest address
to the guest's own. It is stored in the canonical form QEMU's ``hostfwd`` takes, ``tcp:127.0.0.1:2222-:22``.
The NIC, the rng and the balloon device are part of the saved device state; the forwards are not (a suspended VM may get
other forwards, but not another NIC).

Both the client (to start QEMU) and the server's admin tool (to check what it stores) read devices here.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import FormatError

#: Every role and the models isr can run (a role with one free-form value, like ``forward``, is not here).
MODELS: dict[str, tuple[str, ...]] = {
    "disk": ("virtio-blk",),
    "net": ("user", "none"),
    "rng": ("virtio", "none"),
    "balloon": ("virtio", "none"),
    "display": ("vnc", "none"),
}
#: The devices of a new parcel: user-mode networking, a virtio rng and the free-page-reporting balloon. A
#: manifest without ``net``, ``rng`` or ``balloon`` has none of them (parcels made before they existed keep
#: the virtual hardware their saved state was made on).
DEFAULT = {"disk": "virtio-blk", "net": "user", "rng": "virtio", "balloon": "virtio", "display": "vnc"}
#: The role holding the port forwards.
FORWARD = "forward"
#: The roles that are part of the virtual hardware a saved state needs (all but the forwards).
HARDWARE = tuple(MODELS)

_FORWARD_RE = re.compile(r"(?:(tcp|udp):)?(?:([0-9.]*):)?(\d{1,5})-(?:([0-9.]*):)?(\d{1,5})")
_FORWARD_HELP = "write [tcp:|udp:][HOSTADDR:]HOSTPORT-[GUESTADDR:]GUESTPORT, e.g. tcp:2222-:22"


@dataclass(frozen=True)
class Forward:
    """One port forward of the user-mode network: connections to ``host_addr:host_port`` on this PC reach
    ``guest_addr:guest_port`` (``guest_addr`` empty: the guest's own address)."""

    proto: str
    host_addr: str
    host_port: int
    guest_addr: str
    guest_port: int

    def __str__(self) -> str:
        """The canonical form, which is also QEMU's ``hostfwd=`` value."""
        return f"{self.proto}:{self.host_addr}:{self.host_port}-{self.guest_addr}:{self.guest_port}"


def parse_forward(text: str) -> Forward:
    """A forward from ``[tcp:|udp:][HOSTADDR:]HOSTPORT-[GUESTADDR:]GUESTPORT``; raises FormatError."""
    match = _FORWARD_RE.fullmatch(text.strip())
    if match is None:
        raise FormatError(f"bad port forward {text!r}: {_FORWARD_HELP}")
    proto, host_addr, host_port, guest_addr, guest_port = match.groups()
    for addr in (host_addr, guest_addr):
        if addr:
            try:
                ipaddress.IPv4Address(addr)
            except ValueError:
                raise FormatError(f"bad port forward {text!r}: {addr!r} is not an IPv4 address") from None
    for port in (host_port, guest_port):
        if not 1 <= int(port) <= 65535:
            raise FormatError(f"bad port forward {text!r}: port {port} is not in 1-65535")
    return Forward(proto or "tcp", host_addr or "127.0.0.1", int(host_port), guest_addr or "", int(guest_port))


def parse_forwards(texts: list[str]) -> list[Forward]:
    """Several forwards (each may itself be a space-separated list); raises FormatError on a bad one or on two
    that take the same host port."""
    found: list[Forward] = []
    taken: dict[tuple[str, str, int], Forward] = {}
    for text in texts:
        for word in text.split():
            forward = parse_forward(word)
            key = (forward.proto, forward.host_addr, forward.host_port)
            if key in taken:
                raise FormatError(f"port forwards {taken[key]} and {forward} take the same host port")
            taken[key] = forward
            found.append(forward)
    return found


def forwards(devices: Mapping[str, str]) -> list[Forward]:
    """The forwards stored in ``devices``; raises FormatError if they do not parse."""
    return parse_forwards([devices.get(FORWARD, "")])


def format_forwards(found: list[Forward]) -> str:
    """The ``forward`` value that stores ``found``."""
    return " ".join(str(f) for f in found)


def problems(devices: Mapping[str, str]) -> list[str]:
    """What isr cannot run in ``devices`` (unknown roles or models, bad forwards), one line each."""
    found = []
    for role, model in devices.items():
        if role == FORWARD:
            try:
                if forwards(devices) and devices.get("net") != "user":
                    found.append("port forwards need the user-mode network (device net=user)")
            except FormatError as exc:
                found.append(str(exc))
        elif model not in MODELS.get(role, ()):
            found.append(f"device {role}={model} is not supported by this isr"
                         + (f" (it knows {', '.join(MODELS[role])})" if role in MODELS else ""))
    return found


def check(devices: Mapping[str, str]) -> None:
    """Raise FormatError naming the first problem of ``devices`` (see `problems`)."""
    found = problems(devices)
    if found:
        raise FormatError(found[0])
