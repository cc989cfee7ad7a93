"""`isr hoard`: fetch a parcel ahead of time."""
from __future__ import annotations

import argparse
import json
import sys
import time

from isrprogress import human_bytes

from .. import hoarded, paths
from ..checkout import Client
from ..errors import StateError
from ..keyhoard import hoard_with_key
from . import common


def cmd_hoard(args: argparse.Namespace) -> int:
    if args.list:
        return _list(args)
    if not args.parcel:
        raise StateError("name the parcel: `isr hoard PARCEL` (or `isr hoard --list`)")
    if args.check or args.drop:
        return _check_or_drop(args)
    reporter = common.make_reporter(args)
    keyless = args.no_key
    if not keyless and not (args.passphrase_file or args.passphrase_env or args.key_file) and not sys.stdin.isatty():
        reporter.say("no key given and no terminal to ask for one: hoarding without the key (--no-key)")
        keyless = True
    with Client() as client:
        parcel, state = common.server_state(client, args.parcel)
        if state.busy():
            raise StateError(f"{parcel['name']} is running at this site: a running session fetches what it needs "
                             f"(resume with --policy lazy-ws to hoard in the background)")
        mode = "working-set" if args.working_set else "full"
        if keyless:
            # Imported here: a hoard with the key needs neither vulpes-fetch's driver nor the scheduler (whose
            # calendar parsing takes a fifth of `isr`'s start).
            from .. import hoard as hoardmod

            result = hoardmod.hoard(client, parcel, mode, reporter)
            _note_throughput(result.bytes, result.seconds)
            return common.finish(
                args, reporter, f"hoarded {parcel['name']} version {result.need.version}: {result.chunks} chunks and "
                                f"{len(result.need.blobs)} boot files fetched ({human_bytes(result.bytes)} in "
                                f"{result.seconds:.1f} s); {result.need.chunk_count} chunks are now here",
                common.parcel_result(state, parcel["name"], hoard={
                    "version": result.need.version, "mode": mode, "keyless": True,
                    "chunks": result.need.chunk_count, "chunks_fetched": result.chunks,
                    "bytes_fetched": result.bytes, "seconds": round(result.seconds, 3)}))
        with state.locked():
            parcel_keys = client.unlock(parcel["id"], common.parcel_credential(args, parcel["name"]), state)
            started = time.monotonic()
            version, status = hoard_with_key(client, parcel, state, parcel_keys, working_set_only=args.working_set,
                                             reporter=reporter)
    return common.finish(args, reporter, "", common.parcel_result(state, parcel["name"], hoard={
        "version": version, "mode": mode, "keyless": False, "chunks": int(status.get("chunks_total", 0)),
        "chunks_fetched": None, "bytes_fetched": int(status.get("bytes_fetched", 0)),
        "seconds": round(time.monotonic() - started, 3)}))


def _list(args: argparse.Namespace) -> int:
    with common.quick_client() as client:
        found = hoarded.list_hoarded(client)
    if args.json:
        print(json.dumps({"cache": str(paths.chunk_cache_dir()), "parcels": [h.to_json() for h in found]}, indent=1))
        return 0
    rows = [["NAME", "VERSION", "CHUNKS HERE", "BYTES HERE"]]
    for h in found:
        share = f" ({h.cached / h.chunks:.0%})" if h.chunks else ""
        rows.append([h.name, str(h.version), f"{h.cached} of {h.chunks}{share}",
                     f"{human_bytes(h.cached_bytes)} of {human_bytes(h.bytes)}"])
    common.print_table(rows)
    if not found:
        print("(no parcel with a version on the server)")
    return 0


def _check_or_drop(args: argparse.Namespace) -> int:
    reporter = common.make_reporter(args)
    with Client() as client:
        parcel, state = common.server_state(client, args.parcel)
        name = parcel["name"]
        if args.drop:
            dropped = hoarded.drop(client, parcel)
            kept = [f"{dropped.shared} shared with another parcel here"] if dropped.shared else []
            kept += [f"{dropped.pinned} not uploaded yet (or pinned for a disconnected session)"] if dropped.pinned else []
            return common.finish(args, reporter, f"dropped {dropped.objects} chunks of {name} from the cache "
                                                 f"({human_bytes(dropped.bytes)} freed)"
                                                 + (f"; kept {' and '.join(kept)}" if kept else ""),
                                 common.parcel_result(state, name, drop=dropped.to_json()))
        checked = hoarded.check(client, parcel)
    result = checked.result
    text = (f"checked {result.present} cached chunks of {name} ({human_bytes(result.bytes)}): "
            + ("all intact" if not result.bad else f"{len(result.bad)} bad, quarantined; they are fetched again "
                                                   f"when needed")
            + (f"; {result.absent} are not in the cache" if result.absent else ""))
    if checked.local_only:
        text += (f"; {len(checked.local_only)} of the bad ones were written here and not uploaded yet: that data is "
                 f"lost (`isr discard {name}` goes back to the last version checked in)")
    if result.errors:
        text += f"; {result.errors} could not be read (see the messages above)"
    common.finish(args, reporter, text, common.parcel_result(state, name, check=checked.to_json()))
    if result.bad or result.errors:
        print(f"isr: {len(result.bad) + result.errors} chunks of {name} in the cache were bad or unreadable",
              file=sys.stderr)
        return 1
    return 0


def _note_throughput(nbytes: int, seconds: float) -> None:
    """A hoard's transfer rate also informs the hoard scheduler's plans."""
    from .. import schedule as schedulemod

    with schedulemod.RunnerState.updating(paths.schedule_state_file()) as state:
        state.add_sample(nbytes, seconds)
