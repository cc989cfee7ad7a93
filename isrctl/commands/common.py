"""What the `isr` commands share: the reporter, credentials, finding a parcel here or on the server,
confirmations, the quick server client, and lock-loss notes."""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isrprogress import TerminalReporter

from .. import config as configmod
from .. import keys as keymod
from ..errors import ConfigError, IsrError, StateError
from ..localstate import POWEROFF, RUNNING, SUSPENDED, LocalChange, ParcelState, local_parcels

if TYPE_CHECKING:  # the HTTP client is imported by the commands that reach the server (not `isr suspend`)
    from ..checkout import Client

log = logging.getLogger("isrctl")

#: How long the commands that only look (ls, stat, discard's lock check) wait for the server, and after how
#: many seconds without an answer they say that they are waiting.
QUICK_TIMEOUT, QUICK_NOTE_AFTER = 10.0, 3.0


def make_reporter(args: argparse.Namespace) -> TerminalReporter:
    """Where a command's messages and progress go: stdout, or stderr with --json (stdout is then the JSON
    result alone, `finish`)."""
    return TerminalReporter(sys.stderr if getattr(args, "json", False) else None, quiet=getattr(args, "quiet", False))


def parcel_result(state: ParcelState, name: str | None = None, **fields: Any) -> dict[str, Any]:
    """The JSON result of a command that works on one parcel (doc/isrctl.md "JSON results"): the parcel as it
    is at this site now, and the command's own ``fields``."""
    checkout = state.checkout()
    change = state.effective_local_change()
    return {"parcel": state.parcel, "name": checkout.name if checkout else name,
            "version": checkout.version if checkout else None, "lock_held": bool(checkout and checkout.lock),
            "local": change.state if change else ("clean" if checkout else None),
            "running": state.session_info() is not None and state.busy(), **fields}


def finish(args: argparse.Namespace, reporter: TerminalReporter, text: str, result: dict[str, Any]) -> int:
    """End a command that reports a result: ``text`` for a person (on stderr with --json), and with --json
    ``result`` as one JSON object on stdout. Returns the exit code, 0."""
    if text:
        reporter.say(text)
    if getattr(args, "json", False):
        print(json.dumps(result, indent=1, sort_keys=True, default=str), flush=True)
    return 0


def cache_limit() -> str:
    """The chunk cache's limit as configured ("" if none, or not logged in: the commands that only look
    work without a login)."""
    try:
        return configmod.load().cache_limit
    except ConfigError:
        return ""


def parcel_credential(args: argparse.Namespace, name: str = "") -> keymod.Credential:
    return keymod.obtain_credential(passphrase_file=getattr(args, "passphrase_file", None),
                                    passphrase_env=getattr(args, "passphrase_env", None),
                                    key_file=getattr(args, "key_file", None),
                                    prompt=f"passphrase of parcel {name}: " if name else "parcel passphrase: ")


def local_state(ref: str | None, *, want_session: bool = False) -> ParcelState:
    """A parcel with local state at this site, by UUID or name; with no ``ref``, the only one (the only
    one with a running session if ``want_session``). Raises StateError."""
    states = local_parcels()
    if ref is not None:
        try:
            wanted = str(uuid.UUID(ref))
            matches = [s for s in states if s.parcel == wanted]
        except ValueError:
            matches = [s for s in states if (c := s.checkout()) is not None and c.name == ref.rpartition("/")[2]]
        if not matches:
            raise StateError(f"parcel {ref!r} has no local state at this site (`isr ls` lists the server's parcels)")
        if len(matches) > 1:
            raise StateError(f"{ref!r} names several local parcels: use the UUID")
        return matches[0]
    if want_session:
        states = [s for s in states if s.session_info() is not None]
        what = "running"
    else:
        what = "checked out"
    if len(states) == 1:
        return states[0]
    if not states:
        raise StateError(f"no parcel is {what} at this site")
    raise StateError(f"several parcels are {what} here: name one")


def server_state(client: Client, ref: str) -> tuple[dict[str, Any], ParcelState]:
    parcel = client.resolve(ref)
    return parcel, ParcelState(parcel["id"])


def unlock_local(state: ParcelState, args: argparse.Namespace, name: str,
                  client: Client | None = None) -> Any:
    """Open the parcel's keys from the local copy of the key envelope, or from the server's."""
    credential = parcel_credential(args, name)
    envelope = state.envelope()
    if envelope is None:
        if client is None:
            raise StateError(f"no key envelope of {name} at this site: check it out while connected")
        return client.unlock(state.parcel, credential, state)
    return keymod.unlock(envelope, uuid.UUID(state.parcel), credential)


def check_writable(directory: Path, what: str, variable: str) -> None:
    """Fail early, with the path, if ``directory`` (made if missing) cannot be written: a session that finds
    out later has already taken the lock and fetched the version."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise StateError(f"{what} {directory} cannot be written ({exc.strerror or exc}): make it writable, or set "
                         f"{variable} to a place that is") from None


def confirm(question: str, args: argparse.Namespace) -> None:
    if getattr(args, "yes", False):
        return
    if not sys.stdin.isatty():
        raise StateError(f"{question} Not confirmed: add --yes to do it without asking")
    answer = input(f"{question} [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        raise StateError("not confirmed; nothing done")


@contextlib.contextmanager
def quick_client() -> Iterator[Client]:
    """A connection for commands that only look: requests give up after QUICK_TIMEOUT seconds, and after
    QUICK_NOTE_AFTER seconds without an answer a line on stderr says what isr is waiting for."""
    from ..checkout import Client

    with Client(timeout=QUICK_TIMEOUT) as client:
        timer = threading.Timer(QUICK_NOTE_AFTER, lambda: print(
            f"isr: waiting for the server {client.config.server} (no answer for {QUICK_NOTE_AFTER:g} s; giving up "
            f"after {QUICK_TIMEOUT:g} s)", file=sys.stderr, flush=True))
        timer.daemon = True
        timer.start()
        try:
            yield client
        finally:
            timer.cancel()


def lost_locks(states: list[ParcelState], server: str, parcels: list[dict[str, Any]]) -> dict[str, str]:
    """The parcels (by id) whose lock this site records but the server (``server``, whose parcel list is
    ``parcels``) no longer shows as this site's, each with why (`checkout.lost_lock`)."""
    from ..checkout import lost_lock

    listed = {p["id"]: p for p in parcels}
    lost: dict[str, str] = {}
    for state in states:
        checkout = state.checkout()
        if checkout is None or checkout.lock is None or checkout.server != server:
            continue
        if state.parcel not in listed:
            lost[state.parcel] = "lost: the server does not list this parcel any more"
        elif (why := lost_lock(checkout.lock, listed[state.parcel].get("lock"))) is not None:
            lost[state.parcel] = why
    return lost


def ask_lost_locks(states: list[ParcelState]) -> tuple[dict[str, str], str]:
    """`_lost_locks` for commands that work without the server: asks it only if a lock is recorded, and
    returns what was lost and, if the server could not be asked, why not ("" if it was)."""
    if not any((c := s.checkout()) is not None and c.lock is not None for s in states):
        return {}, ""
    try:
        with quick_client() as client:
            return lost_locks(states, client.config.server, client.remote.parcels()), ""
    except IsrError as exc:
        return {}, str(exc)


def stale_lock_note(name: str, why: str, change: LocalChange | None) -> str:
    """What a site whose lock record is stale can do about it."""
    if change is None:
        return f"{name}: this site's lock was {why}; `isr checkout {name}` or `isr resume {name}` takes it again"
    return (f"{name}: this site's lock was {why}; the changes made here cannot be committed: `isr discard {name}` "
            f"drops them, then `isr checkout {name}`")


def describe_change(change: LocalChange | None, version: int) -> str:
    if change is None:
        return f"same as version {version}"
    if change.state == SUSPENDED:
        return f"suspended here at {change.suspended_at}, not checked in (newer than version {version})"
    if change.state == POWEROFF:
        return f"powered off here, not checked in (newer than version {version})"
    if change.state == RUNNING:
        return "running"
    return f"DAMAGED: {change.reason} (`isr discard` goes back to version {version})"


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
