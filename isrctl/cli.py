"""``isr``: suspend your PC at one machine and resume it at another.

Each subcommand is a function ``cmd_<name>(args) -> int``; `main` parses the command line, runs one, and
is the only place that turns an exception into a one-line message and an exit code:

    0 success, 1 error, 2 usage, 3 the parcel is locked by someone else, 4 this site's lock was broken,
    130 interrupted.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import getpass
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from parcels.chunk import chunk_count
from parcels.errors import ParcelError
from parcels.keyring import Keyring, decode_stream
from parcels.manifest import IMAGES, open_keyring, open_manifest, seal_manifest, utc_now
from parcels.store import KEYRING_FILES, MANIFEST

from . import checkin as checkinmod
from . import config as configmod
from . import hoard as hoardmod
from . import keys as keymod
from . import paths
from . import policy as policymod
from . import schedule as schedulemod
from . import session as sessionmod
from . import workingset
from .checkout import Client, describe_holder, ensure_checkout, lost_lock, when
from .errors import CredentialError, IsrError, LockBroken, LockRefused, StateError
from .localstate import DAMAGED, POWEROFF, RUNNING, SUSPENDED, LocalChange, ParcelState, local_parcels
from .progress import LogReporter, NullReporter, Reporter, TerminalReporter, human_bytes
from .remote import Remote, RemoteError, RemoteUnreachable, fetch_certificate, normalize_fingerprint
from .vulpes import Vulpes, cache_object_path

log = logging.getLogger("isrctl")

EXIT_ERROR, EXIT_USAGE, EXIT_LOCKED, EXIT_LOCK_BROKEN, EXIT_INTERRUPTED = 1, 2, 3, 4, 130
#: How long the commands that only look (ls, stat, discard's lock check) wait for the server, and after how
#: many seconds without an answer they say that they are waiting.
QUICK_TIMEOUT, QUICK_NOTE_AFTER = 10.0, 3.0

DESCRIPTION = """\
Internet Suspend/Resume: your whole PC is a virtual machine (a "parcel") kept encrypted on an ISR server.
Resume it at any PC, work, suspend it, and resume it somewhere else exactly where you left off.

A typical day:
  isr login https://isr.example.org:8443 --user alice --fingerprint sha256:9a81...
  isr ls                       your parcels, their versions, who holds each lock
  isr resume laptop            take the lock, fetch what is needed, run the VM (Ctrl-C suspends)
  isr suspend laptop           (from another terminal) save it and check in a new version
  ...at home:
  isr hoard laptop             optional: fetch it ahead of time (t3), so the resume is instant
  isr resume laptop --policy proactive
  ...or let your calendar say when, without the key (`isr schedule --help`):
  isr site add --location "Lab 4"; isr schedule calendar add ~/work.ics; isr schedule run
"""

EPILOG = """\
Policies (isr resume --policy; the ISR timeline t1..t5 is in doc/isrctl.md):
  baseline         fetch everything before the VM starts (long resume, no slowdown)
  proactive        everything was hoarded earlier with `isr hoard`; resume just launches the VM
  demand           start at once, fetch chunks on first touch (short resume, some slowdown)
  lazy-ws          demand, plus hoard the last working set in the background
  eager-ws         the working set was hoarded earlier with `isr hoard --working-set`
  eager-writeback  demand, plus trickle dirty chunks to the server while you work

Files: ~/.config/isr/config.toml, ~/.local/share/isr/ (token, parcel state), ~/.cache/isr/chunks
(XDG_CONFIG_HOME, XDG_DATA_HOME, XDG_CACHE_HOME and XDG_RUNTIME_DIR are honored).
"""


# --- helpers -------------------------------------------------------------------------------------------

def _reporter(args: argparse.Namespace) -> TerminalReporter:
    return TerminalReporter(quiet=getattr(args, "quiet", False))


def _credential(args: argparse.Namespace, name: str = "") -> keymod.Credential:
    return keymod.obtain_credential(passphrase_env=getattr(args, "passphrase_env", None),
                                    keyfile=getattr(args, "keyfile", None),
                                    prompt=f"passphrase of parcel {name}: " if name else "parcel passphrase: ")


def _local_state(ref: str | None, *, want_session: bool = False) -> ParcelState:
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


def _server_state(client: Client, ref: str) -> tuple[dict[str, Any], ParcelState]:
    parcel = client.resolve(ref)
    return parcel, ParcelState(parcel["id"])


def _unlock_local(state: ParcelState, args: argparse.Namespace, name: str,
                  client: Client | None = None) -> Any:
    """Open the parcel's keys from the local copy of the key envelope, or from the server's."""
    credential = _credential(args, name)
    envelope = state.envelope()
    if envelope is None:
        if client is None:
            raise StateError(f"no key envelope of {name} at this site: check it out while connected")
        return client.unlock(state.parcel, credential, state)
    return keymod.unlock(envelope, uuid.UUID(state.parcel), credential)


def _check_writable(directory: Path, what: str, variable: str) -> None:
    """Fail early, with the path, if ``directory`` (made if missing) cannot be written: a session that finds
    out later has already taken the lock and fetched the version."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise StateError(f"{what} {directory} cannot be written ({exc.strerror or exc}): make it writable, or set "
                         f"{variable} to a place that is") from None


def _confirm(question: str, args: argparse.Namespace) -> None:
    if getattr(args, "yes", False):
        return
    if not sys.stdin.isatty():
        raise StateError(f"{question} Not confirmed: add --yes to do it without asking")
    answer = input(f"{question} [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        raise StateError("not confirmed; nothing done")


@contextlib.contextmanager
def _quick_client() -> Iterator[Client]:
    """A connection for commands that only look: requests give up after QUICK_TIMEOUT seconds, and after
    QUICK_NOTE_AFTER seconds without an answer a line on stderr says what isr is waiting for."""
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


def _lost_locks(states: list[ParcelState], server: str, parcels: list[dict[str, Any]]) -> dict[str, str]:
    """The parcels (by id) whose lock this site records but the server (``server``, whose parcel list is
    ``parcels``) no longer shows as this site's, each with why (`checkout.lost_lock`)."""
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


def _ask_lost_locks(states: list[ParcelState]) -> tuple[dict[str, str], str]:
    """`_lost_locks` for commands that work without the server: asks it only if a lock is recorded, and
    returns what was lost and, if the server could not be asked, why not ("" if it was)."""
    if not any((c := s.checkout()) is not None and c.lock is not None for s in states):
        return {}, ""
    try:
        with _quick_client() as client:
            return _lost_locks(states, client.config.server, client.remote.parcels()), ""
    except IsrError as exc:
        return {}, str(exc)


def _stale_lock_note(name: str, why: str, change: LocalChange | None) -> str:
    """What a site whose lock record is stale can do about it."""
    if change is None:
        return f"{name}: this site's lock was {why}; `isr checkout {name}` or `isr resume {name}` takes it again"
    return (f"{name}: this site's lock was {why}; the changes made here cannot be committed: `isr discard {name}` "
            f"drops them, then `isr checkout {name}`")


def _describe_change(change: LocalChange | None, version: int) -> str:
    if change is None:
        return f"same as version {version}"
    if change.state == SUSPENDED:
        return f"suspended here at {change.suspended_at}, not checked in (newer than version {version})"
    if change.state == POWEROFF:
        return f"powered off here, not checked in (newer than version {version})"
    if change.state == RUNNING:
        return "running"
    return f"DAMAGED: {change.reason} (`isr discard` goes back to version {version})"


# --- login / logout ------------------------------------------------------------------------------------

def spki_pin(der: bytes) -> str:
    """The public-key pin (``sha256//<base64>``) of a DER certificate, as libcurl (vulpes ``--pin``) takes it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_der_x509_certificate(der)
    spki = cert.public_key().public_bytes(serialization.Encoding.DER,
                                          serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256//" + base64.b64encode(hashlib.sha256(spki).digest()).decode()


def cmd_login(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    fingerprint = "sha256:" + normalize_fingerprint(args.fingerprint)
    der = fetch_certificate(url)
    seen = "sha256:" + hashlib.sha256(der).hexdigest()
    if seen != fingerprint:
        raise IsrError(f"{url} presents the certificate {seen}, not the {fingerprint} you gave: not logging in "
                       f"(check the fingerprint isr-server printed)")
    if args.password_env:
        password = os.environ.get(args.password_env)
        if not password:
            raise CredentialError(f"environment variable {args.password_env} (--password-env) is not set")
    elif sys.stdin.isatty():
        password = getpass.getpass(f"password of {args.user} on {url}: ")
    else:
        raise CredentialError("no password: run from a terminal or give --password-env VAR")
    site = args.site or configmod.default_site()
    with Remote(url, fingerprint=fingerprint) as remote:
        token = remote.login(args.user, password, label=f"isr on {socket.gethostname()} ({site})"[:100])
    cfg = configmod.ClientConfig(server=url, user=args.user, fingerprint=fingerprint, pin=spki_pin(der), site=site,
                                 accel=args.accel, cache_limit=args.cache_limit or "")
    configmod.write_token(token)
    path = configmod.save(cfg)
    print(f"logged in to {url} as {args.user} (site {site}); settings in {path}")
    return 0


def cmd_logout(args: argparse.Namespace) -> int:
    try:
        with Client() as client:
            client.remote.logout()
    except RemoteError as exc:
        print(f"isr: the server did not revoke the token ({exc}); forgetting it anyway", file=sys.stderr)
    paths.token_file().unlink(missing_ok=True)
    print("logged out")
    return 0


# --- ls, stat --------------------------------------------------------------------------------------------

def cmd_ls(args: argparse.Namespace) -> int:
    with _quick_client() as client:
        parcels = client.remote.parcels()
        server = client.config.server
    local = {s.parcel: s for s in local_parcels()}
    lost = _lost_locks(list(local.values()), server, parcels)
    if args.json:
        out = []
        for p in parcels:
            entry = dict(p)
            state = local.get(p["id"])
            if state is not None:
                checkout = state.checkout()
                change = state.effective_local_change()
                entry["local"] = {"version": checkout.version if checkout else None,
                                  "lock_held": bool(checkout and checkout.lock) and p["id"] not in lost,
                                  "lock_lost": p["id"] in lost,
                                  "state": change.state if change else "clean",
                                  "running": state.session_info() is not None}
            out.append(entry)
        print(json.dumps(out, indent=1))
        return 0
    if not parcels:
        print("no parcels (an administrator creates them with isr-admin parcel create)")
        return 0
    rows = [["NAME", "VERSION", "LOCK", "HERE"]]
    notes = []
    for p in parcels:
        lock = p.get("lock")
        lock_text = describe_holder(lock) if lock else "-"
        state = local.get(p["id"])
        here = "-"
        if state is not None:
            checkout = state.checkout()
            change = state.effective_local_change()
            here = f"v{checkout.version}" if checkout else "?"
            if p["id"] in lost:
                here += ", lock lost"
                notes.append(_stale_lock_note(p["name"], lost[p["id"]], change))
            elif checkout and checkout.lock:
                here += ", lock held"
            if state.session_info() is not None:
                here += ", running"
            elif change is not None:
                here += f", {change.state}"
        rows.append([p["name"], str(p.get("current_version", 0)), lock_text, here])
    _print_table(rows)
    for note in notes:
        print(note)
    if args.long:
        for p in parcels:
            print(f"\n{p['name']}  {p['id']}  created {when(p.get('created'))}")
            with _quick_client() as client:
                versions = client.remote.versions(p["id"])["versions"]
            for v in versions:
                print(f"  v{v['version']:<4} {when(v.get('created'))}  by {v.get('user', '?')} from "
                      f"{v.get('host', '?')} ({v.get('site') or '-'})  {v.get('chunk_count', 0)} chunks, "
                      f"{human_bytes(v.get('chunk_bytes') or 0)}")
    return 0


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _cache_usage() -> tuple[int, int]:
    root = paths.chunk_cache_dir() / "chunks"
    count = size = 0
    if root.is_dir():
        for dirpath, _, files in os.walk(root):
            for name in files:
                if len(name) == 64:
                    count += 1
                    try:
                        size += os.stat(os.path.join(dirpath, name)).st_size
                    except OSError:
                        pass
    return count, size


def parcel_stat(state: ParcelState) -> dict[str, Any]:
    """Everything `isr stat` knows about a parcel at this site (no server contact, no keys needed)."""
    checkout = state.checkout()
    change = state.effective_local_change()
    info: dict[str, Any] = {"parcel": state.parcel, "state_dir": str(state.dir)}
    if checkout is None:
        return info
    info.update({"name": checkout.name, "server": checkout.server, "version": checkout.version,
                 "lock": checkout.lock.__dict__ if checkout.lock else None, "policy": checkout.policy,
                 "local": change.to_json() if change else None})
    session = state.session_info()
    if session is not None:
        info["session"] = session
        try:
            info["session_status"] = sessionmod.request(state, "status", NullReporter(), timeout=10)
        except IsrError as exc:
            info["session_status"] = {"error": str(exc)}
    cache = paths.chunk_cache_dir()
    images: dict[str, Any] = {}
    try:
        base_total = base_cached = 0
        for image in IMAGES:
            base_records = decode_stream(state.base_stream(image))
            _, size, records = base_records
            cover = workingset.coverage(cache, records)
            base_total += cover.chunks
            base_cached += cover.cached
            images[image] = {"size": size, "base_chunks": len(records), "base_cached": cover.cached}
        if change is None or change.state != RUNNING or session is None:
            changes = checkinmod.compare(state)
            for image in IMAGES:
                images[image]["changed_chunks"] = changes.changed[image]
                local_records = decode_stream(changes.streams[image])[2]
                images[image]["chunks"] = len(local_records)
                images[image]["stored_bytes"] = sum(
                    p.stat().st_size for r in local_records if (p := cache_object_path(cache, r.tag)).is_file())
        info["hoard"] = {"version": checkout.version, "chunks": base_total, "cached": base_cached,
                         "fraction": round(base_cached / base_total, 4) if base_total else 1.0}
    except (IsrError, ParcelError) as exc:
        info["error"] = str(exc)
    info["images"] = images
    return info


def cmd_stat(args: argparse.Namespace) -> int:
    states = [_local_state(args.parcel)] if args.parcel else local_parcels()
    results = [parcel_stat(s) for s in states]
    lost, unasked = _ask_lost_locks(states)
    for state, info in zip(states, results):
        if info.get("lock") is None:
            continue
        if unasked:
            info["lock_unconfirmed"] = unasked
        elif state.parcel in lost:
            info["stale_lock"] = {**info["lock"], "why": lost[state.parcel]}
            info["lock"] = None
    count, size = _cache_usage()
    if args.json:
        print(json.dumps({"parcels": results, "cache": {"dir": str(paths.chunk_cache_dir()), "objects": count,
                                                        "bytes": size}}, indent=1, default=str))
        return 0
    print(f"cache     {paths.chunk_cache_dir()}: {count} chunk objects, {human_bytes(size)}")
    if not results:
        print("no parcel has local state at this site")
    for info in results:
        print()
        if "name" not in info:
            print(f"parcel    {info['parcel']}: no checkout")
            continue
        print(f"parcel    {info['name']} ({info['parcel']})")
        print(f"server    {info['server']}")
        lock, stale = info["lock"], info.get("stale_lock")
        if stale:
            lock_text = f"; lock lost: {stale['why']}"
        elif lock:
            lock_text = f"; lock held since {when(lock['acquired'])} (site {lock['site']})"
            if info.get("lock_unconfirmed"):
                lock_text += ", not confirmed: the server was not reachable"
        else:
            lock_text = "; lock not held"
        print(f"version   {info['version']}{lock_text}")
        change = LocalChange.from_json(info["local"]) if info["local"] else None
        print(f"local     {_describe_change(change, info['version'])}")
        if stale:
            print(f"note      {_stale_lock_note(info['name'], stale['why'], change)}")
        images = info.get("images", {})
        if "changed_chunks" in images.get("disk", {}):
            print(f"dirty     {images['disk']['changed_chunks']} disk and {images['memory']['changed_chunks']} memory "
                  f"chunks differ from version {info['version']}")
        if "memory" in images:
            mem = images["memory"]
            stored = mem.get("stored_bytes")
            print(f"memory    image {human_bytes(mem['size'])}, {mem.get('chunks', mem['base_chunks'])} chunks stored"
                  + (f" ({human_bytes(stored)} compressed and encrypted)" if stored is not None else ""))
        if "hoard" in info:
            h = info["hoard"]
            print(f"hoard     version {h['version']}: {h['cached']} of {h['chunks']} chunks in the cache "
                  f"({h['fraction']:.0%})")
        session = info.get("session")
        if session:
            status = info.get("session_status", {})
            print(f"session   running (pid {session['pid']}, policy {session.get('policy')}), resumed in "
                  f"{session.get('resume_seconds')} s")
            print(f"          display vnc {session.get('vnc')}, console {session.get('console')}")
            vulpes = status.get("vulpes") or {}
            if "hoard" in vulpes:
                hv = vulpes["hoard"]
                print(f"          hoard {hv['state']}: {hv['chunks_done']}/{hv['chunks_total']} chunks")
            if "writeback" in vulpes:
                wb = vulpes["writeback"]
                print(f"          writeback {'on' if wb['trickle'] else 'off'}: {wb['uploaded_chunks']} chunks "
                      f"({human_bytes(wb['uploaded_bytes'])}) uploaded")
        if info.get("error"):
            print(f"problem   {info['error']}")
    return 0


# --- checkout, resume, suspend ---------------------------------------------------------------------------

def cmd_checkout(args: argparse.Namespace) -> int:
    reporter = _reporter(args)
    with Client() as client:
        parcel, state = _server_state(client, args.parcel)
        with state.locked():
            change = state.effective_local_change()
            if change is not None:
                raise StateError(f"{parcel['name']} is already checked out here with local changes "
                                 f"({_describe_change(change, state.require_checkout().version)}): resume, check in "
                                 f"or discard them")
            parcel_keys = client.unlock(parcel["id"], _credential(args, parcel["name"]), state)
            first = state.checkout() is None
            checkout, current = ensure_checkout(client, state, parcel)
            if checkout.version != current or not state.keyring_path("disk").exists():
                from . import compat

                try:
                    client.download_version(state, current, parcel_keys, check=lambda m: compat.check(m),
                                            reporter=reporter)
                except BaseException:
                    if first:  # leave nothing behind: no lock, no "version 0" state for the next command
                        with contextlib.suppress(IsrError):
                            checkinmod.release(client, state, checkout)
                        state.forget_unfinished_checkout()
                    raise
                checkout.version = current
                state.save_checkout(checkout)
            reporter.say(f"checked out {parcel['name']} version {checkout.version}; this site holds the lock")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    reporter = _reporter(args)
    policymod.get(args.policy)
    _check_writable(paths.chunk_cache_dir(), "the chunk cache", "XDG_CACHE_HOME")
    _check_writable(paths.parcels_dir(), "the parcel state directory", "XDG_DATA_HOME")
    if args.disconnected:
        state = _local_state(args.parcel)
        checkout = state.require_checkout()
        name = checkout.name
        parcel_keys = _unlock_local(state, args, name)
    else:
        with Client() as client:
            parcel, state = _server_state(client, args.parcel)
            name = parcel["name"]
            if state.busy():
                info = state.session_info()
                raise StateError(f"{name} is already running at this site"
                                 f"{' (session pid ' + str(info['pid']) + ')' if info else ''}: "
                                 f"`isr suspend {name}` first")
            parcel_keys = client.unlock(parcel["id"], _credential(args, name), state)
    cfg = configmod.load()
    first = state.checkout() is None
    options = sessionmod.SessionOptions(
        parcel=state.parcel, name=name, policy=args.policy, writeback=args.writeback,
        writeback_rate=policymod.parse_rate(args.writeback_rate), disconnected=args.disconnected,
        vnc=args.vnc, accel=args.accel or cfg.accel, lookaside=[str(Path(p).absolute()) for p in args.lookaside],
        checkin_on_poweroff=not args.no_checkin)
    try:
        if args.detach:
            info = sessionmod.spawn_detached(options, parcel_keys, reporter)
            print(f"session pid {info['pid']}; `isr suspend {name}` suspends it")
            print(f"  control  {info['control']}")
            return 0
        code = sessionmod.run_foreground(options, parcel_keys, reporter)
    except BaseException:
        if first:  # a first resume that failed before its version was here leaves no "version 0" state
            state.forget_unfinished_checkout()
        raise
    if code != 0 and first:
        state.forget_unfinished_checkout()
    return code


def cmd_suspend(args: argparse.Namespace) -> int:
    return _end_session(args, "suspend")


def _end_session(args: argparse.Namespace, op: str) -> int:
    reporter = _reporter(args)
    state = _local_state(args.parcel, want_session=True)
    info = state.session_info()
    if info is None:
        change = state.effective_local_change()
        if change is not None and change.state == DAMAGED:
            raise StateError(f"no session is running; the last one crashed ({change.reason}): `isr discard` goes "
                             f"back to the last checked-in version")
        checkout = state.checkout()
        raise StateError(f"{checkout.name if checkout else state.parcel} is not running at this site")
    started = time.monotonic()
    result = sessionmod.request(state, op, reporter, checkin=not args.no_checkin)
    log.info("%s answered after %.2f s; waiting for the session to exit", op, time.monotonic() - started)
    if not sessionmod.wait_for_exit(int(info["pid"]), timeout=300):
        raise IsrError(f"the session (pid {info['pid']}) did not exit after {op}; see {state.dir / 'session.log'}")
    log.info("session exited after %.2f s", time.monotonic() - started)
    if "version" in result:
        reporter.say(f"done: {result.get('name')} is at version {result['version']}")
    return 0


def cmd_poweroff(args: argparse.Namespace) -> int:
    state = _local_state(args.parcel)
    if state.session_info() is not None:
        return _end_session(args, "poweroff")
    reporter = _reporter(args)
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
                parcel_keys = _unlock_local(state, args, checkout.name, client)
                checkinmod.checkin(client, state, parcel_keys, reporter=reporter)
    return 0


def cmd_checkin(args: argparse.Namespace, keep_lock: bool = False) -> int:
    reporter = _reporter(args)
    state = _local_state(args.parcel)
    checkout = state.require_checkout()
    with Client() as client, state.locked():
        parcel_keys = _unlock_local(state, args, checkout.name, client)
        checkinmod.checkin(client, state, parcel_keys, keep_lock=keep_lock, reporter=reporter)
    return 0


def cmd_sync(args: argparse.Namespace) -> int:
    return cmd_checkin(args, keep_lock=True)


def cmd_discard(args: argparse.Namespace) -> int:
    state = _local_state(args.parcel)
    checkout = state.require_checkout()
    with state.locked():
        change = state.effective_local_change()
        if change is None:
            print(f"{checkout.name}: nothing to discard (same as version {checkout.version})")
            return 0
        if change.state != DAMAGED:
            _confirm(f"Drop the changes to {checkout.name} made here since version {checkout.version}?", args)
        state.restore_base()
        held = ""
        if checkout.lock is not None:
            lost, unasked = _ask_lost_locks([state])
            if state.parcel in lost:
                # Nothing here depends on the lost lock any more: forget it, as the next resume would.
                checkout.lock = None
                state.save_checkout(checkout)
                held = f"; this site no longer holds the lock, which was {lost[state.parcel]}"
            else:
                held = "; this site still holds the lock" + (" (not confirmed: the server was not reachable)"
                                                             if unasked else "")
        print(f"{checkout.name} is back at version {checkout.version}{held}")
    return 0


# --- hoard --------------------------------------------------------------------------------------------------

def cmd_hoard(args: argparse.Namespace) -> int:
    reporter = _reporter(args)
    keyless = args.no_key
    if not keyless and not (args.passphrase_env or args.keyfile) and not sys.stdin.isatty():
        reporter.say("no key given and no terminal to ask for one: hoarding without the key (--no-key)")
        keyless = True
    with Client() as client:
        parcel, state = _server_state(client, args.parcel)
        if state.busy():
            raise StateError(f"{parcel['name']} is running at this site: a running session fetches what it needs "
                             f"(resume with --policy lazy-ws to hoard in the background)")
        if keyless:
            result = hoardmod.hoard(client, parcel, "working-set" if args.working_set else "full", reporter)
            _note_throughput(result.bytes, result.seconds)
            reporter.say(f"hoarded {parcel['name']} version {result.need.version}: {result.chunks} chunks and "
                         f"{len(result.need.blobs)} boot files fetched ({human_bytes(result.bytes)} in "
                         f"{result.seconds:.1f} s); {result.need.chunk_count} chunks are now here")
            return 0
        with state.locked():
            parcel_keys = client.unlock(parcel["id"], _credential(args, parcel["name"]), state)
            checkout = state.checkout()
            change = state.effective_local_change()
            current = int(client.remote.parcel(parcel["id"]).get("current_version") or 0)
            if current == 0:
                raise StateError(f"{parcel['name']} has no version to hoard")
            use_local = checkout is not None and (checkout.lock is not None or
                                                  (checkout.version == current and change is None))
            if use_local:
                assert checkout is not None
                manifest = open_manifest(parcel_keys.parcel_key, state.base_manifest_sealed(),
                                         parcel=uuid.UUID(state.parcel), version=checkout.version)
                if change is not None and change.state in (SUSPENDED, POWEROFF):
                    counts = {image: chunk_count(manifest.chunk_size, manifest.images[image].size)
                              for image in IMAGES}
                    working_set, problem = workingset.checked(change.working_set, counts)
                    if problem is not None and args.working_set:
                        reporter.say(f"warning: the working set recorded here is ignored ({problem})")
                else:
                    working_set = manifest.working_set
                hoard_dir = state.dir
            else:
                _, manifest = client.fetch_manifest(parcel["id"], current, parcel_keys)
                hoard_dir = state.dir / "hoard"
                shutil.rmtree(hoard_dir, ignore_errors=True)
                hoard_dir.mkdir(parents=True)
                for image in IMAGES:
                    sealed = client.remote.get_blob(parcel["id"], current, KEYRING_FILES[image])
                    records = open_keyring(parcel_keys.parcel_key, sealed, manifest, image)
                    with Keyring.create(hoard_dir / f"keyring.{image}", manifest.chunk_size,
                                        manifest.images[image].size) as keyring:
                        keyring.put_many(records)
                working_set = manifest.working_set
            client.boot_blobs(state, manifest, parcel_keys, reporter)
            what = "the working set" if args.working_set else "everything"
            reporter.say(f"hoarding {what} of {parcel['name']} version {manifest.version}")
            try:
                _hoard(hoard_dir, state, parcel_keys, client, reporter,
                       working_set=working_set if args.working_set else None)
            finally:
                if hoard_dir != state.dir:
                    shutil.rmtree(hoard_dir, ignore_errors=True)
    return 0


def _hoard(state_dir: Path, state: ParcelState, parcel_keys: Any, client: Client, reporter: Reporter, *,
           working_set: dict[str, list[int]] | None) -> None:
    runtime = paths.parcel_runtime_dir(state.parcel)
    paths.chunk_cache_dir().mkdir(parents=True, exist_ok=True)
    daemon = Vulpes(mountpoint=runtime / "hoard-mnt", state_dir=state_dir, cache_dir=paths.chunk_cache_dir(),
                    control_path=runtime / "hoard.sock", log_path=state.dir / "vulpes.log",
                    server=client.config.server, token_file=paths.token_file(), pin=client.config.pin,
                    cache_limit=client.config.cache_limit)
    daemon.start(parcel_keys)
    try:
        if working_set is None:
            status = daemon.hoard(everything=True)
        else:
            status = daemon.hoard(disk=working_set.get("disk", []), memory=working_set.get("memory", []))
        hoard = status.get("hoard", {})
        bar = reporter.progress("hoarding", int(hoard.get("bytes_total", 0)))
        try:
            while True:
                hoard = daemon.status().get("hoard", {})
                bar.update(int(hoard.get("bytes_done", 0)), int(hoard.get("bytes_total", 0)))
                if hoard.get("state") in ("done", "stopped", "idle"):
                    break
                time.sleep(0.2)
        finally:
            bar.close(f"{hoard.get('chunks_done', 0)} of {hoard.get('chunks_total', 0)} chunks, "
                      f"{human_bytes(hoard.get('bytes_fetched', 0))} fetched")
        if int(hoard.get("chunks_failed", 0)):
            raise IsrError(f"{hoard['chunks_failed']} chunks could not be hoarded (see {daemon.log_path})")
    finally:
        daemon.stop()


def _note_throughput(nbytes: int, seconds: float) -> None:
    """A hoard's transfer rate also informs the hoard scheduler's plans."""
    with schedulemod.RunnerState.updating(paths.schedule_state_file()) as state:
        state.add_sample(nbytes, seconds)


# --- site rules and hoard scheduling ---------------------------------------------------------------------

def _schedule_config() -> schedulemod.ScheduleConfig:
    return schedulemod.ScheduleConfig.load(paths.schedule_file())


def _save_schedule(config: schedulemod.ScheduleConfig, done: str) -> None:
    config.save(paths.schedule_file())
    print(done)


def _rule_from_args(args: argparse.Namespace) -> schedulemod.SiteRule | None:
    for kind in schedulemod.RULE_KINDS:
        value = getattr(args, kind, None)
        if value is not None:
            return schedulemod.SiteRule(kind, value)
    return None


def cmd_site_add(args: argparse.Namespace) -> int:
    config = _schedule_config()
    rule = _rule_from_args(args)
    assert rule is not None  # argparse requires one
    if rule in config.rules:
        print(f"this PC already has the rule {rule}")
        return 0
    config.rules.append(rule)
    _save_schedule(config, f"added rule {len(config.rules)}: events with {rule} mean you will be at this PC")
    if not config.calendars:
        print("no calendars yet: add one with `isr schedule calendar add FILE|URL`")
    return 0


def cmd_site_rm(args: argparse.Namespace) -> int:
    config = _schedule_config()
    rule = _rule_from_args(args)
    if rule is None:
        if args.number is None or not 1 <= args.number <= len(config.rules):
            raise schedulemod.ScheduleError(f"name the rule to remove by its number (1 to {len(config.rules)}, see "
                                            f"`isr site ls`) or as it was added (--location, --category, --summary)")
        rule = config.rules[args.number - 1]
    elif rule not in config.rules:
        raise schedulemod.ScheduleError(f"there is no rule {rule} (`isr site ls` lists them)")
    config.rules.remove(rule)
    _save_schedule(config, f"removed the rule {rule}")
    return 0


def cmd_site_ls(args: argparse.Namespace) -> int:
    config = _schedule_config()
    if not config.rules:
        print("no site rules: `isr site add --location TEXT` (or --category NAME, --summary REGEX) tells isr which "
              "calendar events mean you will be at this PC")
        return 0
    for number, rule in enumerate(config.rules, start=1):
        print(f"{number}  {rule.kind:<9} {rule.pattern}")
    return 0


def cmd_calendar_add(args: argparse.Namespace) -> int:
    config = _schedule_config()
    source = args.source if "://" in args.source else str(Path(args.source).absolute())
    if source in config.calendars:
        print(f"{source} is already a calendar of this PC")
        return 0
    if not args.no_check:
        read = schedulemod.read_calendar(config, source, schedulemod.utc_now())
        for problem in read.problems:
            print(f"warning: {problem}", file=sys.stderr)
        print(f"{source}: {len(read.occurrences)} events in the next {config.horizon_days:g} days, "
              f"{sum(1 for o in read.occurrences if config.matches(o))} of them at this PC")
    config.calendars.append(source)
    _save_schedule(config, f"added calendar {source}")
    return 0


def cmd_calendar_rm(args: argparse.Namespace) -> int:
    config = _schedule_config()
    source = args.source
    if source not in config.calendars:
        source = str(Path(args.source).absolute())
    if source not in config.calendars:
        raise schedulemod.ScheduleError(f"{args.source} is not a calendar of this PC (`isr schedule calendar ls`)")
    config.calendars.remove(source)
    _save_schedule(config, f"removed calendar {source}")
    return 0


def cmd_calendar_ls(args: argparse.Namespace) -> int:
    config = _schedule_config()
    if not config.calendars:
        print("no calendars: `isr schedule calendar add FILE|https://URL`")
    for source in config.calendars:
        print(source)
    return 0


def cmd_schedule_set(args: argparse.Namespace) -> int:
    config = _schedule_config()
    if args.name is None:
        for name, value in dataclasses.asdict(config).items():
            if name not in ("rules", "calendars"):
                print(f"{name} = {value!r}")
        return 0
    if args.value is None:
        raise schedulemod.ScheduleError(f"give a value: `isr schedule set {args.name} VALUE`")
    config.set(args.name, args.value)
    _save_schedule(config, f"{args.name} = {getattr(config, args.name)!r}")
    return 0


def _schedule_parcels(config: schedulemod.ScheduleConfig, inventory: hoardmod.ServerInventory) -> list[str]:
    return list(config.parcels) or [p["name"] for p in inventory.parcels() if p.get("current_version")]


def cmd_schedule_show(args: argparse.Namespace) -> int:
    config = _schedule_config()
    if args.days is not None:
        config.horizon_days = args.days
        config.validate()
    state = schedulemod.RunnerState.load(paths.schedule_state_file())
    now = schedulemod.utc_now()
    read = schedulemod.read_calendars(config, now)
    with Client() as client:
        inventory = hoardmod.ServerInventory(client)
        plans = schedulemod.plan(read.occurrences, _schedule_parcels(config, inventory), inventory, config,
                                 state.throughput(), now)
    if args.json:
        print(json.dumps({"plans": [schedulemod.plan_json(p) for p in plans],
                          "problems": [str(p) for p in read.problems], "history": state.history}, indent=1))
        return 0
    if not config.rules:
        print("no site rules yet: `isr site add --location TEXT` says which events mean you will be here")
    if not config.calendars:
        print("no calendars yet: `isr schedule calendar add FILE|https://URL`")
    print(schedulemod.format_plan(plans, config.zone(), read.problems))
    for done in state.history[-3:]:
        print(schedulemod.format_history(done, config.zone()))
    return 0


def cmd_schedule_run(args: argparse.Namespace) -> int:
    import signal

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.getLogger().handlers[:] = [handler]
    logging.getLogger("isrctl").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    schedulemod.ScheduleConfig.load(paths.schedule_file())  # a broken file is reported before anything starts
    with contextlib.ExitStack() as stack:
        stack.enter_context(schedulemod.single_runner(paths.schedule_state_file()))
        client = stack.enter_context(Client())
        inventory = hoardmod.ServerInventory(client)
        hoarder = hoardmod.KeylessHoarder(client, inventory, LogReporter(logging.getLogger("isrctl.hoard")))
        runner = schedulemod.Runner(
            paths.schedule_file(), paths.schedule_state_file(),
            parcels=lambda config: _schedule_parcels(config, inventory), inventory=inventory, hoarder=hoarder,
            replan_s=args.replan, watch_s=args.watch,
            watch=lambda config: inventory.versions(_schedule_parcels(config, inventory)))
        if args.once:
            config = _schedule_config()
            plans, _ = runner.step()
            print(schedulemod.format_plan(plans, config.zone()))
            return 0

        def stop(signum: int, frame: Any) -> None:
            log.info("got signal %d: stopping", signum)
            runner.stop()

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, stop)
        log.info("isr schedule run: site %s, schedule %s, state %s", client.config.site, paths.schedule_file(),
                 paths.schedule_state_file())
        runner.run()
        log.info("stopped")
    return 0


# --- lock, clean, rollback, passwd ------------------------------------------------------------------------

def cmd_lock(args: argparse.Namespace) -> int:
    with Client() as client:
        parcel = client.resolve(args.parcel)
        status = client.remote.lock_status(parcel["id"])
        holder = status.get("lock")
        if not args.force:
            print(f"{parcel['name']}: " + (f"locked by {describe_holder(holder)}" if holder else "not locked"))
            return 0
        if not holder:
            print(f"{parcel['name']} is not locked: nothing to break")
            return 0
        _confirm(f"Break the lock of {parcel['name']} held by {describe_holder(holder)}? That site's changes since "
                 f"its last checkin can then never be committed.", args)
        client.remote.break_lock(parcel["id"], force=True, reason=args.reason or f"broken with isr lock --force from "
                                                                                 f"{client.config.site}")
        print(f"broke the lock of {parcel['name']} (it was held by {describe_holder(holder)})")
    return 0


def cmd_clean(args: argparse.Namespace) -> int:
    if args.cache:
        running = [s for s in local_parcels() if s.busy()]
        if running:
            raise StateError("a session is running at this site: suspend it before removing the chunk cache")
        _confirm(f"Remove the chunk cache {paths.chunk_cache_dir()}?", args)
        shutil.rmtree(paths.chunk_cache_dir(), ignore_errors=True)
        print(f"removed {paths.chunk_cache_dir()}")
        if not args.parcel:
            return 0
    if not args.parcel:
        raise StateError("name the parcel to clean (or --cache for the chunk cache)")
    state = _local_state(args.parcel)
    checkout = state.checkout()
    name = checkout.name if checkout else state.parcel
    with state.locked():
        change = state.effective_local_change()
        if change is not None and not args.force:
            raise StateError(f"{name} has local changes ({_describe_change(change, checkout.version if checkout else 0)})"
                             f": check them in, or `isr clean --force {name}` to throw them away")
        if checkout is not None and checkout.lock is not None:
            try:
                with Client() as client:
                    client.release(state.parcel, checkout.lock)
            except RemoteError as exc:
                if not args.force:
                    raise IsrError(f"cannot release the lock of {name} ({exc}): `isr clean --force` removes the local "
                                   f"state anyway (the lock then stays until broken)") from None
        state.remove()
    print(f"removed the local state of {name}")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    reporter = _reporter(args)
    with Client() as client:
        parcel, state = _server_state(client, args.parcel)
        with state.locked():
            if state.effective_local_change() is not None:
                raise StateError(f"{parcel['name']} has local changes here: check them in or discard them first")
            parcel_keys = client.unlock(parcel["id"], _credential(args, parcel["name"]), state)
            with _holding_lock(client, state, parcel) as (lock, current, had_lock):
                new_version = _rollback(client, parcel, parcel_keys, lock.nonce, current, args.version)
                reporter.say(f"version {new_version} of {parcel['name']} now holds the content of version "
                             f"{args.version}")
                if had_lock:
                    client.download_version(state, new_version, parcel_keys, reporter=reporter)
                    checkout = state.require_checkout()
                    checkout.version = new_version
                    state.save_checkout(checkout)
    return 0


@contextlib.contextmanager
def _holding_lock(client: Client, state: ParcelState, parcel: dict[str, Any]) -> Iterator[tuple[Any, int, bool]]:
    """The parcel's lock for a short server-side change: this site's lock if it holds one (kept), else one
    taken for the block and released after it. Yields (lock, current version, whether it was held)."""
    before = state.checkout()
    had_lock = before is not None and before.lock is not None
    checkout, current = ensure_checkout(client, state, parcel)
    lock = checkout.lock
    assert lock is not None
    try:
        yield lock, current, had_lock
    finally:
        if not had_lock:
            client.release(parcel["id"], lock)
            checkout = state.require_checkout()
            checkout.lock = None
            state.save_checkout(checkout)


def _rollback(client: Client, parcel: dict[str, Any], parcel_keys: Any, nonce: str, current: int, target: int) -> int:
    """Commit version current+1 with version ``target``'s content; returns the new version number.

    The target's sealed keyrings and device state are staged as they are (they are bound to the manifest by
    digest, not by version number); the manifest is re-sealed with the new version and parent; boot files
    identical to the current version's are inherited.
    """
    if not 1 <= target < current:
        raise IsrError(f"version {target} is not an older version of {parcel['name']} (current: {current})")
    remote = client.remote
    _, old = client.fetch_manifest(parcel["id"], target, parcel_keys)
    _, now = client.fetch_manifest(parcel["id"], current, parcel_keys)
    tags: set[str] = set()
    staged: dict[str, bytes] = {}
    records = {}
    for image in IMAGES:
        sealed = remote.get_blob(parcel["id"], target, KEYRING_FILES[image])
        records[image] = open_keyring(parcel_keys.parcel_key, sealed, old, image)
        tags.update(r.tag.hex() for r in records[image])
        staged[KEYRING_FILES[image]] = sealed
    inherit = []
    for name, info in old.blobs.items():
        same = now.blobs.get(name)
        if same is not None and same.sha256 == info.sha256 and same.kind == info.kind:
            inherit.append(name)
        else:
            staged[name] = remote.get_blob(parcel["id"], target, name)
    manifest = old.replace(version=current + 1, parent=current,
                           timestamps=dataclasses.replace(old.timestamps, created=utc_now()))
    staged[MANIFEST] = seal_manifest(parcel_keys.parcel_key, manifest)
    for name, data in staged.items():
        remote.put_blob(parcel["id"], name, data, nonce)
    record = remote.commit(parcel["id"], nonce, current, list(staged), sorted(tags), inherit,
                           workingset.tags(old.working_set, records))
    return int(record["version"])


def cmd_passwd(args: argparse.Namespace) -> int:
    from parcels.envelope import new_keyfile, wrap_envelope

    with Client() as client:
        parcel, state = _server_state(client, args.parcel)
        parcel_keys = client.unlock(parcel["id"], _credential(args, parcel["name"]))
        keyfile: bytes | None = None
        passphrase: str | None = None
        if args.new_keyfile:
            new_key = Path(args.new_keyfile)
            if new_key.exists():
                raise IsrError(f"{new_key} exists: give a new file name for the new key file")
            keyfile = new_keyfile()
        elif args.new_passphrase_env:
            passphrase = os.environ.get(args.new_passphrase_env)
            if not passphrase:
                raise CredentialError(f"environment variable {args.new_passphrase_env} is not set")
        elif sys.stdin.isatty():
            passphrase = getpass.getpass("new passphrase: ")
            if not passphrase or passphrase != getpass.getpass("again: "):
                raise CredentialError("the two passphrases differ (or are empty); nothing changed")
        else:
            raise CredentialError("no new passphrase: give --new-passphrase-env VAR or --new-keyfile FILE")
        envelope = wrap_envelope(uuid.UUID(parcel["id"]), parcel_keys.parcel_key, parcel_keys.convergence_secret,
                                 passphrase=passphrase, keyfile=keyfile)
        with state.locked(), _holding_lock(client, state, parcel) as (lock, _, _):
            if keyfile is not None:
                configmod.write_private(Path(args.new_keyfile), keyfile)
            client.remote.put_key_envelope(parcel["id"], envelope, lock.nonce)
            state.save_envelope(envelope)
    print(f"changed the {'key file' if keyfile else 'passphrase'} of {parcel['name']}"
          + (f"; the new key file is {args.new_keyfile}" if keyfile else ""))
    return 0


# --- parser --------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="isr", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (to stderr)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def cmd(name: str, func: Any, help_text: str, description: str | None = None) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=description or help_text,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
        return p

    def credentials(p: argparse.ArgumentParser) -> None:
        group = p.add_argument_group("parcel credential (default: ask on the terminal)")
        group.add_argument("--passphrase-env", metavar="VAR", help="take the parcel passphrase from this variable")
        group.add_argument("--keyfile", metavar="FILE", help="the parcel is protected by this key file")

    p = cmd("login", cmd_login, "log in to an ISR server and remember it",
            "Log in to an ISR server. The server's certificate is pinned by the fingerprint isr-server printed\n"
            "at start-up (checked before the password is sent); the token is kept in ~/.local/share/isr/token.")
    p.add_argument("url", help="the server, https://HOST:PORT")
    p.add_argument("--user", required=True, help="your user name on the server")
    p.add_argument("--fingerprint", required=True, metavar="sha256:HEX", help="the server certificate's fingerprint")
    p.add_argument("--site", help="a name for this site, shown to others in lock information (default: host name)")
    p.add_argument("--password-env", metavar="VAR", help="take the password from this variable")
    p.add_argument("--accel", choices=configmod.ACCELERATORS, default="tcg",
                   help="default accelerator for resumes here (kvm is used only where a probe boot works)")
    p.add_argument("--cache-limit", metavar="SIZE",
                   help="bound this PC's chunk cache, e.g. 20G (least recently used chunks are evicted; chunks not "
                        "yet uploaded never are); default: no limit")

    cmd("logout", cmd_logout, "revoke and forget the token")

    p = cmd("ls", cmd_ls, "list your parcels, their versions and locks")
    p.add_argument("-l", "--long", action="store_true", help="also list every version")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = cmd("checkout", cmd_checkout, "take the lock and fetch the current version's metadata",
            "Take the parcel's lock and fetch the current version's manifest, keyrings and device state into\n"
            "this site's state (chunks come later, on demand or with `isr hoard`).")
    p.add_argument("parcel", help="parcel name or UUID")
    credentials(p)

    p = cmd("resume", cmd_resume, "run the parcel's VM here (Ctrl-C suspends)",
            "Take the lock, fetch what the policy needs, and resume the VM exactly where it was suspended\n"
            "(or boot it if it was powered off). Runs until suspended: Ctrl-C, `isr suspend`, or the guest\n"
            "powering off. With --detach it returns once the guest runs.", )
    p.add_argument("parcel", help="parcel name or UUID")
    p.add_argument("--policy", default=policymod.DEFAULT, choices=list(policymod.POLICIES),
                   help=f"state-transfer policy (default {policymod.DEFAULT}; see `isr --help`)")
    p.add_argument("--writeback", action="store_true", help="trickle dirty chunks to the server while running")
    p.add_argument("--writeback-rate", default="4M", metavar="RATE",
                   help="trickle rate in bytes/s, e.g. 500K, 4M, 0 = unlimited (default 4M)")
    p.add_argument("--disconnected", action="store_true",
                   help="never contact the server (needs `isr checkout` and a full `isr hoard` first)")
    p.add_argument("--detach", action="store_true", help="return once the guest runs; the session keeps going")
    p.add_argument("--vnc", default="auto", metavar="WHERE",
                   help="VNC display: auto (first free 127.0.0.1:N), unix (a socket in the runtime dir), "
                        "none, or a QEMU -vnc argument such as 127.0.0.1:3")
    p.add_argument("--accel", choices=configmod.ACCELERATORS, help="accelerator (default from config: tcg)")
    p.add_argument("--lookaside", action="append", default=[], metavar="DIR",
                   help="look for chunks in this directory (e.g. a USB disk) before the server; repeatable")
    p.add_argument("--no-checkin", action="store_true",
                   help="if the guest powers itself off, keep the result local instead of checking it in")
    credentials(p)

    p = cmd("suspend", cmd_suspend, "suspend the running VM and check in a new version",
            "Stop the VM, save its device state, make its disk and RAM images durable, quit QEMU, and check\n"
            "in a new version (releasing the lock) unless --no-checkin.")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID (default: the only running one)")
    p.add_argument("--no-checkin", action="store_true", help="keep the new state here (and the lock)")

    p = cmd("checkin", cmd_checkin, "upload local changes as a new version and release the lock")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID (default: the only one here)")
    credentials(p)

    p = cmd("sync", cmd_sync, "upload local changes as a new version and keep the lock")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID (default: the only one here)")
    credentials(p)

    p = cmd("discard", cmd_discard, "drop local changes since the last checkout or sync")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID (default: the only one here)")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")

    p = cmd("hoard", cmd_hoard, "fetch a parcel's chunks into this site's cache ahead of time",
            "Fetch the current version (everything, or with --working-set the chunks its last session touched\n"
            "first) into this site's cache, so that a later resume with --policy proactive or eager-ws is fast.\n"
            "Needs no lock: the parcel may be running elsewhere (t3 of the ISR timeline).\n"
            "\n"
            "With --no-key (or with no key given and no terminal to ask for one) it needs no key either: the\n"
            "server lists the version's chunks and working set, and the ciphertext is fetched and checked\n"
            "against its tags; the boot files are kept sealed and checked by the next resume.")
    p.add_argument("parcel", help="parcel name or UUID")
    p.add_argument("--working-set", action="store_true", help="only the working set recorded at the last suspend")
    p.add_argument("--no-key", action="store_true",
                   help="hoard without the parcel key (what `isr schedule run` does)")
    credentials(p)

    def rule_options(p: argparse.ArgumentParser, required: bool) -> None:
        group = p.add_mutually_exclusive_group(required=required)
        group.add_argument("--location", metavar="TEXT", help="events whose LOCATION contains TEXT (any case)")
        group.add_argument("--category", metavar="NAME", help="events with the CATEGORY NAME (any case)")
        group.add_argument("--summary", metavar="REGEX", help="events whose title (SUMMARY) matches REGEX (any case)")

    p = cmd("site", cmd_site_ls, "which calendar events mean you will be at this PC (site rules)",
            "Site rules tell `isr schedule` which calendar events mean you will be at this PC: by the event's\n"
            "LOCATION, one of its CATEGORIES, or a pattern in its title. Any rule matching is enough.\n"
            "\n"
            "  isr site add --location \"Lab 4\"     meetings in Lab 4 happen at this PC\n"
            "  isr site add --summary '^Office day'\n"
            "  isr site ls\n"
            "  isr site rm 2")
    site_sub = p.add_subparsers(dest="site_command", metavar="ACTION")
    q = site_sub.add_parser("add", help="add a rule", description="Add a site rule (one of the options).")
    q.set_defaults(func=cmd_site_add)
    rule_options(q, required=True)
    q = site_sub.add_parser("rm", help="remove a rule", description="Remove a site rule by its number in "
                                                                    "`isr site ls`, or as it was added.")
    q.set_defaults(func=cmd_site_rm)
    q.add_argument("number", nargs="?", type=int, help="the rule's number in `isr site ls`")
    rule_options(q, required=False)
    q = site_sub.add_parser("ls", help="list the rules")
    q.set_defaults(func=cmd_site_ls)

    p = cmd("schedule", cmd_schedule_show, "hoard before your calendar says you will be at this PC",
            "Plan hoards from calendars: for each upcoming event that a site rule (`isr site`) places at this\n"
            "PC, start hoarding the parcel's newest version early enough to finish before the event starts:\n"
            "bytes missing here / measured throughput x (1 + margin) + overhead, ending lead_s before it.\n"
            "Hoards need no key (see `isr hoard --no-key`).\n"
            "\n"
            "  isr schedule calendar add ~/work.ics     a file, or an https:// URL (e.g. a published calendar)\n"
            "  isr schedule show                        the plan for the next days\n"
            "  isr schedule run                         do it: in the foreground, or as a service\n"
            "                                           (contrib/systemd/isr-schedule.service, doc/isrctl.md)\n"
            "  isr schedule set mode working-set        settings: `isr schedule set` lists them")
    schedule_sub = p.add_subparsers(dest="schedule_command", metavar="ACTION")
    q = schedule_sub.add_parser("calendar", help="add, remove or list calendars",
                                description="The calendars (iCalendar files or https URLs) that `isr schedule` reads.")
    q.set_defaults(func=cmd_calendar_ls)
    calendar_sub = q.add_subparsers(dest="calendar_command", metavar="ACTION")
    r = calendar_sub.add_parser("add", help="add a calendar file or https URL",
                                description="Add an iCalendar file (stored as an absolute path) or https URL; it is "
                                            "read once now to check it.")
    r.set_defaults(func=cmd_calendar_add)
    r.add_argument("source", help="a .ics file or an https:// URL")
    r.add_argument("--no-check", action="store_true", help="add it without reading it now")
    r = calendar_sub.add_parser("rm", help="remove a calendar")
    r.set_defaults(func=cmd_calendar_rm)
    r.add_argument("source", help="as `isr schedule calendar ls` shows it")
    r = calendar_sub.add_parser("ls", help="list the calendars")
    r.set_defaults(func=cmd_calendar_ls)
    q = schedule_sub.add_parser("set", help="show or change a setting",
                                description="Without arguments, list the settings; with NAME VALUE, change one.\n"
                                            "mode (full or working-set), margin (0.5 = +50 %), overhead_s, lead_s,\n"
                                            "horizon_days, assumed_bytes_per_s (until a hoard is measured),\n"
                                            "allday_start (08:00), timezone (default: this machine's), parcels\n"
                                            "(comma-separated; empty: all of yours), site (a label).",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    q.set_defaults(func=cmd_schedule_set)
    q.add_argument("name", nargs="?", help="the setting")
    q.add_argument("value", nargs="?", help="its new value")
    q = schedule_sub.add_parser("show", help="print the plan: events here, bytes missing, when each hoard starts",
                                description="The plan for the next days: each event at this PC, where and when, the "
                                            "bytes still missing here, when the hoard starts and is expected to "
                                            "finish, and a warning where there is not enough time.")
    q.set_defaults(func=cmd_schedule_show)
    q.add_argument("--days", type=float, metavar="N", help="look N days ahead (default: horizon_days, 7)")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(days=None, json=False)
    q = schedule_sub.add_parser("run", help="hoard as planned until stopped (foreground or service)",
                                description="Sleep until the next planned hoard start, hoard without the key (progress "
                                            "in the log, on stderr), plan again when a calendar or the schedule "
                                            "changes, a new version is checked in, or every --replan seconds. What "
                                            "was hoarded and the measured throughput survive restarts. SIGTERM or "
                                            "Ctrl-C stops it cleanly.")
    q.set_defaults(func=cmd_schedule_run)
    q.add_argument("--once", action="store_true", help="plan, run the hoards due now, print the plan and exit")
    q.add_argument("--replan", type=float, default=300.0, metavar="SECONDS",
                   help="plan again at least this often (default 300)")
    q.add_argument("--watch", type=float, default=30.0, metavar="SECONDS",
                   help="look for changed calendars and new versions this often (default 30)")

    p = cmd("stat", cmd_stat, "show local state: version, lock, dirty chunks, cache, hoard, memory image")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID (default: all with local state)")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = cmd("clean", cmd_clean, "remove a parcel's local state (and release its lock)")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID")
    p.add_argument("-f", "--force", action="store_true", help="even with local changes or an unreachable server")
    p.add_argument("--cache", action="store_true", help="also remove the chunk cache shared by all parcels")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")

    p = cmd("rollback", cmd_rollback, "make a new version with an older version's content")
    p.add_argument("parcel", help="parcel name or UUID")
    p.add_argument("version", type=int, help="the older version to go back to")
    credentials(p)

    p = cmd("lock", cmd_lock, "show who holds the lock; --force breaks it")
    p.add_argument("parcel", help="parcel name or UUID")
    p.add_argument("--force", action="store_true", help="break the lock (asks first)")
    p.add_argument("--reason", default="", help="recorded in the server's audit log")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")

    p = cmd("poweroff", cmd_poweroff, "forget the saved RAM: the next resume boots cold",
            "Power the VM off (a running one is stopped as if its plug were pulled). The version then checked\n"
            "in has no device state and an all-zero memory image, so the next resume boots it cold.")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID (default: the only one here)")
    p.add_argument("--no-checkin", action="store_true", help="keep the result here; `isr checkin` later")
    credentials(p)

    p = cmd("passwd", cmd_passwd, "change the parcel's passphrase (or switch to a key file)")
    p.add_argument("parcel", help="parcel name or UUID")
    p.add_argument("--new-passphrase-env", metavar="VAR", help="take the new passphrase from this variable")
    p.add_argument("--new-keyfile", metavar="FILE", help="protect the parcel with a new key file written here")
    credentials(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="isr: %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except LockRefused as exc:
        print(f"isr: {exc}", file=sys.stderr)
        return EXIT_LOCKED
    except LockBroken as exc:
        print(f"isr: {exc}", file=sys.stderr)
        return EXIT_LOCK_BROKEN
    except RemoteUnreachable as exc:
        print(f"isr: the server is unreachable: {exc} (for work without it see `isr resume --disconnected`)",
              file=sys.stderr)
        return EXIT_ERROR
    except (IsrError, ParcelError) as exc:
        print(f"isr: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("isr: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:
        print(f"isr: {exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
