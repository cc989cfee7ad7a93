"""`isr hoard`: fetch a parcel ahead of time."""
from __future__ import annotations

import argparse
import sys
import time

from isrprogress import human_bytes

from .. import hoard as hoardmod
from .. import paths
from .. import schedule as schedulemod
from ..checkout import Client
from ..errors import StateError
from ..keyhoard import hoard_with_key
from . import common


def cmd_hoard(args: argparse.Namespace) -> int:
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


def _note_throughput(nbytes: int, seconds: float) -> None:
    """A hoard's transfer rate also informs the hoard scheduler's plans."""
    with schedulemod.RunnerState.updating(paths.schedule_state_file()) as state:
        state.add_sample(nbytes, seconds)
