"""The ISR test guest: a small real Linux VM for tests and benchmarks, built from Debian packages.

``python -m tools.guest build|path|boot`` builds it (cached), prints where it is, or boots it.

- `build` (`build.build`, `GuestArtifacts`): kernel, initramfs and ext4 data disk, cached by content key.
- `boot` (`booted_guest`, `resumed_guest`, `guest_config`): run it under QEMU from any disk image (or
  resume it from a saved state), via `isrctl.qemu`.
- `console` (`GuestConsole`): wait for it, run commands in it, read its RAM counter.
- `disk` (`copy_disk`, `check_ext4`): give each VM its own copy of the disk; check it afterwards.
"""
from .boot import (KERNEL_CMDLINE, BootedGuest, ResumedGuest, booted_guest, guest_config, guest_kvm_works,
                   resumed_guest)
from .build import DEFAULT_VARIANT, VARIANTS, GuestArtifacts, build, cache_root
from .console import GuestConsole
from .disk import check_ext4, copy_disk
from .errors import GuestBuildError, GuestCommandError, GuestConsoleError, GuestError, GuestTimeoutError

__all__ = [
    "KERNEL_CMDLINE", "BootedGuest", "ResumedGuest", "booted_guest", "guest_config", "guest_kvm_works",
    "resumed_guest",
    "DEFAULT_VARIANT", "VARIANTS", "GuestArtifacts", "build", "cache_root",
    "GuestConsole", "check_ext4", "copy_disk",
    "GuestBuildError", "GuestCommandError", "GuestConsoleError", "GuestError", "GuestTimeoutError",
]
