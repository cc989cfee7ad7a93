"""A seccomp filter that keeps guest RAM in a file free of huge-page read-around.

QEMU 7.2 calls madvise(MADV_HUGEPAGE) on all guest RAM (physmem.c, ram_block_add), with no option to turn
it off. For RAM in a file that sets VM_HUGEPAGE on the shared file mapping, and on every major fault the
kernel then reads 4 MiB of the file around the faulting page, 2 MiB-aligned, even where readahead is off
(mm/filemap.c, do_sync_mmap_readahead). With RAM in vulpes's memory image each such read is up to 32
demand-fetched chunks for a 4 KiB page. The filter below makes exactly that madvise fail with EINVAL (as
on a kernel without THP), which QEMU ignores: advice MADV_HUGEPAGE on a range the size of guest RAM.
Smaller ranges (TCG's code buffer) keep their huge pages. The filter asks for no_new_privs, which only
matters if QEMU were to execute a set-user-ID helper (e.g. qemu-bridge-helper; isr uses none).
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform

_AUDIT_ARCH_X86_64 = 0xC000003E
_NR_MADVISE_X86_64 = 28
_MADV_HUGEPAGE = 14
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, _PR_SET_NO_NEW_PRIVS = 22, 2, 38
_SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
_LD_ABS_W, _JEQ_K, _RET_K = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K


def no_hugepage_filter(ram_bytes: int) -> None:
    """Install, on the calling thread, a seccomp filter that fails madvise(_, ram_bytes, MADV_HUGEPAGE).

    Everything else is allowed. Raises OSError if the filter cannot be installed (no seccomp in this
    kernel, not an x86-64 host); the caller then runs QEMU without it: slower demand fetch, same guest.
    """
    if platform.machine() != "x86_64":
        raise OSError(errno.ENOSYS, f"the filter is written for x86-64, not {platform.machine()}")
    # struct seccomp_data: int nr @0, u32 arch @4, u64 ip @8, u64 args[6] @16, in little-endian halves.
    # madvise(addr, len, advice): len is args[1] (@24 low, @28 high), advice (an int) args[2] (@32).
    # Each test either falls through to the next load or jumps to the ALLOW at index 11.
    checks = [(4, _AUDIT_ARCH_X86_64), (0, _NR_MADVISE_X86_64), (32, _MADV_HUGEPAGE),
              (24, ram_bytes & 0xFFFFFFFF), (28, ram_bytes >> 32)]
    program: list[tuple[int, int, int, int]] = []
    for offset, value in checks:
        program += [(_LD_ABS_W, 0, 0, offset), (_JEQ_K, 0, 10 - (len(program) + 1), value)]
    program += [(_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.EINVAL), (_RET_K, 0, 0, _SECCOMP_RET_ALLOW)]

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                    ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    insns = (SockFilter * len(program))(*(SockFilter(*insn) for insn in program))
    fprog = SockFprog(len(program), insns)
    libc = ctypes.CDLL(None, use_errno=True)
    ulong = ctypes.c_ulong
    for what, args in (("no_new_privs", (_PR_SET_NO_NEW_PRIVS, ulong(1), ulong(0))),
                       ("seccomp", (_PR_SET_SECCOMP, ulong(_SECCOMP_MODE_FILTER), ctypes.byref(fprog)))):
        if libc.prctl(*args, ulong(0), ulong(0)) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"prctl({what}): {os.strerror(code)}")
