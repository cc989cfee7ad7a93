"""`isr ls`, `isr stat`, `isr checkout`, `isr discard`, `isr lock`, `isr clean`, `isr rollback`: the parcels
here and on the server."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil


from isrprogress import human_bytes

from .. import checkin as checkinmod
from .. import compat
from .. import paths
from ..checkout import Client, describe_holder, ensure_checkout, holding_lock, when
from ..errors import IsrError, StateError
from ..localstate import DAMAGED, LocalChange, local_parcels
from ..remote import RemoteError
from ..rollback import rollback
from ..status import parcel_status
from ..vulpes import cache_usage
from . import common
from .watch import cmd_top


def cmd_ls(args: argparse.Namespace) -> int:
    with common.quick_client() as client:
        parcels = client.remote.parcels()
        server = client.config.server
    local = {s.parcel: s for s in local_parcels()}
    lost = common.lost_locks(list(local.values()), server, parcels)
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
                notes.append(common.stale_lock_note(p["name"], lost[p["id"]], change))
            elif checkout and checkout.lock:
                here += ", lock held"
            if state.session_info() is not None:
                here += ", running"
            elif change is not None:
                here += f", {change.state}"
        rows.append([p["name"], str(p.get("current_version", 0)), lock_text, here])
    common.print_table(rows)
    for note in notes:
        print(note)
    if args.long:
        for p in parcels:
            print(f"\n{p['name']}  {p['id']}  created {when(p.get('created'))}")
            with common.quick_client() as client:
                versions = client.remote.versions(p["id"])["versions"]
            for v in versions:
                print(f"  v{v['version']:<4} {when(v.get('created'))}  by {v.get('user', '?')} from "
                      f"{v.get('host', '?')} ({v.get('site') or '-'})  {v.get('chunk_count', 0)} chunks, "
                      f"{human_bytes(v.get('chunk_bytes') or 0)}")
    return 0


def cmd_stat(args: argparse.Namespace) -> int:
    if args.watch:
        return cmd_top(args)
    states = [common.local_state(args.parcel)] if args.parcel else local_parcels()
    results = [parcel_status(s) for s in states]
    lost, unasked = common.ask_lost_locks(states)
    for state, info in zip(states, results):
        if info.get("lock") is None:
            continue
        if unasked:
            info["lock_unconfirmed"] = unasked
        elif state.parcel in lost:
            info["stale_lock"] = {**info["lock"], "why": lost[state.parcel]}
            info["lock"] = None
    usage = cache_usage(paths.chunk_cache_dir(), limit=common.cache_limit())
    if args.json:
        cache = {**dataclasses.asdict(usage), "clean_bytes": usage.clean_bytes}
        print(json.dumps({"parcels": results, "cache": cache}, indent=1, default=str))
        return 0
    print(f"cache     {usage.dir}: {usage.objects} chunk objects, {human_bytes(usage.bytes)} "
          f"({human_bytes(usage.clean_bytes)} clean, {human_bytes(usage.pinned_bytes)} not yet uploaded or pinned)")
    print(f"          room for {human_bytes(usage.room)} more: {human_bytes(usage.fs_free)} free on its file system"
          + (f", limit {human_bytes(usage.limit)}" if usage.limit else ", no limit"))
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
        print(f"local     {common.describe_change(change, info['version'])}")
        if stale:
            print(f"note      {common.stale_lock_note(info['name'], stale['why'], change)}")
        images = info.get("images", {})
        if "changed_chunks" in images.get("disk", {}):
            print(f"dirty     {images['disk']['changed_chunks']} disk and {images['memory']['changed_chunks']} memory "
                  f"chunks differ from version {info['version']}")
        if info.get("not_uploaded_bytes"):
            print(f"upload    {human_bytes(info['not_uploaded_bytes'])} only at this site (not yet uploaded)")
        if "memory" in images:
            mem = images["memory"]
            stored = mem.get("stored_bytes")
            print(f"memory    image {human_bytes(mem['size'])}, {mem.get('chunks', mem['base_chunks'])} chunks stored"
                  + (f" ({human_bytes(stored)} compressed and encrypted)" if stored is not None else ""))
        if "hoard" in info:
            h = info["hoard"]
            print(f"hoard     version {h['version']}: {h['cached']} of {h['chunks']} chunks in the cache "
                  f"({h['fraction']:.0%})")
        if info.get("mount"):
            m = info["mount"]
            print(f"mount     {m['dir']}: version {m['version']}, {'read-write' if m['rw'] else 'read-only'} "
                  f"(vulpes pid {m['pid']}; `isr umount {m['dir']}` ends it)")
        session = info.get("session")
        if session:
            status = info.get("session_status", {})
            print(f"session   running (pid {session['pid']}, policy {session.get('policy')}), resumed in "
                  f"{session.get('resume_seconds')} s")
            print(f"          display {status.get('display') or 'vnc ' + str(session.get('vnc'))}, "
                  f"console {session.get('console')}")
            if session.get("forwards"):
                print(f"          forwards {' '.join(session['forwards'])}")
            if status.get("paused"):
                print(f"          {status['paused']['message']}")
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


def cmd_checkout(args: argparse.Namespace) -> int:
    reporter = common.make_reporter(args)
    with Client() as client:
        parcel, state = common.server_state(client, args.parcel)
        with state.locked():
            change = state.effective_local_change()
            if change is not None:
                raise StateError(f"{parcel['name']} is already checked out here with local changes "
                                 f"({common.describe_change(change, state.require_checkout().version)}): resume, check in "
                                 f"or discard them")
            parcel_keys = client.unlock(parcel["id"], common.parcel_credential(args, parcel["name"]), state)
            first = state.checkout() is None
            checkout, current = ensure_checkout(client, state, parcel)
            if checkout.version != current or not state.keyring_path("disk").exists():

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
        return common.finish(args, reporter,
                             f"checked out {parcel['name']} version {checkout.version}; this site holds the lock",
                             common.parcel_result(state))


def cmd_discard(args: argparse.Namespace) -> int:
    state = common.local_state(args.parcel)
    checkout = state.require_checkout()
    with state.locked():
        change = state.effective_local_change()
        if change is None:
            print(f"{checkout.name}: nothing to discard (same as version {checkout.version})")
            return 0
        if change.state != DAMAGED:
            common.confirm(f"Drop the changes to {checkout.name} made here since version {checkout.version}?", args)
        state.restore_base()
        held = ""
        if checkout.lock is not None:
            lost, unasked = common.ask_lost_locks([state])
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
        common.confirm(f"Break the lock of {parcel['name']} held by {describe_holder(holder)}? That site's changes since "
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
        common.confirm(f"Remove the chunk cache {paths.chunk_cache_dir()}?", args)
        shutil.rmtree(paths.chunk_cache_dir(), ignore_errors=True)
        print(f"removed {paths.chunk_cache_dir()}")
        if not args.parcel:
            return 0
    if not args.parcel:
        raise StateError("name the parcel to clean (or --cache for the chunk cache)")
    state = common.local_state(args.parcel)
    checkout = state.checkout()
    name = checkout.name if checkout else state.parcel
    with state.locked():
        change = state.effective_local_change()
        if change is not None and not args.force:
            raise StateError(f"{name} has local changes ({common.describe_change(change, checkout.version if checkout else 0)})"
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
    reporter = common.make_reporter(args)
    with Client() as client:
        parcel, state = common.server_state(client, args.parcel)
        with state.locked():
            if state.effective_local_change() is not None:
                raise StateError(f"{parcel['name']} has local changes here: check them in or discard them first")
            parcel_keys = client.unlock(parcel["id"], common.parcel_credential(args, parcel["name"]), state)
            with holding_lock(client, state, parcel) as (lock, current, had_lock):
                new_version = rollback(client, parcel, parcel_keys, lock.nonce, current, args.version)
                reporter.say(f"version {new_version} of {parcel['name']} now holds the content of version "
                             f"{args.version}")
                if had_lock:
                    client.download_version(state, new_version, parcel_keys, reporter=reporter)
                    checkout = state.require_checkout()
                    checkout.version = new_version
                    state.save_checkout(checkout)
    return common.finish(args, reporter, "", common.parcel_result(state, parcel["name"], committed=new_version,
                                                                  content_of=args.version))


