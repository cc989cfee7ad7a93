"""The resume session: the process that runs a parcel's VM at this site, from resume to suspend.

`isr resume` is the session. In order, it

1. takes the parcel's state lock at this site (one session per parcel) and the server's lock (a refusal
   names the holder), or, disconnected, checks that this site still holds it;
2. fetches and verifies the version's manifest and checks that this PC can run it (QEMU version, machine
   type, CPU model, RAM) before anything big is downloaded; then the keyrings and the device state
   (`checkout.Client.download_version`), unless this site already has them;
3. starts vulpes on a mountpoint in the runtime directory (disk and memory images, access trace);
4. applies the policy (`policy`): hoard everything first, or report how much an earlier hoard got, or
   hoard the working set in the background, or trickle writeback;
5. starts QEMU with the parcel's pinned virtual hardware: disk = vulpes ``disk``, RAM = vulpes ``memory``
   (``memory-backend-file``, ``share=on``, migration capability ``x-ignore-shared``, so the saved state
   is only the device state and RAM is fetched lazily, chunk by chunk), a VNC display and a serial console;
   it loads the saved device state (through a pipe: plaintext state never touches a disk) or boots cold;
6. serves until the VM is suspended or powered off: a control socket (``isr suspend``, ``isr poweroff``,
   ``isr stat``), a console socket relaying the serial console, lock renewals, and a watch on QEMU and
   vulpes (if one is killed, the local state is marked damaged and the lock kept: `isr discard` goes
   back to the last version).

Suspend: stop the guest, save the device state (sealed at once), make the memory file and every vulpes
write durable, quit QEMU, record the working set from the trace, and (by default) let vulpes upload the
new chunks, unmount, and commit the new version (`checkin.checkin`), releasing the lock.

A session runs in the foreground of `isr resume` (Ctrl-C suspends), or detached (``--detach``): then
`isr resume` starts ``python -m isrctl.session`` with the options on stdin and the keys through an
inherited pipe, relays its progress, and exits once the guest runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parcels import seal
from parcels.errors import ParcelError
from parcels.keyring import Keyring, encode_stream
from parcels.manifest import IMAGES, Manifest, open_blob, open_manifest, utc_now
from parcels.parcel import ParcelKeys
from parcels.chunk import chunk_count

from . import compat, paths, workingset
from . import config as configmod
from . import keys as keymod
from . import policy as policymod
from .checkin import checkin as do_checkin
from .checkin import compare as compare_changes
from .checkout import Client, boot_blobs, ensure_checkout
from .errors import IsrError, LockBroken, LockRefused, SessionError, StateError, VMError
from .localstate import DAMAGED, POWEROFF, RUNNING, SUSPENDED, LocalChange, ParcelState, write_file
from .progress import JsonReporter, Reporter, TerminalReporter
from .qemu import VM, VMConfig, kvm_works
from .remote import RemoteError, RemoteUnreachable
from .vulpes import Vulpes

log = logging.getLogger(__name__)

CONTROL_SOCKET = "session.sock"
CONSOLE_SOCKET = "console.sock"
VNC_SOCKET = "vnc.sock"
_CONSOLE_HISTORY = 1 << 20
_CONSOLE_SEND_TIMEOUT = 10.0
_POLL = 0.2
#: How long an ending session waits for its control thread to hand the result to the requester.
_ANSWER_TIMEOUT = 10.0
_RENEW_DEFAULT = 60.0


class SuspendAborted(SessionError):
    """A suspend failed before the state was saved; the VM and the session keep running."""


@dataclass
class SessionOptions:
    """Everything a session needs besides the keys (JSON-serializable, for a detached session)."""

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


@dataclass
class _Request:
    op: str                      # "suspend", "poweroff"
    checkin: bool
    reporter: Reporter
    done: threading.Event = field(default_factory=threading.Event)
    answered: threading.Event = field(default_factory=threading.Event)  # the requester has the result
    result: dict[str, Any] | None = None
    error: str | None = None
    kind: str | None = None


def _memfd(name: str, data: bytes) -> tuple[int, Path]:
    """An anonymous in-memory file holding ``data`` and a path other processes (QEMU) can open it by, so
    plaintext boot files never touch a disk."""
    fd = os.memfd_create(f"isr-{name}", os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    return fd, Path(f"/proc/{os.getpid()}/fd/{fd}")


def _free_vnc_display() -> str:
    for display in range(0, 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 5900 + display))
            except OSError:
                continue
            return f"127.0.0.1:{display}"
    raise SessionError("no free VNC display on 127.0.0.1:5900-5999: give --vnc HOST:DISPLAY or --vnc unix")


class ConsoleRelay:
    """Relays the guest's serial console to whoever connects to ``path`` (one client at a time).

    Everything the guest printed since QEMU started is kept (up to 1 MiB) and replayed to each new client,
    so that a client that connects late still sees, say, a boot message. The transcript is also appended
    to ``log_path``.
    """

    def __init__(self, serial: socket.socket, path: Path, log_path: Path) -> None:
        self.serial = serial
        self.path = path
        self.history = bytearray()
        self.client: socket.socket | None = None
        self.lock = threading.Lock()
        self.log = open(log_path, "ab")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        os.chmod(path, 0o600)
        self.listener.listen(2)
        self.closed = False
        threading.Thread(target=self._from_guest, args=(serial,), name="console-out", daemon=True).start()
        threading.Thread(target=self._accept, name="console-accept", daemon=True).start()

    def attach(self, serial: socket.socket) -> None:
        """Relay a new QEMU's serial console (the guest was started again): the client stays connected."""
        self.serial = serial
        threading.Thread(target=self._from_guest, args=(serial,), name="console-out", daemon=True).start()

    def _from_guest(self, serial: socket.socket) -> None:
        while True:
            try:
                data = serial.recv(65536)
            except OSError:
                data = b""
            if not data:
                return
            with self.lock:
                self.history += data
                if len(self.history) > _CONSOLE_HISTORY:
                    del self.history[:len(self.history) - _CONSOLE_HISTORY]
                with contextlib.suppress(OSError, ValueError):
                    self.log.write(data)
                    self.log.flush()
                # Sent under the lock, so that it can never interleave with a new client's backlog.
                client = self.client
                if client is not None:
                    try:
                        client.sendall(data)
                    except OSError:
                        self.client = None
                        with contextlib.suppress(OSError):
                            client.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            # A client that stops reading must not stall the guest's console for long.
            client.settimeout(_CONSOLE_SEND_TIMEOUT)
            with self.lock:
                old, self.client = self.client, client
                try:
                    client.sendall(bytes(self.history))
                except OSError:
                    self.client = None
            if old is not None:
                with contextlib.suppress(OSError):
                    old.close()
            if self.client is not client:
                with contextlib.suppress(OSError):
                    client.close()
                continue
            threading.Thread(target=self._to_guest, args=(client,), name="console-in", daemon=True).start()

    def _to_guest(self, client: socket.socket) -> None:
        while True:
            try:
                data = client.recv(65536)
            except TimeoutError:
                continue          # the timeout is for sending; a quiet client is fine
            except OSError:
                data = b""
            if not data:
                self._drop(client)
                return
            try:
                self.serial.sendall(data)
            except OSError:
                return

    def _drop(self, client: socket.socket) -> None:
        with self.lock:
            if self.client is client:
                self.client = None
        with contextlib.suppress(OSError):
            client.close()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with self.lock:
            if self.client is not None:
                with contextlib.suppress(OSError):
                    self.client.close()
                self.client = None
            self.log.close()


class ControlServer:
    """The session's control socket: JSON lines. ``status`` is answered at once; ``suspend`` and
    ``poweroff`` are handed to the session's main thread, whose progress streams back on the same
    connection, ending with ``{"ok": ..., "result"|"error": ...}``."""

    def __init__(self, path: Path, session: Session) -> None:
        self.path = path
        self.session = session
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        os.chmod(path, 0o600)
        self.listener.listen(8)
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
                        write(json.dumps({"ok": True, "status": self.session.status()}) + "\n")
                    elif op in ("suspend", "poweroff"):
                        req = _Request(op, bool(request.get("checkin", True)), JsonReporter(write))
                        self.session.submit(req)
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


class Session:
    """One resume of one parcel at this site. `start` brings the VM up; `serve` runs until it ends."""

    def __init__(self, options: SessionOptions, parcel_keys: ParcelKeys, reporter: Reporter,
                 cfg: configmod.ClientConfig | None = None) -> None:
        self.options = options
        self.keys = parcel_keys
        self.reporter = reporter
        self.policy = policymod.get(options.policy)
        self.config = cfg or configmod.load()
        self.state = ParcelState(options.parcel)
        self.client: Client | None = None
        self.runtime = paths.parcel_runtime_dir(options.parcel)
        self.vulpes: Vulpes | None = None
        self.vm: VM | None = None
        self.console: ConsoleRelay | None = None
        self.control: ControlServer | None = None
        self.manifest: Manifest | None = None
        self.base_version = 0
        self.trace_path: Path | None = None
        self.vnc_text = "none"
        self._vnc: str | None = None
        self.host: compat.HostQemu | None = None
        # SimpleQueue.put is reentrant: a signal handler may call it.
        self.requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self.ending = False
        self.exit_code = 0
        self.phases: dict[str, float] = {}
        self.started = time.monotonic()
        self._memfds: list[int] = []
        self._previous_change: LocalChange | None = None
        self._guest_started = False
        self._running_written = False
        self._acquired_lock = False
        self._next_renew = 0.0

    # --- requests from other threads ----------------------------------------------------------------

    def submit(self, request: _Request) -> None:
        """Queue a suspend or poweroff for the main thread (`serve`)."""
        self.requests.put(request)

    def status(self) -> dict[str, Any]:
        """What `isr stat` shows about a running session."""
        info: dict[str, Any] = {"parcel": self.options.parcel, "name": self.options.name,
                                "version": self.base_version, "policy": self.options.policy,
                                "disconnected": self.options.disconnected, "pid": os.getpid(),
                                "vnc": self.vnc_text, "running": self.vm is not None and self.vm.is_running(),
                                "uptime": time.monotonic() - self.started}
        if self.vulpes is not None and self.vulpes.alive():
            with contextlib.suppress(IsrError):
                info["vulpes"] = self.vulpes.status()
        return info

    # --- start ---------------------------------------------------------------------------------------

    def _phase(self, name: str, since: float) -> float:
        now = time.monotonic()
        self.phases[name] = now - since
        return now

    def start(self) -> dict[str, Any]:
        """Bring the VM up (steps 1-5 of the module docstring). Returns what `isr resume` prints.

        On failure everything started is stopped again and the local state is left as it was; raises
        IsrError subclasses (LockRefused, CompatibilityError, StateError, VulpesFailure, VMError, ...).
        """
        if not self.state.try_lock():
            info = self.state.session_info()
            raise StateError(f"{self.options.name} is already running at this site"
                             f"{' (session pid ' + str(info['pid']) + ')' if info else ''}: "
                             f"use `isr suspend {self.options.name}` first")
        try:
            return self._start()
        except BaseException:
            self._abort_start()
            raise

    def _start(self) -> dict[str, Any]:
        opts = self.options
        t = self.started
        change = self.state.effective_local_change()
        if change is not None and change.state == DAMAGED:
            raise StateError(f"the last session of {opts.name} at this site did not end cleanly ({change.reason}); "
                             f"its state cannot be resumed: `isr discard {opts.name}` goes back to the last "
                             f"checked-in version")
        self._previous_change = change
        if opts.disconnected:
            checkout = self.state.require_checkout()
            if checkout.lock is None:
                raise StateError(f"a disconnected resume needs the lock: `isr checkout {opts.name}` and "
                                 f"`isr hoard {opts.name}` while connected")
            self.reporter.say(f"resuming {opts.name} disconnected (no server contact until checkin)")
        else:
            self.client = Client(self.config)
            parcel = {"id": opts.parcel, "name": opts.name}
            before = self.state.checkout()
            checkout, current = ensure_checkout(self.client, self.state, parcel)
            self._acquired_lock = before is None or before.lock is None
            self._next_renew = time.monotonic() + 5.0   # then as the lease says
            if change is not None and current != checkout.version:
                raise StateError(f"this site has changes to version {checkout.version} of {opts.name}, but the "
                                 f"server is at version {current}: `isr discard {opts.name}` first")
            t = self._phase("lock", t)
            if change is None and (checkout.version != current or not self._has_local_version()):
                self.reporter.say(f"fetching version {current} of {opts.name}")
                manifest = self.client.download_version(self.state, current, self.keys, check=self._check,
                                                        reporter=self.reporter)
                checkout.version = current
                self.state.save_checkout(checkout)
            t = self._phase("metadata", t)
        checkout = self.state.require_checkout()
        checkout.policy = opts.policy
        self.state.save_checkout(checkout)
        self.base_version = checkout.version
        manifest = open_manifest(self.keys.parcel_key, self.state.base_manifest_sealed(),
                                 parcel=uuid.UUID(opts.parcel), version=checkout.version)
        self.manifest = manifest
        suspended = change.state == SUSPENDED if change is not None else manifest.suspended
        self.host = compat.check(manifest, suspended=suspended)
        devstate = self._devstate(manifest, change) if suspended else None
        t = self._phase("device state", t)
        # A suspended guest's kernel is in its memory image: the boot files are needed only to boot cold (and
        # for the KVM probe boot). They are fetched if the guest reboots later, or if the state will not load.
        boot: dict[str, bytes] | None = None
        if devstate is None or self.options.accel == "kvm":
            boot = self._boot_blobs(manifest)
            t = self._phase("boot files", t)

        # From here on vulpes may change the keyrings: a crash must read as "damaged", not as the old state.
        self.state.save_local_change(LocalChange(state=RUNNING, base_suspended=manifest.suspended))
        self._running_written = True
        self._start_vulpes()
        t = self._phase("vulpes", t)
        self._apply_policy_before(manifest, change)
        t = self._phase("hoard", t)
        self._start_vm(manifest, boot, devstate)
        t = self._phase("qemu", t)
        self._guest_started = True
        self._apply_policy_after(manifest, change)
        self.control = ControlServer(self.runtime / CONTROL_SOCKET, self)
        latency = time.monotonic() - self.started
        info = {"parcel": opts.parcel, "name": opts.name, "version": checkout.version, "policy": opts.policy,
                "pid": os.getpid(), "control": str(self.runtime / CONTROL_SOCKET),
                "console": str(self.runtime / CONSOLE_SOCKET), "vnc": self.vnc_text,
                "mount": str(self.runtime / "mnt"), "resume_seconds": round(latency, 3),
                "phases": {k: round(v, 3) for k, v in self.phases.items()},
                "qemu_pid": self.vm.pid if self.vm else None, "vulpes_pid": self.vulpes.pid if self.vulpes else None,
                "cold_boot": devstate is None, "started": time.time()}
        self.state.save_session_info(info)
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in self.phases.items())
        how = "booted cold" if devstate is None else "resumed"
        self.reporter.say(f"{opts.name} version {checkout.version} {how} in {latency:.1f} s "
                          f"(t4, policy {opts.policy}: {phases})")
        self.reporter.say(f"  display  vnc {self.vnc_text}")
        self.reporter.say(f"  console  {info['console']}")
        return info

    def _has_local_version(self) -> bool:
        return all(self.state.keyring_path(i).exists() for i in IMAGES) and (self.state.dir / "base" / "manifest").exists()

    def _check(self, manifest: Manifest) -> None:
        compat.check(manifest)

    def _devstate(self, manifest: Manifest, change: LocalChange | None) -> bytes:
        """The plaintext device state to load, verified (local suspend or the base version's)."""
        if change is not None and change.state == SUSPENDED:
            assert change.devstate is not None
            sealed = self.state.local_devstate_path().read_bytes()
            payload = seal.open_sealed(self.keys.parcel_key, sealed, seal.KIND_DEVSTATE, int(change.devstate["size"]))
            if hashlib.sha256(payload).hexdigest() != change.devstate["sha256"]:
                raise StateError(f"the local device state of {self.options.name} does not match its record: "
                                 f"`isr discard {self.options.name}`")
            return payload
        return open_blob(self.keys.parcel_key, self.state.base_devstate_path().read_bytes(), manifest, "devstate")

    def _start_vulpes(self) -> None:
        opts = self.options
        self.state.trace_dir().mkdir(parents=True, exist_ok=True)
        self.trace_path = self.state.trace_dir() / f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.trace"
        connected = not opts.disconnected
        self.vulpes = Vulpes(mountpoint=self.runtime / "mnt", state_dir=self.state.dir,
                             cache_dir=paths.chunk_cache_dir(), control_path=self.runtime / "vulpes.sock",
                             log_path=self.state.dir / "vulpes.log",
                             server=self.config.server if connected else None,
                             token_file=paths.token_file() if connected else None,
                             pin=self.config.pin if connected else None, trace=self.trace_path,
                             lookaside=[Path(p) for p in opts.lookaside], cache_limit=self.config.cache_limit)
        paths.chunk_cache_dir().mkdir(parents=True, exist_ok=True)
        self.vulpes.start(self.keys)
        if self.state.take_base_moved():
            # The keyrings are exactly the base now (nothing has run yet): vulpes's changed-chunk count restarts.
            self.vulpes.control({"op": "checkin-done"})

    def _records(self, image: str) -> list:
        with Keyring.open(self.state.keyring_path(image)) as keyring:
            return list(keyring)

    def _working_set(self, manifest: Manifest, change: LocalChange | None) -> dict[str, list[int]]:
        """The working set recorded at the last suspend (this site's, or the version's); one that cannot be
        used is ignored with a warning: it only steers prefetching."""
        recorded: object = manifest.working_set
        if change is not None and change.state in (SUSPENDED, POWEROFF):
            recorded = change.working_set
        counts = {image: chunk_count(manifest.chunk_size, manifest.images[image].size) for image in IMAGES}
        working_set, problem = workingset.checked(recorded, counts)
        if problem is not None:
            log.warning("recorded working set ignored: %s", problem)
            self.reporter.say(f"  warning: the recorded working set is ignored ({problem}); chunks are fetched "
                              f"as the guest touches them")
        return working_set

    def _apply_policy_before(self, manifest: Manifest, change: LocalChange | None) -> None:
        assert self.vulpes is not None
        pol = self.policy
        records = {image: self._records(image) for image in IMAGES}
        cache = paths.chunk_cache_dir()
        if self.options.disconnected:
            cover = workingset.coverage(cache, records["disk"] + records["memory"])
            if not cover.complete:
                raise StateError(f"{cover.missing_chunks} of {cover.chunks} chunks of {self.options.name} are not "
                                 f"at this site: a disconnected resume needs a full `isr hoard` first")
            return
        if pol.hoard_all_first:
            self._hoard_and_wait(everything=True, label="hoarding everything (baseline)")
        elif pol.expects_hoard == "all":
            cover = workingset.coverage(cache, records["disk"] + records["memory"])
            if cover.complete:
                self.reporter.say(f"  all {cover.chunks} chunks were hoarded ahead of time")
            else:
                self.reporter.say(f"  {cover.missing_chunks} of {cover.chunks} chunks were not hoarded ahead of time "
                                  f"(`isr hoard`): they are fetched on demand")
        elif pol.expects_hoard == "working-set":
            ws = self._working_set(manifest, change)
            wanted = workingset.select(records["disk"], ws["disk"]) + workingset.select(records["memory"], ws["memory"])
            cover = workingset.coverage(cache, wanted)
            self.reporter.say(f"  working set: {cover.cached} of {cover.chunks} chunks hoarded ahead of time"
                              + ("" if cover.complete else f"; {cover.missing_chunks} are fetched on demand"))

    def _apply_policy_after(self, manifest: Manifest, change: LocalChange | None) -> None:
        assert self.vulpes is not None
        if self.options.disconnected:
            return
        if self.policy.hoard_working_set_lazily:
            ws = self._working_set(manifest, change)
            self.vulpes.hoard(disk=ws["disk"], memory=ws["memory"])
            self.reporter.say(f"  hoarding the working set in the background ({len(ws['disk'])} disk and "
                              f"{len(ws['memory'])} memory chunks)")
        elif self.policy.stream_when_idle:
            ws = self._working_set(manifest, change)
            self.vulpes.hoard(disk=ws["disk"], memory=ws["memory"], then_all=("disk",), idle=True)
            self.reporter.say(f"  while the guest does not wait: the working set ({len(ws['disk'])} disk and "
                              f"{len(ws['memory'])} memory chunks), then the rest of the disk")
        if self.policy.writeback or self.options.writeback:
            self.vulpes.writeback(True, self.options.writeback_rate)
            rate = self.options.writeback_rate
            self.reporter.say(f"  trickle writeback on ({'unlimited' if not rate else f'{rate >> 10} KiB/s'})")

    def _hoard_and_wait(self, *, everything: bool = False, disk: list[int] | None = None,
                        memory: list[int] | None = None, label: str) -> None:
        assert self.vulpes is not None
        status = self.vulpes.hoard(disk=disk, memory=memory, everything=everything)
        hoard = status.get("hoard", {})
        bar = self.reporter.progress(label, int(hoard.get("bytes_total", 0)))
        try:
            while True:
                hoard = self.vulpes.status().get("hoard", {})
                bar.update(int(hoard.get("bytes_done", 0)), int(hoard.get("bytes_total", 0)))
                if hoard.get("state") in ("done", "stopped", "idle"):
                    break
                if not self.vulpes.alive():
                    raise SessionError(f"vulpes exited while hoarding:\n{self.vulpes.output()}")
                time.sleep(_POLL)
        finally:
            bar.close(f"{hoard.get('chunks_done', 0)} chunks, {hoard.get('bytes_fetched', 0) >> 20} MiB fetched")
        if int(hoard.get("chunks_failed", 0)):
            raise SessionError(f"{hoard['chunks_failed']} chunks could not be hoarded (see {self.vulpes.log_path})")

    def _boot_blobs(self, manifest: Manifest) -> dict[str, bytes]:
        return boot_blobs(self.state, manifest, self.keys, remote=None if self.client is None else self.client.remote,
                          reporter=self.reporter)

    def _vm_config(self, manifest: Manifest, boot: dict[str, bytes] | None) -> VMConfig:
        """QEMU's configuration; ``boot`` None: without the boot files (only to load a saved state)."""
        assert self.vulpes is not None
        vm = manifest.vm
        kernel = initrd = None
        cmdline = None
        if vm.boot is not None and boot is not None:
            fd, kernel = _memfd("kernel", boot[vm.boot.kernel])
            self._memfds.append(fd)
            if vm.boot.initrd:
                fd, initrd = _memfd("initrd", boot[vm.boot.initrd])
                self._memfds.append(fd)
            cmdline = vm.boot.cmdline
        if self._vnc is None and vm.devices.get("display", "vnc") == "vnc":
            choice = self.options.vnc
            if choice == "auto":
                self._vnc = _free_vnc_display()
            elif choice == "unix":
                self._vnc = f"unix:{self.runtime / VNC_SOCKET}"
            else:
                self._vnc = choice
            self.vnc_text = self._vnc
        vnc = self._vnc
        accel = self.options.accel
        if accel == "kvm":
            if kernel is None or not kvm_works(kernel, initrd, marker=b"Run /init as init process",
                                               cache_dir=paths.cache_dir()):
                self.reporter.say("  KVM does not work here (a probe boot failed): using TCG")
                accel = "tcg"
        return VMConfig(disk=self.vulpes.disk, disk_cache="writeback", kernel=kernel, initrd=initrd, cmdline=cmdline,
                        machine=vm.machine, cpu=vm.cpu, memory_mib=vm.ram_mib, smp=vm.smp, accel=accel,
                        memory_file=self.vulpes.memory, vnc=vnc,
                        # Without the boot files (a resume) a reset could not boot again: it ends QEMU, and
                        # the session starts the guest again with them (`_boot_after_reset`).
                        reset_exits=vm.boot is not None and boot is None)

    def _launch(self, manifest: Manifest, boot: dict[str, bytes] | None, *, incoming: bool) -> None:
        """Start a QEMU for the VM (paused), and relay its console (to the clients already attached, if any)."""
        qemu_dir = self.state.dir / "qemu"
        self.vm = VM(self._vm_config(manifest, boot), run_dir=qemu_dir, name="vm")
        if incoming:
            self.vm.launch_incoming()
        else:
            self.vm.launch(paused=True)
        if self.console is None:
            self.console = ConsoleRelay(self.vm.serial, self.runtime / CONSOLE_SOCKET, qemu_dir / "console.log")
        else:
            self.console.attach(self.vm.serial)

    def _start_vm(self, manifest: Manifest, boot: dict[str, bytes] | None, devstate: bytes | None) -> None:
        self._launch(manifest, boot, incoming=devstate is not None)
        assert self.vm is not None
        if devstate is None:
            self.vm.cont()
            return
        try:
            stats = self.vm.load_state_bytes(devstate, start=True)
        except VMError as exc:
            if boot is not None or manifest.vm.boot is None:
                raise
            # Not seen with QEMU 7.2 (a state saved with -kernel loads into a QEMU started without it), but
            # another QEMU might want the boot files' option ROM: the resume then costs them, and still works.
            log.warning("the device state did not load without the boot files (%s); trying again with them", exc)
            self.reporter.say("  the saved state needs the boot files here: fetching them")
            self.vm.kill()
            self._launch(manifest, self._boot_blobs(manifest), incoming=True)
            stats = self.vm.load_state_bytes(devstate, start=True)
        log.info("device state loaded in %.2f s", stats.seconds)

    def _boot_after_reset(self) -> None:
        """The guest rebooted in a QEMU that had no boot files (it ended QEMU): boot it cold with them, on the
        same disk, as the reset would have. Without them (the server unreachable, none here) the session ends
        as if the guest had powered off, without a checkin."""
        assert self.manifest is not None
        self.reporter.say("the guest rebooted: starting it again with its boot files")
        try:
            boot = self._boot_blobs(self.manifest)
        except IsrError as exc:
            self.reporter.say(f"cannot boot {self.options.name} again here ({exc}): it stays powered off")
            self._end(POWEROFF, False, self.reporter, quit_vm=False)
            return
        self._launch(self.manifest, boot, incoming=False)
        assert self.vm is not None
        self.vm.cont()

    def _abort_start(self) -> None:
        """Undo a failed start: stop QEMU and vulpes; restore the local state record if the guest never ran."""
        with contextlib.suppress(Exception):
            if self.vm is not None:
                self.vm.kill()
        with contextlib.suppress(Exception):
            if self.vulpes is not None:
                self.vulpes.stop()
        if self.vulpes is not None and self.vulpes.alive():
            self.vulpes.kill()
        if self._running_written and not self._guest_started:
            # The guest never ran, so nothing changed: put back the record of the state as it was.
            with contextlib.suppress(Exception):
                if self._previous_change is None:
                    (self.state.dir / "local.json").unlink(missing_ok=True)
                else:
                    self.state.save_local_change(self._previous_change)
        if not self._guest_started and self._acquired_lock and self._previous_change is None \
                and self.client is not None:
            # Nothing happened under the lock this start took: give it back.
            with contextlib.suppress(Exception):
                checkout = self.state.require_checkout()
                if checkout.lock is not None:
                    self.client.release(self.options.parcel, checkout.lock)
                    checkout.lock = None
                    self.state.save_checkout(checkout)
        self._close_common()

    def _close_common(self) -> None:
        for closer in (self.control, self.console):
            if closer is not None:
                with contextlib.suppress(Exception):
                    closer.close()
        self.control = self.console = None
        for fd in self._memfds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._memfds.clear()
        self.state.clear_session_info()
        if self.client is not None:
            self.client.close()
            self.client = None
        self.state.unlock()

    # --- running --------------------------------------------------------------------------------------

    def _schedule_renew(self, expires: float | None) -> None:
        now = time.time()
        if expires:
            self._next_renew = time.monotonic() + max(0.5, (expires - now) / 3)
        else:
            self._next_renew = time.monotonic() + _RENEW_DEFAULT

    def _renew(self) -> None:
        if self.client is None or time.monotonic() < self._next_renew:
            return
        checkout = self.state.checkout()
        if checkout is None or checkout.lock is None:
            return
        try:
            reply = self._renew_with_dirty_report(checkout.lock.nonce)
            self._schedule_renew(reply.get("lock", {}).get("expires"))
        except RemoteUnreachable as exc:
            log.warning("cannot renew the lock (server unreachable): %s", exc)
            self._schedule_renew(None)
        except RemoteError as exc:
            if exc.code == "lock_lost":
                self.reporter.say(f"WARNING: the lock on {self.options.name} was broken; this session's changes "
                                  f"cannot be committed")
            else:
                log.warning("cannot renew the lock: %s", exc)
            self._next_renew = time.monotonic() + _RENEW_DEFAULT

    def _renew_with_dirty_report(self, nonce: str) -> dict[str, Any]:
        """Renew the lock, telling the server how much this site has changed since the base version (the
        web pages show it to the owner before they break the lock from elsewhere)."""
        assert self.client is not None and self.manifest is not None
        report = getattr(self.client.remote, "report_dirty", None)
        if report is not None:
            try:
                changes = compare_changes(self.state)
                dirty = sum(changes.changed.values())
                return dict(report(self.options.parcel, nonce, dirty, dirty * self.manifest.chunk_size))
            except (IsrError, ParcelError) as exc:
                if isinstance(exc, RemoteError) and exc.code in ("lock_lost",):
                    raise
                log.debug("dirty report failed (%s); renewing plainly", exc)
        return dict(self.client.remote.renew(self.options.parcel, nonce))

    def serve(self) -> int:
        """Run until the VM is suspended or powered off, or QEMU or vulpes dies. Returns an exit code."""
        try:
            while not self.ending:
                try:
                    request = self.requests.get(timeout=_POLL)
                except queue.Empty:
                    request = None
                if request is not None:
                    self._handle(request)
                    # The session may end now: not before the requester has its answer (this thread
                    # exiting would kill the control thread that writes it).
                    request.answered.wait(_ANSWER_TIMEOUT)
                    continue
                assert self.vm is not None and self.vulpes is not None
                if not self.vulpes.alive():
                    self._crashed(f"vulpes exited (code {self.vulpes.proc.returncode if self.vulpes.proc else '?'})")
                elif not self.vm.is_running():
                    code = self.vm.wait(5)
                    if code == 0 and self.vm.config.reset_exits and self.vm.shutdown_reason == "guest-reset":
                        self._boot_after_reset()
                    elif code == 0:
                        self.reporter.say("the guest powered itself off")
                        self._end(POWEROFF, self.options.checkin_on_poweroff and not self.options.disconnected,
                                  self.reporter, quit_vm=False)
                    else:
                        self._crashed(f"QEMU exited with code {code}" + (" (killed)" if code < 0 else ""))
                else:
                    self._renew()
        finally:
            self._close_common()
        log.info("session ends (exit code %d)", self.exit_code)
        return self.exit_code

    def _handle(self, request: _Request) -> None:
        try:
            if request.op == "suspend":
                request.result = self._end(SUSPENDED, request.checkin and not self.options.disconnected,
                                           request.reporter, quit_vm=True)
            else:
                request.result = self._end(POWEROFF, request.checkin and not self.options.disconnected,
                                           request.reporter, quit_vm=True)
        except SuspendAborted as exc:
            request.error = str(exc)
            request.kind = type(exc).__name__
        except IsrError as exc:
            request.error = str(exc)
            request.kind = type(exc).__name__
            self.exit_code = 1
        except Exception as exc:  # report anything to the requester; the log has the traceback
            log.exception("%s failed", request.op)
            request.error = f"{request.op} failed: {exc!r}"
            self.exit_code = 1
        finally:
            request.done.set()

    def _crashed(self, why: str) -> None:
        """QEMU or vulpes died under the VM: stop the rest, mark the local state damaged, keep the lock."""
        assert self.vm is not None and self.vulpes is not None
        self.ending = True
        self.exit_code = 1
        self.vm.kill()
        if self.vulpes.alive():
            with contextlib.suppress(IsrError):
                self.vulpes.stop()
        self.vulpes.kill()
        self.state.save_local_change(LocalChange(state=DAMAGED, reason=why))
        self.reporter.say(f"{self.options.name}: {why}. The work since version {self.base_version} is lost; "
                          f"`isr discard {self.options.name}` goes back to version {self.base_version} "
                          f"(this site keeps the lock)")

    def _end(self, kind: str, checkin: bool, reporter: Reporter, *, quit_vm: bool) -> dict[str, Any]:
        """Suspend (kind SUSPENDED) or power off (POWEROFF) the VM, and check in unless told not to."""
        assert self.vm is not None and self.vulpes is not None and self.manifest is not None
        started = time.monotonic()
        phases: dict[str, float] = {}
        t = started
        result: dict[str, Any] = {"parcel": self.options.parcel, "name": self.options.name}
        if kind == SUSPENDED:
            try:
                self.vm.stop()
                with contextlib.suppress(IsrError):
                    self.vulpes.trace_stop()
                data, stats = self.vm.save_state_bytes()
                payload_digest = hashlib.sha256(data).hexdigest()
                sealed = seal.seal(self.keys.parcel_key, seal.KIND_DEVSTATE, data)
                size = len(data)
                del data
                write_file(self.state.local_devstate_path(), sealed)
                t = _lap(phases, "save device state", t)
                _fsync(self.vulpes.disk)
                self.vulpes.flush()
                t = _lap(phases, "flush", t)
            except (IsrError, OSError) as exc:
                self._carry_on_after_failed_suspend()
                raise SuspendAborted(f"the suspend failed ({exc}); the VM keeps running here. If the guest waits "
                                     f"for chunks from an unreachable server, suspend again when it is back") \
                    from None
            # The point of no return: the state is saved; the session ends whatever happens next.
            self.ending = True
            self.vm.shutdown()
            t = _lap(phases, "quit QEMU", t)
            change = LocalChange(state=SUSPENDED, devstate={"sha256": payload_digest, "size": size},
                                 qemu_version=self.host.version if self.host else None, suspended_at=utc_now(),
                                 working_set=self._trace_working_set(), base_suspended=self.manifest.suspended)
            reporter.say(f"suspended {self.options.name}: device state {size / 2**20:.1f} MiB "
                         f"({len(sealed) / 2**20:.1f} MiB sealed), working set {len(change.working_set['disk'])} disk + "
                         f"{len(change.working_set['memory'])} memory chunks")
        else:
            # A power cut for the guest (QEMU's 'quit' still completes the writes it accepted); the RAM goes.
            self.ending = True
            self.vm.shutdown()
            with contextlib.suppress(IsrError):
                self.vulpes.trace_stop()
            _fsync(self.vulpes.disk)
            self.vulpes.flush()
            t = _lap(phases, "flush", t)
            change = LocalChange(state=POWEROFF, working_set=self._trace_working_set(),
                                 base_suspended=self.manifest.suspended)
        self.state.save_local_change(change)
        safe = time.monotonic() - started
        if kind == SUSPENDED:
            reporter.say(f"the VM state is safe at this site after {safe:.1f} s "
                         f"({', '.join(f'{k} {v:.2f} s' for k, v in phases.items())})")
        if checkin and not self._server_answers():
            reporter.say("the server does not answer: the new state stays at this site (and so does the lock)")
            checkin = False
            self.exit_code = 1
        if checkin and kind == SUSPENDED:
            self._vulpes_upload(reporter)
            t = _lap(phases, "upload (vulpes)", t)
        self.vulpes.stop()
        t = _lap(phases, "unmount", t)
        if kind == POWEROFF:
            forget_memory(self.state)
            safe = time.monotonic() - started
            reporter.say(f"powered off {self.options.name} in {safe:.1f} s: the saved RAM is forgotten; the next "
                         f"resume boots cold")
        result["suspend_seconds"] = round(safe, 3)
        result["version"] = self.base_version
        if checkin:
            result.update(self._checkin(reporter))
        else:
            reporter.say(f"not checked in: this site keeps the lock; `isr checkin {self.options.name}` uploads "
                         f"the new version")
        result["phases"] = {k: round(v, 3) for k, v in phases.items()}
        return result

    def _carry_on_after_failed_suspend(self) -> None:
        """Let the guest go on after a suspend that did not save its state (best effort)."""
        assert self.vm is not None and self.vulpes is not None
        with contextlib.suppress(FileNotFoundError):
            self.state.local_devstate_path().unlink()
        with contextlib.suppress(IsrError):
            if self.vm.is_running() and self.vm.query_status() in ("paused", "postmigrate"):
                self.vm.cont()
        if self.trace_path is not None:
            with contextlib.suppress(IsrError):
                self.vulpes.trace_start(self.trace_path)

    def _server_answers(self) -> bool:
        """A quick health check, so that a suspend while the server is down does not wait on vulpes, which
        retries uploads forever."""
        if self.client is None:
            return False
        try:
            with self.client.new_remote(timeout=10.0) as remote:
                remote.health()
            return True
        except RemoteError:
            return False

    def _trace_working_set(self) -> dict[str, list[int]]:
        assert self.manifest is not None
        counts = {image: chunk_count(self.manifest.chunk_size, self.manifest.images[image].size) for image in IMAGES}
        if self.trace_path is None:
            return {image: [] for image in IMAGES}
        return workingset.from_trace(self.trace_path, counts)

    def _vulpes_upload(self, reporter: Reporter) -> None:
        """Let vulpes (libcurl, parallel) upload the new chunk objects, with a progress bar by chunk count."""
        assert self.vulpes is not None
        status = self.vulpes.status()
        pending = sum(int(status["images"][i].get("pending_uploads", 0)) for i in IMAGES)
        if pending == 0:
            return
        bar = reporter.progress("uploading new chunks", pending, unit="chunks")
        failure: list[BaseException] = []
        uploaded: list[int] = []

        def run() -> None:
            try:
                uploaded.append(self.vulpes.upload())  # type: ignore[union-attr]
            except BaseException as exc:  # reported below
                failure.append(exc)

        worker = threading.Thread(target=run, name="vulpes-upload", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(_POLL)
            with contextlib.suppress(IsrError):
                status = self.vulpes.status()
                left = sum(int(status["images"][i].get("pending_uploads", 0)) for i in IMAGES)
                bar.update(max(0, pending - left))
        note = ""
        if uploaded:
            note = f"{uploaded[0]} sent" + (", the rest superseded or already there" if uploaded[0] < pending else "")
        bar.close(note)
        if failure:
            # Not fatal: the checkin uploads whatever the server still lacks from the cache files.
            log.warning("vulpes upload failed: %s", failure[0])

    def _checkin(self, reporter: Reporter) -> dict[str, Any]:
        if self.client is None:
            return {}
        started = time.monotonic()
        try:
            version = do_checkin(self.client, self.state, self.keys, keep_lock=False, reporter=reporter)
        except LockBroken:
            self.exit_code = 1
            raise
        except RemoteUnreachable as exc:
            self.exit_code = 1
            raise SessionError(f"the server is unreachable ({exc}); the new state is kept at this site: "
                               f"`isr checkin {self.options.name}` when it is back") from None
        self.base_version = version
        return {"version": version, "checkin_seconds": round(time.monotonic() - started, 3)}


def _fsync(path: Path) -> None:
    """Push the kernel's cached writes of a vulpes file down to vulpes (and have vulpes make them durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _lap(phases: dict[str, float], name: str, since: float) -> float:
    now = time.monotonic()
    phases[name] = now - since
    return now


def forget_memory(state: ParcelState) -> None:
    """Make the local memory image all zero (no records): what a powered-off VM keeps of its RAM."""
    path = state.keyring_path("memory")
    with Keyring.open(path) as keyring:
        keyring.import_stream(encode_stream(keyring.chunk_size, keyring.image_size, []))
    with contextlib.suppress(FileNotFoundError):
        state.local_devstate_path().unlink()


# --- talking to a running session ---------------------------------------------------------------------

def request(state: ParcelState, op: str, reporter: Reporter, *, timeout: float | None = None,
            **fields: Any) -> dict[str, Any]:
    """Send one request to the parcel's running session, replaying its progress into ``reporter``.

    Returns the ``result`` (or ``status``). Raises SessionError if no session runs or it reports an error.
    """
    from .progress import Replayer

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


def wait_for_exit(pid: int, timeout: float = 120.0) -> bool:
    """Wait until process ``pid`` is gone; True if it went within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process_alive(pid):
            return True
        time.sleep(0.05)
    return False


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped by whoever adopted it) counts as gone."""
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The state letter follows the command name in parentheses, which may itself contain spaces.
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True


# --- running a session in the foreground, or as a detached process -------------------------------------

def run_foreground(options: SessionOptions, parcel_keys: ParcelKeys, reporter: Reporter) -> int:
    """`isr resume` without --detach: the session runs until the VM ends; Ctrl-C (SIGINT), SIGTERM or a
    closed terminal (SIGHUP) suspend it.

    The session itself is a separate process (as with --detach) in a session of its own: a Ctrl-C typed
    at the terminal goes to the whole foreground process group, and QEMU and vulpes must not get it. This
    process relays the start, waits, turns the signals into a suspend request and relays its progress.
    Returns 0 when the VM was suspended or powered off cleanly, 1 otherwise.
    """
    state = ParcelState(options.parcel)
    info = spawn_detached(options, parcel_keys, reporter)
    pid = int(info["pid"])
    log_path = state.dir / "session.log"
    try:
        log_offset = log_path.stat().st_size
    except OSError:
        log_offset = 0
    reporter.say("running; Ctrl-C or `isr suspend` suspends it")
    wanted: list[int] = []

    def interrupted(signum: int, frame: object) -> None:
        wanted.append(signum)

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, interrupted) for sig in signals}
    try:
        asked = False
        while process_alive(pid):
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
        # The session ended by itself (the guest powered off, or QEMU or vulpes died): show what it said.
        with contextlib.suppress(OSError):
            with open(log_path, errors="replace") as f:
                f.seek(log_offset)
                for line in f.read().splitlines():
                    if not line[:4].isdigit():      # its messages, not its log records
                        reporter.say(line)
    change = state.effective_local_change()
    return 1 if change is not None and change.state == DAMAGED else 0


def spawn_detached(options: SessionOptions, parcel_keys: ParcelKeys, reporter: Reporter,
                   timeout: float = 3600.0) -> dict[str, Any]:
    """Start a detached session process and relay its progress until the guest runs.

    Returns the session's start information. Raises SessionError with the session's own message if it
    fails to start.
    """
    import subprocess

    from .progress import Replayer

    state = ParcelState(options.parcel)
    state.dir.mkdir(parents=True, exist_ok=True)
    log_path = state.dir / "session.log"
    key_fd = keymod.key_pipe(parcel_keys)
    try:
        with open(log_path, "ab") as log_file:
            # Its own session: the terminal's Ctrl-C belongs to `isr resume`, not to the running VM.
            proc = subprocess.Popen([sys.executable, "-m", "isrctl.session"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log_file, pass_fds=(key_fd,),
                                    start_new_session=True)
    finally:
        os.close(key_fd)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write((json.dumps({"options": options.to_json(), "key_fd": key_fd}) + "\n").encode())
    proc.stdin.close()
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
    """Entry of ``python -m isrctl.session``: options on stdin, keys on an inherited fd, reports on stdout
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
        request_data = json.loads(sys.stdin.readline())
        options = SessionOptions.from_json(request_data["options"])
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
    log_fd = os.open(session.state.dir / "session.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(log_fd, 1)
    os.close(log_fd)
    session.reporter = TerminalReporter(interactive=False)

    def terminate(signum: int, frame: object) -> None:
        request = _Request("suspend", True, session.reporter)
        request.answered.set()  # nobody waits for an answer: the log has it
        session.submit(request)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    return session.serve()


if __name__ == "__main__":
    sys.exit(_detached_main())
