"""Raw image files on the local disk: reading them chunk by chunk, sparsely, and writing them sparsely.

Reading skips holes with SEEK_DATA/SEEK_HOLE and drops all-zero chunks, so a mostly empty 64 GiB disk
costs only its data. A qcow2 input is first converted to a temporary sparse raw file with `qemu-img`.
Writing seeks over absent (zero) chunks, so the output is sparse too, and appears under its final name
only once it is complete.
"""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from parcels.chunk import chunk_count, is_zero
from parcels.errors import ImageError

QCOW2_MAGIC = b"QFI\xfb"
# Converting a large qcow2 image can take long; the limit is there only so a hung qemu-img cannot hang us.
QEMU_IMG_TIMEOUT = 6 * 3600


def image_format(path: Path) -> str:
    """"qcow2" if the file starts with the qcow2 magic, else "raw". Raises ImageError if unreadable."""
    try:
        with open(path, "rb") as f:
            return "qcow2" if f.read(4) == QCOW2_MAGIC else "raw"
    except OSError as exc:
        raise ImageError(f"failed to read disk image {path}: {exc.strerror or exc}") from None


@contextlib.contextmanager
def raw_image(path: str | os.PathLike[str], tmpdir: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """Yield the path of a raw version of the disk image at `path`.

    A raw file is used as it is. A qcow2 file is converted with `qemu-img convert -O raw` into a sparse
    temporary file (in `tmpdir`, default the system's), which is deleted when the context ends. Raises
    ImageError if the file cannot be read or converted.
    """
    path = Path(path)
    if image_format(path) == "raw":
        yield path
        return
    qemu_img = shutil.which("qemu-img")
    if qemu_img is None:
        raise ImageError(f"{path} is a qcow2 image and converting it needs qemu-img (Debian: qemu-utils)")
    with tempfile.TemporaryDirectory(prefix="isr-convert-", dir=tmpdir) as scratch:
        raw = Path(scratch) / "disk.raw"
        # -f qcow2: never let qemu-img probe the format of an input we already identified.
        cmd = [qemu_img, "convert", "-q", "-f", "qcow2", "-O", "raw", str(path), str(raw)]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=QEMU_IMG_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ImageError(f"failed to run {' '.join(cmd)}: {exc}") from None
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise ImageError(f"qemu-img could not convert {path}: {detail[-1] if detail else result.returncode}")
        yield raw


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
