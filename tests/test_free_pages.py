"""Holes in the images: fallocate(PUNCH_HOLE) on vulpes's files drops whole chunks unread, and a resumed guest's
free pages, reported through virtio-balloon, become such holes in the memory image (issue 15).

The first test punches through real FUSE mounts (both the main one and the memory mount); the second runs
the test guest under isr, frees memory in it and follows the memory image's records as QEMU punches them,
then resumes the checked-in parcel elsewhere and checks the guest's memory is intact.
"""
from __future__ import annotations

import mmap
import os
import random
import subprocess
from pathlib import Path

import pytest

from tests.vulpes_fixtures import CHUNK_SIZE, IsrServer, Vulpes, chunk_path, make_state, read_all
from tests.vulpes_fixtures import isr_server, vulpes_binary  # noqa: F401  (pytest fixtures)

pytestmark = pytest.mark.timeout(300)

MIB = 1 << 20


def punch(path: Path, offset: int, length: int) -> None:
    """fallocate(1) --punch-hole, as QEMU's discard of guest RAM or disk blocks does it."""
    subprocess.run(["fallocate", "--punch-hole", "--offset", str(offset), "--length", str(length), str(path)],
                   check=True, capture_output=True, timeout=60)


def test_punched_chunks_read_zeros_unfetched_and_lose_their_records(vulpes_binary: Path, isr_server: IsrServer,
                                                                    tmp_path: Path) -> None:
    """A hole over whole chunks makes them zeros without fetching them, and their flush drops their records;
    the pieces of chunks at its edges are zeroed through the write path; a mapped page in a hole reads zeros
    at once (the kernel drops it); the holes survive a restart."""
    rng = random.Random(191)
    disk, memory = rng.randbytes(4 * MIB), rng.randbytes(2 * MIB)         # no two chunks alike
    state = make_state(tmp_path / "state", disk, 2 * MIB, memory=memory)
    state.publish(isr_server.store)
    cache, ram = tmp_path / "cache", tmp_path / "mnt-ram"
    ram.mkdir()
    disk_model, memory_model = bytearray(disk), bytearray(memory)
    with Vulpes(vulpes_binary, tmp_path / "mnt", state, cache, server=isr_server.url,
                token_file=isr_server.token_file, ca=isr_server.ca, extra=[f"--memory-mount={ram}"]) as v:
        before = v.status()["images"]
        # The disk: chunk 1 from 4 KiB on, chunks 2 and 3 whole, chunk 4 up to 4 KiB.
        punch(v.path("disk"), CHUNK_SIZE + 4096, 3 * CHUNK_SIZE)
        disk_model[CHUNK_SIZE + 4096:4 * CHUNK_SIZE + 4096] = bytes(3 * CHUNK_SIZE)
        assert v.status()["fetch"]["fetches"] == 2                  # the edge chunks 1 and 4, for their other bytes
        # The memory image, mapped from the memory mount as QEMU maps it: a page read before the punch
        # reads zeros after it.
        fd = os.open(ram / "memory", os.O_RDWR)
        try:
            with mmap.mmap(fd, 2 * MIB, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
                page = 6 * CHUNK_SIZE + 8192
                assert m[page:page + 16] == memory[page:page + 16]
                punch(ram / "memory", 5 * CHUNK_SIZE, 4 * CHUNK_SIZE)
                memory_model[5 * CHUNK_SIZE:9 * CHUNK_SIZE] = bytes(4 * CHUNK_SIZE)
                assert m[page:page + 16] == bytes(16)
        finally:
            os.close(fd)
        assert read_all(v.path("disk")) == disk_model
        assert read_all(v.path("memory")) == memory_model
        # The full reads fetched every other chunk, but none of the punched ones (memory chunk 6 was read
        # before its punch).
        for image, punched in (("disk", (2, 3)), ("memory", (5, 7, 8))):
            for index in punched:
                assert not chunk_path(cache, state.tag_of(image, index)).exists(), (image, index)
        assert chunk_path(cache, state.tag_of("disk", 5)).exists()
        for fd_path in (v.path("disk"), ram / "memory"):
            with open(fd_path, "r+b") as f:
                os.fsync(f.fileno())
        after = v.status()["images"]
        assert after["disk"]["records"] == before["disk"]["records"] - 2
        assert after["memory"]["records"] == before["memory"]["records"] - 4
    with Vulpes(vulpes_binary, tmp_path / "mnt", state, cache, server=isr_server.url,
                token_file=isr_server.token_file, ca=isr_server.ca) as v:
        assert read_all(v.path("disk")) == disk_model
        assert read_all(v.path("memory")) == memory_model
        assert v.status()["fetch"]["fetches"] == 0
