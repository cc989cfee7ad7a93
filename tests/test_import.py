"""Parcels made from the disk images other virtualizers write (doc/parcels.md): raw, qcow2, vmdk, vdi and vhdx
read through qemu-img and qemu-storage-daemon with no copy of the image, and each kind of bad input refused
by isr-admin in one line that names the file, leaving nothing on the server."""
from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from parcels import parcel as parcel_ops
from parcels.image import boot_problem
from parcels.qemuimg import FORMATS
from parcels.store import DirStore
from tests.server_fixtures import BIN, ServerEnv, image_with_data, server_env  # noqa: F401

pytestmark = pytest.mark.timeout(300)

KEYFILE = bytes(range(32))
SECRET = bytes(32 * [7])
MIB = 1 << 20


def qemu_img(*args: str) -> None:
    subprocess.run(["qemu-img", *args], check=True, capture_output=True, timeout=120)


def bootable_image(path: Path, size: int = 6 * MIB) -> bytes:
    """A sparse raw disk with data here and there and a (token) MBR: boot code and the boot signature."""
    content = bytearray(image_with_data(path, size, seed=17, data_ranges=[(0, 446), (MIB + 3, 300000),
                                                                           (4 * MIB, 2 * MIB - 4096)]))
    content[510:512] = b"\x55\xaa"
    path.write_bytes(bytes(content))
    return bytes(content)


def disk_tags(store: DirStore, parcel: uuid.UUID) -> list[tuple[int, bytes]]:
    keys = parcel_ops.unlock(store, parcel, keyfile=KEYFILE)
    contents = parcel_ops.open_version(store, parcel, 1, keys)
    return [(r.idx, r.tag) for r in contents.disk]


def test_every_format_gives_the_same_chunks(tmp_path: Path) -> None:
    """The same disk as raw, qcow2 (also compressed), vmdk, vdi and vhdx: the same virtual size and, under one
    convergence secret, the same chunk tags; extracted, the raw bytes come back."""
    raw = tmp_path / "disk.raw"
    content = bootable_image(raw)
    images = {"raw": raw}
    for fmt in FORMATS[1:]:
        images[fmt] = tmp_path / f"disk.{fmt}"
        qemu_img("convert", "-f", "raw", "-O", fmt, str(raw), str(images[fmt]))
    images["qcow2-compressed"] = tmp_path / "disk-c.qcow2"
    qemu_img("convert", "-c", "-f", "raw", "-O", "qcow2", str(raw), str(images["qcow2-compressed"]))
    tags = {}
    for name, path in images.items():
        store = DirStore(tmp_path / f"store-{name}")
        parcel = parcel_ops.create_parcel(store, name=name, disk=path, ram_mib=8, keyfile=KEYFILE,
                                          convergence_secret=SECRET, tmpdir=tmp_path, check_boot=True)
        tags[name] = disk_tags(store, parcel)
        manifest = parcel_ops.extract_image(store, parcel, None, "disk", tmp_path / f"out-{name}", keyfile=KEYFILE)
        assert manifest.images["disk"].size == len(content), name
        assert (tmp_path / f"out-{name}").read_bytes() == content, name
        assert manifest.vm.firmware == "bios"
    assert [i for i, _ in tags["raw"]] == [0, 8, 9, 10, *range(32, 48)]   # 128 KiB chunks; the rest is holes
    for name, found in tags.items():
        assert found == tags["raw"], name
    # Nothing of the exports is left mounted or behind.
    assert not any(p.name.startswith("isr-image-") for p in tmp_path.iterdir())


def test_boot_problem_reads_mbr_and_gpt(tmp_path: Path) -> None:
    blank = tmp_path / "blank.raw"
    blank.write_bytes(bytes(MIB))
    assert "no MBR boot signature" in (boot_problem(blank, "bios") or "")
    assert "no EFI system partition" in (boot_problem(blank, "uefi") or "")
    gpt = tmp_path / "gpt.raw"
    gpt.write_bytes(bytes(8 * MIB))
    subprocess.run(["sfdisk", "-q", str(gpt)], input="label: gpt\nsize=4MiB, type=uefi\n", text=True, check=True,
                   timeout=60)
    # A GPT disk with an EFI system partition and no BIOS boot code: UEFI only, and the BIOS answer says so.
    assert boot_problem(gpt, "uefi") is None
    assert "--firmware uefi" in (boot_problem(gpt, "bios") or "")
    mbr = tmp_path / "mbr.raw"
    bootable_image(mbr)
    assert boot_problem(mbr, "bios") is None


def run_admin(env: ServerEnv, tmp_path: Path, name: str, disk: Path, *extra: str,
              environ: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    keyfile = tmp_path / "parcel.key"
    keyfile.write_bytes(KEYFILE)
    return subprocess.run([str(BIN / "isr-admin"), "-c", str(env.config), "--json", "parcel", "create", "--owner",
                           "alice", "--name", name, "--disk", str(disk), "--ram", "16", "--key-file", str(keyfile),
                           *extra], capture_output=True, text=True, timeout=180,
                          env={**os.environ, **(environ or {})})


def assert_refused(env: ServerEnv, chunks_before: int, result: subprocess.CompletedProcess[str], name: str,
                   named: Path, *phrases: str) -> None:
    """One line naming the file at fault (`named`), exit 1, and the server unchanged: no parcel, no chunk
    counted as stored."""
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert result.stderr.startswith("isr-admin: ") and result.stderr.count("\n") == 1, result.stderr
    assert str(named) in result.stderr and "Traceback" not in result.stderr, result.stderr
    for phrase in phrases:
        assert phrase in result.stderr, result.stderr
    assert name not in [p["name"] for p in env.admin_json("parcel", "list")]
    assert env.admin_json("usage")["chunks"] == chunks_before, "a refused import left chunks behind"


@pytest.mark.parametrize("server_env", ["sqlite-directory"], indirect=True)  # the refusals come before any backend
def test_admin_refuses_bad_images(server_env: ServerEnv, tmp_path: Path) -> None:  # noqa: F811
    env = server_env
    before = env.admin_json("usage")["chunks"]

    unbootable = tmp_path / "data-only.raw"
    image_with_data(unbootable, 2 * MIB, seed=3, data_ranges=[(MIB, 4096)])
    assert_refused(env, before, run_admin(env, tmp_path, "unbootable", unbootable), "unbootable", unbootable,
                   "would not boot under BIOS", "no MBR boot signature", "--force")

    good = tmp_path / "good.raw"
    bootable_image(good)
    truncated = tmp_path / "truncated.qcow2"
    qemu_img("convert", "-f", "raw", "-O", "qcow2", str(good), str(truncated))
    os.truncate(truncated, truncated.stat().st_size // 2)
    assert_refused(env, before, run_admin(env, tmp_path, "truncated", truncated), "truncated", truncated,
                   "copy it again")
    vdi = tmp_path / "truncated.vdi"
    qemu_img("convert", "-f", "raw", "-O", "vdi", str(good), str(vdi))
    os.truncate(vdi, vdi.stat().st_size // 2)
    assert_refused(env, before, run_admin(env, tmp_path, "truncated-vdi", vdi), "truncated-vdi", vdi, "is truncated")

    unknown = tmp_path / "disk.vhd"
    qemu_img("convert", "-f", "raw", "-O", "vpc", str(good), str(unknown))
    assert_refused(env, before, run_admin(env, tmp_path, "unknown", unknown), "unknown", unknown,
                   "vpc format", "qemu-img convert")

    flat = tmp_path / "split.vmdk"
    qemu_img("create", "-f", "vmdk", "-o", "subformat=monolithicFlat", str(flat), "4M")
    (tmp_path / "split-flat.vmdk").unlink()
    assert_refused(env, before, run_admin(env, tmp_path, "split", flat), "split", flat, "vmdk")

    missing = tmp_path / "absent.qcow2"
    assert_refused(env, before, run_admin(env, tmp_path, "absent", missing), "absent", missing, "No such file")

    assert_refused(env, before, run_admin(env, tmp_path, "uefi", good, "--firmware", "uefi",
                                  environ={"ISR_OVMF_DIR": str(tmp_path / "no-ovmf")}),
                   "uefi", tmp_path / "no-ovmf" / "OVMF_VARS_4M.fd", "OVMF", "apt-get install ovmf", "--firmware bios")

    # Room for the data: the temporary store isr-admin builds in is a 1 MiB file system here.
    small = tmp_path / "small-tmp"
    small.mkdir()
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True, timeout=30)
        try:
            assert_refused(env, before, run_admin(env, tmp_path, "roomless", good, environ={"TMPDIR": str(small)}),
                           "roomless", good, "of data but the temporary directory", "make room")
        finally:
            subprocess.run(["umount", str(small)], capture_output=True, timeout=30)

    # The same image with a boot sector, and the data-only one with --force, are taken.
    made = run_admin(env, tmp_path, "bootable", good)
    assert made.returncode == 0, made.stderr
    forced = run_admin(env, tmp_path, "forced", unbootable, "--force")
    assert forced.returncode == 0, forced.stderr
