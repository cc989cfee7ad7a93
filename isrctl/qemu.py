"""Run one QEMU virtual machine and drive it over QMP: launch, stop, save and load its state, shut it down.

This is the only module in isrctl that starts QEMU; it speaks QMP through `isrctl.qmp` (a synchronous
face on the ``qemu.qmp`` package), so a `VM` can be used from ordinary code, from tests, and from code that
has its own asyncio loop. Next to it: `isrctl.seccomp` (the filter QEMU runs under when its RAM is a file)
and `isrctl.accel` (the probe that says whether KVM works here).

Life of a VM::

    with VM(VMConfig(disk=Path("disk.img"), kernel=..., initrd=..., cmdline="console=ttyS0")) as vm:
        vm.launch()                      # QEMU runs; vm.serial is the guest's serial console
        ...
        vm.save_state(Path("state.zst")) # stop + migrate to a zstd-compressed file
    # leaving the block quits QEMU (then SIGTERM, then SIGKILL) and always reaps it

    with VM(same_config) as vm:
        vm.launch_incoming()             # same command line plus -incoming defer
        vm.load_state(Path("state.zst")) # the guest continues where it stopped

QEMU is always started with ``-S`` (CPUs stopped) so that the monitor and the serial console are both
connected before the guest executes its first instruction: nothing the guest prints can be lost.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from parcels.durable import fsync_path

from .errors import MigrationError, VMError, VMLaunchError, VMTimeoutError
from .qmp import QMPConnection
from .seccomp import no_hugepage_filter

log = logging.getLogger(__name__)


#: Disk cache modes QEMU accepts for ``-drive cache=``.
CACHE_MODES = ("none", "writeback", "writethrough", "directsync", "unsafe")
#: Asynchronous I/O back ends QEMU accepts for ``-drive aio=``.
AIO_MODES = ("threads", "native", "io_uring")
#: Accelerators this module knows how to ask for.
ACCELERATORS = ("tcg", "kvm")

# Migration bandwidth while saving: QEMU's default limit (128 MiB/s) applies even to a stopped guest, which
# would make saving a 4 GiB guest take half a minute for no reason. 64 GiB/s is effectively unlimited.
_SAVE_BANDWIDTH = 64 << 30
_POLL_INTERVAL = 0.05
_OUTPUT_TAIL = 4000


@dataclass(frozen=True)
class VMConfig:
    """Everything that determines a VM's QEMU command line.

    A saved state can only be loaded into a VM with the same configuration, which is why the machine type
    must be a versioned one (``pc-q35-7.2``, never the ``q35`` alias) and the CPU a named model (never
    ``host``): both pin the virtual hardware so that the state stays loadable on another PC.
    """

    disk: Path | None = None
    disk_format: str = "raw"
    disk_cache: str = "writeback"
    disk_aio: str = "threads"
    disk_readonly: bool = False
    kernel: Path | None = None
    initrd: Path | None = None
    cmdline: str | None = None
    machine: str = "pc-q35-7.2"
    cpu: str = "qemu64"
    memory_mib: int = 256
    smp: int = 1
    accel: str = "tcg"
    #: Keep guest RAM in this file (``memory-backend-file``, ``share=on``) instead of anonymous memory; a
    #: saved state then leaves RAM out of the stream (migration capability ``x-ignore-shared``).
    memory_file: Path | None = None
    #: A ``-vnc`` display argument (e.g. ``unix:/run/isr/vnc.sock`` or ``127.0.0.1:5``); adds a VGA card.
    vnc: str | None = None
    #: QEMU's user-mode network on a virtio-net NIC (the guest is 10.0.2.15), with these ``hostfwd`` rules
    #: (``tcp:127.0.0.1:2222-:22``; `parcels.devices.Forward`).
    user_net: bool = False
    host_forwards: tuple[str, ...] = ()
    #: A virtio-rng device fed from the host's /dev/urandom.
    rng: bool = False
    #: A virtio-balloon device with free page reporting: the guest reports free memory and QEMU discards it,
    #: which punches it out of ``memory_file`` (vulpes then stores and fetches nothing for those chunks).
    balloon: bool = False
    #: UEFI: the firmware's code (read-only flash, e.g. OVMF_CODE_4M.fd) and the VM's own variable store
    #: (writable flash, the parcel's ``nvram``). Neither: legacy BIOS (SeaBIOS, built into QEMU).
    firmware_code: Path | None = None
    firmware_vars: Path | None = None
    #: Make a guest reset end QEMU (``-action reboot=shutdown``; `VM.shutdown_reason` then says
    #: ``guest-reset``) instead of restarting the machine in place: for a VM resumed without its boot files,
    #: which a reset inside QEMU could not boot again.
    reset_exits: bool = False
    extra_args: tuple[str, ...] = ()
    qemu_binary: str = "qemu-system-x86_64"

    def __post_init__(self) -> None:
        if self.disk_cache not in CACHE_MODES:
            raise VMError(f"disk cache mode {self.disk_cache!r} is not one of {', '.join(CACHE_MODES)}")
        if self.disk_aio not in AIO_MODES:
            raise VMError(f"disk aio mode {self.disk_aio!r} is not one of {', '.join(AIO_MODES)}")
        if self.disk_aio == "native" and self.disk_cache not in ("none", "directsync"):
            raise VMError("disk aio=native needs O_DIRECT: use disk cache mode 'none' or 'directsync'")
        if self.accel not in ACCELERATORS:
            raise VMError(f"accelerator {self.accel!r} is not one of {', '.join(ACCELERATORS)}")
        if not re.fullmatch(r"[a-z0-9-]+-\d+\.\d+", self.machine):
            raise VMError(f"machine type {self.machine!r} is not versioned: use e.g. 'pc-q35-7.2'")
        if self.cpu in ("host", "max"):
            raise VMError(f"CPU model {self.cpu!r} depends on this PC: use a named model such as 'qemu64'")
        if self.memory_mib < 16 or self.smp < 1:
            raise VMError(f"implausible VM size: {self.memory_mib} MiB RAM, {self.smp} CPUs")
        if (self.initrd or self.cmdline) and not self.kernel:
            raise VMError("an initrd or kernel command line needs a kernel")
        if (self.firmware_code is None) != (self.firmware_vars is None):
            raise VMError("UEFI needs both the firmware code and a variable store")
        if self.host_forwards and not self.user_net:
            raise VMError("port forwards need the user-mode network")

    def command_line(self, *, qmp_socket: Path, serial_socket: Path, incoming: bool = False) -> list[str]:
        """The full QEMU command line for this configuration, with the given control sockets."""
        machine = self.machine
        args = [self.qemu_binary, "-nodefaults", "-no-user-config", "-S", "-display", "none"]
        if self.memory_file is not None:
            backend = (f"memory-backend-file,id=ram0,size={self.memory_mib}M,"
                       f"mem-path={_qemu_opt(str(self.memory_file))},share=on")
            args += ["-object", backend]
            machine += ",memory-backend=ram0"
        args += ["-machine", machine, "-accel", self.accel, "-cpu", self.cpu,
                 "-m", str(self.memory_mib), "-smp", str(self.smp)]
        if self.firmware_code is not None and self.firmware_vars is not None:
            args += ["-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={_qemu_opt(str(self.firmware_code))}",
                     "-drive", f"if=pflash,format=raw,unit=1,file={_qemu_opt(str(self.firmware_vars))}"]
        if self.kernel is not None:
            args += ["-kernel", str(self.kernel)]
        if self.initrd is not None:
            args += ["-initrd", str(self.initrd)]
        if self.cmdline is not None:
            args += ["-append", self.cmdline]
        if self.disk is not None:
            # A write refused for lack of room (vulpes's cache is full) pauses the VM, and QEMU retries it
            # on `cont`; any other error is the guest's to see.  discard=unmap passes the guest's discards
            # (TRIM) on as holes in the image; it is a property of the host side only (virtio-blk offers
            # discard to the guest either way), so a state saved without it loads with it.
            drive = (f"file={_qemu_opt(str(self.disk))},format={self.disk_format},if=none,id=disk0,"
                     f"cache={self.disk_cache},aio={self.disk_aio},discard=unmap,werror=enospc,rerror=report")
            if self.disk_readonly:
                drive += ",readonly=on"
            args += ["-drive", drive, "-device", "virtio-blk-pci,drive=disk0"]
        args += ["-chardev", f"socket,id=qmp0,path={_qemu_opt(str(qmp_socket))},server=on,wait=off",
                 "-mon", "chardev=qmp0,mode=control",
                 "-chardev", f"socket,id=serial0,path={_qemu_opt(str(serial_socket))},server=on,wait=off",
                 "-serial", "chardev:serial0"]
        if self.vnc is not None:
            args += ["-device", "VGA", "-vnc", self.vnc]
        if self.user_net:
            netdev = "user,id=net0" + "".join(f",hostfwd={_qemu_opt(rule)}" for rule in self.host_forwards)
            args += ["-netdev", netdev, "-device", "virtio-net-pci,netdev=net0"]
        if self.rng:
            args += ["-object", "rng-random,id=rng0,filename=/dev/urandom", "-device", "virtio-rng-pci,rng=rng0"]
        if self.balloon:
            args += ["-device", "virtio-balloon-pci,id=balloon0,free-page-reporting=on"]
        if self.reset_exits:
            args += ["-action", "reboot=shutdown"]
        if incoming:
            args += ["-incoming", "defer"]
        return args + list(self.extra_args)


def _qemu_opt(value: str) -> str:
    """Escape a value for a QEMU ``key=value,...`` option string (a comma is written as two)."""
    return value.replace(",", ",,")


@dataclass(frozen=True)
class MigrationStats:
    """What saving or loading a VM's state cost."""

    seconds: float
    #: Bytes QEMU put into (or read from) the migration stream, before compression.
    stream_bytes: int
    #: Size of the state file after compression, when the state went to a file.
    file_bytes: int | None = None
    #: QEMU's own view of the migration (the last ``query-migrate`` answer).
    info: dict[str, Any] = field(default_factory=dict)


class VM:
    """One QEMU process: a context manager that always leaves no QEMU behind.

    ``run_dir`` receives QEMU's output log (``<name>.log``); the control sockets live in a private short
    directory of their own because Unix socket paths are limited to 107 bytes.
    """

    def __init__(self, config: VMConfig, *, run_dir: Path | None = None, name: str = "vm") -> None:
        self.config = config
        self.name = name
        self._run_dir = run_dir
        self._sock_dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._qmp: QMPConnection | None = None
        self._serial: socket.socket | None = None
        self._log_path: Path | None = None
        self._log_start = 0
        self._args: list[str] = []
        self._incoming = False
        #: QEMU's exit code once it has been reaped (negative: killed by that signal).
        self.exitcode: int | None = None
        #: Why QEMU shut down, from its last ``SHUTDOWN`` event (``guest-shutdown``: the guest powered off;
        #: ``guest-reset``: it rebooted, with `VMConfig.reset_exits`); None if it sent none (killed, crashed).
        self.shutdown_reason: str | None = None

    # --- context manager ---------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # --- properties --------------------------------------------------------------------------------

    @property
    def args(self) -> list[str]:
        """The command line of the current (or last) QEMU process."""
        return list(self._args)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def log_path(self) -> Path | None:
        """QEMU's own stdout and stderr."""
        return self._log_path

    @property
    def serial(self) -> socket.socket:
        """The connected serial console (ttyS0) socket; the caller reads and writes it."""
        if self._serial is None:
            raise VMError(f"VM {self.name} is not running")
        return self._serial

    def is_running(self) -> bool:
        """Whether the QEMU process exists and has not exited."""
        return self._proc is not None and self._proc.poll() is None

    def output(self) -> str:
        """The tail of QEMU's own output (not the guest's console) since the last launch."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        with open(self._log_path, "rb") as f:
            f.seek(max(self._log_start, f.seek(0, os.SEEK_END) - _OUTPUT_TAIL))
            return f.read().decode(errors="replace")

    # --- starting ----------------------------------------------------------------------------------

    def launch(self, *, paused: bool = False, timeout: float = 30.0) -> None:
        """Start QEMU, connect its monitor and serial console, and (unless ``paused``) start the guest."""
        self._start(incoming=False, timeout=timeout)
        if not paused:
            self.cont()

    def launch_incoming(self, *, timeout: float = 30.0) -> None:
        """Start QEMU waiting for a saved state (``-incoming defer``); continue with `load_state`."""
        self._start(incoming=True, timeout=timeout)

    def _start(self, *, incoming: bool, timeout: float) -> None:
        if self._proc is not None:
            raise VMError(f"VM {self.name} is already running")
        self._sock_dir = Path(tempfile.mkdtemp(prefix="isr-vm-"))
        if self._run_dir is None:
            log_dir = self._sock_dir
        else:
            log_dir = self._run_dir
            log_dir.mkdir(parents=True, exist_ok=True)
        self._log_path = log_dir / f"{self.name}.log"
        qmp_path = self._sock_dir / "qmp.sock"
        serial_path = self._sock_dir / "serial.sock"
        self._args = self.config.command_line(qmp_socket=qmp_path, serial_socket=serial_path, incoming=incoming)
        self._incoming = incoming
        self.exitcode = None
        self.shutdown_reason = None
        log.info("launching %s: %s", self.name, shlex.join(self._args))
        try:
            # Appended, so that relaunching under the same name keeps the earlier run's output too.
            with open(self._log_path, "ab") as out:
                self._log_start = out.tell()
                self._proc = self._spawn(out)
        except OSError as exc:
            self._cleanup()
            raise VMLaunchError(f"cannot run {self._args[0]}: {exc.strerror}", exitcode=None,
                                args=self._args, output="") from exc
        try:
            self._connect_qmp(qmp_path, timeout)
            self._serial = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._serial.connect(str(serial_path))
        except BaseException as exc:
            # Kill first so the error can report the exit code and the complete output.
            self._kill_and_reap()
            error = VMLaunchError(f"QEMU ({self.name}) failed to start", exitcode=self.exitcode,
                                  args=self._args, output=self.output())
            self._cleanup()
            if isinstance(exc, VMError | OSError):
                raise error from exc
            raise

    def _spawn(self, out: Any) -> subprocess.Popen[bytes]:
        """Start QEMU; with RAM in a file, from a short-lived thread that carries `no_hugepage_filter`.

        A seccomp filter belongs to the thread that installs it and to the processes it starts, so a
        throwaway thread keeps it away from the rest of isrctl and needs no code between fork and exec.
        """
        def popen() -> subprocess.Popen[bytes]:
            return subprocess.Popen(self._args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)

        if self.config.memory_file is None:
            return popen()
        result: list[Any] = []

        def launcher() -> None:
            try:
                no_hugepage_filter(self.config.memory_mib << 20)
            except OSError as exc:
                log.warning("cannot keep QEMU from marking guest RAM MADV_HUGEPAGE (%s); each RAM fault will "
                            "read up to 4 MiB of %s", exc, self.config.memory_file)
            try:
                result.append(popen())
            except BaseException as exc:  # handed to the caller's thread below
                result.append(exc)

        thread = threading.Thread(target=launcher, name=f"launch-{self.name}")
        thread.start()
        thread.join()
        if isinstance(result[0], BaseException):
            raise result[0]
        proc: subprocess.Popen[bytes] = result[0]
        return proc

    def _connect_qmp(self, path: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._qmp = QMPConnection(self.name)
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise VMError("QEMU exited during start-up")
            if path.exists():
                try:
                    self._qmp.connect(path, timeout=max(0.1, deadline - time.monotonic()))
                    return
                except VMError as exc:
                    log.debug("QMP connect to %s: %s", path, exc)
            if time.monotonic() > deadline:
                raise VMTimeoutError(f"QEMU's monitor did not come up within {timeout} s")
            time.sleep(_POLL_INTERVAL)

    # --- QMP commands ------------------------------------------------------------------------------

    def qmp(self, command: str, arguments: dict[str, Any] | None = None, *, timeout: float = 30.0) -> Any:
        """Execute one QMP command and return its result; raises `QMPCommandError` on an error answer."""
        if self._qmp is None or not self.is_running():
            raise VMError(f"VM {self.name} is not running; cannot execute {command}")
        return self._qmp.execute(command, arguments, timeout)

    def query_status(self) -> str:
        """The run state: ``running``, ``paused``, ``inmigrate``, ``postmigrate``, ``shutdown``, ..."""
        return str(self.qmp("query-status")["status"])

    def stop(self) -> None:
        """Pause the guest's CPUs."""
        self.qmp("stop")

    def cont(self) -> None:
        """Resume the guest's CPUs."""
        self.qmp("cont")

    def paused_for_space(self) -> bool:
        """Whether QEMU stopped the guest because a disk write found no space (run state ``io-error``:
        with ``werror=enospc`` only ENOSPC stops it); `cont` retries the write."""
        return self.query_status() == "io-error"

    # --- saving and loading the state --------------------------------------------------------------

    def save_state(self, target: os.PathLike[str] | str, *, compress: bool = True,
                   timeout: float = 600.0, sync: bool = True) -> MigrationStats:
        """Stop the guest and write its whole state (RAM, devices) to ``target``.

        ``target`` is a file path, written through ``zstd`` (or plain when ``compress`` is false), or a
        string starting with ``exec:``, a complete QEMU migration URI whose command receives the stream on
        stdin. The guest stays stopped (run state ``postmigrate``) with its disk flushed; the caller then
        quits it with `shutdown`. With ``sync`` the state file and the RAM file (if any) are fsynced,
        because QEMU makes neither durable.
        """
        path: Path | None = None
        if isinstance(target, str) and target.startswith("exec:"):
            uri = target
        else:
            path = Path(target)
            writer = "zstd -T0 -3 -q" if compress else "cat"
            uri = f"exec:{writer} > {shlex.quote(str(path))}"
        if self.query_status() == "running":
            self.stop()
        self.qmp("migrate-set-parameters", {"max-bandwidth": _SAVE_BANDWIDTH})
        self._set_ignore_shared()
        started = time.monotonic()
        self.qmp("migrate", {"uri": uri})
        info = self._wait_migration(timeout, "saving the state")
        seconds = time.monotonic() - started
        file_bytes = None
        if path is not None:
            if sync:
                fsync_path(path)
            file_bytes = path.stat().st_size
        if sync and self.config.memory_file is not None:
            fsync_path(self.config.memory_file)
        stats = MigrationStats(seconds=seconds, stream_bytes=_stream_bytes(info), file_bytes=file_bytes,
                               info=info)
        log.info("saved %s: %d stream bytes, %s file bytes, %.2f s", self.name, stats.stream_bytes,
                 file_bytes, seconds)
        return stats

    def load_state(self, source: os.PathLike[str] | str, *, compress: bool = True,
                   timeout: float = 600.0, start: bool = True) -> MigrationStats:
        """Load a state written by `save_state` into a VM started with `launch_incoming`, then continue it.

        ``source`` is a file path (read through ``zstd -dc`` unless ``compress`` is false) or an ``exec:``
        URI whose command writes the stream to stdout. With ``start`` false the guest stays paused.
        """
        if not self._incoming:
            raise VMError(f"VM {self.name} was not launched with launch_incoming()")
        if isinstance(source, str) and source.startswith("exec:"):
            uri = source
        else:
            reader = "zstd -dc" if compress else "cat"
            uri = f"exec:{reader} {shlex.quote(str(Path(source)))}"
        return self._finish_incoming(uri, timeout, start)

    def _finish_incoming(self, uri: str, timeout: float, start: bool) -> MigrationStats:
        """Start the incoming migration from ``uri``, wait until the state is loaded, and continue."""
        self._set_ignore_shared()
        started = time.monotonic()
        self.qmp("migrate-incoming", {"uri": uri})
        deadline = started + timeout
        while True:
            status = self._poll_status("loading the state")
            if status == "paused":
                break
            if status not in ("inmigrate", "prelaunch"):
                raise MigrationError(f"loading the state left VM {self.name} in run state {status!r}")
            info = self.qmp("query-migrate")
            if info.get("status") in ("failed", "cancelled"):
                raise MigrationError(f"loading the state failed: {info.get('error-desc', info)}")
            if time.monotonic() > deadline:
                raise VMTimeoutError(f"loading the state took longer than {timeout} s")
            time.sleep(_POLL_INTERVAL)
        seconds = time.monotonic() - started
        info = self.qmp("query-migrate")
        if start:
            self.cont()
        self._incoming = False
        return MigrationStats(seconds=seconds, stream_bytes=_stream_bytes(info), info=info)

    def save_state_bytes(self, *, timeout: float = 600.0, sync: bool = True) -> tuple[bytes, MigrationStats]:
        """Stop the guest and return its whole state (devices, and RAM unless RAM is in a shared file).

        The stream goes through a pipe handed to QEMU, straight into this process's memory: unlike
        `save_state` to a file, no plaintext VM state ever touches a disk. The caller seals it. With RAM
        in a shared file (``memory_file``) the stream is small (device state only, ~0.1-1 MB); that file
        is fsynced here (unless ``sync`` is false: the caller does it), since QEMU does not make it durable.
        """
        if self.query_status() == "running":
            self.stop()
        self.qmp("migrate-set-parameters", {"max-bandwidth": _SAVE_BANDWIDTH})
        self._set_ignore_shared()
        read_end, write_end = os.pipe()
        chunks: list[bytes] = []
        failure: list[BaseException] = []

        def drain() -> None:
            try:
                while block := os.read(read_end, 1 << 20):
                    chunks.append(block)
            except OSError as exc:  # pragma: no cover - a pipe read fails only if the fd is broken
                failure.append(exc)

        reader = threading.Thread(target=drain, name=f"save-{self.name}", daemon=True)
        reader.start()
        try:
            assert self._qmp is not None
            self._qmp.send_fd(write_end, "isr-save")
            # QEMU holds its own copy now; ours must go, or the reader would never see end of file.
            os.close(write_end)
            write_end = -1
            started = time.monotonic()
            self.qmp("migrate", {"uri": "fd:isr-save"})
            info = self._wait_migration(timeout, "saving the state")
            seconds = time.monotonic() - started
            reader.join(timeout)
            if reader.is_alive():
                raise VMTimeoutError("QEMU finished the migration but kept the state pipe open")
        finally:
            if write_end >= 0:
                os.close(write_end)
            if not reader.is_alive():
                os.close(read_end)
        if failure:
            raise MigrationError(f"reading the state stream failed: {failure[0]}")
        if sync and self.config.memory_file is not None:
            fsync_path(self.config.memory_file)
        data = b"".join(chunks)
        return data, MigrationStats(seconds=seconds, stream_bytes=_stream_bytes(info), file_bytes=None, info=info)

    def load_state_bytes(self, data: bytes, *, timeout: float = 600.0, start: bool = True) -> MigrationStats:
        """Load a state returned by `save_state_bytes` into a VM started with `launch_incoming`.

        The stream goes to QEMU through a pipe, never through a file. With ``start`` false the guest stays
        paused.
        """
        if not self._incoming:
            raise VMError(f"VM {self.name} was not launched with launch_incoming()")
        read_end, write_end = os.pipe()
        failure: list[BaseException] = []

        def feed() -> None:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(write_end, view):]
            except OSError as exc:  # EPIPE if QEMU gave up on the stream; the migration status says why
                failure.append(exc)
            finally:
                os.close(write_end)

        writer = threading.Thread(target=feed, name=f"load-{self.name}", daemon=True)
        try:
            assert self._qmp is not None
            self._qmp.send_fd(read_end, "isr-load")
        finally:
            os.close(read_end)
        writer.start()
        # A feeding failure (EPIPE) means QEMU abandoned the stream; the migration status reports why.
        stats = self._finish_incoming("fd:isr-load", timeout, start)
        writer.join(timeout)
        return stats

    def _set_ignore_shared(self) -> None:
        # RAM in a shared file is already where the other side will look for it: leave it out of the
        # stream. Both the saving and the loading QEMU must agree on the capability.
        if self.config.memory_file is not None:
            self.qmp("migrate-set-capabilities",
                     {"capabilities": [{"capability": "x-ignore-shared", "state": True}]})

    def _poll_status(self, doing: str) -> str:
        assert self._proc is not None
        if self._proc.poll() is not None:
            self._reap()
            raise MigrationError(f"QEMU ({self.name}) exited with code {self.exitcode} while {doing}:\n"
                                 f"{self.output().rstrip()}")
        return self.query_status()

    def _wait_migration(self, timeout: float, doing: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            self._poll_status(doing)
            info = self.qmp("query-migrate")
            status = info.get("status")
            if status == "completed":
                return dict(info)
            if status in ("failed", "cancelled"):
                raise MigrationError(f"{doing} failed: {info.get('error-desc', status)}")
            if time.monotonic() > deadline:
                with contextlib.suppress(VMError):
                    self.qmp("migrate_cancel")
                raise VMTimeoutError(f"{doing} took longer than {timeout} s (status {status})")
            time.sleep(_POLL_INTERVAL)

    # --- stopping ----------------------------------------------------------------------------------

    def wait(self, timeout: float) -> int:
        """Wait for QEMU to exit by itself (e.g. the guest powered off) and return its exit code."""
        if self._proc is None:
            raise VMError(f"VM {self.name} was never launched")
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise VMTimeoutError(f"QEMU ({self.name}) did not exit within {timeout} s") from exc
        self._reap()
        self._cleanup()
        assert self.exitcode is not None
        return self.exitcode

    def shutdown(self, timeout: float = 30.0) -> int | None:
        """Make QEMU exit: ``quit`` over QMP, then SIGTERM, then SIGKILL; always reap and clean up.

        Returns the exit code (None if QEMU was never launched). Safe to call more than once.
        """
        if self._proc is None:
            return self.exitcode
        try:
            if self._proc.poll() is None:
                self._graceful_quit(timeout)
        finally:
            self._kill_and_reap()
            self._cleanup()
        return self.exitcode

    def _graceful_quit(self, timeout: float) -> None:
        assert self._proc is not None
        if self._qmp is not None:
            try:
                self._qmp.execute("quit", timeout=min(timeout, 10.0))
            except VMError as exc:
                # QEMU may hang up before answering 'quit'; the wait below decides whether it worked.
                log.debug("quit %s: %s", self.name, exc)
        try:
            self._proc.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            log.warning("QEMU (%s) ignored 'quit' for %s s; sending SIGTERM", self.name, timeout)
        self._proc.terminate()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            log.warning("QEMU (%s) ignored SIGTERM; killing it", self.name)

    def kill(self) -> None:
        """Kill QEMU at once (SIGKILL), reap it and clean up: the guest's state is lost."""
        if self._proc is None:
            return
        try:
            self._kill_and_reap()
        finally:
            self._cleanup()

    def _kill_and_reap(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            try:
                self._proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._proc.wait()
        self._reap()

    def _reap(self) -> None:
        assert self._proc is not None
        self.exitcode = self._proc.poll()
        if self.exitcode not in (None, 0):
            log.info("QEMU (%s) exited with code %s", self.name, self.exitcode)

    def _cleanup(self) -> None:
        if self._qmp is not None:
            self.shutdown_reason = self._qmp.shutdown_reason()
            self._qmp.close()
            self._qmp = None
        if self._serial is not None:
            self._serial.close()
            self._serial = None
        if self._sock_dir is not None:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
            self._sock_dir = None
        # Only ever reached once the process has been reaped: the VM object may be launched again.
        self._proc = None


def _stream_bytes(info: dict[str, Any]) -> int:
    ram = info.get("ram", {})
    return int(ram.get("transferred", 0))


__all__ = ["VM", "VMConfig", "MigrationStats", "CACHE_MODES", "AIO_MODES",
           "ACCELERATORS"]
