"""The test guest, packed into an encrypted parcel and booted from what comes back out of it.

This is the Foundation's end-to-end proof: the disk image and the boot files go through the real parcel
format (chunked, compressed, convergently encrypted, sealed) into a directory store, nothing readable is
left in the store, and the image extracted from the store boots and runs the workload with the result the
host computed from the original archive.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from parcels import parcel as parcel_ops
from parcels.envelope import new_keyfile
from tools.guest import GuestArtifacts, booted_guest, check_ext4
from tools.guest.boot import KERNEL_CMDLINE
from parcels.store import DirStore
from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.timeout(300)


def _store_files(root: Path) -> list[Path]:
    return [Path(d) / f for d, _, files in os.walk(root) for f in files]


def _plaintext_probes(artifacts: GuestArtifacts) -> list[bytes]:
    """32-byte windows that certainly occur in the guest's plaintext: from its kernel, its initramfs, and
    the source archive stored on its disk."""
    probes = []
    for path, offset in ((artifacts.kernel, 1 << 20), (artifacts.initrd, 4096), (artifacts.archive, 65536)):
        with open(path, "rb") as f:
            f.seek(offset)
            probes.append(f.read(32))
    return probes


def test_guest_boots_from_parcel(guest_artifacts: GuestArtifacts, tmp_path: Path) -> None:
    store = DirStore(tmp_path / "store")
    keyfile = new_keyfile()
    parcel = parcel_ops.create_parcel(
        store, name="test-guest", disk=guest_artifacts.disk, ram_mib=256, keyfile=keyfile,
        boot={"kernel": guest_artifacts.kernel, "initrd": guest_artifacts.initrd, "cmdline": KERNEL_CMDLINE})

    # The store holds only ciphertext: no 32-byte window of the kernel, initramfs or disk contents appears.
    probes = _plaintext_probes(guest_artifacts)
    files = _store_files(tmp_path / "store")
    assert files, "the store is empty"
    stored = 0
    for path in files:
        data = path.read_bytes()
        stored += len(data)
        for probe in probes:
            assert probe not in data, f"plaintext of the guest found in {path}"

    # Zero chunks are not stored, and compression works: the store is much smaller than the image.
    image_bytes = guest_artifacts.disk.stat().st_size
    assert stored < image_bytes / 4, (stored, image_bytes)

    # Everything comes back out through the verified read path, and the version is complete.
    keys = parcel_ops.unlock(store, parcel, keyfile=keyfile)
    assert parcel_ops.verify_version(store, parcel, 1, keys) == []
    contents = parcel_ops.open_version(store, parcel, 1, keys)
    assert contents.manifest.suspended is False
    assert contents.manifest.vm.ram_mib == 256
    disk = tmp_path / "disk.img"
    parcel_ops.extract_image(store, parcel, None, "disk", disk, keyfile=keyfile)
    assert disk.stat().st_size == image_bytes
    # The extracted image is byte-identical to the original.
    with open(disk, "rb") as a, open(guest_artifacts.disk, "rb") as b:
        while True:
            block_a, block_b = a.read(1 << 20), b.read(1 << 20)
            assert block_a == block_b
            if not block_a:
                break
    kernel = tmp_path / "kernel"
    initrd = tmp_path / "initrd"
    kernel.write_bytes(parcel_ops.read_blob(store, parcel, contents.manifest, "kernel", keys))
    initrd.write_bytes(parcel_ops.read_blob(store, parcel, contents.manifest, "initrd", keys))
    assert contents.manifest.vm.boot is not None and contents.manifest.vm.boot.cmdline == KERNEL_CMDLINE

    # Boot what came out of the parcel (its kernel, its initramfs, its disk) and run the workload.
    from_parcel = dataclasses.replace(guest_artifacts, kernel=kernel, initrd=initrd)
    with booted_guest(from_parcel, disk, run_dir=tmp_path, name="from-parcel") as guest:
        result = guest.console.run_workload(timeout=180)
        assert result["digest"] == guest_artifacts.expected.digest
        assert int(result["files"]) == guest_artifacts.expected.files
        guest.console.request_poweroff()
        assert guest.vm.wait(60) == 0
    status, output = check_ext4(disk)
    assert status == 0, output


def test_wrong_keyfile_opens_nothing(guest_artifacts: GuestArtifacts, tmp_path: Path) -> None:
    from parcels.errors import WrongKeyError

    store = DirStore(tmp_path / "store")
    parcel = parcel_ops.create_parcel(store, name="locked", disk=guest_artifacts.disk, ram_mib=64,
                                      keyfile=new_keyfile())
    with pytest.raises(WrongKeyError):
        parcel_ops.extract_image(store, parcel, None, "disk", tmp_path / "out.img", keyfile=new_keyfile())
    assert not (tmp_path / "out.img").exists()
