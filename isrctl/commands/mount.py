"""`isr mount` and `isr umount`: a parcel's disk image without its VM (`isrctl.mount`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from .. import config as configmod
from .. import mount as mountmod
from ..checkout import Client
from ..errors import StateError
from . import common


def cmd_mount(args: argparse.Namespace) -> int:
    reporter = common.make_reporter(args)
    directory = Path(args.dir)
    try:
        state = common.local_state(args.parcel)
    except StateError:
        state = None
    checkout = state.checkout() if state is not None else None
    if state is not None and checkout is not None and state.keyring_path("disk").exists():
        # Checked out here: its local state, with no server needed (its key envelope is kept here).
        parcel = {"id": state.parcel, "name": checkout.name}
        keys = common.unlock_local(state, args, checkout.name)
        record = mountmod.mount(state, parcel, keys, directory, rw=args.rw, client=None, cfg=configmod.load())
    else:
        with Client() as client:
            parcel, state = common.server_state(client, args.parcel)
            keys = client.unlock(parcel["id"], common.parcel_credential(args, parcel["name"]), state)
            record = mountmod.mount(state, parcel, keys, directory, rw=args.rw, client=client, cfg=client.config)
    how = "read-write" if record["rw"] else "read-only"
    text = (f"mounted {record['name']} version {record['version']} {how} on {record['dir']}: its disk image is "
            f"{record['disk']} (`mount -o loop{'' if record['rw'] else ',ro'} {record['disk']} /mnt` reaches the "
            f"guest's file system); `isr umount {record['dir']}` ends it")
    if record["rw"]:
        text += f". This counts as a session: after the umount, `isr checkin {record['name']}` commits what was written"
    return common.finish(args, reporter, text, common.parcel_result(state, record["name"], mount=record))


def cmd_umount(args: argparse.Namespace) -> int:
    reporter = common.make_reporter(args)
    record = mountmod.umount(Path(args.dir))
    name = record["name"]
    text = f"unmounted {name} from {record['dir']}"
    if record["crashed"]:
        text += (f"; its vulpes had exited before (see {Path(record['control']).name} and vulpes.log in its state "
                 f"directory)" + (f": the local state is damaged, `isr discard {name}` goes back to the last "
                                  f"version" if record["rw"] else ""))
    elif record["rw"]:
        text += (f"; {record['changed_chunks']} chunks differ from the version checked out: `isr checkin {name}` "
                 f"commits them" if record["changed_chunks"] else "; nothing was written")
    result = {key: record[key] for key in ("parcel", "name", "dir", "rw", "version", "changed_chunks", "crashed",
                                           "local")}
    return common.finish(args, reporter, text, result)
