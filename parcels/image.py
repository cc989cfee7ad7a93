"""Raw image files on the local disk: reading them chunk by chunk, sparsely, and writing them sparsely.

Reading skips holes with SEEK_DATA/SEEK_HOLE and drops all-zero chunks, so a mostly empty 64 GiB disk
costs only its data. A qcow2, vmdk, vdi or vhdx input is read through a raw view of it (`parcels.qemuimg`),
never copied. `boot_problem` says whether a disk could boot through its own bootloader.
Writing seeks over absent (zero) chunks, so the output is sparse too, and appears under its final name
only once it is complete.
"""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from parcels import qemuimg
from parcels.chunk import chunk_count, is_zero
from parcels.errors import ImageError

_MBR_SIGNATURE = b"\x55\xaa"
_GPT_SIGNATURE = b"EFI PART"
#: The EFI system partition's type: C12A7328-F81F-11D2-BA4B-00A0C93EC93B, in GPT's mixed-endian bytes.
_ESP_TYPE = bytes.fromhex("28732ac11ff8d211ba4b00a0c93ec93b")
_MBR_ESP_TYPE = 0xEF


@contextlib.contextmanager
def raw_image(path: str | os.PathLike[str], tmpdir: str | os.PathLike[str] | None = None,
              fmt: str | None = None) -> Iterator[Path]:
    """Yield the path of a raw, read-only view of the disk image at `path`, without a copy of it.

    `path` is raw, qcow2, vmdk, vdi or vhdx (`fmt`, else as qemu-img identifies it), and is checked to be
    readable, whole and uncorrupted first (`parcels.qemuimg.inspect`). A raw file is used as it is; the
    others are exported as raw through FUSE from a scratch directory in `tmpdir` (default the system's)
    until the context ends. Raises ImageError with one line naming the file and what to do.
    """
    image = qemuimg.inspect(path, fmt)
    with tempfile.TemporaryDirectory(prefix="isr-image-", dir=tmpdir) as scratch:
        with qemuimg.raw_view(image, Path(scratch)) as raw:
            yield raw


def check_disk(path: str | os.PathLike[str], fmt: str | None, firmware: str, *, bootable: bool,
               tmpdir: str | os.PathLike[str] | None = None) -> qemuimg.DiskImage:
    """Everything that would refuse the disk image at `path` as a parcel's disk, checked before any work:
    readable, whole, in a known format (`qemuimg.inspect`), a size that is a nonzero multiple of 512, and,
    with `bootable`, a way to boot under `firmware` (`boot_problem`). Raises ImageError with one line."""
    image = qemuimg.inspect(path, fmt)
    if image.virtual_size == 0 or image.virtual_size % 512:
        raise ImageError(f"disk image {path} is {image.virtual_size} bytes: the size must be a nonzero multiple "
                         "of 512")
    if bootable:
        with tempfile.TemporaryDirectory(prefix="isr-image-", dir=tmpdir) as scratch:
            with qemuimg.raw_view(image, Path(scratch)) as raw:
                problem = boot_problem(raw, firmware)
        if problem is not None:
            raise ImageError(f"disk image {path} would not boot under {firmware.upper()}: {problem}, and no kernel "
                             "was given for direct boot; give --kernel, or --force to create the parcel anyway")
    return image


def boot_problem(path: Path, firmware: str) -> str | None:
    """Why the raw disk image at `path` could not boot under `firmware` ("bios" or "uefi"), or None if
    it looks bootable: BIOS needs boot code and the MBR boot signature in sector 0; UEFI needs an EFI
    system partition (in a GPT or an MBR partition table)."""
    try:
        with open(path, "rb") as f:
            head = f.read(34 * 512)
            has_gpt = head[512:520] == _GPT_SIGNATURE
            esp = any(head[446 + 16 * i + 4] == _MBR_ESP_TYPE for i in range(4)) if len(head) >= 512 else False
            if has_gpt and not esp:
                esp = _gpt_has_esp(f, head)
    except OSError as exc:
        raise ImageError(f"failed to read {path}: {exc.strerror or exc}") from None
    signed = head[510:512] == _MBR_SIGNATURE
    if firmware == "uefi":
        return None if esp else "no EFI system partition (UEFI boots from one)"
    if not signed:
        return "no MBR boot signature" + (" (a GPT disk with an EFI system partition: try --firmware uefi)"
                                          if esp else ", no GPT with an EFI system partition")
    if not any(head[:440]):
        return "an empty MBR boot code area (a UEFI-only disk?" + (" try --firmware uefi)" if esp else ")")
    return None


def _gpt_has_esp(f: BinaryIO, head: bytes) -> bool:
    entries_lba, count, size = struct.unpack_from("<QII", head, 512 + 72)
    if not 128 <= size <= 4096 or count > 1024:
        return False
    f.seek(entries_lba * 512)
    table = f.read(count * size)
    return any(table[i * size:i * size + 16] == _ESP_TYPE for i in range(len(table) // size))


def image_size(path: Path) -> int:
    """Size in bytes of a raw image: a regular file or a block device. Raises ImageError if it cannot be
    examined."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            # st_size is 0 for a block device; seeking to the end works for both.
            return os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ImageError(f"failed to examine {path}: {exc.strerror or exc}") from None


def _pread_full(fd: int, length: int, offset: int, path: Path) -> bytes:
    data = os.pread(fd, length, offset)
    while len(data) < length:
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            raise ImageError(f"{path} ended early at byte {offset + len(data)} (did it shrink?)")
        data += more
    return data


def _data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) byte ranges that may hold data, in order; the whole file if holes are unknown."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        # Only regular files report holes reliably; read anything else (a block device) in full.
        yield 0, size
        return
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:        # no data after pos
                return
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                yield pos, size                 # the file system cannot tell; read everything
                return
            raise
        if start >= size:
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end
        pos = end


def read_chunks(path: Path, size: int, chunk_size: int) -> Iterator[tuple[int, bytes]]:
    """Yield (index, bytes) for every chunk of the raw image that is not all zero, in index order.

    Only one chunk is held at a time; holes are skipped without reading. The last chunk may be short.
    Raises ImageError if the file cannot be read or is shorter than `size`.
    """
    count = chunk_count(chunk_size, size)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ImageError(f"failed to open {path}: {exc.strerror or exc}") from None
    try:
        next_index = 0
        for start, end in _data_extents(fd, size):
            first = max(start // chunk_size, next_index)
            last = min((end - 1) // chunk_size, count - 1)
            for index in range(first, last + 1):
                offset = index * chunk_size
                data = _pread_full(fd, min(chunk_size, size - offset), offset, path)
                if not is_zero(data):
                    yield index, data
            next_index = max(next_index, last + 1)
    except OSError as exc:
        raise ImageError(f"failed to read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


class SparseImageWriter:
    """Writes a raw image of a known size as a sparse file, atomically.

    Chunks are written at their offsets into a temporary file next to the target; everything not
    written reads as zero. `commit()` sets the size, fsyncs and renames the file into place; leaving the
    context without commit deletes it, so a failed extraction never leaves a plausible-looking image.
    """

    def __init__(self, out: str | os.PathLike[str], size: int) -> None:
        self.out = Path(out)
        self.size = size
        self._tmp = self.out.parent / f".{self.out.name}.tmp-{secrets.token_hex(4)}"
        try:
            self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ImageError(f"failed to create {self._tmp}: {exc.strerror or exc}") from None
        self._open = True

    def write(self, offset: int, data: bytes) -> None:
        """Write `data` at `offset`. Raises ImageError on an I/O error or a write past the end."""
        if offset + len(data) > self.size:
            raise ImageError(f"write of {len(data)} bytes at {offset} is past the image end {self.size}")
        try:
            view = memoryview(data)
            while view:
                written = os.pwrite(self._fd, view, offset)
                view, offset = view[written:], offset + written
        except OSError as exc:
            raise ImageError(f"failed to write {self._tmp}: {exc.strerror or exc}") from None

    def commit(self) -> None:
        """Give the file its full size, make it durable and move it to its final name.
        Raises ImageError on failure (the temporary file is then removed)."""
        try:
            os.ftruncate(self._fd, self.size)
            os.fsync(self._fd)
            os.close(self._fd)
            self._open = False
            os.replace(self._tmp, self.out)
        except OSError as exc:
            self.abort()
            raise ImageError(f"failed to finish {self.out}: {exc.strerror or exc}") from None

    def abort(self) -> None:
        """Discard the temporary file (no-op after commit)."""
        if self._open:
            os.close(self._fd)
            self._open = False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)

    def __enter__(self) -> SparseImageWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()
