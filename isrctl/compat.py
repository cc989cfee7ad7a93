"""Can this PC run a parcel's VM? Checked from the manifest alone, before anything big is downloaded.

A saved device state loads only into the same virtual hardware: the same versioned machine type, the same
CPU model, the same devices, and a QEMU at least as new as the one that saved it (QEMU keeps versioned
machine types loadable forward, not backward). The guest's RAM must also fit in this PC's available
memory. `check` raises `CompatibilityError` with every problem found, one per line.
"""
from __future__ import annotations

import functools
import re
import shutil
import subprocess
from dataclasses import dataclass

from parcels import devices, firmware
from parcels.errors import ParcelError
from parcels.manifest import Manifest

from .errors import CompatibilityError

QEMU = "qemu-system-x86_64"
#: Room for QEMU itself, vulpes's RAM cache and the host, beyond the guest's RAM.
RAM_MARGIN_MIB = 192


@dataclass(frozen=True)
class HostQemu:
    """What the local QEMU offers."""

    version: str
    machines: frozenset[str]
    cpus: frozenset[str]


def run_qemu(args: list[str]) -> str:
    """The output of a QEMU query (``args``: the binary and its options). Raises CompatibilityError if QEMU
    is missing or fails."""
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=30, check=True).stdout
    except FileNotFoundError:
        raise CompatibilityError(f"{args[0]} is not installed (Debian: apt-get install qemu-system-x86)") from None
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise CompatibilityError(f"`{' '.join(args)}` failed: {exc}") from None


@functools.lru_cache(maxsize=4)
def host_qemu(binary: str = QEMU) -> HostQemu:
    """Ask the local QEMU for its version, machine types and CPU models (cached per process).
    Raises CompatibilityError if QEMU is missing or does not answer."""
    path = shutil.which(binary) or binary
    version_text = run_qemu([path, "--version"])
    match = re.search(r"version (\d+\.\d+(?:\.\d+)?)", version_text)
    if match is None:
        raise CompatibilityError(f"cannot tell the QEMU version from {version_text.splitlines()[:1]}")
    machines = set()
    for line in run_qemu([path, "-machine", "help"]).splitlines()[1:]:
        if line.strip():
            machines.add(line.split()[0])
    cpus = set()
    for line in run_qemu([path, "-cpu", "help"]).splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "x86":
            cpus.add(parts[1])
    return HostQemu(match.group(1), frozenset(machines), frozenset(cpus))


def version_tuple(text: str) -> tuple[int, ...]:
    """'7.2.19' -> (7, 2, 19); anything after the numbers is ignored."""
    match = re.match(r"(\d+(?:\.\d+)*)", text.strip())
    if match is None:
        raise CompatibilityError(f"not a QEMU version: {text!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def available_ram_mib() -> int:
    """MemAvailable from /proc/meminfo, in MiB (0 if it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def check(manifest: Manifest, *, suspended: bool | None = None, host: HostQemu | None = None) -> HostQemu:
    """Raise CompatibilityError unless this PC can start (or, for a suspended version, restore) the VM.

    ``suspended`` overrides ``manifest.suspended`` (a local suspend not yet checked in). Returns what was
    found about the local QEMU.
    """
    host = host or host_qemu()
    vm = manifest.vm
    problems = []
    restoring = manifest.suspended if suspended is None else suspended
    if vm.machine not in host.machines:
        problems.append(f"machine type {vm.machine} is not offered by QEMU {host.version} here "
                        f"(see `{QEMU} -machine help`)")
    if vm.cpu not in host.cpus:
        problems.append(f"CPU model {vm.cpu} is not offered by QEMU {host.version} here (see `{QEMU} -cpu help`)")
    if restoring and vm.qemu_version:
        saved, local = version_tuple(vm.qemu_version)[:2], version_tuple(host.version)[:2]
        if local < saved:
            problems.append(f"the VM was suspended by QEMU {vm.qemu_version}; QEMU {host.version} here is older "
                            f"and cannot load its state (install QEMU >= {'.'.join(map(str, saved))})")
    need = vm.ram_mib + RAM_MARGIN_MIB
    have = available_ram_mib()
    if have and have < need:
        problems.append(f"the VM needs {vm.ram_mib} MiB of RAM (+{RAM_MARGIN_MIB} MiB for QEMU and vulpes); only "
                        f"{have} MiB are available here")
    problems += devices.problems(vm.devices)
    if vm.firmware == "uefi":
        try:
            firmware.ovmf_file(firmware.CODE)
        except ParcelError as exc:
            problems.append(str(exc))
    if problems:
        raise CompatibilityError(f"this PC cannot run parcel {manifest.name} version {manifest.version}:\n  "
                                 + "\n  ".join(problems))
    return host
