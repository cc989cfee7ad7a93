"""UEFI firmware for parcels whose ``vm.firmware`` is "uefi": OVMF, as Debian's ``ovmf`` package installs it.

A UEFI VM needs two flash images: the firmware's code (read-only, from this PC's OVMF) and its variable
store (boot entries and settings, written by the guest). The variable store belongs to the parcel: a new
UEFI parcel gets a copy of OVMF's empty store as its ``nvram`` blob (kind 4), so it is encrypted and
versioned with the rest. Legacy BIOS (SeaBIOS) is built into QEMU and needs nothing here.

``ISR_OVMF_DIR`` names another directory holding the same files (for another distribution's layout).
"""
from __future__ import annotations

import os
from pathlib import Path

from parcels.errors import ImageError

DEFAULT_OVMF_DIR = Path("/usr/share/OVMF")
#: The 4 MiB build (Debian 12's default): no Secure Boot, so no SMM is needed in the machine.
CODE = "OVMF_CODE_4M.fd"
VARS = "OVMF_VARS_4M.fd"
#: The blob that holds a UEFI parcel's variable store.
NVRAM_BLOB = "nvram"


def ovmf_dir() -> Path:
    """Where OVMF's files are: ``$ISR_OVMF_DIR``, else Debian's place."""
    return Path(os.environ.get("ISR_OVMF_DIR") or DEFAULT_OVMF_DIR)


def ovmf_file(name: str) -> Path:
    """The path of OVMF's ``name`` (`CODE` or `VARS`). Raises ImageError, saying what to install, if absent."""
    path = ovmf_dir() / name
    if not path.is_file():
        raise ImageError(f"UEFI firmware (OVMF) is not installed here: {path} is missing; install it "
                         "(Debian: apt-get install ovmf) or use the BIOS firmware (--firmware bios)")
    return path


def empty_variable_store() -> bytes:
    """OVMF's empty variable store, for a new UEFI parcel. Raises ImageError if OVMF is not installed."""
    path = ovmf_file(VARS)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ImageError(f"failed to read the UEFI variable store template {path}: {exc.strerror or exc}") from None
