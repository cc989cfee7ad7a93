"""`isr console`, `isr viewer`: see and use the VM of a parcel running at this site."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .. import console, paths
from .. import display as displaymod
from ..errors import SessionError, StateError
from ..localstate import ParcelState
from . import common


def _running(ref: str | None) -> tuple[ParcelState, dict[str, Any], str]:
    """The parcel's state, its session's record and its name; StateError if it does not run here."""
    state = common.local_state(ref, want_session=ref is None)
    checkout = state.checkout()
    name = checkout.name if checkout else state.parcel
    info = state.session_info()
    if info is None or not state.busy():
        raise StateError(f"{name} is not running at this site: `isr resume {name}` first")
    return state, info, name


def cmd_console(args: argparse.Namespace) -> int:
    _, info, name = _running(args.parcel)
    try:
        console.attach(Path(info["console"]), name)
    except OSError as exc:
        raise SessionError(f"cannot reach the console of {name} ({info['console']}): {exc.strerror or exc}") from None
    return 0


def cmd_viewer(args: argparse.Namespace) -> int:
    state, info, name = _running(args.parcel)
    recorded = info.get("vnc_display")
    if not recorded:
        raise StateError(f"{name} runs without a display (`isr resume --vnc none`, or its VM has none)")
    display = displaymod.load(recorded, paths.parcel_runtime_dir(state.parcel))
    command = None
    if os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"):
        command = displaymod.viewer_command(display)
    if args.print or command is None:
        for line in displaymod.how_to_connect(display):
            print(line)
        if command is None and not args.print:
            print(f"(no VNC viewer found here: install one of {', '.join(displaymod.VIEWERS)}, or use one elsewhere"
                  + (")" if os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
                     else "; and there is no graphical session: DISPLAY is not set)"))
        return 0
    if display.password is not None:
        print(f"password: {display.password}", file=sys.stderr)
    print(f"starting {' '.join(command)}", file=sys.stderr)
    try:
        return subprocess.run(command, check=False).returncode
    except OSError as exc:
        raise SessionError(f"cannot start {command[0]}: {exc.strerror or exc}") from None
