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

from tools.guest import GuestArtifacts, GuestBuildError, build, copy_disk
from tests.conftest import wait_until as _wait_until


@pytest.fixture(scope="session")
def guest_artifacts() -> GuestArtifacts:
    """The built (cached) small test guest: kernel, initramfs, pristine disk, expected workload result."""
    try:
        return build("small")
    except GuestBuildError as exc:
        pytest.fail(f"cannot build the test guest: {exc}")


@pytest.fixture
def guest_disk(guest_artifacts: GuestArtifacts, tmp_path: Path) -> Path:
    """A private, writable copy of the guest's pristine data disk."""
    return copy_disk(guest_artifacts.disk, tmp_path / "disk.img")


#: Console probes are round trips over the serial line: poll them more gently than local conditions.
wait_until = functools.partial(_wait_until, interval=0.2)
