"""`isr resume`, `isr suspend`, `isr poweroff`, `isr checkin`, `isr sync`: a parcel's session at this site.

`isr suspend` (and `isr sync` of a running VM) only ask the session over its control socket and wait, so
the session's own modules and the HTTP client are imported in the commands that use them: the suspend's
start counts against the checkin's throughput.
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

from isrprogress import TerminalReporter, human_bytes
from parcels.manifest import IMAGES

from .. import config as configmod
from .. import control, detach, paths
from .. import policy as policymod
from ..errors import IsrError, StateError
from ..localstate import DAMAGED, POWEROFF, LocalChange, ParcelState
from . import common

log = logging.getLogger("isrctl")


def running_session(ref: str | None) -> ParcelState | None:
    """The local state of ``ref`` if a session of it runs at this site (its process holds the state lock)."""
    try:
        state = common.local_state(ref, want_session=ref is None)
    except StateError:
        return None
    return state if state.session_info() is not None and state.busy() else None


def cmd_resume(args: argparse.Namespace) -> int:
    reporter = common.make_reporter(args)
    policymod.get(args.policy)
    running = running_session(args.parcel)
    if running is not None:
        # The VM may be paused for lack of room in the cache: go on (the session says if it cannot).
        result = control.request(running, "continue", reporter)
        return common.finish(args, reporter, f"{result.get('name', args.parcel)} continues",
                             common.parcel_result(running, session=running.session_info(), continued=True))
    common.check_writable(paths.chunk_cache_dir(), "the chunk cache", "XDG_CACHE_HOME")
    common.check_writable(paths.parcels_dir(), "the parcel state directory", "XDG_DATA_HOME")
    # The session's process starts now: its own start then overlaps the work with the server below.
    with detach.SessionProcess() as process:
        return _resume(args, reporter, process)


def _resume(args: argparse.Namespace, reporter: TerminalReporter, process: detach.SessionProcess) -> int:
    from .. import mount as mountmod
    from ..checkout import Client

    if args.disconnected:
        state = common.local_state(args.parcel)
        checkout = state.require_checkout()
        name = checkout.name
        parcel_keys = common.unlock_local(state, args, name)
    else:
        with Client() as client:
            parcel, state = common.server_state(client, args.parcel)
            name = parcel["name"]
            if state.busy():
                info = state.session_info()
                if (mounted := mountmod.info(state)) is not None:
                    raise StateError(f"{name} is mounted on {mounted['dir']}: `isr umount {mounted['dir']}` first")
                raise StateError(f"{name} is already running at this site"
                                 f"{' (session pid ' + str(info['pid']) + ')' if info else ''}: "
                                 f"`isr suspend {name}` first")
            parcel_keys = client.unlock(parcel["id"], common.parcel_credential(args, name), state)
    cfg = configmod.load()
    first = state.checkout() is None
    options = detach.SessionOptions(
        parcel=state.parcel, name=name, policy=args.policy, writeback=args.writeback,
        writeback_rate=policymod.parse_rate(args.writeback_rate), disconnected=args.disconnected,
        vnc=args.vnc, accel=args.accel or cfg.accel, lookaside=[str(Path(p).absolute()) for p in args.lookaside],
        checkin_on_poweroff=not args.no_checkin)
    try:
        if args.detach:
            info = detach.spawn_detached(options, parcel_keys, reporter, process=process)
            return common.finish(args, reporter, f"session pid {info['pid']}; `isr suspend {name}` suspends it\n"
                                                 f"  control  {info['control']}",
                                 common.parcel_result(state, session=info, continued=False))
        code = detach.run_foreground(options, parcel_keys, reporter, process=process)
    except BaseException:
        if first:  # a first resume that failed before its version was here leaves no "version 0" state
            state.forget_unfinished_checkout()
        raise
    if code != 0 and first:
        state.forget_unfinished_checkout()
    common.finish(args, reporter, "", common.parcel_result(state, name, session=None, continued=False))
    return code


def cmd_suspend(args: argparse.Namespace) -> int:
    return _end_session(args, "suspend")


def _end_session(args: argparse.Namespace, op: str, **fields: Any) -> int:
    reporter = common.make_reporter(args)
    state = common.local_state(args.parcel, want_session=True)
    info = state.session_info()
    if info is None:
        change = state.effective_local_change()
        if change is not None and change.state == DAMAGED:
            raise StateError(f"no session is running; the last one crashed ({change.reason}): `isr discard` goes "
                             f"back to the last checked-in version")
        checkout = state.checkout()
        raise StateError(f"{checkout.name if checkout else state.parcel} is not running at this site")
    started = time.monotonic()
    # How long this command had run when it asked: the session counts the time to the safe state from the
    # command's own start, as the user waits for it.
    result = control.request(state, op, reporter, checkin=not args.no_checkin, age=detach.process_age(), **fields)
    log.info("%s answered after %.2f s; waiting for the session to exit", op, time.monotonic() - started)
    if not detach.wait_for_exit(int(info["pid"]), timeout=300):
        raise IsrError(f"the session (pid {info['pid']}) did not exit after {op}; see {state.dir / 'session.log'}")
    log.info("session exited after %.2f s", time.monotonic() - started)
    return common.finish(args, reporter,
                         f"done: {result.get('name')} is at version {result['version']}" if "version" in result else "",
                         common.parcel_result(state, checked_in="checkin_seconds" in result))


def cmd_poweroff(args: argparse.Namespace) -> int:
    state = common.local_state(args.parcel)
    if state.session_info() is not None:
        if args.timeout is not None and args.timeout < 0:
            raise IsrError(f"--timeout {args.timeout:g}: give a number of seconds >= 0")
        return _end_session(args, "poweroff", wait=args.timeout, force=args.force)
    from .. import checkin as checkinmod
    from .. import session as sessionmod
    from ..checkout import Client

    reporter = common.make_reporter(args)
    checkout = state.require_checkout()
    with state.locked():
        change = state.effective_local_change()
        if change is not None and change.state == DAMAGED:
            raise StateError(f"the last session crashed ({change.reason}): `isr discard {checkout.name}` first")
        if checkout.lock is None:
            raise StateError(f"this site does not hold the lock of {checkout.name}: `isr checkout {checkout.name}` "
                             f"first")
        sessionmod.forget_memory(state)
        state.save_local_change(LocalChange(state=POWEROFF,
                                            working_set=change.working_set if change else {i: [] for i in IMAGES}))
        reporter.say(f"powered off {checkout.name}: the saved RAM is forgotten; the next resume boots cold")
        if not args.no_checkin:
            with Client() as client:
                parcel_keys = common.unlock_local(state, args, checkout.name, client)
                checkinmod.checkin(client, state, parcel_keys, reporter=reporter)
    return common.finish(args, reporter, "", common.parcel_result(state, checked_in=not args.no_checkin))


def cmd_checkin(args: argparse.Namespace, keep_lock: bool = False) -> int:
    from .. import checkin as checkinmod
    from ..checkout import Client

    reporter = common.make_reporter(args)
    state = common.local_state(args.parcel)
    checkout = state.require_checkout()
    with Client() as client, state.locked():
        parcel_keys = common.unlock_local(state, args, checkout.name, client)
        version = checkinmod.checkin(client, state, parcel_keys, keep_lock=keep_lock, reporter=reporter)
    return common.finish(args, reporter, "", common.parcel_result(state, checked_in=version != checkout.version))


def cmd_sync(args: argparse.Namespace) -> int:
    running = running_session(args.parcel)
    if running is not None:
        # A running VM's state cannot be committed (the suspend does that), but what it wrote can go to the
        # server now, so that the cache may drop it.
        reporter = common.make_reporter(args)
        result = control.request(running, "sync", reporter)
        name = result.get("name", args.parcel)
        return common.finish(
            args, reporter, f"uploaded {human_bytes(int(result.get('uploaded_bytes', 0)))} of {name}; the cache has "
                            f"room for {human_bytes(int(result.get('room', 0)))} now"
                            + ("; the VM continues" if result.get("continued") else "")
                            + f" (the version is committed when it is suspended: `isr suspend {name}`)",
            common.parcel_result(running, checked_in=False, uploaded_bytes=int(result.get("uploaded_bytes", 0)),
                                 room=int(result.get("room", 0))))
    return cmd_checkin(args, keep_lock=True)
