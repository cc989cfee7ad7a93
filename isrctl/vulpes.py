"""Run vulpes, the FUSE daemon that serves a parcel's disk and memory images, and steer it; run
vulpes-fetch, which fetches chunk objects by tag into the cache without any key.

This is the only isrctl module that starts vulpes or vulpes-fetch or speaks the control socket (JSON lines,
see vulpes/src/control.c) or vulpes-fetch's progress lines (vulpes/tools/vulpes-fetch.c). A `Vulpes` is one daemon on one mountpoint: `start` mounts (keys through an
inherited pipe, never a file) and waits until the mount and the control socket are there; `stop`
unmounts and waits for the daemon by PID (``fusermount3 -u`` has been seen to leave it running), and a
non-zero exit is an error; `kill` is ``kill -9`` plus a lazy unmount, for when things went wrong.

Which binary: ``$ISR_VULPES``, else ``$ISR_BUILD_DIR/vulpes/vulpes``, else ``build/vulpes/vulpes`` in the
source tree this package comes from, else ``vulpes`` on ``$PATH`` (vulpes-fetch: the same places).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isrprogress import Reporter, human_bytes
from parcels.parcel import ParcelKeys
from parcels.store import chunk_object_name

from . import keys as keymod
from . import paths
from .errors import CacheFull, HoardStopped, VulpesFailure

log = logging.getLogger(__name__)

START_TIMEOUT = 30.0
STOP_TIMEOUT = 60.0
#: How long a suspend waits for vulpes to drop the guest's mapped pages (`Vulpes.invalidate`).
INVALIDATE_TIMEOUT = 10.0
_LOG_TAIL = 3000
#: How often `Vulpes.hoard_and_wait` looks at the hoard's progress: also how late, at most, it sees the end
#: (every 0.2 s, that was up to 5 % of `isr hoard` at 100 Mbit/s; a status request took about 2 ms).
_HOARD_POLL = 0.05


def parse_size(text: str) -> int:
    """A size as vulpes's ``--cache-limit`` takes it, in bytes: "512" (MiB), "64K", "512M", "20G", "1T".
    Raises VulpesFailure for anything else."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    shift = {"K": 10, "M": 20, "G": 30, "T": 40}.get(value[-1:], 0)
    number = value[:-1] if shift else value
    if not number.isdigit():
        raise VulpesFailure(f"not a size: {text!r} (examples: 512M, 20G; MiB without a suffix)")
    return int(number) << (shift or 20)


def binary(name: str = "vulpes") -> Path:
    """The executable ``name`` (``vulpes`` or ``vulpes-fetch``) to run. Raises VulpesFailure if none is found."""
    candidates: list[Path] = []
    if os.environ.get("ISR_VULPES"):
        given = Path(os.environ["ISR_VULPES"])
        candidates.append(given if name == "vulpes" else given.with_name(name))
    if os.environ.get("ISR_BUILD_DIR"):
        candidates.append(Path(os.environ["ISR_BUILD_DIR"]) / "vulpes" / name)
    candidates.append(Path(__file__).resolve().parent.parent / "build" / "vulpes" / name)
    found = shutil.which(name)
    if found:
        candidates.append(Path(found))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise VulpesFailure(f"{name} is not built: run `ninja -C build` in the source tree (or set ISR_VULPES)")


def is_mounted(path: Path) -> bool:
    """Whether ``path`` is a mountpoint; a dead FUSE mount ("transport endpoint is not connected")
    counts as mounted."""
    try:
        return os.path.ismount(path)
    except OSError:
        return True


def release_mount(path: Path) -> None:
    """Detach whatever is mounted on ``path`` (lazily, so a dead FUSE mount goes too); no error if nothing is."""
    if is_mounted(path) or _listed_as_mount(path):
        subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True, timeout=60)


def _listed_as_mount(path: Path) -> bool:
    # os.path.ismount cannot stat a dead FUSE mount; /proc/self/mounts still lists it.
    try:
        target = str(path.absolute())
        with open("/proc/self/mounts") as f:
            return any(line.split()[1] == target for line in f if len(line.split()) > 1)
    except OSError:
        return False


def log_tail(path: Path, offset: int) -> str:
    """The end of a log file, from ``offset`` at most (what a program printed since it started)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(offset, f.seek(0, os.SEEK_END) - _LOG_TAIL))
            return f.read().decode(errors="replace").rstrip()
    except OSError:
        return ""


def control_request(path: Path, request: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """One JSON-lines exchange on a vulpes control socket: the response as vulpes sent it, refusals included.
    Raises VulpesFailure if the socket cannot be reached or the answer is not JSON."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            sock.sendall(json.dumps(request).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                more = sock.recv(65536)
                if not more:
                    raise VulpesFailure(f"vulpes closed its control socket during {request.get('op')}")
                buf += more
    except OSError as exc:
        raise VulpesFailure(f"vulpes control socket {path}: {exc}") from None
    try:
        response: dict[str, Any] = json.loads(buf)
    except ValueError:
        raise VulpesFailure(f"vulpes answered {request.get('op')} with something that is not JSON") from None
    return response


def unmount(mountpoint: Path, alive: Callable[[], bool]) -> str:
    """``fusermount3 -u``, retried while the kernel still reports the mount busy (a file QEMU had open or mapped
    can take a moment to be released after it exits) and the daemon is ``alive``; returns fusermount3's last
    complaint ("" once unmounted)."""
    complaint = ""
    for _ in range(50):
        result = subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True, text=True, timeout=60)
        if result.returncode == 0 or not is_mounted(mountpoint):
            return ""
        complaint = result.stderr.strip()
        if not alive():
            break
        time.sleep(0.1)
    log.warning("cannot unmount %s: %s", mountpoint, complaint)
    return complaint


class Vulpes:
    """One vulpes process serving one parcel on ``mountpoint`` (files ``disk``, ``memory``, ``stats``).

    With ``memory_mountpoint`` it serves the same files there too, with the kernel's readahead off, and the
    guest's RAM is mapped from that one (`guest_memory`): each page fault is then one 4 KiB read, so the
    trace names the very pages the guest touched (what the resume pack is made of), and a fault on a page
    the pack holds never waits for the chunks around it. The disk keeps the main mount's readahead."""

    def __init__(self, *, mountpoint: Path, state_dir: Path, cache_dir: Path, control_path: Path, log_path: Path,
                 server: str | None = None, token_file: Path | None = None, pin: str | None = None,
                 trace: Path | None = None, offline: bool = False, lookaside: Sequence[Path] = (),
                 cache_limit: str = "", extra: Sequence[str] = (), keep_fds: Sequence[int] = (),
                 memory_mountpoint: Path | None = None) -> None:
        self.mountpoint = mountpoint
        self.memory_mountpoint = memory_mountpoint
        #: Descriptors the daemon inherits and holds for its life (`isr mount`: the parcel's state lock).
        self.keep_fds = tuple(keep_fds)
        self.control_path = control_path
        self.log_path = log_path
        self.args = [str(binary()), str(mountpoint), "-f", f"--state={state_dir}", f"--cache={cache_dir}",
                     f"--control={control_path}"]
        if server:
            self.args += [f"--server={server}", f"--token-file={token_file}"]
            if pin:
                self.args.append(f"--pin={pin}")
        if trace is not None:
            self.args.append(f"--trace={trace}")
        if offline:
            self.args.append("--offline")
        if cache_limit:
            self.args.append(f"--cache-limit={cache_limit}")
        self.args += [f"--lookaside={d}" for d in lookaside]
        if memory_mountpoint is not None:
            self.args.append(f"--memory-mount={memory_mountpoint}")
        self.args += list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def disk(self) -> Path:
        return self.mountpoint / "disk"

    @property
    def memory(self) -> Path:
        return self.mountpoint / "memory"

    @property
    def guest_memory(self) -> Path:
        """The memory image as QEMU should map it (``memory-backend-file``)."""
        return (self.memory_mountpoint or self.mountpoint) / "memory"

    def _mountpoints(self) -> list[Path]:
        return [self.mountpoint] + ([self.memory_mountpoint] if self.memory_mountpoint is not None else [])

    def alive(self) -> bool:
        """Whether the daemon process is still running."""
        return self.proc is not None and self.proc.poll() is None

    def start(self, parcel_keys: ParcelKeys, timeout: float = START_TIMEOUT) -> Vulpes:
        """Mount. Returns once the mount and the control socket exist.

        A dead mount left on the mountpoint by a crashed session is detached first. Raises VulpesFailure
        (with the daemon's output) if vulpes exits or does not mount within ``timeout`` seconds.
        """
        for path in self._mountpoints():
            release_mount(path)
            path.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.control_path.unlink()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            self._log_offset = self.log_path.stat().st_size
        key_fd = keymod.key_pipe(parcel_keys)
        try:
            with open(self.log_path, "ab") as log_file:
                # Its own session: a Ctrl-C meant for `isr resume` must not kill the daemon under the VM.
                self.proc = subprocess.Popen([*self.args, f"--key-fd={key_fd}"], stdin=subprocess.DEVNULL,
                                             stdout=log_file, stderr=log_file, pass_fds=(key_fd, *self.keep_fds),
                                             start_new_session=True)
        except OSError as exc:
            raise VulpesFailure(f"cannot run {self.args[0]}: {exc.strerror}") from None
        finally:
            os.close(key_fd)
        deadline = time.monotonic() + timeout
        while not (is_mounted(self.mountpoint) and self.control_path.exists()):
            if self.proc.poll() is not None:
                raise VulpesFailure(f"vulpes exited with code {self.proc.returncode} before mounting "
                                    f"{self.mountpoint}:\n{self.output()}")
            if time.monotonic() > deadline:
                self.kill()
                raise VulpesFailure(f"vulpes did not mount {self.mountpoint} within {timeout:.0f} s:\n{self.output()}")
            time.sleep(0.02)
        log.info("vulpes %d serving %s", self.proc.pid, self.mountpoint)
        return self

    def output(self) -> str:
        """What vulpes printed since `start` (the tail)."""
        return log_tail(self.log_path, self._log_offset)

    # --- control socket -----------------------------------------------------------------------------

    def control(self, request: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        """Send one request and return the response; raises VulpesFailure if vulpes refuses it or cannot be
        reached."""
        response = control_request(self.control_path, request, timeout)
        if not response.get("ok"):
            raise VulpesFailure(f"vulpes refused {request.get('op')}: {response.get('error', response)}")
        return response

    def status(self) -> dict[str, Any]:
        """The full status report (images, I/O, fetch, cache, hoard, writeback, trace)."""
        status: dict[str, Any] = self.control({"op": "status"})["status"]
        return status

    def preload(self, image: str, payload: bytes, part: int = 0) -> None:
        """Hand vulpes part ``part`` of the resume pack of ``image`` (`isrctl.pack`), through RAM only."""
        fd, path = paths.memory_file(f"{image}-pack", payload)
        try:
            self.control({"op": "preload", "image": image, "path": str(path), "part": part})
        finally:
            os.close(fd)

    def preload_end(self, image: str, rate: int = 0) -> None:
        """No more parts of the resume pack of ``image`` will come: vulpes stops waiting for them, and on a
        fast link fetches the chunks that hold the pack's pages (doc/vulpes.md). ``rate``: the bytes/s the link
        carried while the parts came (0: not measured)."""
        request: dict[str, Any] = {"op": "preload", "image": image, "end": True}
        if rate > 0:
            request["rate"] = int(rate)
        self.control(request)

    def invalidate(self, image: str) -> None:
        """Drop the kernel's cached pages of ``image`` (also those QEMU maps): each next touch faults again and
        reaches the trace. Dirty pages are written back first: no fetch, but a bound all the same (it is
        optional)."""
        self.control({"op": "invalidate", "image": image}, timeout=INVALIDATE_TIMEOUT)

    def trace_mapped(self, pid: int) -> int:
        """Trace, with source ``mapped``, the pages of the memory image process ``pid`` (QEMU) maps in chunks
        vulpes's warmer put into the page cache: the guest touched them without a read reaching the trace.
        Returns how many (0 without a warmer)."""
        return int(self.control({"op": "trace-mapped", "pid": pid}, timeout=INVALIDATE_TIMEOUT).get("pages", 0))

    def flush(self) -> None:
        """Make every write vulpes has acknowledged durable (chunk objects and keyring records)."""
        self.control({"op": "flush"}, timeout=600)

    def reclaim(self) -> dict[str, Any]:
        """Give back room held for nothing (flush dirty chunks, drop stale pins); returns the status. A flush
        that finds no room is not an error here: the status says it (``flush_error``)."""
        status: dict[str, Any] = self.control({"op": "reclaim"}, timeout=600)["status"]
        return status

    def set_cache_limit(self, limit: str) -> None:
        """Apply a cache limit (``--cache-limit`` syntax; "" or "0": none) to the running daemon."""
        self.control({"op": "cache-limit", "limit": parse_size(limit) if limit else 0})

    def upload(self) -> int:
        """Flush, then upload every chunk object the server may lack; returns how many were sent."""
        return int(self.control({"op": "upload"}, timeout=3600).get("uploaded", 0))

    def hoard(self, disk: Sequence[int] | None = None, memory: Sequence[int] | None = None, *,
              everything: bool = False, wait: bool = False, then_all: Sequence[str] = (),
              idle: bool = False) -> dict[str, Any]:
        """Start hoarding: everything, or the listed chunk indices in priority order, followed by the rest of
        each image named in ``then_all``. ``idle``: only while no guest read waits (doc/vulpes.md, fetch.c).
        Returns the status."""
        request: dict[str, Any] = {"op": "hoard", "wait": wait, "priority": "idle" if idle else "hoard"}
        if not everything:
            for image, indices in (("disk", disk), ("memory", memory)):
                request[image] = list(indices or [])
                if image in then_all:
                    request[image] = {"first": request[image], "then": "all"}
        return dict(self.control(request, timeout=86400 if wait else 60)["status"])

    def hoard_and_wait(self, reporter: Reporter, label: str, *, disk: Sequence[int] | None = None,
                       memory: Sequence[int] | None = None, everything: bool = False) -> dict[str, Any]:
        """Hoard (as `hoard`) and show its progress in ``reporter`` until it ends; returns the final hoard
        status. Raises CacheFull if the cache had no room for all of it (saying exactly how much is there),
        VulpesFailure if vulpes exits meanwhile or a chunk could not be hoarded."""
        hoard = self.hoard(disk=disk, memory=memory, everything=everything).get("hoard", {})
        bar = reporter.progress(label, int(hoard.get("bytes_total", 0)))
        try:
            while True:
                hoard = self.status().get("hoard", {})
                bar.update(int(hoard.get("bytes_done", 0)), int(hoard.get("bytes_total", 0)))
                if hoard.get("state") in ("done", "stopped", "idle"):
                    break
                if not self.alive():
                    raise VulpesFailure(f"vulpes exited while hoarding:\n{self.output()}")
                time.sleep(_HOARD_POLL)
        finally:
            bar.close(f"{hoard.get('chunks_done', 0)} of {hoard.get('chunks_total', 0)} chunks, "
                      f"{human_bytes(hoard.get('bytes_fetched', 0))} fetched")
        if hoard.get("cache_full"):
            cache = self.status().get("cache", {})
            raise CacheFull(f"the chunk cache {cache.get('dir', '')} is full: {hoard.get('chunks_done', 0)} of "
                            f"{hoard.get('chunks_total', 0)} chunks ({human_bytes(hoard.get('bytes_done', 0))} of "
                            f"{human_bytes(hoard.get('bytes_total', 0))}) are in it; "
                            f"{CacheUsage.from_status(cache).what_to_do()}")
        if int(hoard.get("chunks_failed", 0)):
            raise VulpesFailure(f"{hoard['chunks_failed']} chunks could not be hoarded (see {self.log_path})")
        return hoard

    def writeback(self, enabled: bool, rate: int = 0) -> None:
        """Trickle the chunk objects that flushes create up to the server while the VM runs (``rate`` in
        bytes per second, 0 = unlimited)."""
        self.control({"op": "writeback", "enabled": enabled, "rate": rate})

    def trace_start(self, path: Path) -> None:
        self.control({"op": "trace-start", "path": str(path.absolute())})

    def trace_stop(self) -> int:
        """Stop tracing; returns how many records were written."""
        return int(self.control({"op": "trace-stop"}).get("records", 0))

    # --- stopping -----------------------------------------------------------------------------------

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Unmount and wait for the daemon to exit (it flushes on the way out).

        Raises VulpesFailure if it does not exit in time (it is killed then) or exits with an error.
        """
        if self.proc is None:
            return
        if self.proc.poll() is None:
            unmount = self._unmount()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                still = "still mounted" if is_mounted(self.mountpoint) else "unmounted"
                self.kill()
                raise VulpesFailure(f"vulpes did not exit within {timeout:.0f} s of the unmount ({still}; fusermount3: "
                                    f"{unmount or 'ok'}):\n{self.output()}") from None
        for path in self._mountpoints():
            release_mount(path)
        code = self.proc.returncode
        if code != 0:
            raise VulpesFailure(f"vulpes exited with code {code}:\n{self.output()}")

    def _unmount(self) -> str:
        return unmount(self.mountpoint, lambda: self.proc is not None and self.proc.poll() is None)

    def kill(self) -> None:
        """``kill -9`` the daemon and detach its mount. Safe to call at any time, more than once."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT)
        for path in self._mountpoints():
            release_mount(path)


@dataclass
class FetchResult:
    """What one run of vulpes-fetch did."""

    tags: int        # tags it was given
    cached: int      # of those, already in the cache
    fetched: int     # fetched and verified
    failed: int      # not on the server, or every copy failed verification, or not stored
    bytes: int       # object bytes fetched
    seconds: float   # from the first request to the last answer
    stored: int = 0  # fetched and stored in the cache
    cache_full: bool = False  # it ended early: the cache had no room for the rest


#: vulpes-fetch's exit status when the server stayed unreachable for longer than --patience.
FETCH_UNREACHABLE = 75


class ChunkFetch:
    """Runs vulpes-fetch: chunk objects by tag from the server into the chunk cache, no key needed.

    `run` blocks until it is done; `stop` (from any thread, e.g. a signal handler) makes it end early,
    keeping what was fetched, and `run` then raises HoardStopped.
    """

    def __init__(self, *, cache_dir: Path, server: str, token_file: Path, pin: str | None, log_path: Path,
                 cache_limit: str = "", patience_s: int = 120) -> None:
        self.log_path = log_path
        self.cache_dir = cache_dir
        self._log_offset = 0
        self.args = [str(binary("vulpes-fetch")), f"--cache={cache_dir}", f"--server={server}",
                     f"--token-file={token_file}", f"--patience={patience_s}"]
        if pin:
            self.args.append(f"--pin={pin}")
        if cache_limit:
            self.args.append(f"--cache-limit={cache_limit}")
        self.cache_limit = cache_limit
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()  # stop() may come from a signal handler
        self._stopped = False

    def run(self, tags: Iterable[str], progress: Callable[[dict[str, Any]], None] | None = None) -> FetchResult:
        """Fetch the objects of ``tags`` that the cache lacks; ``progress`` gets each progress line.

        Raises CacheFull if the cache had no room for all of them (saying how many are there now),
        VulpesFailure if some object could not be had or the server stayed unreachable, HoardStopped if
        `stop` was called.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            self._log_offset = self.log_path.stat().st_size
        with self._lock:
            if self._stopped:
                raise HoardStopped("the hoard was stopped")
            with open(self.log_path, "ab") as log_file:
                try:
                    self._proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                  stderr=log_file, start_new_session=True)
                except OSError as exc:
                    raise VulpesFailure(f"cannot run {self.args[0]}: {exc.strerror}") from None
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None
        last: dict[str, Any] = {}
        start: dict[str, Any] = {}
        try:
            with contextlib.suppress(BrokenPipeError):
                # vulpes-fetch reads every tag before it prints anything, so this cannot deadlock.
                proc.stdin.write("".join(f"{tag}\n" for tag in tags).encode())
                proc.stdin.close()
            for raw in proc.stdout:
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if line.get("event") == "start":
                    start = line
                else:
                    last = line
                if progress is not None:
                    progress(line)
            code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        result = FetchResult(tags=int(start.get("tags", 0)), cached=int(start.get("cached", 0)),
                             fetched=int(last.get("fetched", 0)), failed=int(last.get("failed", 0)),
                             bytes=int(last.get("bytes", 0)), seconds=float(last.get("seconds", 0.0)),
                             stored=int(last.get("stored", 0)), cache_full=bool(last.get("cache_full")))
        if self._stopped or last.get("event") == "stopped":
            raise HoardStopped(f"the hoard was stopped after {result.fetched} chunks")
        if code == FETCH_UNREACHABLE:
            raise VulpesFailure(f"the server stayed unreachable; {result.fetched} of {start.get('wanted', '?')} "
                                f"chunks were fetched (see {self.log_path})")
        if code != 0 and not start:
            raise VulpesFailure(f"vulpes-fetch exited with code {code} before fetching:\n{self.output()}")
        if result.cache_full:
            here = result.cached + result.stored
            raise CacheFull(f"the chunk cache {self.cache_dir} is full: {here} of {result.tags} chunks are in it "
                            f"({result.stored} stored now, {result.cached} were there); "
                            f"{cache_usage(self.cache_dir, limit=self.cache_limit).what_to_do()}")
        if code != 0:
            raise VulpesFailure(f"{result.failed} chunks could not be fetched (exit code {code}; see {self.log_path})")
        return result

    def output(self) -> str:
        """What vulpes-fetch printed to its log during `run` (the tail)."""
        return log_tail(self.log_path, self._log_offset)

    def stop(self) -> None:
        """Ask a running fetch to end (SIGTERM); safe from any thread and before `run`."""
        with self._lock:
            self._stopped = True
            if self._proc is not None and self._proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.send_signal(signal.SIGTERM)


def cache_object_path(cache_dir: Path, tag: bytes | str) -> Path:
    """Where vulpes keeps a chunk object in its cache: the store layout of the format (`chunk_object_name`)."""
    return cache_dir / chunk_object_name(tag)


@dataclass(frozen=True)
class CacheUsage:
    """What a chunk cache holds and the room it has, by its own index and its file system (``vulpes-fetch
    --usage``, or a running vulpes's status)."""

    dir: str = ""
    objects: int = 0
    bytes: int = 0
    #: Objects that must not be evicted (not yet uploaded, or pinned for disconnected use), and their bytes.
    pinned: int = 0
    pinned_bytes: int = 0
    #: Bytes one parcel has not uploaded yet (asked with its state directory as the owner).
    own_pinned_bytes: int = 0
    #: Objects evicted so far by every process sharing the cache.
    evictions_total: int = 0
    #: The limit the room was computed under (0: none), and the file system's free space and size.
    limit: int = 0
    fs_free: int = 0
    fs_size: int = 0
    #: Bytes of new objects the cache can take after dropping every clean object (under the limit).
    room: int = 0

    @property
    def clean_bytes(self) -> int:
        """Bytes of objects the cache may drop to make room: the server has them."""
        return max(0, self.bytes - self.pinned_bytes)

    @property
    def limit_bound(self) -> bool:
        """Whether the limit, not the file system, is what leaves no more room."""
        return bool(self.limit) and self.limit - self.pinned_bytes <= self.fs_free + self.clean_bytes

    @classmethod
    def from_status(cls, cache: dict[str, Any]) -> CacheUsage:
        """From the ``cache`` part of a running vulpes's status."""
        return cls(dir=str(cache.get("dir", "")), **{f: int(cache.get(f, 0)) for f in _USAGE_FIELDS})

    def describe(self) -> str:
        """The room in a few words: free space, what may be dropped, what must stay."""
        limit = f", limit {human_bytes(self.limit)}" if self.limit else ""
        return (f"{human_bytes(self.fs_free)} free on its file system{limit}, {human_bytes(self.clean_bytes)} "
                f"clean that can be dropped, {human_bytes(self.pinned_bytes)} not yet uploaded or pinned")

    def what_to_do(self) -> str:
        """How to make room, in the words of the `isr` commands."""
        if self.limit_bound:
            return f"raise its limit ({human_bytes(self.limit)}, `isr login --cache-limit`) or free space in it"
        return f"free space under {self.dir}" if self.dir else "free space under the cache"


_USAGE_FIELDS = ("objects", "bytes", "pinned", "pinned_bytes", "own_pinned_bytes", "evictions_total", "limit",
                 "fs_free", "fs_size", "room")


def cache_usage(cache_dir: Path, *, owner: Path | None = None, limit: str = "") -> CacheUsage:
    """Ask vulpes what the cache at ``cache_dir`` holds and how much room it has under ``limit`` (a
    `--cache-limit` value; "": none); with ``owner`` (a parcel's state directory), how much of it that parcel
    has not uploaded yet. A cache that does not exist yet holds nothing (its room is its file system's)."""
    if not cache_dir.is_dir():
        probe = next((p for p in (cache_dir, *cache_dir.parents) if p.is_dir()), None)
        if probe is None:
            return CacheUsage(dir=str(cache_dir))
        st = os.statvfs(probe)
        free = st.f_bavail * st.f_frsize
        bound = parse_size(limit) if limit else 0
        return CacheUsage(dir=str(cache_dir), limit=bound, fs_free=free, fs_size=st.f_blocks * st.f_frsize,
                          room=min(free, bound) if bound else free)
    args = [str(binary("vulpes-fetch")), f"--cache={cache_dir}", "--usage"]
    if owner is not None:
        args.append(f"--owner={owner}")
    if limit:
        args.append(f"--cache-limit={limit}")
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    try:
        answer = json.loads(proc.stdout)
    except ValueError:
        answer = None
    if proc.returncode != 0 or not isinstance(answer, dict):
        raise VulpesFailure(f"cannot read the chunk cache {cache_dir}: {proc.stderr.strip() or proc.returncode}")
    return CacheUsage(dir=str(cache_dir), **{f: int(answer.get(f, 0)) for f in _USAGE_FIELDS})


def release_pins(cache_dir: Path, state_dir: Path) -> None:
    """After a checkin the server has every object of the parcel: let the cache evict them (drop the pins
    its vulpes left in the shared index). Raises VulpesFailure if the index cannot be updated."""
    if not cache_dir.is_dir():
        return
    proc = subprocess.run([str(binary("vulpes-fetch")), f"--cache={cache_dir}", f"--unpin={state_dir}"],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise VulpesFailure(f"cannot update the chunk cache {cache_dir}: {proc.stderr.strip() or proc.returncode}")


@dataclass(frozen=True)
class CacheCheck:
    """What ``vulpes-fetch --check`` found of some tags' objects in the cache."""

    present: int = 0       # verified
    absent: int = 0        # not in the cache
    bytes: int = 0         # of the verified ones
    bad: tuple[str, ...] = ()  # failed verification: quarantined (moved out of the cache), fetched again when needed
    errors: int = 0        # could not be read (vulpes-fetch said why on stderr)


def cache_check(cache_dir: Path, tags: Iterable[str]) -> CacheCheck:
    """Verify the cached objects of ``tags`` against their tags; a bad one is quarantined (vulpes's own
    verification, cache.c), so that the next use fetches it again. Raises VulpesFailure if the cache cannot
    be read."""
    answer = _cache_tool(cache_dir, "--check", tags)
    return CacheCheck(present=int(answer.get("present", 0)), absent=int(answer.get("absent", 0)),
                      bytes=int(answer.get("bytes", 0)), bad=tuple(answer.get("bad", [])),
                      errors=int(answer.get("errors", 0)))


def cache_drop(cache_dir: Path, tags: Iterable[str]) -> tuple[int, int, int]:
    """Remove the objects of ``tags`` from the cache, except pinned ones (not yet uploaded, or kept for a
    disconnected session); returns (objects removed, their bytes, pinned objects kept). Raises VulpesFailure."""
    answer = _cache_tool(cache_dir, "--drop", tags)
    return int(answer.get("dropped", 0)), int(answer.get("bytes", 0)), int(answer.get("pinned", 0))


def _cache_tool(cache_dir: Path, flag: str, tags: Iterable[str]) -> dict[str, Any]:
    """One JSON answer of ``vulpes-fetch --cache=DIR FLAG`` given ``tags`` (exit 1 with an answer is a finding,
    not a failure)."""
    if not cache_dir.is_dir():
        return {}
    proc = subprocess.run([str(binary("vulpes-fetch")), f"--cache={cache_dir}", flag], capture_output=True,
                          text=True, timeout=3600, input="".join(f"{tag}\n" for tag in tags))
    try:
        answer = json.loads(proc.stdout.splitlines()[-1])
    except (ValueError, IndexError):
        answer = None
    if not isinstance(answer, dict):
        raise VulpesFailure(f"cannot read the chunk cache {cache_dir}: {proc.stderr.strip() or proc.returncode}")
    return answer
