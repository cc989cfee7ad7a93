"""Holes in the images: fallocate(PUNCH_HOLE) on vulpes's files drops whole chunks unread, and a resumed guest's
free pages, reported through virtio-balloon, become such holes in the memory image (issue 15).

The first test punches through real FUSE mounts (both the main one and the memory mount); the second and
third show that the pages the kernel writes back before each hole (every dirty page from the hole to the end
of the file), and a guest's block writes to disk chunks not at the site, do not wait for their chunks, which the flusher then fetches and flushes; the fourth runs the test guest under isr, frees memory in it and follows the
memory image's records as QEMU punches them, then resumes the checked-in parcel elsewhere and checks the
guest's memory is intact.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import random
import subprocess
import threading
from pathlib import Path
from typing import Callable, TypeVar

import pytest

from tests.conftest import wait_until
from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import (IsrEnv, Parcel, Site, check_continues, isr_env,  # noqa: F401  (isr_env: fixture)
                                make_changes, sites)
from tests.vulpes_fixtures import CHUNK_SIZE, IsrServer, Vulpes, chunk_path, make_state, read_all
from tests.vulpes_fixtures import isr_server, vulpes_binary  # noqa: F401  (pytest fixtures)

pytestmark = pytest.mark.timeout(300)

MIB = 1 << 20
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
T = TypeVar("T")


def punch(path: Path, offset: int, length: int) -> None:
    """fallocate(1) --punch-hole, as QEMU's discard of guest RAM or disk blocks does it."""
    subprocess.run(["fallocate", "--punch-hole", "--offset", str(offset), "--length", str(length), str(path)],
                   check=True, capture_output=True, timeout=60)


def test_punched_chunks_read_zeros_unfetched_and_lose_their_records(vulpes_binary: Path, isr_server: IsrServer,
                                                                    tmp_path: Path) -> None:
    """A hole over whole chunks makes them zeros without fetching them, and their flush drops their records;
    the pieces of chunks at its edges are zeroed through the write path; a mapped page in a hole reads zeros
    at once (the kernel drops it); chunks punched whole need no room in the cache; the holes survive a restart."""
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
            # Chunks punched whole store nothing (until a close or fsync flushes them, they are dirty zeros):
            # they need no room, and the session must not take them for writes the cache had no room for
            # (it would pause the VM).
            punch_fd(fd, 12 * CHUNK_SIZE, 2 * CHUNK_SIZE)
            memory_model[12 * CHUNK_SIZE:14 * CHUNK_SIZE] = bytes(2 * CHUNK_SIZE)
            memory_now = v.status()["images"]["memory"]
            assert memory_now["dirty_chunks"] >= 2 and memory_now["unreserved_chunks"] == 0, memory_now
        finally:
            os.close(fd)
        assert read_all(v.path("disk")) == disk_model
        assert read_all(v.path("memory")) == memory_model
        # The full reads fetched every other chunk, but none of the punched ones (memory chunk 6 was read
        # before its punch).
        for image, punched in (("disk", (2, 3)), ("memory", (5, 7, 8, 12, 13))):
            for index in punched:
                assert not chunk_path(cache, state.tag_of(image, index)).exists(), (image, index)
        assert chunk_path(cache, state.tag_of("disk", 5)).exists()
        for fd_path in (v.path("disk"), ram / "memory"):
            with open(fd_path, "r+b") as f:
                os.fsync(f.fileno())
        after = v.status()["images"]
        assert after["disk"]["records"] == before["disk"]["records"] - 2
        assert after["memory"]["records"] == before["memory"]["records"] - 6
    with Vulpes(vulpes_binary, tmp_path / "mnt", state, cache, server=isr_server.url,
                token_file=isr_server.token_file, ca=isr_server.ca) as v:
        assert read_all(v.path("disk")) == disk_model
        assert read_all(v.path("memory")) == memory_model
        assert v.status()["fetch"]["fetches"] == 0


def punch_fd(fd: int, offset: int, length: int) -> None:
    """fallocate(PUNCH_HOLE) on an open file, as QEMU does it (fallocate(1) would also close the file, and a
    close flushes it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if libc.fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, offset, length) != 0:
        raise OSError(ctypes.get_errno(), "fallocate")


@pytest.mark.parametrize("image", ["memory", "disk"])
def test_whole_pages_written_to_absent_chunks_do_not_wait_for_them(vulpes_binary: Path, isr_server: IsrServer,
                                                                    tmp_path: Path, image: str) -> None:
    """With the server out of reach, whole pages written to chunks that are not at this site (memory: the
    writeback before a hole; disk: a guest's block writes at a fresh site) are taken at once and read back,
    and a hole over such a chunk makes it zeros; back online, the first read of another page of such a chunk
    sees both, and fsync fetches what the partial chunks still lack and makes every byte durable."""
    rng = random.Random(211)
    content = rng.randbytes(4 * MIB)                                   # 32 chunks, no two alike
    if image == "memory":
        state = make_state(tmp_path / "state", bytes(CHUNK_SIZE), 4 * MIB, memory=content)
    else:
        state = make_state(tmp_path / "state", content, 4 * MIB)
    state.publish(isr_server.store)
    cache, ram = tmp_path / "cache", tmp_path / "mnt-ram"
    ram.mkdir()
    model = bytearray(content)
    page = 4096

    def promptly(what: str, work: Callable[[], T]) -> T:
        """``work`` done in a thread, which must not wait for the server (it is offline)."""
        done: list[T] = []
        worker = threading.Thread(target=lambda: done.append(work()), daemon=True)
        worker.start()
        worker.join(20)
        assert done, f"{what} waited for the server"
        return done[0]

    def read(fd: int, at: int, length: int) -> bytes:
        """Through the memory mount (QEMU's file, no readahead) from vulpes, not from the page cache."""
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return os.pread(fd, length, at)

    with Vulpes(vulpes_binary, tmp_path / "mnt", state, cache, server=isr_server.url,
                token_file=isr_server.token_file, ca=isr_server.ca, extra=[f"--memory-mount={ram}"]) as v:
        fd = os.open(ram / image, os.O_RDWR)       # the mount without readahead: reads of exactly these pages
        try:
            assert v.control({"op": "offline"})["ok"]
            writes = {(2, 3): 1, (10, 0): 1, (22, 31): 1, (27, 7): 3}  # (chunk, first page in it): pages
            for (chunk, first), pages in writes.items():
                at = chunk * CHUNK_SIZE + first * page
                data = rng.randbytes(pages * page)
                assert promptly("a write", lambda: os.pwrite(fd, data, at)) == len(data)
                model[at:at + len(data)] = data
            # The disk's unit is a sector: a guest's 1 KiB file system blocks, and runs of them.
            sectors = [(5, 3072, 1024), (14, 1024, 5632)] if image == "disk" else []
            for chunk, offset, length in sectors:
                at = chunk * CHUNK_SIZE + offset
                data = rng.randbytes(length)
                assert promptly("a write of sectors", lambda: os.pwrite(fd, data, at)) == length
                model[at:at + length] = data
            status = v.status()
            assert status["images"][image]["partial_chunks"] == 4 + len(sectors)
            assert status["flush"]["partial_chunks"] == 4 + len(sectors)
            for (chunk, first), pages in writes.items():
                at = chunk * CHUNK_SIZE + first * page
                assert promptly("a read of pages written", lambda: read(fd, at, pages * page)) == \
                    model[at:at + pages * page]
            # A hole over chunk 10 (partial) and chunk 11 (not here): zeros.
            promptly("a hole", lambda: punch_fd(fd, 10 * CHUNK_SIZE, 2 * CHUNK_SIZE))
            model[10 * CHUNK_SIZE:12 * CHUNK_SIZE] = bytes(2 * CHUNK_SIZE)
            assert promptly("a read of a hole", lambda: read(fd, 10 * CHUNK_SIZE, 2 * page)) == bytes(2 * page)
            assert v.status()["fetch"]["fetches"] == 0
            assert v.control({"op": "online"})["ok"]
            # Another page of chunk 2 (fetched now), and the page written there.
            assert read(fd, 2 * CHUNK_SIZE, 4 * page) == model[2 * CHUNK_SIZE:2 * CHUNK_SIZE + 4 * page]
            for chunk, offset, length in sectors:             # pages of sectors written and not
                at = chunk * CHUNK_SIZE
                assert read(fd, at, 2 * page) == model[at:at + 2 * page]
            # Part of a page: written into the chunk once it is here.
            assert os.pwrite(fd, b"part of a page", 16 * CHUNK_SIZE + 100) == 14
            model[16 * CHUNK_SIZE + 100:16 * CHUNK_SIZE + 114] = b"part of a page"
            os.fsync(fd)
        finally:
            os.close(fd)
        status = v.status()
        assert status["images"][image]["partial_chunks"] == 0
        assert status["images"][image]["dirty_chunks"] == 0
        assert read_all(v.path(image)) == model
    # Durable: a vulpes without a server reads every byte from the cache.
    with Vulpes(vulpes_binary, tmp_path / "mnt", state, cache) as v:
        assert read_all(v.path(image)) == model


def test_the_flusher_fetches_partial_chunks_in_the_background_and_flushes_them(
        vulpes_binary: Path, isr_server: IsrServer, tmp_path: Path) -> None:
    """Without an fsync, the background flusher asks for a partial chunk's object at idle priority, completes
    the chunk once the object is here and flushes it."""
    rng = random.Random(223)
    memory = rng.randbytes(2 * MIB)
    state = make_state(tmp_path / "state", bytes(CHUNK_SIZE), 2 * MIB, memory=memory)
    state.publish(isr_server.store)
    cache, ram = tmp_path / "cache", tmp_path / "mnt-ram"
    ram.mkdir()
    model = bytearray(memory)
    with Vulpes(vulpes_binary, tmp_path / "mnt", state, cache, server=isr_server.url,
                token_file=isr_server.token_file, ca=isr_server.ca,
                extra=[f"--memory-mount={ram}", "--flush-interval=200"]) as v:
        fd = os.open(ram / "memory", os.O_RDWR)
        try:
            data = rng.randbytes(4096)
            assert os.pwrite(fd, data, 7 * CHUNK_SIZE + 4096) == 4096
            model[7 * CHUNK_SIZE + 4096:7 * CHUNK_SIZE + 8192] = data
            wait_until(lambda: v.status()["images"]["memory"]["dirty_chunks"] == 0, 30, "the partial chunk flushed")
            status = v.status()
            assert status["images"]["memory"]["partial_chunks"] == 0
            assert status["flush"]["partial_chunks"] == 1
            assert chunk_path(cache, state.tag_of("memory", 7)).exists()
        finally:
            os.close(fd)
        assert read_all(v.path("memory")) == model


def memory_records(site: Site, parcel: Parcel) -> int:
    """The memory image's keyring records at ``site``, once every page the guest wrote has reached vulpes: an
    fsync of the file QEMU maps writes its dirty pages back and has vulpes flush them."""
    memory = site.runtime / f"isr-{os.getuid()}" / parcel.id[:8] / "mnt-ram" / "memory"
    fd = os.open(memory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return int(site.stat(parcel)["session_status"]["vulpes"]["images"]["memory"]["records"])


@pytest.mark.timeout(900)
def test_freed_guest_memory_becomes_holes_and_resumes_intact(isr_env: IsrEnv, tmp_path: Path) -> None:
    """A guest fills a tmpfs and empties it again: the balloon reports the free memory, QEMU punches it out of
    the memory image and the memory image loses those chunks' records (so a checkin stores none of them).
    The parcel then resumes at another site with the guest's memory intact (a tmpfs file kept in RAM, the
    RAM token, the counter)."""
    parcel = isr_env.make_parcel()
    with sites(isr_env, tmp_path, ["A", "B"]) as (a, b):
        a.resume(parcel, "--policy", "demand")
        with a.console(parcel) as console:
            console.wait_ready(90)
            kept = console.check("mkdir -p /mnt/t && mount -t tmpfs -o size=100m tmpfs /mnt/t && "
                                 "dd if=/dev/urandom of=/mnt/t/kept bs=1M count=4 2>/dev/null && "
                                 "dd if=/dev/urandom of=/mnt/t/freed bs=1M count=64 2>/dev/null && "
                                 "md5sum /mnt/t/kept", timeout=120).split()[0]
            filled = memory_records(a, parcel)
            assert filled >= 64 * (1 << 20) // CHUNK_SIZE, filled
            console.check("rm /mnt/t/freed && echo 3 > /proc/sys/vm/drop_caches")
            # Free page reporting waits 2 s and reports 2 MiB blocks: most of the 64 MiB (512 chunks) goes.
            freed = wait_until(lambda: (r := memory_records(a, parcel)) <= filled - 256 and r, 300,
                               f"the memory image to lose half the freed chunks' records (of {filled})", interval=1)
            print(f"memory image records: {filled} with the tmpfs full, {freed} after it was emptied")
            marks = make_changes(console, "holes", megabytes=1)
        a.isr("suspend", parcel.name)
        a.wait_session_end(parcel)

        b.resume(parcel, "--policy", "demand")
        with b.console(parcel) as console:
            check_continues(console, marks)
            assert console.check("md5sum /mnt/t/kept").split()[0] == kept, "the tmpfs file kept in RAM changed"
        b.isr("poweroff", parcel.name, "--no-checkin")
        b.wait_session_end(parcel)
