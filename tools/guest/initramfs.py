"""The test guest's initramfs: busybox, the virtio modules in load order, /init and the command agent.

The Debian cloud kernel builds virtio as modules, and busybox's ``insmod`` loads exactly one file without
looking at dependencies, so the builder works out the order itself from each module's ``depends=`` field
(the ``.modinfo`` section; Debian's package does not ship ``modules.dep``).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

from .errors import GuestBuildError

log = logging.getLogger(__name__)

#: The modules the guest needs, by name; their dependencies are added in front automatically.
#: virtio_pci finds the devices, virtio_blk drives the disk, virtio_net the NIC of QEMU's user-mode network and
#: virtio_rng its random number generator, virtio_balloon the balloon that reports free pages to QEMU (so that
#: their memory chunks become holes; when the VM has these devices); button and evdev turn the ACPI power button
#: into an input event that busybox's acpid answers with ``isr-poweroff``.
WANTED_MODULES = ("virtio_pci", "virtio_blk", "virtio_net", "virtio_rng", "virtio_balloon", "button", "evdev")

#: Files from the package's files/ directory and where they go in the initramfs.
GUEST_FILES = {"init": "init", "isr-agent": "bin/isr-agent", "isr-poweroff": "bin/isr-poweroff",
               "isr-reboot": "bin/isr-reboot"}


def module_load_order(modules_dir: Path, wanted: tuple[str, ...] = WANTED_MODULES) -> list[Path]:
    """The ``.ko`` files to load, dependencies first, for the modules in ``wanted``."""
    by_name: dict[str, Path] = {}
    for path in modules_dir.rglob("*.ko"):
        by_name[path.stem.replace("-", "_")] = path
    order: list[Path] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        name = name.replace("-", "_")
        path = by_name.get(name)
        if path is None:
            raise GuestBuildError(f"kernel module {name} is not in {modules_dir} (is it built in?)")
        if path in order:
            return
        if name in visiting:
            raise GuestBuildError(f"kernel module dependency loop through {name}")
        visiting.add(name)
        for dependency in _module_depends(path):
            visit(dependency)
        visiting.discard(name)
        order.append(path)

    for name in wanted:
        visit(name)
    return order


def _module_depends(path: Path) -> list[str]:
    # .modinfo holds NUL-separated key=value strings; "depends=" lists the modules this one needs.
    match = re.search(rb"\x00depends=([A-Za-z0-9_,-]*)\x00", path.read_bytes())
    if match is None:
        return []
    return [name for name in match.group(1).decode().split(",") if name]


def build_initramfs(*, busybox: Path, modules_dir: Path, files_dir: Path, staging: Path, dest: Path) -> list[str]:
    """Assemble the initramfs tree in ``staging`` and write it as an uncompressed newc cpio to ``dest``.

    Uncompressed because the kernel would otherwise spend boot time (slow under TCG) decompressing it, and
    it is only a few MB. Returns the module load order (names), which /init reads from
    ``/lib/modules/load-order``.
    """
    for directory in ("bin", "dev", "proc", "sys", "run", "tmp", "data", "lib/modules", "etc", "root"):
        (staging / directory).mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox, staging / "bin" / "busybox")
    os.chmod(staging / "bin" / "busybox", 0o755)
    applets = _run([str(staging / "bin" / "busybox"), "--list"], "list busybox applets").split()
    for applet in applets:
        link = staging / "bin" / applet
        if applet != "busybox" and not link.exists():
            link.symlink_to("busybox")
    for source, target in GUEST_FILES.items():
        shutil.copyfile(files_dir / source, staging / target)
        os.chmod(staging / target, 0o755)
    # busybox acpid runs /etc/acpi/<action> for an event: the power button (PWRF) powers the guest off cleanly.
    (staging / "etc" / "acpi" / "PWRF").mkdir(parents=True, exist_ok=True)
    (staging / "etc" / "acpi" / "PWRF" / "00000080").symlink_to("/bin/isr-poweroff")
    order = module_load_order(modules_dir)
    for module in order:
        shutil.copyfile(module, staging / "lib" / "modules" / module.name)
    names = [module.stem for module in order]
    (staging / "lib" / "modules" / "load-order").write_text("".join(f"{n}\n" for n in names))
    (staging / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (staging / "etc" / "group").write_text("root:x:0:\n")

    entries = sorted(str(p.relative_to(staging)) for p in staging.rglob("*"))
    with open(dest, "wb") as out:
        try:
            proc = subprocess.run([str(staging / "bin" / "busybox"), "cpio", "-o", "-H", "newc"], cwd=staging,
                                  input="\n".join(entries).encode() + b"\n", stdout=out,
                                  stderr=subprocess.PIPE, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise GuestBuildError(f"failed to write the initramfs: {exc}") from exc
    if proc.returncode != 0:
        raise GuestBuildError(f"failed to write the initramfs: {proc.stderr.decode(errors='replace').strip()}")
    return names


def _run(args: list[str], doing: str) -> str:
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GuestBuildError(f"failed to {doing}: {exc}") from exc
    if result.returncode != 0:
        raise GuestBuildError(f"failed to {doing}: {result.stderr.strip()}")
    return result.stdout
