"""The test guest's data disk: a sparse raw ext4 image, filled at creation time, never mounted on the host.

``mkfs.ext4 -d DIR`` copies a directory tree into the new file system, so building needs neither root
privileges for a loop mount nor a running guest.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .errors import GuestBuildError, GuestError

#: The file system label; /init mounts /dev/vda by device, the label is only for people looking at it.
LABEL = "isr-data"


def make_ext4_image(content: Path, dest: Path, size_mib: int) -> None:
    """Create ``dest`` as a ``size_mib`` sparse file holding an ext4 file system with ``content``'s files."""
    with open(dest, "wb") as f:
        f.truncate(size_mib << 20)
    try:
        result = subprocess.run(["mkfs.ext4", "-q", "-F", "-L", LABEL, "-d", str(content), str(dest)],
                                capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GuestBuildError(f"failed to create the ext4 image {dest}: {exc}") from exc
    if result.returncode != 0:
        raise GuestBuildError(f"failed to create the ext4 image {dest}: {result.stderr.strip()}")


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
