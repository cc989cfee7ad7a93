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
   ``isr stat``, ``isr sync``, ``isr resume`` of a paused VM), a console socket relaying the serial console,
   lock renewals, and a watch on QEMU and vulpes (if one is killed, the local state is marked damaged and
   the lock kept: `isr discard` goes back to the last version).

A full chunk cache pauses the VM: vulpes refuses a disk write it has no room for with ENOSPC (after
evicting every clean object it may), QEMU stops the guest on it (``werror=enospc``) and retries the write
on ``cont``; a memory image that cannot be flushed makes the session stop the guest itself. The session
says so in one line (`room.full_line`), watches for room (space freed, the limit raised, or `isr sync`
uploading what is dirty so that it can be dropped) and continues the VM then, or when `isr resume` asks.

Suspend: stop the guest, save the device state (sealed at once), make the memory file and every vulpes
write durable, quit QEMU, record the working set from the trace, and (by default) let vulpes upload the
new chunks, unmount, and commit the new version (`checkin.checkin`), releasing the lock.

The session is a process of its own, in the foreground of `isr resume` (Ctrl-C suspends) or detached
(``--detach``): `isrctl.detach` starts it. Its console relay is `isrctl.console`, its control socket
`isrctl.control`.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import itertools
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from isrprogress import Reporter, human_bytes
from parcels import devices, firmware, seal
from parcels.durable import fsync_path
from parcels.errors import ParcelError
from parcels.keyring import Keyring, KeyringRecord, encode_stream
from parcels.manifest import IMAGES, Manifest, open_blob, open_manifest, utc_now
from parcels.parcel import ParcelKeys

from . import background, compat, pack, paths, room, workingset
from . import display as displaymod
from . import config as configmod
from . import policy as policymod
from .accel import kvm_works
from .checkin import Staged
from .checkin import checkin as do_checkin
from .checkin import compare as compare_changes
from .checkin import stage as stage_blobs
from .checkout import Client, boot_blobs, ensure_checkout, version_blobs
from .console import CONSOLE_SOCKET, ConsoleRelay
from .control import CONTROL_SOCKET, POWEROFF_WAIT, ControlServer, Request
from .detach import SessionOptions
from .errors import IsrError, LockBroken, SessionError, StateError, VMError, VMTimeoutError, VulpesFailure
from .localstate import DAMAGED, POWEROFF, RUNNING, SUSPENDED, LocalChange, ParcelState, write_file
from .qemu import VM, VMConfig
from .remote import RemoteError, RemoteUnreachable, ServerFailure
from .vulpes import CacheUsage, Vulpes

log = logging.getLogger(__name__)

_POLL = 0.2
#: How long a suspend waits for vulpes's upload while the server takes no chunk (answering errors, or not at
#: all) before it leaves the new chunks here and tries the checkin, which then says what failed.
_UPLOAD_STALL = 20.0
#: How long an ending session waits for its control thread to hand the result to the requester.
_ANSWER_TIMEOUT = 10.0
_RENEW_DEFAULT = 60.0
#: A requesting command's age (control.Request.age) above this is not believed: the suspend counts from its
#: own start.
_AGE_MAX = 60.0


class Refused(SessionError):
    """A request the session cannot do now (continue a VM the cache still has no room for, sync while
    disconnected); the VM and the session keep running."""


class SuspendAborted(Refused):
    """A suspend failed before the state was saved; the VM and the session keep running."""


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
        #: The guest continued from a saved state (not a cold boot): its trace can make the next resume pack.
        self.resumed = False
        self._recent_since: float | None = None      # when the suspend began to watch the recent pages
        #: Set once the resume pack's parts are all with vulpes (at once if there are none to stream).
        self._pack_loaded = threading.Event()
        self._pack_fetching: pack.Fetching | None = None     # the resume pack's parts on their way
        self._pack_loaded.set()
        self.vnc_text = "none"
        self._vnc: str | None = None
        #: The VNC display (None: none, or not chosen yet); chosen once, at the first QEMU start.
        self.display: displaymod.Display | None = None
        self._display_chosen = False
        #: The port forwards in use (those whose host port was free at the first QEMU start).
        self.forwards: list[devices.Forward] | None = None
        self.host: compat.HostQemu | None = None
        # SimpleQueue.put is reentrant: a signal handler may call it.
        self.requests: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self.ending = False
        self.exit_code = 0
        self.phases: dict[str, float] = {}
        self.started = time.monotonic()
        self._memfds: list[int] = []
        #: A UEFI VM's variable store (an in-memory file QEMU writes), the digest of what it was loaded with,
        #: and the local record it came from (a session not yet checked in), if any.
        self._nvram: Path | None = None
        self._nvram_fd = -1
        self._nvram_loaded = ""
        self._nvram_record: dict[str, Any] | None = None
        self._previous_change: LocalChange | None = None
        self._guest_started = False
        self._running_written = False
        self._acquired_lock = False
        self._next_renew = 0.0
        #: Whether the VM is paused because the chunk cache has no room (`room.FullCache`).
        self.full = room.FullCache(options.name, disconnected=options.disconnected)

    # --- requests from other threads ----------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a suspend or poweroff for the main thread (`serve`)."""
        self.requests.put(request)

    def status(self) -> dict[str, Any]:
        """What `isr stat` shows about a running session."""
        info: dict[str, Any] = {"parcel": self.options.parcel, "name": self.options.name,
                                "version": self.base_version, "policy": self.options.policy,
                                "disconnected": self.options.disconnected, "pid": os.getpid(),
                                "vnc": self.vnc_text, "running": self.vm is not None and self.vm.is_running(),
                                "display": self.display.describe() if self.display else "none",
                                "forwards": [str(f) for f in self.forwards or []],
                                "uptime": time.monotonic() - self.started}
        if self.full.since is not None:
            info["paused"] = {"why": "cache-full", "since": round(time.monotonic() - self.full.since, 1),
                              "message": self.full.message}
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
        if manifest.vm.firmware == "uefi":
            self._load_nvram(manifest, change)

        self.resumed = devstate is not None
        if self.resumed and change is None and self.client is not None and pack.worth_loading(self.state, manifest):
            # The pack's first part crosses the link from now on, while vulpes starts; the others once QEMU has.
            self._pack_fetching = pack.Fetching(self.client.new_remote(), self.state, manifest, self.keys,
                                                pack.parts(manifest), keep=pack.PACK_BYTES, close_remote=True,
                                                hold=True)

        # From here on vulpes may change the keyrings: a crash must read as "damaged", not as the old state.
        self.state.save_local_change(LocalChange(state=RUNNING, base_suspended=manifest.suspended))
        self._running_written = True
        self._start_vulpes()
        t = self._phase("vulpes", t)
        self._apply_policy_before(manifest, change)
        t = self._phase("hoard", t)
        launching = None
        if self._pack_fetching is not None:
            # QEMU starts, paused and waiting for the state, while the pack's first part is handed to vulpes (or
            # still crosses the link): its start (0.2-0.3 s) touches no guest RAM, and the state loads only
            # once the part is in vulpes.
            launching = background.start("qemu-launch", self._launch, manifest, boot, True)
            try:
                self._load_resume_pack(self._pack_fetching)
            finally:
                with contextlib.suppress(Exception):
                    launching.exception()        # never two starts at once: _abort_start() kills what this made
                self._pack_fetching.go()
            t = self._phase("resume pack + qemu start", t)
        self._start_vm(manifest, boot, devstate, launched=launching)
        t = self._phase("qemu", t)
        self._guest_started = True
        self._apply_policy_after(manifest, change)
        self.control = ControlServer(self.runtime / CONTROL_SOCKET, status=self.status, submit=self.submit)
        latency = time.monotonic() - self.started
        info = {"parcel": opts.parcel, "name": opts.name, "version": checkout.version, "policy": opts.policy,
                "pid": os.getpid(), "control": str(self.runtime / CONTROL_SOCKET),
                "console": str(self.runtime / CONSOLE_SOCKET), "vnc": self.vnc_text,
                "vnc_display": self.display.to_json() if self.display else None,
                "forwards": [str(f) for f in self.forwards or []],
                "mount": str(self.runtime / "mnt"), "resume_seconds": round(latency, 3),
                "phases": {k: round(v, 3) for k, v in self.phases.items()},
                "qemu_pid": self.vm.pid if self.vm else None, "vulpes_pid": self.vulpes.pid if self.vulpes else None,
                "cold_boot": devstate is None, "started": time.time()}
        self.state.save_session_info(info)
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in self.phases.items())
        how = "booted cold" if devstate is None else "resumed"
        self.reporter.say(f"{opts.name} version {checkout.version} {how} in {latency:.1f} s "
                          f"(t4, policy {opts.policy}: {phases})")
        self.reporter.say(f"  display  {self.display.describe() if self.display else 'none'}")
        self.reporter.say(f"  console  {info['console']} (`isr console {opts.name}`)")
        if manifest.vm.devices.get("net") == "user":
            self.reporter.say("  network  user-mode (the guest is 10.0.2.15)"
                              + "".join(f"; {f.host_addr}:{f.host_port} -> guest {f.proto} port {f.guest_port}"
                                        for f in self.forwards or []))
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
        self.vulpes = Vulpes(mountpoint=self.runtime / "mnt", memory_mountpoint=self.runtime / "mnt-ram",
                             state_dir=self.state.dir,
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
        working_set, problem = workingset.checked(recorded, manifest.chunk_counts())
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
        self._warn_if_no_room(manifest, change, records)
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

    def _warn_if_no_room(self, manifest: Manifest, change: LocalChange | None,
                         records: dict[str, list[KeyringRecord]]) -> None:
        """Warn before the VM starts if what the policy is expected to fetch (everything, or the working set,
        and for the streaming policies the whole disk) does not fit in the room the cache has."""
        assert self.vulpes is not None
        pol = self.policy
        if pol.hoard_all_first or pol.expects_hoard == "all":
            wanted = records["disk"] + records["memory"]
        else:
            recorded: object = manifest.working_set
            if change is not None and change.state in (SUSPENDED, POWEROFF):
                recorded = change.working_set
            ws, _ = workingset.checked(recorded, manifest.chunk_counts())
            wanted = workingset.select(records["memory"], ws["memory"])
            wanted += records["disk"] if pol.stream_when_idle else workingset.select(records["disk"], ws["disk"])
        usage = CacheUsage.from_status(self.vulpes.status()["cache"])
        missing, kept = room.missing_tags(paths.chunk_cache_dir(), wanted)
        need = room.expected_bytes(self.client.remote if self.client else None, self.options.parcel,
                                   self.base_version, missing, manifest.largest_chunk_size(), usage.room - kept)
        warning = room.shortfall(usage, need, f"resuming {self.options.name} with policy {pol.name}",
                                 "the VM pauses when the cache is full", kept=kept)
        if warning:
            log.warning("%s", warning)
            self.reporter.say(warning)

    def _apply_policy_after(self, manifest: Manifest, change: LocalChange | None) -> None:
        assert self.vulpes is not None
        if self.options.disconnected:
            return
        start: Callable[[], Any] | None = None
        if self.policy.hoard_working_set_lazily or self.policy.stream_when_idle:
            ws = self._working_set(manifest, change)
        if self.policy.hoard_working_set_lazily:
            # Demand first: the working set is background bytes, so it comes while the guest does not wait (at
            # hoard priority it made lazy-ws answer later than demand: 9.0 s against 6.8 s at 10 Mbit/s).
            start = functools.partial(self.vulpes.hoard, disk=ws["disk"], memory=ws["memory"], idle=True)
            self.reporter.say(f"  while the guest does not wait: the working set ({len(ws['disk'])} disk and "
                              f"{len(ws['memory'])} memory chunks)")
        elif self.policy.stream_when_idle:
            start = functools.partial(self.vulpes.hoard, disk=ws["disk"], memory=ws["memory"], then_all=("disk",),
                                      idle=True)
            self.reporter.say(f"  while the guest does not wait: the working set ({len(ws['disk'])} disk and "
                              f"{len(ws['memory'])} memory chunks), then the rest of the disk")
        if start is not None and not self._pack_loaded.is_set():
            # The rest of the resume pack is what the guest will touch next: it has the link first.
            def after_pack(start: Callable[[], Any] = start) -> None:
                self._pack_loaded.wait()
                with contextlib.suppress(IsrError):
                    start()

            threading.Thread(target=after_pack, name="hoard-after-pack", daemon=True).start()
        elif start is not None:
            start()
        if self.policy.writeback or self.options.writeback:
            self.vulpes.writeback(True, self.options.writeback_rate)
            rate = self.options.writeback_rate
            self.reporter.say(f"  trickle writeback on ({'unlimited' if not rate else f'{rate >> 10} KiB/s'})")

    def _hoard_and_wait(self, label: str, **what: Any) -> None:
        assert self.vulpes is not None
        try:
            self.vulpes.hoard_and_wait(self.reporter, label, **what)
        except VulpesFailure as exc:
            raise SessionError(str(exc)) from None

    def _load_nvram(self, manifest: Manifest, change: LocalChange | None) -> None:
        """The UEFI variable store to start with: this site's from a session not yet checked in, else the
        version's ``nvram`` blob, else OVMF's empty one; into an in-memory file QEMU's flash writes to."""
        if change is not None and change.nvram:
            sealed = self.state.local_nvram_path().read_bytes()
            payload = seal.open_sealed(self.keys.parcel_key, sealed, seal.KIND_BOOT, int(change.nvram["size"]))
            if hashlib.sha256(payload).hexdigest() != change.nvram["sha256"]:
                raise StateError(f"the local UEFI variable store of {self.options.name} does not match its record: "
                                 f"`isr discard {self.options.name}`")
            self._nvram_record = change.nvram
        elif firmware.NVRAM_BLOB in manifest.blobs:
            payload = version_blobs(self.state, manifest, self.keys, [firmware.NVRAM_BLOB],
                                    remote=None if self.client is None else self.client.remote,
                                    reporter=self.reporter)[firmware.NVRAM_BLOB]
        else:
            payload = firmware.empty_variable_store()
        self._nvram_loaded = hashlib.sha256(payload).hexdigest()
        self._nvram_fd, self._nvram = paths.memory_file("nvram", payload)
        self._memfds.append(self._nvram_fd)

    def _save_nvram(self) -> dict[str, Any] | None:
        """After the VM: the variable store's record for the local change (sealed into ``local/nvram`` if
        the VM changed it; None if it is the version's)."""
        if self._nvram is None:
            return None
        payload = os.pread(self._nvram_fd, os.fstat(self._nvram_fd).st_size, 0)
        digest = hashlib.sha256(payload).hexdigest()
        if digest == self._nvram_loaded:
            return self._nvram_record
        sealed = seal.seal(self.keys.parcel_key, seal.KIND_BOOT, payload)
        write_file(self.state.local_nvram_path(), sealed)
        # Kept by digest too, like the blobs fetched from the server: the version it goes into finds it here.
        write_file(self.state.blob_path(digest), sealed)
        return {"sha256": digest, "size": len(payload)}

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
            fd, kernel = paths.memory_file("kernel", boot[vm.boot.kernel])
            self._memfds.append(fd)
            if vm.boot.initrd:
                fd, initrd = paths.memory_file("initrd", boot[vm.boot.initrd])
                self._memfds.append(fd)
            cmdline = vm.boot.cmdline
        if not self._display_chosen:
            self._display_chosen = True
            if vm.devices.get("display", "vnc") == "vnc":
                # `--vnc none` keeps the VGA card (the saved state has it) and shows it nowhere.
                self.display = displaymod.choose(self.options.vnc, self.runtime)
                self._vnc = self.vnc_text = self.display.qemu_arg if self.display else "none"
                if self.display is not None:
                    displaymod.save_password(self.display, self.runtime)
        vnc = self._vnc
        if self.forwards is None:
            self.forwards = self._free_forwards(devices.forwards(vm.devices))
        accel = self.options.accel
        if accel == "kvm":
            if vm.boot is None:
                self.reporter.say("  KVM is used only where a probe boot of the parcel's kernel works, and this "
                                  "parcel boots from its disk: using TCG")
                accel = "tcg"
            elif kernel is None or not kvm_works(kernel, initrd, marker=b"Run /init as init process",
                                                 cache_dir=paths.cache_dir()):
                self.reporter.say("  KVM does not work here (a probe boot failed): using TCG")
                accel = "tcg"
        return VMConfig(disk=self.vulpes.disk, disk_cache="writeback", kernel=kernel, initrd=initrd, cmdline=cmdline,
                        machine=vm.machine, cpu=vm.cpu, memory_mib=vm.ram_mib, smp=vm.smp, accel=accel,
                        memory_file=self.vulpes.guest_memory, vnc=vnc, user_net=vm.devices.get("net") == "user",
                        host_forwards=tuple(str(f) for f in self.forwards), rng=vm.devices.get("rng") == "virtio",
                        balloon=vm.devices.get("balloon") == "virtio",
                        firmware_code=firmware.ovmf_file(firmware.CODE) if self._nvram else None,
                        firmware_vars=self._nvram,
                        # Without the boot files (a resume) a reset could not boot again: it ends QEMU, and
                        # the session starts the guest again with them (`_boot_after_reset`).
                        reset_exits=vm.boot is not None and boot is None)

    def _free_forwards(self, wanted: list[devices.Forward]) -> list[devices.Forward]:
        """The forwards whose host port is free here; each other one is left out with a warning (the VM matters
        more than a port)."""
        free = []
        for forward in wanted:
            kind = socket.SOCK_STREAM if forward.proto == "tcp" else socket.SOCK_DGRAM
            with socket.socket(socket.AF_INET, kind) as probe:
                # As QEMU binds it: a port whose old connections linger in TIME_WAIT is free.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind((forward.host_addr, forward.host_port))
                except OSError as exc:
                    self.reporter.say(f"  warning: port forward {forward} left out: {forward.proto} port "
                                      f"{forward.host_addr}:{forward.host_port} is not free here ({exc.strerror}); "
                                      f"free it and resume again, or change the forward with `isr-admin parcel set`")
                    continue
            free.append(forward)
        return free

    def _launch(self, manifest: Manifest, boot: dict[str, bytes] | None, incoming: bool) -> None:
        """Start a QEMU for the VM (paused), and relay its console (to the clients already attached, if any)."""
        qemu_dir = self.state.dir / "qemu"
        self.vm = VM(self._vm_config(manifest, boot), run_dir=qemu_dir, name="vm")
        if incoming:
            self.vm.launch_incoming()
        else:
            self.vm.launch(paused=True)
        if self.display is not None and self.display.password is not None:
            # QEMU refuses every VNC client of a password=on display until it has a password.
            self.vm.qmp("set_password", {"protocol": "vnc", "password": self.display.password})
        if self.console is None:
            self.console = ConsoleRelay(self.vm.serial, self.runtime / CONSOLE_SOCKET, qemu_dir / "console.log")
        else:
            self.console.attach(self.vm.serial)

    def _start_vm(self, manifest: Manifest, boot: dict[str, bytes] | None, devstate: bytes | None, *,
                  launched: concurrent.futures.Future[None] | None = None) -> None:
        """Start the VM: boot it, or load ``devstate`` into it and let it run (``launched``: its QEMU is
        being started already, waiting for the state)."""
        if launched is not None:
            launched.result()
        else:
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
        if self._pack_fetching is not None:
            self._pack_fetching.close()
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
                dirty_bytes = sum(n * self.manifest.image_chunk_size(image) for image, n in changes.changed.items())
                return dict(report(self.options.parcel, nonce, dirty, dirty_bytes))
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
                    assert self.vm is not None and self.vulpes is not None
                    self.full.watch(self.vm, self.vulpes, self.reporter)
                    self._renew()
        finally:
            self._close_common()
        log.info("session ends (exit code %d)", self.exit_code)
        return self.exit_code

    def _handle(self, request: Request) -> None:
        try:
            if request.op == "continue":
                request.result = self._continue(request.reporter)
            elif request.op == "sync":
                request.result = self._sync(request.reporter)
            elif request.op == "suspend":
                request.result = self._end(SUSPENDED, request.checkin and not self.options.disconnected,
                                           request.reporter, quit_vm=True, age=request.age)
            else:
                request.result = self._end(POWEROFF, request.checkin and not self.options.disconnected,
                                           request.reporter, quit_vm=True,
                                           wait=0.0 if request.force else request.wait, age=request.age)
        except Refused as exc:
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

    def _continue(self, reporter: Reporter) -> dict[str, Any]:
        """`isr resume` of a running session: continue a VM paused for lack of room, with the cache limit
        read again from the configuration (the user may have raised it). Raises Refused if it cannot."""
        assert self.vm is not None and self.vulpes is not None
        if self.full.since is None and not self.vm.paused_for_space():
            raise Refused(f"{self.options.name} is already running at this site (session pid {os.getpid()}): "
                          f"`isr suspend {self.options.name}` first")
        if self.full.since is None:
            self.full.paused(self.vulpes, self.reporter)
        self.vulpes.set_cache_limit(configmod.load().cache_limit)
        if not self.full.go_on_if_room(self.vm, self.vulpes, 1, reporter):
            raise Refused(f"the chunk cache still has no room: {self.full.say_again(self.vulpes)}")
        return {"name": self.options.name, "continued": True}

    def _sync(self, reporter: Reporter) -> dict[str, Any]:
        """`isr sync` of a running session: upload every chunk object the server lacks, so that the cache
        may drop them (a paused VM then goes on if that made room). The version is not committed: that is
        the suspend's checkin."""
        assert self.vulpes is not None
        if self.options.disconnected:
            raise Refused(f"{self.options.name} runs disconnected: nothing can be uploaded until `isr checkin`")
        if not self._server_answers():
            raise Refused("the server does not answer: nothing was uploaded")
        status = self.vulpes.status()
        before = room.dirty_bytes(status)
        self._vulpes_upload(reporter)
        status = self.vulpes.reclaim()
        result = {"name": self.options.name, "uploaded_bytes": max(0, before - room.dirty_bytes(status)),
                  "room": int(status["cache"]["room"])}
        if self.full.since is not None:
            assert self.vm is not None
            result["continued"] = self.full.go_on_if_room(self.vm, self.vulpes, 1, reporter)
        return result

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

    def _end(self, kind: str, checkin: bool, reporter: Reporter, *, quit_vm: bool,
             wait: float | None = None, age: float | None = None) -> dict[str, Any]:
        """Suspend (kind SUSPENDED) or power off (POWEROFF) the VM, and check in unless told not to. A poweroff
        asks the guest to shut down first and pulls the plug after ``wait`` seconds (default `POWEROFF_WAIT`;
        0: at once). ``age``: how long the requesting command had run when it asked; the time to the safe
        state counts from its start (a first phase, "isr start")."""
        assert self.vm is not None and self.vulpes is not None and self.manifest is not None
        t = time.monotonic()
        phases: dict[str, float] = {}
        if age is not None and age < _AGE_MAX:
            phases["isr start"] = age
        started = t - phases.get("isr start", 0.0)
        result: dict[str, Any] = {"parcel": self.options.parcel, "name": self.options.name}
        # Asked while QEMU saves the state, so that the upload does not wait a connection and a round trip for it.
        answers = background.start("health check", self._server_answers) if checkin and kind == SUSPENDED else None
        if kind == SUSPENDED:
            self._recent_since = self._watch_recent_pages(answers)
            if self._recent_since is not None:
                t = _lap(phases, "recent pages", t)
            try:
                self.vm.stop()
                with contextlib.suppress(IsrError):
                    self.vulpes.trace_stop()
                data, stats = self.vm.save_state_bytes(sync=False)
                payload_digest = hashlib.sha256(data).hexdigest()
                sealed = seal.seal(self.keys.parcel_key, seal.KIND_DEVSTATE, data)
                size = len(data)
                del data
                write_file(self.state.local_devstate_path(), sealed)
                t = _lap(phases, "save device state", t)
                self._make_durable(checkin, reporter)
                t = _lap(phases, "flush", t)
            except (IsrError, OSError) as exc:
                self._carry_on_after_failed_suspend()
                if room.no_room_error(exc):
                    status = self.vulpes.status()
                    usage = CacheUsage.from_status(status["cache"])
                    raise SuspendAborted(f"the chunk cache has no room to make the VM's state durable "
                                         f"({human_bytes(room.dirty_bytes(status))} of {self.options.name} not yet "
                                         f"uploaded): {usage.what_to_do()}, then suspend again; the VM stays "
                                         f"here") from None
                raise SuspendAborted(f"the suspend failed ({exc}); the VM keeps running here. If the guest waits "
                                     f"for chunks from an unreachable server, suspend again when it is back") \
                    from None
            # The point of no return: the state is saved; the session ends whatever happens next.
            self.ending = True
            self.vm.shutdown()
            t = _lap(phases, "quit QEMU", t)
            resume_pack = self._make_resume_pack()
            if resume_pack:
                t = _lap(phases, "resume pack", t)
            change = LocalChange(state=SUSPENDED, devstate={"sha256": payload_digest, "size": size},
                                 resume_pack=resume_pack,
                                 qemu_version=self.host.version if self.host else None, suspended_at=utc_now(),
                                 working_set=self._trace_working_set(), base_suspended=self.manifest.suspended)
            reporter.say(f"suspended {self.options.name}: device state {size / 2**20:.1f} MiB "
                         f"({len(sealed) / 2**20:.1f} MiB sealed), working set {len(change.working_set['disk'])} disk + "
                         f"{len(change.working_set['memory'])} memory chunks")
        else:
            self.ending = True
            if quit_vm:
                self._shut_down(reporter, POWEROFF_WAIT if wait is None else wait)
            # A power cut for the guest if it is still on (QEMU's 'quit' still completes the writes it accepted);
            # the RAM goes.
            self.vm.shutdown()
            with contextlib.suppress(IsrError):
                self.vulpes.trace_stop()
            fsync_path(self.vulpes.disk)
            self.vulpes.flush()
            t = _lap(phases, "flush", t)
            change = LocalChange(state=POWEROFF, working_set=self._trace_working_set(),
                                 base_suspended=self.manifest.suspended)
        change.nvram = self._save_nvram()
        self.state.save_local_change(change)
        safe_at = time.monotonic()
        safe = safe_at - started
        if kind == SUSPENDED:
            reporter.say(f"the VM state is safe at this site after {safe:.2f} s "
                         f"({', '.join(f'{k} {v:.2f} s' for k, v in phases.items())})")
        unreachable = checkin and not (answers.result() if answers is not None else self._server_answers())
        if unreachable:
            checkin = False
        staging = None
        if checkin and kind == SUSPENDED:
            staging = self._stage()
            self._vulpes_upload(reporter)
            t = _lap(phases, "upload (vulpes)", t)
        stopped = None
        if staging is not None:
            # vulpes unmounts and exits while the commit crosses the link (the local state becomes the new base
            # only once it has exited).
            stopped = self._stop_vulpes_beside()
        else:
            self.vulpes.stop()
            t = _lap(phases, "unmount", t)
        if kind == POWEROFF:
            forget_memory(self.state)
            safe = time.monotonic() - started
            reporter.say(f"powered off {self.options.name} in {safe:.1f} s: the saved RAM is forgotten; the next "
                         f"resume boots cold")
        result["suspend_seconds"] = round(safe, 3)
        result["version"] = self.base_version
        if unreachable:
            # Asked to check in and could not even start: the command fails, in one line, like a checkin that
            # fails part way (it used to exit 0 with a note in its output).
            raise SessionError(f"the server does not answer: the new state is kept at this site, and so is the "
                               f"lock: `isr checkin {self.options.name}` when it is back")
        if checkin:
            try:
                result.update(self._checkin(reporter, staging, settle=stopped))
            finally:
                failure = stopped() if stopped is not None else None
            if failure is not None:
                raise failure
            reporter.say(f"checked in {time.monotonic() - safe_at:.2f} s after the state was safe")
        else:
            reporter.say(f"not checked in: this site keeps the lock; `isr checkin {self.options.name}` uploads "
                         f"the new version")
        result["phases"] = {k: round(v, 3) for k, v in phases.items()}
        return result

    def _shut_down(self, reporter: Reporter, wait: float) -> None:
        """Press the guest's ACPI power button and give it ``wait`` seconds to power itself off (QEMU then
        exits); the caller pulls the plug if it has not."""
        assert self.vm is not None
        if wait <= 0:
            reporter.say(f"pulling the plug of {self.options.name}")
            return
        try:
            status = self.vm.query_status()
            if status != "running":
                reporter.say(f"the VM is not running ({status}), so it cannot shut itself down: pulling the plug")
                return
            self.vm.qmp("system_powerdown")
        except VMError as exc:
            reporter.say(f"cannot ask the guest to shut down ({exc}): pulling the plug")
            return
        reporter.say(f"asked {self.options.name} to shut down (ACPI power button); pulling the plug after {wait:g} s")
        started = time.monotonic()
        deadline = started + wait
        while True:
            try:
                self.vm.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            except VMTimeoutError:
                if time.monotonic() >= deadline:
                    reporter.say(f"the guest did not power off within {wait:g} s: pulling the plug")
                    return
                self._renew()   # the lock lease goes on while the guest takes its time
                continue
            reporter.say(f"the guest shut down cleanly in {time.monotonic() - started:.1f} s")
            return

    def _make_durable(self, checkin: bool, reporter: Reporter) -> None:
        """Make the guest's RAM (the memory image, written back through QEMU's mapping) and every write vulpes
        acknowledged durable. If the cache has no room for them and a checkin follows anyway, what is not
        uploaded yet goes to the server first, so that the cache may drop it."""
        assert self.vm is not None and self.vulpes is not None
        try:
            if self.vm.config.memory_file is not None:
                fsync_path(self.vm.config.memory_file)
            fsync_path(self.vulpes.disk)
            self.vulpes.flush()
            return
        except (IsrError, OSError) as exc:
            if not (room.no_room_error(exc) and checkin and not self.options.disconnected and self._server_answers()):
                raise
        reporter.say("  the chunk cache is full: uploading what is not on the server yet, to make room")
        self.vulpes.upload()
        if self.vm.config.memory_file is not None:
            fsync_path(self.vm.config.memory_file)
        fsync_path(self.vulpes.disk)
        self.vulpes.flush()

    def _carry_on_after_failed_suspend(self) -> None:
        """Let the guest go on after a suspend that did not save its state (best effort); a VM that was
        paused for lack of room stays paused."""
        assert self.vm is not None and self.vulpes is not None
        with contextlib.suppress(FileNotFoundError):
            self.state.local_devstate_path().unlink()
        with contextlib.suppress(IsrError):
            if self.vm.is_running() and self.vm.query_status() in ("paused", "postmigrate") \
                    and self.full.since is None:
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

    def _load_resume_pack(self, fetching: pack.Fetching) -> None:
        """The resume pack's parts, as ``fetching`` brings them, to vulpes: the first now, the others in the
        background while the guest runs on the first (`isrctl.pack`)."""
        assert self.vulpes is not None
        count = len(fetching.names)
        parts = iter(fetching)
        used = pack.hand_over(itertools.islice(parts, 1), self.vulpes)
        if not used:
            fetching.close()
            return
        self.reporter.say(f"  resume pack: {used / 2**20:.1f} MiB of memory ready before its chunks"
                          + (f", {count - 1} more parts to follow" if count > 1 else ""))
        if count > 1:
            vulpes = self.vulpes
            self._pack_loaded.clear()

            def rest() -> None:
                try:
                    pack.hand_over(parts, vulpes)
                finally:
                    fetching.close()
                    with contextlib.suppress(IsrError):
                        vulpes.preload_end("memory", fetching.rate)     # no read waits for a part now
                    self._pack_loaded.set()

            threading.Thread(target=rest, name="resume-pack", daemon=True).start()
        else:
            with contextlib.suppress(IsrError):
                self.vulpes.preload_end("memory", fetching.rate)    # the whole pack is here

    def _watch_recent_pages(self, answers: concurrent.futures.Future[bool] | None) -> float | None:
        """Let the guest run `pack.RECENT_SECONDS` more with its mapped pages dropped, so that the trace records
        the pages it is using now (the resume pack's recent pages); when that began, or None if not: no trace,
        vulpes refused, or the server does not answer (``answers``: the suspend's health check), for then a
        guest that runs on may wait for it (a write to part of a disk chunk not here), and the stop with it.
        First the trace gets the pages QEMU maps that no read showed it: those vulpes's warmer had put into
        the page cache before the guest touched them (`Vulpes.trace_mapped`)."""
        assert self.vulpes is not None
        if self.trace_path is None:
            return None
        try:
            if (answers is not None and not answers.result()) or self.vulpes.status()["fetch"].get("waiting"):
                log.info("the resume pack has no recent pages: the server does not answer")
                return None
            if self.vm is not None and self.vm.pid is not None:
                try:
                    self.vulpes.trace_mapped(self.vm.pid)
                except VulpesFailure as exc:      # e.g. Yama's ptrace_scope 1 hides QEMU's page tables
                    log.warning("the trace lacks the guest's touches of pages vulpes had warmed: %s", exc)
            since = time.time()
            self.vulpes.invalidate("memory")
        except (VulpesFailure, KeyError) as exc:
            log.warning("the resume pack has no recent pages: %s", exc)
            return None
        time.sleep(pack.RECENT_SECONDS)
        return since

    def _make_resume_pack(self) -> list[dict[str, Any]]:
        """Seal this session's resume pack into ``local/resumepack*``; each part's digest and size, or none (the
        guest booted cold here, the trace holds no memory reads, or the pack could not be made: it is
        optional)."""
        assert self.vulpes is not None and self.manifest is not None
        if self.trace_path is None or not (self.resumed or self._recent_since is not None):
            return []
        made = []
        try:
            try:
                rate_peak = float(self.vulpes.status().get("fetch", {}).get("rate_peak") or 0)
            except VulpesFailure:
                rate_peak = 0
            limit = pack.limit(rate_peak)
            payloads = pack.build(self.trace_path, self.vulpes.memory, self.manifest.images["memory"].size,
                                  limit=limit, recent_since=self._recent_since, resumed=self.resumed)
            log.info("resume pack: %d parts of at most %d MiB (the link carried %.1f MB/s at best)", len(payloads),
                     limit >> 20, rate_peak / 1e6)
            for index, payload in enumerate(payloads):
                write_file(self.state.local_pack_path(index), pack.seal_pack(self.keys, payload))
                made.append({"sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload)})
        except (OSError, ParcelError) as exc:
            log.warning("this suspend makes no resume pack: %s", exc)
            return []
        return made

    def _trace_working_set(self) -> dict[str, list[int]]:
        assert self.manifest is not None
        if self.trace_path is None:
            return {image: [] for image in IMAGES}
        return workingset.from_trace(self.trace_path, self.manifest.chunk_counts())

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
        refused = ""
        last_left, moved = pending, time.monotonic()
        while worker.is_alive():
            worker.join(_POLL)
            with contextlib.suppress(IsrError):
                status = self.vulpes.status()
                left = sum(int(status["images"][i].get("pending_uploads", 0)) for i in IMAGES)
                bar.update(max(0, pending - left))
                if left < last_left:
                    last_left, moved = left, time.monotonic()
                fetch = status.get("fetch", {})
                if time.monotonic() - moved > _UPLOAD_STALL and fetch.get("waiting_seconds", 0) > _UPLOAD_STALL:
                    # vulpes retries forever (right for a running VM); a suspend gives the user control back.
                    refused = str(fetch.get("last_error") or "no answer")
                    break
        note = ""
        if uploaded:
            note = f"{uploaded[0]} sent" + (", the rest superseded or already there" if uploaded[0] < pending else "")
        bar.close(note or ("stopped" if refused else ""))
        if refused:
            reporter.say(f"  the server has taken no new chunk for {_UPLOAD_STALL:.0f} s ({refused}): they stay here")
        if failure:
            # Not fatal: the checkin uploads whatever the server still lacks from the cache files.
            log.warning("vulpes upload failed: %s", failure[0])

    def _stop_vulpes_beside(self) -> Callable[[], VulpesFailure | None]:
        """Stop vulpes on a thread of its own; returns the wait for it, which gives the failure of the stop (None
        if it exited cleanly) and may be called more than once."""
        assert self.vulpes is not None
        stopping = background.start("stop vulpes", self.vulpes.stop)

        def stopped() -> VulpesFailure | None:
            try:
                stopping.result()
            except VulpesFailure as exc:
                return exc
            return None
        return stopped

    def _stage(self) -> concurrent.futures.Future[Staged]:
        """Seal and stage the new version's blobs (keyrings, device state, resume pack, manifest) while vulpes
        uploads its chunks, so that the checkin after the upload is only the commit (`checkin.stage`)."""
        assert self.client is not None
        return background.start("stage", stage_blobs, self.client, self.state, self.keys)

    def _checkin(self, reporter: Reporter, staged: concurrent.futures.Future[Staged] | None = None, *,
                 settle: Callable[[], object] | None = None) -> dict[str, Any]:
        if self.client is None:
            return {}
        started = time.monotonic()
        try:
            version = do_checkin(self.client, self.state, self.keys, keep_lock=False, reporter=reporter,
                                 staged=staged, settle=settle)
        except LockBroken:
            self.exit_code = 1
            raise
        except RemoteUnreachable as exc:
            self.exit_code = 1
            raise SessionError(f"the server is unreachable ({exc}); the new state is kept at this site: "
                               f"`isr checkin {self.options.name}` when it is back") from None
        except ServerFailure as exc:
            self.exit_code = 1
            raise SessionError(f"the server failed to store the new version ({exc}); the new state is kept at "
                               f"this site: `isr checkin {self.options.name}` when it works again") from None
        self.base_version = version
        return {"version": version, "checkin_seconds": round(time.monotonic() - started, 3)}


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


