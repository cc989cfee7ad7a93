"""Turn the Debian kernel's bzImage into the uncompressed ``vmlinux`` that QEMU boots directly (PVH).

Why bother: with the bzImage the guest decompresses its own kernel at every boot (slow under TCG) and the
compressed copy and the decompression buffers stay behind in guest RAM as non-zero pages, so a saved idle
guest weighs ~40 MB compressed. Booting the ELF directly through its PVH entry point is faster and leaves
~14 MB. The bzImage setup header says where the compressed payload is; kbuild appends the uncompressed
size to it, which tells whether the decompression was complete.
"""
from __future__ import annotations

import gzip
import lzma
import struct
import subprocess
from pathlib import Path

from .errors import GuestBuildError

_HDRS_MAGIC = b"HdrS"


def extract_vmlinux(bzimage: Path, dest: Path) -> None:
    """Decompress the kernel inside ``bzimage`` (LZ4, zstd, xz or gzip) and write the ELF to ``dest``."""
    data = bzimage.read_bytes()
    if data[0x202:0x206] != _HDRS_MAGIC:
        raise GuestBuildError(f"{bzimage} is not a bzImage (no HdrS setup header)")
    setup_sectors = data[0x1F1] or 4
    protected_mode = (setup_sectors + 1) * 512
    offset, length = struct.unpack_from("<II", data, 0x248)
    payload = data[protected_mode + offset:protected_mode + offset + length]
    if len(payload) != length or length < 8:
        raise GuestBuildError(f"{bzimage}: payload outside the file")
    compressed, (size,) = payload[:-4], struct.unpack("<I", payload[-4:])
    if payload.startswith(b"\x02\x21\x4c\x18"):
        # Python has no LZ4; the lz4 tool reads the legacy frame format the kernel uses.
        vmlinux = _run_filter(["lz4", "-dc"], compressed, "decompress the LZ4 kernel")
    elif payload.startswith(b"\x28\xb5\x2f\xfd"):
        import zstandard

        vmlinux = zstandard.ZstdDecompressor().decompress(compressed, max_output_size=size)
    elif payload.startswith(b"\xfd7zXZ\x00"):
        vmlinux = lzma.decompress(compressed)
    elif payload.startswith(b"\x1f\x8b"):
        vmlinux = gzip.decompress(payload)
    else:
        raise GuestBuildError(f"{bzimage}: kernel compressed with an unsupported method ({payload[:6].hex()})")
    if len(vmlinux) != size:
        raise GuestBuildError(f"{bzimage}: decompressed {len(vmlinux)} bytes, the image says {size}")
    if not vmlinux.startswith(b"\x7fELF\x02\x01"):
        raise GuestBuildError(f"{bzimage}: the payload is not a 64-bit ELF kernel")
    dest.write_bytes(vmlinux)


def _run_filter(args: list[str], data: bytes, doing: str) -> bytes:
    try:
        result = subprocess.run(args, input=data, capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GuestBuildError(f"failed to {doing}: {exc}") from exc
    if result.returncode != 0:
        raise GuestBuildError(f"failed to {doing}: {result.stderr.decode(errors='replace').strip()}")
    return result.stdout
