"""A parcel made from a real PC disk (the disk-booted Debian guest: syslinux, kernel and root on the disk, no
boot files in the parcel) runs the whole ISR cycle: it boots cold at site A through its own bootloader, works,
suspends and checks in; site B, with an empty cache, resumes it where it stopped, works, and checks in."""
from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from parcels import parcel as parcel_ops
from parcels.store import DirStore
from tests.guest_fixtures import disk_guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import IsrEnv, sites, start_isr_env, work_and_check_in
from tools.guest import GuestArtifacts

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def disk_isr_env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                 disk_guest_artifacts: GuestArtifacts) -> Iterator[IsrEnv]:  # noqa: F811
    env = start_isr_env(request, tmp_path_factory.mktemp("diskboot"), disk_guest_artifacts)
    try:
        yield env
    finally:
        env.server.server.stop()


def test_disk_booted_guest_moves_between_sites(disk_isr_env: IsrEnv, tmp_path: Path) -> None:
    env = disk_isr_env
    parcel = env.make_parcel("pc-disk")
    manifest = parcel_ops.open_version(DirStore(env.store), uuid.UUID(parcel.id), 1, parcel_ops.unlock(
        DirStore(env.store), uuid.UUID(parcel.id), keyfile=parcel.keyfile.read_bytes())).manifest
    assert manifest.vm.boot is None and manifest.vm.firmware == "bios" and "kernel" not in manifest.blobs
    with sites(env, tmp_path, ["A", "B"]) as (a, b):
        marks = work_and_check_in(a, parcel, "at-a")
        # It came up through the firmware and the bootloader on its disk, not a kernel handed to QEMU.
        console_log = (a.state_dir(parcel) / "qemu" / "console.log").read_text(errors="replace")
        assert "SYSLINUX" in console_log, console_log[-2000:]
        assert env.current_version(parcel) == 2
        # B checks that A's RAM token, A's file (by digest) and the RAM counter carried over.
        work_and_check_in(b, parcel, "at-b", before=marks)
        assert env.current_version(parcel) == 3
        assert "SYSLINUX" not in (b.state_dir(parcel) / "qemu" / "console.log").read_text(errors="replace")
