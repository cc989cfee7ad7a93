"""Where a session's process runs: in the foreground of `isr resume`, or detached from it.

Either way the session (`session.Session`) is a process of its own, in a session of its own: a Ctrl-C
typed at the terminal goes to the terminal's foreground process group, and QEMU and vulpes must not get
it. `isr resume` starts ``python -m isrctl.detach`` with the options on stdin and the keys through an
inherited pipe, relays its progress until the guest runs, and then either exits (``--detach``) or stays
in the foreground, turning Ctrl-C, SIGTERM and SIGHUP into a suspend request (`control.request`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isrprogress import JsonReporter, Replayer, Reporter, TerminalReporter

from . import keys as keymod
from . import policy as policymod
from .control import Request, request
from .errors import IsrError, LockBroken, LockRefused, SessionError
from .localstate import DAMAGED, ParcelState

if TYPE_CHECKING:  # the session's modules are imported by the session's process alone (`isr suspend` waits here)
    from parcels.parcel import ParcelKeys

log = logging.getLogger(__name__)


@dataclass
class SessionOptions:
    """Everything a session needs besides the keys (JSON-serializable, for a detached session): what `isr
    resume` hands the session's process, here so that `isr resume` need not import the session itself."""

    parcel: str                 # UUID
    name: str
    policy: str = policymod.DEFAULT
    writeback: bool = False
    writeback_rate: int = policymod.DEFAULT_WRITEBACK_RATE
    disconnected: bool = False
    vnc: str = "auto"
    accel: str = "tcg"
    lookaside: list[str] = field(default_factory=list)
    #: Check in when the guest powers itself off (a suspend or poweroff request says for itself).
    checkin_on_poweroff: bool = True

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SessionOptions:
        return cls(**data)


def wait_for_exit(pid: int, timeout: float = 120.0) -> bool:
    """Wait until process ``pid`` is gone; True if it went within ``timeout`` seconds.

    Woken by the exit itself through a pidfd (readable once the process has ended), so that `isr suspend`
    returns the moment the session is gone; without pidfds (an old kernel), by looking every 50 ms."""
    deadline = time.monotonic() + timeout
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:
        fd = None
    try:
        while process_alive(pid):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if fd is None:
                time.sleep(min(left, 0.05))
            elif select.select([fd], [], [], left)[0]:
                return True
        return True
    finally:
        if fd is not None:
            os.close(fd)


def _stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name, from the state letter on (the name is in
    parentheses and may itself hold spaces). Raises OSError."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped by whoever adopted it) counts as gone."""
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        return _stat_fields(pid)[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True


def process_age() -> float | None:
    """How long this process has run, to the kernel's clock tick (its start in /proc/self/stat against
    CLOCK_BOOTTIME), or None where that cannot be read."""
    try:
        ticks = int(_stat_fields("self")[19])           # starttime, the stat file's 22nd field
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class _LogRelay:
    """What a running session says (its messages, not its log records) goes to its log; `isr resume` in the
    foreground passes it on as it comes, so that its user learns at once that the VM paused (a full cache)."""

    def __init__(self, path: Path, offset: int) -> None:
        self.path = path
        self.offset = offset

    def say_new(self, reporter: Reporter) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if line and not line[:4].isdigit():      # its messages, not its log records
                reporter.say(line)


class SessionProcess:
    """The process a session runs in (``python -m isrctl.detach``), started before `isr resume` knows what it
    is to run: the interpreter's start and the session's imports (0.15-0.25 s) then overlap the command's own
    work with the server. `spawn_detached` hands it the options and keys; one that was not handed them (the
    command failed first) is killed when this context ends, before it has done anything. Until it has its
    options it writes to this command's stderr; then to the session's log."""

    def __init__(self) -> None:
        read_fd, self._key_write = os.pipe()
        try:
            # Its own session: the terminal's Ctrl-C belongs to `isr resume`, not to the running VM.
            self.proc = subprocess.Popen([sys.executable, "-m", "isrctl.detach"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, pass_fds=(read_fd,), start_new_session=True)
        except BaseException:
            os.close(self._key_write)
            raise
        finally:
            os.close(read_fd)
        #: The keys' pipe as the process has it (pass_fds keeps the number).
        self.key_fd = read_fd
        self.handed = False

    def hand(self, options: SessionOptions, parcel_keys: ParcelKeys) -> None:
        """Give the process its options and, through their own pipe, the keys (64 bytes: never blocks). A
        process that has already exited is not an error here: the caller reads its end (no "ready")."""
        assert self.proc.stdin is not None and not self.handed
        self.handed = True
        try:
            with contextlib.suppress(BrokenPipeError):
                os.write(self._key_write, keymod.pack(parcel_keys))
                self.proc.stdin.write((json.dumps({"options": options.to_json(), "key_fd": self.key_fd})
                                       + "\n").encode())
                self.proc.stdin.close()
        finally:
            os.close(self._key_write)

    def __enter__(self) -> SessionProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.handed:
            return
        self.proc.kill()
        self.proc.wait()
        os.close(self._key_write)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def run_foreground(options: SessionOptions, parcel_keys: ParcelKeys, reporter: Reporter,
                   process: SessionProcess | None = None) -> int:
    """`isr resume` without --detach: the session runs until the VM ends; Ctrl-C (SIGINT), SIGTERM or a
    closed terminal (SIGHUP) suspend it.

    The session itself is a separate process (as with --detach) in a session of its own: a Ctrl-C typed
    at the terminal goes to the whole foreground process group, and QEMU and vulpes must not get it. This
    process relays the start, waits, turns the signals into a suspend request and relays its progress.
    Returns 0 when the VM was suspended or powered off cleanly, 1 otherwise.
    """
    state = ParcelState(options.parcel)
    info = spawn_detached(options, parcel_keys, reporter, process=process)
    pid = int(info["pid"])
    log_path = state.dir / "session.log"
    try:
        log_offset = log_path.stat().st_size
    except OSError:
        log_offset = 0
    reporter.say("running; Ctrl-C or `isr suspend` suspends it")
    relay = _LogRelay(log_path, log_offset)
    wanted: list[int] = []

    def interrupted(signum: int, frame: object) -> None:
        wanted.append(signum)

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, interrupted) for sig in signals}
    try:
        asked = False
        while process_alive(pid):
            if not asked:
                relay.say_new(reporter)
            if wanted and not asked:
                asked = True
                reporter.say("suspending")
                try:
                    request(state, "suspend", reporter, checkin=True)
                except SessionError as exc:
                    if process_alive(pid):
                        reporter.say(f"isr: {exc}")
                        asked = False
                        wanted.clear()
                        continue
                    raise
            time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not asked:
        # The session ended by itself (the guest powered off, or QEMU or vulpes died): the rest of what it said.
        relay.say_new(reporter)
    change = state.effective_local_change()
    return 1 if change is not None and change.state == DAMAGED else 0


def spawn_detached(options: SessionOptions, parcel_keys: ParcelKeys, reporter: Reporter,
                   timeout: float = 3600.0, process: SessionProcess | None = None) -> dict[str, Any]:
    """Start a detached session process (in ``process``, started earlier, or a new one) and relay its
    progress until the guest runs.

    Returns the session's start information. Raises SessionError with the session's own message if it
    fails to start.
    """
    state = ParcelState(options.parcel)
    state.dir.mkdir(parents=True, exist_ok=True)
    log_path = state.dir / "session.log"
    if process is None:
        process = SessionProcess()
    process.hand(options, parcel_keys)
    proc = process.proc
    replay = Replayer(reporter)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if replay.feed(message):
                continue
            if "ready" in message:
                return dict(message["ready"])
            if "error" in message:
                proc.wait(timeout=120)
                kind = message.get("kind")
                if kind == "LockRefused":
                    raise LockRefused(str(message["error"]), message.get("holder") or {})
                if kind == "LockBroken":
                    raise LockBroken(str(message["error"]))
                raise SessionError(str(message["error"]))
    finally:
        replay.close()
        proc.stdout.close()
    proc.wait(timeout=60)
    tail = ""
    with contextlib.suppress(OSError):
        tail = log_path.read_text(errors="replace")[-3000:]
    raise SessionError(f"the session process exited with code {proc.returncode} before the VM ran:\n{tail}")


def _detached_main() -> int:
    """Entry of ``python -m isrctl.detach``: options on stdin, keys on an inherited fd, reports on stdout
    until the VM runs; then stdout is pointed at the session log and the session serves."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("httpx", "httpcore", "qemu.qmp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "w", buffering=1)

    def write(text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            out.write(text)
            out.flush()

    reporter = JsonReporter(write)
    try:
        # Both from the session's module: run as ``python -m isrctl.detach`` this module is ``__main__``, and
        # the session's options are `isrctl.detach.SessionOptions`, a second copy of this one's.
        from .session import Session, SessionOptions

        line = sys.stdin.readline()
        if not line:  # `isr resume` failed before it had the options (and said why): nothing to run
            return 0
        request_data = json.loads(line)
        options = SessionOptions.from_json(request_data["options"])
        _write_to_log(2, options.parcel)
        parcel_keys = keymod.read_keys_fd(int(request_data["key_fd"]))
        session = Session(options, parcel_keys, reporter)
        info = session.start()
    except IsrError as exc:
        write(json.dumps({"error": str(exc), "kind": type(exc).__name__,
                          "holder": getattr(exc, "holder", None)}) + "\n")
        return 1
    except Exception as exc:
        log.exception("session start failed")
        write(json.dumps({"error": f"the session failed to start: {exc!r}"}) + "\n")
        return 1
    write(json.dumps({"ready": info}) + "\n")
    out.close()
    # From now on nobody reads stdout: what the session says goes to its log.
    _write_to_log(1, options.parcel)
    session.reporter = TerminalReporter(interactive=False)

    def terminate(signum: int, frame: object) -> None:
        request = Request("suspend", True, session.reporter)
        request.answered.set()  # nobody waits for an answer: the log has it
        session.submit(request)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    code = session.serve()
    # The session is over and has closed what it opened (its other threads are daemons with nothing left to
    # do). What would follow is the interpreter's teardown of every module and object, 0.04-0.14 s that `isr
    # suspend` waits for; what is buffered is flushed, and the process leaves without it.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _write_to_log(fd: int, parcel: str) -> None:
    """Point ``fd`` (1 or 2) of the session's process at the parcel's session log."""
    log_fd = os.open(ParcelState(parcel).dir / "session.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(log_fd, fd)
    os.close(log_fd)


if __name__ == "__main__":
    sys.exit(_detached_main())
