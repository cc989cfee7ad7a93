"""The test guests' disks: sparse raw images, filled at creation time, never mounted on the host.

``mkfs.ext4 -d DIR`` copies a directory tree into the new file system, so building needs neither root
privileges for a loop mount nor a running guest. The direct-boot guest's data disk is a bare ext4 file
system; the disk-booted guest's disk (`make_boot_disk`) is a PC disk: an MBR with syslinux's boot code, a
FAT boot partition holding syslinux, the kernel and the initramfs, and an ext4 root partition, all written
into the image file at their offsets (``mkfs.fat --offset``, ``syslinux --offset``, ``mcopy -i IMG@@OFFSET``,
``mkfs.ext4 -E offset=``), again without a loop device.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from .errors import GuestBuildError, GuestError

#: The file system label; /init mounts /dev/vda by device, the label is only for people looking at it.
LABEL = "isr-data"

#: syslinux's MBR boot code (Debian: syslinux-common): it boots the partition marked active.
SYSLINUX_MBR = Path("/usr/lib/syslinux/mbr/mbr.bin")
#: The disk-booted guest's layout: the boot partition from 1 MiB, 31 MiB of FAT16; the root after it.
BOOT_START_SECTOR = 2048
BOOT_SECTORS = 63488
ROOT_START_SECTOR = BOOT_START_SECTOR + BOOT_SECTORS
#: Fixed identifiers, so that two builds from the same packages give the same partition table and file
#: system metadata where the tools allow it.
DISK_ID = "0x49535231"
BOOT_VOLUME_ID = "49535231"
ROOT_UUID = "49535231-6469-736b-2d67-756573740001"
GPT_DISK_ID = "49535231-6469-736b-2d67-756573740002"


def make_ext4_image(content: Path, dest: Path, size_mib: int) -> None:
    """Create ``dest`` as a ``size_mib`` sparse file holding an ext4 file system with ``content``'s files."""
    with open(dest, "wb") as f:
        f.truncate(size_mib << 20)
    _tool(["mkfs.ext4", "-q", "-F", "-L", LABEL, "-d", str(content), str(dest)], "create the ext4 image", dest)


def make_boot_disk(root: Path, boot_files: dict[str, Path | str], dest: Path, size_mib: int, *,
                   uefi: bool = False) -> None:
    """Create ``dest``, a bootable ``size_mib`` PC disk: partition 1 (FAT16) holds ``boot_files`` (path on the
    partition -> a file to copy, or text), partition 2 (ext4) holds ``root``. BIOS (default): an MBR with
    syslinux's boot code, partition 1 active with syslinux installed. ``uefi``: a GPT whose partition 1 is the
    EFI system partition (``boot_files`` then hold the UEFI loader, e.g. ``EFI/BOOT/BOOTX64.EFI``)."""
    if not uefi and not SYSLINUX_MBR.is_file():
        raise GuestBuildError(f"{SYSLINUX_MBR} is missing (Debian: apt-get install syslinux syslinux-common mtools "
                              "dosfstools fdisk)")
    with open(dest, "wb") as f:
        f.truncate(size_mib << 20)
    # A GPT keeps a backup of itself in the disk's last sectors: there the root ends 1 MiB before the end.
    root_sectors = (size_mib << 11) - ROOT_START_SECTOR - (2048 if uefi else 0)
    if uefi:
        table = (f"label: gpt\nlabel-id: {GPT_DISK_ID}\nstart={BOOT_START_SECTOR}, size={BOOT_SECTORS}, type=uefi\n"
                 f"start={ROOT_START_SECTOR}, size={root_sectors}, type=linux\n")
    else:
        table = (f"label: dos\nlabel-id: {DISK_ID}\n"
                 f"start={BOOT_START_SECTOR}, size={BOOT_SECTORS}, type=e, bootable\n"
                 f"start={ROOT_START_SECTOR}, size={root_sectors}, type=83\n")
    _tool(["sfdisk", "-q", str(dest)], "partition", dest, stdin=table)
    boot_offset = BOOT_START_SECTOR * 512
    _tool(["mkfs.fat", "-F", "16", "--offset", str(BOOT_START_SECTOR), "-n", "ISRBOOT", "-i", BOOT_VOLUME_ID,
           str(dest), str(BOOT_SECTORS // 2)], "make the boot file system on", dest)
    if not uefi:
        with open(SYSLINUX_MBR, "rb") as f:
            boot_code = f.read(440)
        with open(dest, "r+b") as f:
            f.write(boot_code)
        _tool(["syslinux", "--offset", str(boot_offset), "--install", str(dest)], "install syslinux on", dest)
    image = f"{dest}@@{boot_offset}"
    mtools = {"MTOOLS_SKIP_CHECK": "1"}
    with tempfile.TemporaryDirectory(prefix="isr-bootfs-") as scratch:
        made: set[str] = set()
        for name, source in boot_files.items():
            parts = name.split("/")[:-1]
            for depth in range(1, len(parts) + 1):
                folder = "/".join(parts[:depth])
                if folder not in made:
                    _tool(["mmd", "-i", image, f"::/{folder}"], "make a folder on", dest, env=mtools)
                    made.add(folder)
            if isinstance(source, str):
                text = Path(scratch) / name.replace("/", "_")
                text.write_text(source)
                source = text
            _tool(["mcopy", "-o", "-i", image, str(source), f"::/{name}"], "copy files onto", dest, env=mtools)
    _tool(["mkfs.ext4", "-q", "-F", "-L", "isr-root", "-U", ROOT_UUID, "-E",
           f"offset={ROOT_START_SECTOR * 512},hash_seed={ROOT_UUID}", "-d", str(root), str(dest),
           f"{root_sectors // 8 * 4}k"], "make the root file system on", dest)


def _tool(args: list[str], doing: str, dest: Path, *, stdin: str | None = None,
          env: dict[str, str] | None = None) -> None:
    try:
        result = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=300,
                                env={**os.environ, **env} if env else None)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GuestBuildError(f"failed to {doing} {dest}: {exc}") from exc
    if result.returncode != 0:
        raise GuestBuildError(f"failed to {doing} {dest} ({args[0]}): {(result.stderr or result.stdout).strip()}")


def copy_disk(source: Path, dest: Path) -> Path:
    """Copy a disk image for one VM to write to, cheaply: a reflink where the file system can, else a sparse
    copy (the image is mostly holes). Returns ``dest``."""
    try:
        result = subprocess.run(["cp", "--reflink=auto", "--sparse=always", str(source), str(dest)],
                                capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GuestError(f"failed to copy the disk image {source}: {exc}") from exc
    if result.returncode != 0:
        raise GuestError(f"failed to copy the disk image {source}: {result.stderr.strip()}")
    os.chmod(dest, 0o644)
    return dest


def check_ext4(image: Path) -> tuple[int, str]:
    """Run ``e2fsck -fn`` (forced, read-only) on an image; returns its exit status and output (0 = clean)."""
    try:
        result = subprocess.run(["e2fsck", "-fn", str(image)], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GuestError(f"failed to check {image}: {exc}") from exc
    return result.returncode, result.stdout + result.stderr
