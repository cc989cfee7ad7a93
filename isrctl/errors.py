"""Exceptions raised by the isrctl package.

Every error that isrctl raises on purpose derives from `IsrError`, so a caller (and the `isr` command's
``main()``) can catch the whole package with one ``except``. Modules add their own subclasses here rather
than defining private roots, so the hierarchy stays visible in one place.
"""
from __future__ import annotations

from collections.abc import Sequence


class IsrError(Exception):
    """Root of every exception isrctl raises on purpose."""


class VMError(IsrError):
    """Something went wrong with a QEMU virtual machine (launching it, talking to it, stopping it)."""


class VMLaunchError(VMError):
    """QEMU did not start, or exited before its monitor answered.

    Carries what is needed to reproduce the failure by hand: the exit code (None if QEMU was still
    running and had to be killed), the full command line and the tail of QEMU's own output.
    """

    def __init__(self, message: str, *, exitcode: int | None, args: Sequence[str], output: str) -> None:
        self.exitcode = exitcode
        self.command = list(args)
        self.output = output
        super().__init__(message)

    def __str__(self) -> str:
        from shlex import join

        text = f"{self.args[0]} (exit code {self.exitcode})\ncommand: {join(self.command)}"
        if self.output.strip():
            text += "\nQEMU output (tail):\n" + self.output.rstrip()
        return text


class QMPCommandError(VMError):
    """QEMU answered a QMP command with an error."""

    def __init__(self, command: str, error_class: str, description: str) -> None:
        self.command = command
        self.error_class = error_class
        self.description = description
        super().__init__(f"QMP command {command} failed: {error_class}: {description}")


class VMTimeoutError(VMError):
    """A VM did not reach a wanted state (monitor up, migration done, exited) within its time limit."""


class MigrationError(VMError):
    """Saving or loading a VM's state (a QEMU migration stream) failed."""


class ConfigError(IsrError):
    """The client configuration is missing or wrong (not logged in, a malformed config file)."""


class CredentialError(IsrError):
    """No passphrase or key file could be obtained, or it does not open the parcel's key envelope."""


class StateError(IsrError):
    """The local state of a parcel does not allow what was asked (not checked out, local changes, a
    session already running, the last session crashed)."""


class LockRefused(IsrError):
    """Someone else holds the parcel's lock; `holder` says who, where, since when and at which version."""

    def __init__(self, message: str, holder: dict[str, object]) -> None:
        super().__init__(message)
        self.holder = holder


class LockBroken(IsrError):
    """This site's lock was broken (or taken over): its local changes can never be committed."""


class CompatibilityError(IsrError):
    """This PC cannot run the parcel's VM (QEMU too old, machine type or CPU model unknown, too little RAM)."""


class VulpesFailure(IsrError):
    """vulpes did not start, did not answer on its control socket, refused a request or exited badly."""


class CacheFull(VulpesFailure):
    """The chunk cache has no room left that may be made (everything else is pinned or was just hoarded): a
    hoard stopped early, or a write was refused. The message says what is there and what to do."""


class HoardStopped(IsrError):
    """A hoard was asked to stop (`isr schedule run` got SIGTERM); what it fetched so far is kept."""


class SessionError(IsrError):
    """The resume session failed, or could not be reached over its control socket."""


class CheckinError(IsrError):
    """A new version could not be uploaded or committed (the local changes are kept)."""


class LockNotReleased(IsrError):
    """Releasing the lock failed (after a successful commit, perhaps): the server still holds it for this
    site, which keeps its lock record so that a later `isr checkin` can release it."""
