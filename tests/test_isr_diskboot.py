"""A parcel made from a real PC disk (the disk-booted Debian guest: bootloader, kernel and root on the disk, no
boot files in the parcel) runs the whole ISR cycle: it boots cold at site A through its own bootloader, works,
suspends and checks in; site B, with an empty cache, resumes it where it stopped, works, and checks in. Under
BIOS (syslinux) and under UEFI (OVMF, systemd-boot), whose variable store is versioned with the parcel."""
from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from parcels import firmware
from parcels import parcel as parcel_ops
from parcels.manifest import Manifest
from parcels.store import DirStore
from tests.guest_fixtures import disk_guest_artifacts, uefi_guest_artifacts  # noqa: F401  (pytest fixtures)
from tests.isr_fixtures import IsrEnv, Parcel, sites, start_isr_env, work_and_check_in
from tools.guest import GuestArtifacts

pytestmark = pytest.mark.timeout(600)


def serve(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, guest: GuestArtifacts
          ) -> Iterator[IsrEnv]:
    """A server for parcels made from ``guest``'s disk, for one module."""
    env = start_isr_env(request, tmp_path_factory.mktemp(guest.variant), guest)
    try:
        yield env
    finally:
        env.server.server.stop()


@pytest.fixture(scope="module")
def disk_isr_env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                 disk_guest_artifacts: GuestArtifacts) -> Iterator[IsrEnv]:  # noqa: F811
    yield from serve(request, tmp_path_factory, disk_guest_artifacts)


def test_disk_booted_guest_moves_between_sites(disk_isr_env: IsrEnv, tmp_path: Path) -> None:
    env = disk_isr_env
    parcel = env.make_parcel("pc-disk")
    manifest = manifest_of(env, parcel, 1)
    assert manifest.vm.boot is None and manifest.vm.firmware == "bios" and "kernel" not in manifest.blobs
    with sites(env, tmp_path, ["A", "B"]) as (a, b):
        marks = work_and_check_in(a, parcel, "at-a")
        # It came up through the firmware and the bootloader on its disk, not a kernel handed to QEMU; the
        # console (what `isr console` shows: everything since QEMU started, replayed) has the boot messages.
        console_log = (a.state_dir(parcel) / "qemu" / "console.log").read_text(errors="replace")
        assert "SYSLINUX" in console_log, console_log[-2000:]
        seen = (a.root / f"{parcel.name}.console.log").read_text(errors="replace")
        assert "SYSLINUX" in seen and "ISR-GUEST-READY" in seen, seen[-2000:]
        assert env.current_version(parcel) == 2
        # B checks that A's RAM token, A's file (by digest) and the RAM counter carried over.
        work_and_check_in(b, parcel, "at-b", before=marks)
        assert env.current_version(parcel) == 3
        assert "SYSLINUX" not in (b.state_dir(parcel) / "qemu" / "console.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def uefi_isr_env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                 uefi_guest_artifacts: GuestArtifacts) -> Iterator[IsrEnv]:  # noqa: F811
    yield from serve(request, tmp_path_factory, uefi_guest_artifacts)


def manifest_of(env: IsrEnv, parcel: Parcel, version: int) -> Manifest:
    store = DirStore(env.store)
    keys = parcel_ops.unlock(store, uuid.UUID(parcel.id), keyfile=parcel.keyfile.read_bytes())
    return parcel_ops.open_version(store, uuid.UUID(parcel.id), version, keys).manifest


def test_uefi_parcel_keeps_its_variable_store(uefi_isr_env: IsrEnv, tmp_path: Path) -> None:
    """A UEFI parcel boots through OVMF and systemd-boot; the variable store OVMF writes on the first boot
    (its boot entries) is checked in as the next version's nvram blob, and the guest moves to site B."""
    env = uefi_isr_env
    parcel = env.make_parcel("uefi-pc")
    first = manifest_of(env, parcel, 1)
    assert first.vm.firmware == "uefi" and first.vm.boot is None
    assert first.blobs[firmware.NVRAM_BLOB].sha256 == hashlib.sha256(firmware.empty_variable_store()).digest()
    with sites(env, tmp_path, ["A", "B"]) as (a, b):
        marks = work_and_check_in(a, parcel, "at-a")
        console_log = (a.state_dir(parcel) / "qemu" / "console.log").read_text(errors="replace")
        assert "BdsDxe" in console_log, console_log[-2000:]     # OVMF's boot manager ran the disk's loader
        second = manifest_of(env, parcel, 2)
        assert second.blobs[firmware.NVRAM_BLOB].sha256 != first.blobs[firmware.NVRAM_BLOB].sha256
        assert second.blobs[firmware.NVRAM_BLOB].size == first.blobs[firmware.NVRAM_BLOB].size
        work_and_check_in(b, parcel, "at-b", before=marks)
        # Nothing changed the variables at B: version 3 inherits version 2's store.
        assert manifest_of(env, parcel, 3).blobs[firmware.NVRAM_BLOB] == second.blobs[firmware.NVRAM_BLOB]
