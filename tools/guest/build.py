"""Build the test guest (kernel, initramfs, data disk) from Debian packages, and cache the result.

The cache lives in ``${XDG_CACHE_HOME:-~/.cache}/isr/guest/<variant>-<key>/``. The key is a hash of this
builder's own source files (the Python modules that shape the artifacts and everything in files/), the
variant's definition, and the exact Debian package versions apt offers now. A warm lookup costs one
``apt-cache show``; a cold build downloads ~30 MB and takes a few seconds. Builds happen in a
temporary directory next to the cache entry and are renamed into place, so a reader never sees half an
entry and two concurrent builds do not clash (the loser throws its copy away).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parcels.durable import fsync_path

from . import debian
from .archive import WorkloadExpectation, collect_python_sources, expected_workload, write_archive
from .disk import make_boot_disk, make_ext4_image
from .errors import GuestBuildError
from .initramfs import build_initramfs
from .kernel import extract_vmlinux

log = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
FILES_DIR = PACKAGE_DIR / "files"
#: The sources whose content decides what gets built (console.py and boot.py only use the artifacts).
BUILDER_SOURCES = ("build.py", "debian.py", "kernel.py", "initramfs.py", "archive.py", "disk.py", "files")

#: Scripts copied from files/ to /data/workload/ on the data disk: the test workload (run.sh) and the
#: workloads whose block traces tools/chunksim studies (office.sh, rsd.sh; see tools/chunksim/capture.py).
WORKLOAD_SCRIPTS = ("run.sh", "office.sh", "rsd.sh")

KERNEL_METAPACKAGE = "linux-image-cloud-amd64"
#: systemd-boot, the UEFI loader of the "diskboot-uefi" variant (only its .efi file is used).
UEFI_LOADER_PACKAGE = "systemd-boot-efi"
UEFI_LOADER = "usr/lib/systemd/boot/efi/systemd-bootx64.efi"
BUSYBOX_PACKAGE = "busybox-static"
PYTHON_LIB = "usr/lib/python3.11"

MANIFEST = "manifest.json"
_MANIFEST_VERSION = 1
#: Touched at every lookup; entries (other variants, old kernels) unused for this long are removed when a
#: new entry is built, so the cache does not grow by ~80 MB with every kernel update.
LAST_USED = "last-used"
_PRUNE_AFTER = 14 * 24 * 3600


@dataclass(frozen=True)
class Variant:
    """One size of the test guest."""

    name: str
    #: Debian packages whose .py files under /usr/lib/python3.11 make the workload's source archive.
    source_packages: tuple[str, ...]
    disk_mib: int
    #: run.sh writes this many new files of this size (and deletes every other one).
    new_files: int
    new_file_kib: int
    #: A PC disk with a bootloader and a Debian root (`_build_disk_guest`), not a kernel, initramfs and
    #: data disk for direct boot.
    boots_from_disk: bool = False
    #: The firmware that boots that disk: "bios" (syslinux in the MBR) or "uefi" (systemd-boot on an ESP).
    firmware: str = "bios"


VARIANTS: dict[str, Variant] = {
    # ~6 MB of source in 270 files: the default, for tests.
    "small": Variant("small", ("libpython3.11-stdlib",), disk_mib=256, new_files=16, new_file_kib=256),
    # ~31 MB of source in ~1500 files and 64 MB of new data: for benchmarks.
    "big": Variant("big", ("libpython3.11-minimal", "libpython3.11-stdlib", "libpython3.11-testsuite"),
                   disk_mib=1024, new_files=64, new_file_kib=1024),
    # A real PC disk: syslinux in the MBR and on a FAT boot partition, a minimal Debian 12 root (debootstrap
    # minbase, ~80 MB) with the same agent and workload as "small" under /data. Needs root to build.
    "diskboot": Variant("diskboot", ("libpython3.11-stdlib",), disk_mib=512, new_files=16, new_file_kib=256,
                        boots_from_disk=True),
    # The same system on a GPT disk whose EFI system partition holds systemd-boot: for UEFI (OVMF).
    "diskboot-uefi": Variant("diskboot-uefi", ("libpython3.11-stdlib",), disk_mib=512, new_files=16,
                             new_file_kib=256, boots_from_disk=True, firmware="uefi"),
}
DEFAULT_VARIANT = "small"


@dataclass(frozen=True)
class GuestArtifacts:
    """A built test guest: what to boot and what its workload must report."""

    variant: str
    key: str
    directory: Path
    kernel: Path
    initrd: Path
    #: The pristine data disk; boot a copy of it (see `tools.guest.disk.copy_disk`), never this file.
    disk: Path
    archive: Path
    expected: WorkloadExpectation
    versions: dict[str, str]
    #: The disk boots through its own bootloader; ``kernel`` and ``initrd`` are the copies on its boot partition.
    boots_from_disk: bool = False
    #: The firmware the disk boots with: "bios" or "uefi".
    firmware: str = "bios"

    @classmethod
    def load(cls, directory: Path) -> GuestArtifacts:
        """Read a cache entry's manifest; raises `GuestBuildError` if the entry is incomplete."""
        try:
            manifest = json.loads((directory / MANIFEST).read_text())
            artifacts = cls(variant=manifest["variant"], key=manifest["key"], directory=directory,
                            kernel=directory / manifest["kernel"], initrd=directory / manifest["initrd"],
                            disk=directory / manifest["disk"], archive=directory / manifest["archive"],
                            expected=WorkloadExpectation(**manifest["expected"]),
                            versions=dict(manifest["versions"]),
                            boots_from_disk=bool(manifest.get("boots_from_disk", False)),
                            firmware=str(manifest.get("firmware", "bios")))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise GuestBuildError(f"unreadable guest cache entry {directory}: {exc}") from exc
        for path in (artifacts.kernel, artifacts.initrd, artifacts.disk, artifacts.archive):
            if not path.is_file():
                raise GuestBuildError(f"guest cache entry {directory} lacks {path.name}")
        return artifacts

    def to_json(self) -> dict[str, Any]:
        return {"variant": self.variant, "key": self.key, "directory": str(self.directory),
                "kernel": str(self.kernel), "initrd": str(self.initrd), "disk": str(self.disk),
                "archive": str(self.archive), "expected": self.expected.to_json(), "versions": self.versions,
                "boots_from_disk": self.boots_from_disk, "firmware": self.firmware}


def cache_root() -> Path:
    """``${XDG_CACHE_HOME:-~/.cache}/isr/guest``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "isr" / "guest"


def build(variant: str = DEFAULT_VARIANT, *, cache_dir: Path | None = None, force: bool = False) -> GuestArtifacts:
    """Return the artifacts of ``variant``, building them first unless the cache already has them."""
    if variant not in VARIANTS:
        raise GuestBuildError(f"unknown guest variant {variant!r}: choose one of {', '.join(VARIANTS)}")
    spec = VARIANTS[variant]
    root = cache_dir or cache_root()
    packages = _resolve_packages(spec, root)
    key = cache_key(spec, packages)
    entry = root / f"{variant}-{key}"
    if not force and (entry / MANIFEST).exists():
        log.info("test guest %s is cached in %s", variant, entry)
        return _use(GuestArtifacts.load(entry))
    try:
        return _build_entry(spec, packages, key, entry)
    except GuestBuildError as exc:
        if "download" not in str(exc) or os.geteuid() != 0:
            raise
        # apt's lists can be older than the mirror, which then no longer has the candidate: refresh once.
        log.info("download failed (%s); refreshing apt's lists and retrying", exc)
        debian.apt_update()
        packages = _resolve_packages(spec, root)
        key = cache_key(spec, packages)
        entry = root / f"{variant}-{key}"
        if not force and (entry / MANIFEST).exists():
            return _use(GuestArtifacts.load(entry))
        return _build_entry(spec, packages, key, entry)


def _use(artifacts: GuestArtifacts) -> GuestArtifacts:
    try:
        (artifacts.directory / LAST_USED).touch()
    except OSError:
        pass  # a read-only cache is still a cache
    return artifacts


def _prune(root: Path, keep: Path) -> None:
    """Remove cache entries unused for two weeks, and leftovers of builds that died (a day old)."""
    now = time.time()
    for entry in root.iterdir():
        if entry == keep or not entry.is_dir():
            continue
        try:
            if entry.name.startswith(".build-"):
                stale = now - entry.stat().st_mtime > 24 * 3600
            elif (entry / MANIFEST).exists():
                stamp = entry / LAST_USED if (entry / LAST_USED).exists() else entry / MANIFEST
                stale = now - stamp.stat().st_mtime > _PRUNE_AFTER
            else:
                continue
        except OSError:
            continue
        if stale:
            log.info("removing unused cache entry %s", entry.name)
            shutil.rmtree(entry, ignore_errors=True)


def cache_key(spec: Variant, packages: dict[str, debian.Package]) -> str:
    """Hash of the builder's sources, the variant and the package versions (32 hex digits)."""
    h = hashlib.sha256()
    h.update(f"isr-test-guest {_MANIFEST_VERSION}\n{spec!r}\n".encode())
    for name in sorted(packages):
        h.update(f"package {packages[name].spec}\n".encode())
    if spec.boots_from_disk:
        h.update(f"cmdline {disk_guest_cmdline()}\n".encode())
    for source in BUILDER_SOURCES:
        path = PACKAGE_DIR / source
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if "__pycache__" in file.parts:
                continue
            data = file.read_bytes()
            h.update(f"file {file.relative_to(PACKAGE_DIR).as_posix()} {len(data)}\n".encode())
            h.update(data)
    return h.hexdigest()[:32]


def _resolve_packages(spec: Variant, root: Path) -> dict[str, debian.Package]:
    names = [KERNEL_METAPACKAGE, BUSYBOX_PACKAGE, *spec.source_packages,
             *([UEFI_LOADER_PACKAGE] if spec.firmware == "uefi" else [])]
    found = debian.resolve(names, memo=root / f"apt-{spec.name}.json")
    kernel = debian.kernel_package(found.pop(KERNEL_METAPACKAGE))
    return {kernel.name: kernel, **found}


def _build_entry(spec: Variant, packages: dict[str, debian.Package], key: str, entry: Path) -> GuestArtifacts:
    started = time.monotonic()
    entry.parent.mkdir(parents=True, exist_ok=True)
    log.info("building test guest %s into %s", spec.name, entry)
    work = Path(tempfile.mkdtemp(prefix=f".build-{spec.name}-", dir=entry.parent))
    try:
        out = work / "out"
        out.mkdir()
        roots = debian.download_and_unpack(list(packages.values()), work / "pkgs")
        kernel_name = next(name for name in packages if name.startswith("linux-image-"))
        kernel_root = roots[kernel_name]

        vmlinuz = sorted((kernel_root / "boot").glob("vmlinuz-*"))
        modules = sorted((kernel_root / "lib" / "modules").glob("*"))
        if len(vmlinuz) != 1 or len(modules) != 1:
            raise GuestBuildError(f"{kernel_name} does not hold exactly one kernel and one module tree")
        files_dir = FILES_DIR
        if spec.boots_from_disk:
            # The bootloader loads the bzImage as it is; the initramfs's /init is the first stage that finds
            # the root file system (files/disk-init), with every other file as in the direct-boot guest's.
            shutil.copyfile(vmlinuz[0], out / "vmlinuz")
            files_dir = work / "files"
            shutil.copytree(FILES_DIR, files_dir)
            shutil.copyfile(FILES_DIR / "disk-init", files_dir / "init")
        else:
            extract_vmlinux(vmlinuz[0], out / "vmlinux")
            log.info("kernel %s, unpacked to vmlinux for direct (PVH) boot", vmlinuz[0].name)

        busybox = roots[BUSYBOX_PACKAGE] / "bin" / "busybox"
        order = build_initramfs(busybox=busybox, modules_dir=modules[0], files_dir=files_dir,
                                staging=work / "initramfs", dest=out / "initrd.cpio")
        log.info("initramfs %.1f MB, modules %s", (out / "initrd.cpio").stat().st_size / 1e6, " ".join(order))

        sources: dict[str, Path] = {}
        for name in spec.source_packages:
            sources.update(collect_python_sources(roots[name] / PYTHON_LIB, "python3.11"))
        write_archive(sources, out / "source.tar.gz")
        expected = expected_workload(out / "source.tar.gz")
        log.info("source archive: %d files, %.1f MB unpacked, %.1f MB compressed", expected.files,
                 sum(p.stat().st_size for p in sources.values()) / 1e6,
                 (out / "source.tar.gz").stat().st_size / 1e6)

        content = work / "disk"
        workload = content / "data" / "workload" if spec.boots_from_disk else content / "workload"
        workload.mkdir(parents=True)
        shutil.copyfile(out / "source.tar.gz", workload / "source.tar.gz")
        for script in WORKLOAD_SCRIPTS:
            shutil.copyfile(FILES_DIR / script, workload / script)
            os.chmod(workload / script, 0o755)
        (workload / "config").write_text(
            f"# written by the test guest builder (variant {spec.name})\n"
            f"ARCHIVE=/data/workload/source.tar.gz\nNEW_FILES={spec.new_files}\nNEW_FILE_KIB={spec.new_file_kib}\n")
        if spec.boots_from_disk:
            loader = roots[UEFI_LOADER_PACKAGE] / UEFI_LOADER if spec.firmware == "uefi" else None
            _build_disk_guest(content, busybox, out, spec, loader)
        else:
            make_ext4_image(content, out / "disk.img", spec.disk_mib)
            log.info("data disk %d MiB (ext4)", spec.disk_mib)

        manifest = {
            "format": _MANIFEST_VERSION, "variant": spec.name, "key": key,
            "kernel": "vmlinuz" if spec.boots_from_disk else "vmlinux", "initrd": "initrd.cpio",
            "disk": "disk.img", "archive": "source.tar.gz", "boots_from_disk": spec.boots_from_disk,
            "firmware": spec.firmware,
            "modules": order, "expected": expected.to_json(),
            "versions": {name: p.version for name, p in sorted(packages.items())},
            "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        # The manifest is written last: its presence is what marks the entry complete. Everything is
        # fsynced before the rename so that a crash cannot leave a complete-looking entry with holes.
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        for path in sorted(out.iterdir()):
            # Read-only: the pristine disk in particular must only ever be copied, never booted.
            os.chmod(path, 0o444)
            fsync_path(path)
        fsync_path(out)
        try:
            os.rename(out, entry)
        except OSError:
            if not (entry / MANIFEST).exists():
                raise
            log.info("another build finished %s first; using it", entry.name)
        log.info("built test guest %s in %.1f s", spec.name, time.monotonic() - started)
        _prune(entry.parent, keep=entry)
        return _use(GuestArtifacts.load(entry))
    finally:
        shutil.rmtree(work, ignore_errors=True)


#: What the disk-booted guest's Debian root may lose: documentation, translations and apt's caches.
_ROOT_TRIM = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale", "var/cache/apt",
              "var/lib/apt/lists")
#: busybox applets the root gets (in /usr/lib/isr-busybox, last in PATH): what minbase lacks.
_ROOT_APPLETS = ("poweroff", "reboot", "acpid", "ip", "usleep")
#: The guest's files in its root, from files/.
_ROOT_FILES = {"root-init": "sbin/isr-init", "isr-agent": "usr/local/bin/isr-agent",
               "isr-poweroff": "usr/local/bin/isr-poweroff", "isr-reboot": "usr/local/bin/isr-reboot"}


def disk_guest_cmdline() -> str:
    """The disk-booted guest's kernel command line, as its syslinux.cfg gives it: the direct-boot guest's
    (`tools.guest.boot.KERNEL_CMDLINE`) and the root partition."""
    from .boot import KERNEL_CMDLINE  # boot.py imports this module
    return f"root=/dev/vda2 {KERNEL_CMDLINE}"


def _build_disk_guest(content: Path, busybox: Path, out: Path, spec: Variant, uefi_loader: Path | None) -> None:
    """Make ``out/disk.img``: a Debian root (debootstrap) holding ``content`` (the workload under /data),
    the agent and busybox, on a PC disk that syslinux (BIOS) or systemd-boot (``uefi_loader``, UEFI) boots
    with ``out``'s kernel and initramfs."""
    if os.geteuid() != 0:
        raise GuestBuildError("building the disk-booted guest needs root (debootstrap runs a chroot)")
    root = content.parent / "root"
    debian.debootstrap(root, suite=debian.host_suite())
    for trim in _ROOT_TRIM:
        shutil.rmtree(root / trim, ignore_errors=True)
        (root / trim).mkdir(parents=True, exist_ok=True)
    shutil.copytree(content, root, dirs_exist_ok=True)
    for source, target in _ROOT_FILES.items():
        (root / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(FILES_DIR / source, root / target)
        os.chmod(root / target, 0o755)
    applets = root / "usr" / "lib" / "isr-busybox"
    applets.mkdir(parents=True)
    shutil.copyfile(busybox, applets / "busybox")
    os.chmod(applets / "busybox", 0o755)
    for applet in _ROOT_APPLETS:
        (applets / applet).symlink_to("busybox")
    # busybox acpid runs /etc/acpi/<action>/<code>: the ACPI power button powers the guest off cleanly.
    (root / "etc" / "acpi" / "PWRF").mkdir(parents=True)
    (root / "etc" / "acpi" / "PWRF" / "00000080").symlink_to("/usr/local/bin/isr-poweroff")
    (root / "etc" / "hostname").write_text("isr-disk-guest\n")
    files: dict[str, Path | str] = {"vmlinuz": out / "vmlinuz", "initrd": out / "initrd.cpio"}
    if uefi_loader is not None:
        files["EFI/BOOT/BOOTX64.EFI"] = uefi_loader
        files["loader/loader.conf"] = "timeout 0\ndefault isr.conf\n"
        files["loader/entries/isr.conf"] = (f"title ISR test guest\nlinux /vmlinuz\ninitrd /initrd\n"
                                            f"options {disk_guest_cmdline()}\n")
    else:
        files["syslinux.cfg"] = ("SERIAL 0 115200\nPROMPT 0\nTIMEOUT 0\nDEFAULT isr\nLABEL isr\n  KERNEL /vmlinuz\n"
                                 f"  INITRD /initrd\n  APPEND {disk_guest_cmdline()}\n")
    make_boot_disk(root, files, out / "disk.img", spec.disk_mib, uefi=uefi_loader is not None)
    log.info("boot disk %d MiB: %s, FAT16 boot partition, ext4 Debian root", spec.disk_mib,
             "GPT, systemd-boot on the EFI system partition" if uefi_loader else "MBR, syslinux")
