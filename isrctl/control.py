"""A running session's control socket: the server side in the session, the client side in `isr`.

The protocol is JSON lines on a Unix socket in the session's runtime directory (mode 0600). A request is
``{"op": "status"}``, ``{"op": "suspend", "checkin": true}``, ``{"op": "poweroff", "checkin": ..., "wait": 30,
"force": false}`` (ask the guest to shut down and wait ``wait`` seconds before pulling the plug, or pull it at
once),
``{"op": "continue"}`` (go on after a pause for lack of room) or ``{"op": "sync"}`` (upload what is dirty); a
suspend or poweroff may say how long the requesting command had run when it asked (``"age": 0.12``, seconds),
so that the time to the safe state it reports counts from the command's start;
progress streams back as the reporter's JSON messages (`progress.JsonReporter`), and the answer ends the
exchange: ``{"ok": true, "result"|"status": {...}}`` or ``{"ok": false, "error": "...", "kind": ...}``.
"""
from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isrprogress import JsonReporter, Replayer, Reporter

from .errors import LockBroken, SessionError
from .paths import listen_private

if TYPE_CHECKING:
    from .localstate import ParcelState

#: The control socket, in the session's runtime directory.
CONTROL_SOCKET = "session.sock"
#: How long `isr poweroff` lets the guest shut itself down (ACPI power button) before pulling the plug: a
#: poweroff request's ``wait`` when it gives none.
POWEROFF_WAIT = 30.0


@dataclass
class Request:
    """One request asked of a session, handed from the control thread to its main thread."""

    op: str                      # "suspend", "poweroff", "continue", "sync"
    checkin: bool
    reporter: Reporter
    done: threading.Event = field(default_factory=threading.Event)
    answered: threading.Event = field(default_factory=threading.Event)  # the requester has the result
    result: dict[str, Any] | None = None
    error: str | None = None
    kind: str | None = None
    #: poweroff: how long the guest may take to shut down when asked (None: `POWEROFF_WAIT`), or
    #: pull the plug at once (``force``).
    wait: float | None = None
    force: bool = False
    #: how long the requesting command had run when it asked (None: not said)
    age: float | None = None


class ControlServer:
    """The session's control socket: JSON lines. ``status`` is answered at once; the other requests are
    handed to the session's main thread, whose progress streams back on the same connection, ending with
    ``{"ok": ..., "result"|"error": ...}``."""

    def __init__(self, path: Path, *, status: Callable[[], dict[str, Any]],
                 submit: Callable[[Request], None]) -> None:
        self.path = path
        self.status = status
        self.submit = submit
        self.listener = listen_private(path, 8)
        threading.Thread(target=self._accept, name="control-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="control", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        lock = threading.Lock()

        def write(text: str) -> None:
            with lock:
                with contextlib.suppress(OSError):
                    conn.sendall(text.encode())

        try:
            with conn, conn.makefile("rb") as lines:
                for line in lines:
                    try:
                        request = json.loads(line)
                        op = request["op"]
                    except (ValueError, KeyError, TypeError):
                        write(json.dumps({"ok": False, "error": "a request is a JSON object with \"op\""}) + "\n")
                        continue
                    if op == "status":
                        write(json.dumps({"ok": True, "status": self.status()}) + "\n")
                    elif op in ("suspend", "poweroff", "continue", "sync"):
                        req = Request(op, bool(request.get("checkin", True)), JsonReporter(write),
                                      wait=_seconds(request.get("wait")), force=bool(request.get("force", False)),
                                      age=_seconds(request.get("age")))
                        self.submit(req)
                        req.done.wait()
                        try:
                            write(json.dumps({"ok": req.error is None, "result": req.result, "error": req.error,
                                              "kind": req.kind}) + "\n")
                        finally:
                            req.answered.set()
                    else:
                        write(json.dumps({"ok": False, "error": f"unknown op {op!r}"}) + "\n")
        except OSError:
            pass

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _seconds(value: Any) -> float | None:
    """A number of seconds from a request (None if absent or not a finite number >= 0)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
        return None
    return float(value)


def request(state: ParcelState, op: str, reporter: Reporter, *, timeout: float | None = None,
            **fields: Any) -> dict[str, Any]:
    """Send one request to the parcel's running session, replaying its progress into ``reporter``.

    Returns the ``result`` (or ``status``). Raises SessionError if no session runs or it reports an error.
    """
    info = state.session_info()
    if info is None:
        raise SessionError(f"no session of parcel {state.parcel} is running at this site")
    replay = Replayer(reporter)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(info["control"])
            sock.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
            with sock.makefile("rb") as lines:
                for line in lines:
                    message = json.loads(line)
                    if replay.feed(message):
                        continue
                    if not message.get("ok"):
                        text = str(message.get("error") or f"{op} failed")
                        raise LockBroken(text) if message.get("kind") == "LockBroken" else SessionError(text)
                    return dict(message.get("result") or message.get("status") or {})
    except OSError as exc:
        raise SessionError(f"cannot reach the session of {state.parcel} ({info.get('control')}): {exc}") from None
    finally:
        replay.close()
    raise SessionError(f"the session of {state.parcel} hung up during {op}; see {state.dir / 'session.log'}")
