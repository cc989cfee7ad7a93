"""`isr stat --watch` and `isr top`: a live view of a parcel in use at this site (`isrctl.watch`)."""
from __future__ import annotations

import argparse
import json
from typing import Any

from isrprogress import LiveView, NullReporter

from .. import control
from .. import mount as mountmod
from .. import watch as watchmod
from ..errors import IsrError, StateError
from ..localstate import ParcelState
from . import common


def _status_source(state: ParcelState) -> Any:
    """A function returning vulpes's status report for the parcel, or None once it is no longer in use: through
    its running session, or the vulpes of its `isr mount`."""
    def status() -> dict[str, Any] | None:
        if state.session_info() is not None:
            try:
                report = control.request(state, "status", NullReporter(), timeout=10).get("vulpes")
            except IsrError:
                return None
            return dict(report) if report else None
        return mountmod.vulpes_status(state)
    return status


def cmd_top(args: argparse.Namespace) -> int:
    try:
        state = common.local_state(args.parcel, want_session=args.parcel is None)
    except StateError:
        # A parcel mounted here without a checkout (`isr mount` of the server's version) has no local state.
        mounted = mountmod.mounted_parcel(args.parcel)
        if mounted is None:
            raise
        state = mounted
    checkout = state.checkout()
    record = mountmod.info(state)
    name = checkout.name if checkout else record["name"] if record else state.parcel
    status = _status_source(state)
    if status() is None:
        raise StateError(f"{name} is not in use at this site: `isr stat --watch` follows a parcel that is resumed "
                         f"or mounted here")
    if args.interval <= 0:
        raise StateError("--interval must be a positive number of seconds")
    with LiveView(interactive=False if args.json else None) as view:
        def show(figures: dict[str, Any]) -> None:
            if args.json:
                print(json.dumps({"parcel": state.parcel, "name": name, **figures}), flush=True)
            else:
                view.show(watchmod.panel(name, figures), watchmod.line(name, figures))
        try:
            still = watchmod.watch(status, show, interval=args.interval, count=args.count)
        except KeyboardInterrupt:
            return 0
    if not still and not args.json:
        print(f"{name} is no longer in use at this site")
    return 0
