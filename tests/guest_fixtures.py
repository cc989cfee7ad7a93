"""Fixtures and helpers for tests that boot the real test guest (tools.guest) under QEMU.

Import the fixtures into a test module with::

    from tests.guest_fixtures import guest_artifacts, guest_disk  # noqa: F401  (pytest fixtures)

and boot any disk image (a copy of the built one, or an image extracted from a parcel) with
`tools.guest.booted_guest(guest_artifacts, disk, run_dir=tmp_path)`. Logs (QEMU output, console
transcript) land in the test's ``tmp_path``.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tools.guest import GuestArtifacts, GuestBuildError, GuestConsole, build, copy_disk
from tests.conftest import wait_until as _wait_until


def _built(variant: str, what: str) -> GuestArtifacts:
    """The built (cached) guest ``variant``; the test fails, naming ``what``, if it cannot be built."""
    try:
        return build(variant)
    except GuestBuildError as exc:
        pytest.fail(f"cannot build the {what}: {exc}")


@pytest.fixture(scope="session")
def guest_artifacts() -> GuestArtifacts:
    """The built (cached) small test guest: kernel, initramfs, pristine disk, expected workload result."""
    return _built("small", "test guest")


@pytest.fixture(scope="session")
def disk_guest_artifacts() -> GuestArtifacts:
    """The built (cached) disk-booted test guest: a PC disk with syslinux and a Debian root (tools/guest/README.md).
    Building it the first time needs root and about two minutes; `./bootstrap setup` does it beforehand."""
    return _built("diskboot", "disk-booted test guest")


@pytest.fixture(scope="session")
def uefi_guest_artifacts() -> GuestArtifacts:
    """The same system on a GPT disk that systemd-boot boots under UEFI (OVMF); skips where OVMF is missing."""
    from parcels.errors import ImageError
    from parcels.firmware import CODE, ovmf_file

    try:
        ovmf_file(CODE)
    except ImageError as exc:
        pytest.skip(str(exc))
    return _built("diskboot-uefi", "UEFI disk-booted test guest")


@pytest.fixture
def guest_disk(guest_artifacts: GuestArtifacts, tmp_path: Path) -> Path:
    """A private, writable copy of the guest's pristine data disk."""
    return copy_disk(guest_artifacts.disk, tmp_path / "disk.img")


#: Console probes are round trips over the serial line: poll them more gently than local conditions.
wait_until = functools.partial(_wait_until, interval=0.2)


#: In the guest: write $1 random 256 KiB blocks into /data/fill with O_DIRECT and fsync, and log each block's
#: MD5 in /run/ack.log once its write is acknowledged (a failed write is logged as FAIL), then DONE.
ACKED_WRITER = """
i=0
while [ $i -lt $1 ]; do
  dd if=/dev/urandom of=/run/blk bs=256k count=1 2>/dev/null
  m=$(md5sum < /run/blk)
  dd if=/run/blk of=/data/fill bs=256k seek=$i count=1 conv=notrunc,fsync oflag=direct 2>/dev/null \\
    || { echo "FAIL $i" >> /run/ack.log; exit 1; }
  echo "ACK $i ${m%% *}" >> /run/ack.log
  i=$((i+1))
done
echo DONE >> /run/ack.log
"""

#: In the guest: read every acknowledged block back (O_DIRECT: from the disk) and compare its MD5; prints
#: ``VERIFY n=<blocks> bad=<mismatches>``.
ACKED_VERIFY = """
echo 3 > /proc/sys/vm/drop_caches
n=0; bad=0
while read -r word i m; do
  [ "$word" = ACK ] || continue
  n=$((n+1))
  got=$(dd if=/data/fill bs=256k skip=$i count=1 iflag=direct 2>/dev/null | md5sum)
  [ "${got%% *}" = "$m" ] || { bad=$((bad+1)); echo "BAD $i"; }
done < /run/ack.log
echo "VERIFY n=$n bad=$bad"
"""


def start_acked_writer(console: GuestConsole, blocks: int) -> None:
    """Start `ACKED_WRITER` for ``blocks`` blocks in the background of the guest (it may be paused meanwhile)."""
    console.check(f"cat > /run/w.sh <<'EOF'\n{ACKED_WRITER}\nEOF\n: > /run/ack.log; "
                  f"sh /run/w.sh {blocks} </dev/null >/dev/null 2>&1 &")
