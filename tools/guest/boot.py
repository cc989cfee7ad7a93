"""Boot the test guest under QEMU (through `isrctl.qemu`) from any disk image.

`guest_config` gives the VM configuration for a disk (a copy of the built one, or an image extracted from a
parcel); `booted_guest` launches it, waits for the ready marker and always shuts QEMU down afterwards.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isrctl.accel import kvm_works
from isrctl.qemu import VM, MigrationStats, VMConfig
from parcels import firmware

from .build import GuestArtifacts
from .console import READY_MARKER, GuestConsole

log = logging.getLogger(__name__)

#: quiet: only warnings reach the console the agent shares. The rest trims boot time under TCG: no
#: probing for hardware the machine does not have (PS/2, floppy, extra UARTs), no speculative-execution
#: mitigations to patch in, no waiting to calibrate or trust a clock that is emulated anyway.
KERNEL_CMDLINE = ("console=ttyS0 quiet loglevel=4 8250.nr_uarts=1 i8042.noaux i8042.nokbd "
                  "i8042.nopnp mitigations=off tsc=reliable no_timer_check random.trust_cpu=on")


def guest_config(artifacts: GuestArtifacts, disk: Path | None, **overrides: Any) -> VMConfig:
    """The VM configuration that boots ``artifacts``' kernel and initramfs with ``disk`` as /dev/vda (None: no
    disk here, the caller adds its own drive through ``extra_args``); for the disk-booted guest, one that
    boots ``disk`` through its bootloader.

    ``overrides`` replace any `VMConfig` field (``memory_file``, ``disk_cache``, ``accel``, ...).
    """
    if artifacts.boots_from_disk:
        # Firmware (SeaBIOS, or OVMF with the variable store the caller gives), then the disk's own bootloader.
        uefi = artifacts.firmware == "uefi"
        config = VMConfig(disk=disk, machine="pc-q35-7.2", cpu="qemu64", memory_mib=256, smp=1, accel="tcg",
                          firmware_code=firmware.ovmf_file(firmware.CODE) if uefi else None,
                          firmware_vars=overrides.pop("firmware_vars", None) if uefi else None)
    else:
        config = VMConfig(disk=disk, kernel=artifacts.kernel, initrd=artifacts.initrd, cmdline=KERNEL_CMDLINE,
                          machine="pc-q35-7.2", cpu="qemu64", memory_mib=256, smp=1, accel="tcg")
    return dataclasses.replace(config, **overrides) if overrides else config


@dataclass
class BootedGuest:
    """A running test guest: its VM, its console, and how long it took to become ready."""

    vm: VM
    console: GuestConsole
    #: Seconds from starting QEMU to the ready marker, as the host saw it.
    boot_seconds: float
    #: The guest's own uptime when it printed the ready marker.
    guest_uptime: float
    #: Wall-clock time (``time.time()``) just before the guest's CPUs were started: lets a caller line up
    #: host-side records, such as QEMU trace-event logs, with the guest's first instruction.
    started_wall: float = 0.0


@contextlib.contextmanager
def booted_guest(artifacts: GuestArtifacts, disk: Path | None, *, run_dir: Path | None = None, name: str = "guest",
                 ready_timeout: float = 90.0, **overrides: Any) -> Iterator[BootedGuest]:
    """Boot the guest from ``disk``, wait until it is ready, and shut QEMU down (quit, then kill) on exit.

    The console transcript goes to ``run_dir/<name>.console.log`` and QEMU's output to
    ``run_dir/<name>.log`` when ``run_dir`` is given.
    """
    if artifacts.firmware == "uefi" and "firmware_vars" not in overrides:
        # A fresh copy of OVMF's empty variable store for this boot (QEMU writes to it).
        vars_dir = run_dir or Path(tempfile.mkdtemp(prefix="isr-guest-nvram-"))
        overrides["firmware_vars"] = vars_dir / f"{name}.nvram.fd"
        overrides["firmware_vars"].write_bytes(firmware.empty_variable_store())
    vm = VM(guest_config(artifacts, disk, **overrides), run_dir=run_dir, name=name)
    console: GuestConsole | None = None
    try:
        started = time.monotonic()
        vm.launch(paused=True)
        console = GuestConsole(vm.serial, log_path=run_dir / f"{name}.console.log" if run_dir else None,
                               name=name)
        started_wall = time.time()
        vm.cont()
        uptime = console.wait_ready(ready_timeout)
        boot_seconds = time.monotonic() - started
        log.info("%s ready after %.1f s (guest uptime %.1f s)", name, boot_seconds, uptime)
        yield BootedGuest(vm=vm, console=console, boot_seconds=boot_seconds, guest_uptime=uptime,
                          started_wall=started_wall)
    finally:
        try:
            vm.shutdown()
        finally:
            if console is not None:
                console.close()


@dataclass
class ResumedGuest:
    """A test guest resumed from a saved state: its VM, its console, and what loading the state cost."""

    vm: VM
    console: GuestConsole
    load: MigrationStats


@contextlib.contextmanager
def resumed_guest(artifacts: GuestArtifacts, disk: Path, state: Path | str | bytes, *, run_dir: Path | None = None,
                  name: str = "resumed", compress: bool = True, **overrides: Any) -> Iterator[ResumedGuest]:
    """Start QEMU with ``-incoming defer``, load ``state`` and let the guest continue.

    ``state`` is a file or ``exec:`` URI for `VM.load_state`, or the bytes `VM.save_state_bytes` returned.

    ``disk`` and ``overrides`` must describe the same VM as the one that saved the state (same disk
    contents, same ``memory_file`` if RAM lived in a file). QEMU is shut down on exit, as in `booted_guest`.
    """
    vm = VM(guest_config(artifacts, disk, **overrides), run_dir=run_dir, name=name)
    console: GuestConsole | None = None
    try:
        vm.launch_incoming()
        console = GuestConsole(vm.serial, log_path=run_dir / f"{name}.console.log" if run_dir else None,
                               name=name)
        if isinstance(state, bytes):
            stats = vm.load_state_bytes(state)
        else:
            stats = vm.load_state(state, compress=compress)
        log.info("%s resumed: state loaded in %.2f s", name, stats.seconds)
        yield ResumedGuest(vm=vm, console=console, load=stats)
    finally:
        try:
            vm.shutdown()
        finally:
            if console is not None:
                console.close()


def guest_kvm_works(artifacts: GuestArtifacts, *, timeout: float = 30.0) -> bool:
    """Whether this guest boots under KVM here (probed once per host, then cached; see `kvm_works`)."""
    return kvm_works(artifacts.kernel, artifacts.initrd, marker=READY_MARKER, cmdline=KERNEL_CMDLINE,
                     disk=artifacts.disk, timeout=timeout)
