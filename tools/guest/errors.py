"""Exceptions raised by the test guest tooling (tools.guest); `GuestError` is their one root."""
from __future__ import annotations


class GuestError(Exception):
    """Root of every exception the test guest tooling raises on purpose."""


class GuestBuildError(GuestError):
    """Building the guest (kernel, initramfs, disk image) failed."""


class GuestConsoleError(GuestError):
    """The guest's serial console did not behave: it closed, or the guest reported an error."""


class GuestTimeoutError(GuestConsoleError):
    """The guest did not print what was expected (ready marker, command result) in time."""


class GuestCommandError(GuestConsoleError):
    """A command run in the guest exited with a non-zero status (only raised when asked to check)."""

    def __init__(self, command: str, status: int, output: str) -> None:
        self.command = command
        self.status = status
        self.output = output
        super().__init__(f"guest command exited with status {status}: {command}\n{output.rstrip()}")
