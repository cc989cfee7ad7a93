"""The ROMs in a device state, and the state sealed without them (doc/parcel-format.md, compression 2).

QEMU's saved device state holds the guest's ROMs as QEMU loaded them from its installation's files when the VM
booted: the BIOS (SeaBIOS's ``bios-256k.bin``) and each PCI device's option ROM (iPXE's ``efi-virtio.rom``
for the NIC, ``vgabios-stdvga.bin`` for the display). They are most of what a resume downloads before the VM
starts: the test guest's state, 870 KB of plaintext, seals to 332 KB, and to 15 KB against those three files
(BENCHMARKS.md, "the device state without its firmware"). A site whose QEMU has the same files, as every PC
of one distribution release does, needs none of those bytes.

So a checkin seals the state a second time, as ``devstate.fw``, against the files of this PC's QEMU whose
contents it finds in the state (`seal_without_firmware`), and a resume at a site that lacks the chunks
fetches that one and opens it with its own QEMU's files (`lookup`); if one of them is missing or differs, it
fetches ``devstate`` as before. The firmware in the state stays the one the VM booted with either way: the
files only stand in for bytes both sites have.

``ISR_QEMU_FIRMWARE_DIRS`` (directories, ``:``-separated) names where the firmware files are instead of
asking QEMU (``-L help``); the tests use it to stand in for a site with other firmware.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path

from parcels import crypto, seal

from .compat import QEMU, run_qemu
from .errors import CompatibilityError

log = logging.getLogger(__name__)

_PAGE = 4096
#: A file is in the state if most of these of its pages are (a few, spread over it: QEMU patches an option
#: ROM's header, so not every page is there byte for byte).
_SAMPLES = 4
#: Pages with fewer distinct byte values (padding, fill) say nothing about where they came from.
_SAMPLE_MIN_DISTINCT = 16
#: QEMU's firmware files are below this; larger files in its directories are other things.
_FILE_MAX = 8 << 20


@functools.lru_cache(maxsize=4)
def firmware_dirs(binary: str = QEMU) -> tuple[Path, ...]:
    """The directories the local QEMU loads firmware from (``$ISR_QEMU_FIRMWARE_DIRS``, else its ``-L help``);
    none if QEMU cannot be asked."""
    override = os.environ.get("ISR_QEMU_FIRMWARE_DIRS")
    if override is not None:
        listed = [part for part in override.split(":") if part]
    else:
        try:
            out = run_qemu([shutil.which(binary) or binary, "-L", "help"])
        except (CompatibilityError, OSError) as exc:
            log.info("cannot ask %s where its firmware is (%s): device states are sealed whole", binary, exc)
            return ()
        listed = [line.strip() for line in out.splitlines() if line.strip()]
    dirs: list[Path] = []
    for entry in listed:
        path = Path(entry).resolve()
        if path.is_dir() and path not in dirs:
            dirs.append(path)
    return tuple(dirs)


def _telling(data: bytes) -> list[bytes]:
    """The pages of ``data`` that say where they came from (padding and fill do not)."""
    pages = (data[o:o + _PAGE] for o in range(0, len(data) - _PAGE + 1, _PAGE))
    return [p for p in pages if len(set(p)) >= _SAMPLE_MIN_DISTINCT]


def _in_state(pages: list[bytes], payload: bytes) -> bool:
    """Whether most of a few of ``pages``, spread over them, are in ``payload``."""
    step = max(1.0, len(pages) / _SAMPLES)
    samples = [pages[int(k * step)] for k in range(min(_SAMPLES, len(pages)))]
    return bool(samples) and 2 * sum(payload.find(page) >= 0 for page in samples) >= len(samples)


def carried(payload: bytes, dirs: tuple[Path, ...] | None = None) -> list[tuple[str, bytes]]:
    """The firmware files in ``dirs`` (default: `firmware_dirs`) whose contents the device state ``payload``
    holds, as (name, contents): the file with the most pages in it first, then each that adds pages the
    ones before it do not hold (iPXE's combined ROM holds its BIOS-only one; SeaBIOS's VGA BIOSes share most
    pages), as many as a sealed blob may name."""
    found: dict[bytes, tuple[str, bytes, list[bytes]]] = {}
    for directory in firmware_dirs() if dirs is None else dirs:
        try:
            entries = sorted(directory.iterdir())
        except OSError:
            continue
        for path in entries:
            try:
                if not seal.FILE_NAME.fullmatch(path.name) or not path.is_file() \
                        or not _PAGE <= path.stat().st_size <= _FILE_MAX:
                    continue
                data = path.read_bytes()
            except OSError:
                continue
            digest = crypto.sha256(data)
            pages = _telling(data)
            if digest not in found and _in_state(pages, payload):
                found[digest] = (path.name, data, [p for p in pages if payload.find(p) >= 0])
    chosen: list[tuple[str, bytes]] = []
    held = b""
    for name, data, pages in sorted(found.values(), key=lambda item: (-len(item[2]), item[0])):
        new = [p for p in pages if held.find(p) < 0]
        if 2 * len(new) <= len(pages) or len(chosen) == seal.FILES_MAX \
                or len(held) + len(data) > seal.FILES_MAX_BYTES:
            continue
        chosen.append((name, data))
        held += data
    return chosen


def seal_without_firmware(parcel_key: bytes, payload: bytes) -> bytes | None:
    """``payload`` (a device state) sealed against the firmware files of this PC's QEMU that it carries; None
    if it carries none of them."""
    files = carried(payload)
    if not files:
        return None
    sealed = seal.seal(parcel_key, seal.KIND_DEVSTATE, payload, files=files)
    log.info("device state: %d bytes sealed against %s", len(sealed), ", ".join(name for name, _ in files))
    return sealed


def lookup(name: str, size: int, digest: bytes) -> bytes | None:
    """This PC's QEMU firmware file ``name`` if it has one of that size and SHA-256 (a `seal.FileLookup`)."""
    if not seal.FILE_NAME.fullmatch(name):
        return None
    for directory in firmware_dirs():
        path = directory / name
        try:
            if path.is_file() and path.stat().st_size == size:
                data = path.read_bytes()
                if crypto.sha256(data) == digest:
                    return data
        except OSError:
            continue
    return None
