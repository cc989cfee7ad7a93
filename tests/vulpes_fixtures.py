"""Fixtures and helpers for the vulpes tests: parcel state directories, a real isr-server holding the chunks,
a small fault-injecting HTTPS chunk server, and a `Vulpes` process that really mounts.

Like sshfs's and libfuse's test helpers: the daemon is started for real, the test polls until the mount is
there (never a bare sleep), the file system is always unmounted in ``finally``, the daemon must exit with
status 0, and anything it printed that the test did not expect fails the test (the output checker).
"""
from __future__ import annotations

import contextlib
import datetime
import http.server
import json
import os
import random
import re
import shutil
import signal
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from isrctl.vulpes import control_request
from parcels.chunk import chunk_count, encode_chunk, is_zero
from parcels.keyring import Keyring, KeyringRecord, wrap_chunk_key

CHUNK_SIZE = 131072
START_TIMEOUT = 20.0
STOP_TIMEOUT = 30.0

#: vulpes lines that are part of normal operation; anything else must be expected by the test.
NORMAL_OUTPUT = (
    r"serving .*",
    r"rebuilt cache index of .*",
    r"hoard finished: .*",
    r"continuing the hoard request in .*",
    r"online",
    r"offline: server requests wait",
    r"server reachable again",
)


def chunk_path(root: Path, tag: bytes) -> Path:
    """Where a chunk object lives in a store or cache directory: chunks/ab/cd/<hex>."""
    h = tag.hex()
    return root / "chunks" / h[:2] / h[2:4] / h


@dataclass
class ParcelState:
    """A prepared per-parcel state directory (the two local keyrings), the chunk objects they name, and
    the keys vulpes gets through --key-fd."""

    state_dir: Path
    parcel_key: bytes
    secret: bytes
    chunk_size: int
    images: dict[str, bytes]                       # name -> plaintext content at creation
    objects: dict[bytes, bytes] = field(default_factory=dict)  # tag -> object
    records: dict[str, dict[int, KeyringRecord]] = field(default_factory=dict)

    @property
    def keys(self) -> bytes:
        return self.parcel_key + self.secret

    def publish(self, root: Path) -> None:
        """Write every chunk object into a store-layout directory (a server's store, a lookaside dir)."""
        for tag, data in self.objects.items():
            path = chunk_path(root, tag)
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists():
                path.write_bytes(data)

    def tag_of(self, image: str, index: int) -> bytes:
        return self.records[image][index].tag


def make_state(state_dir: Path, disk: bytes | Path, memory_size: int, *, memory: bytes | None = None,
               chunk_size: int = CHUNK_SIZE, memory_chunk_size: int | None = None, seed: int = 1) -> ParcelState:
    """Encode the images with the Python reference implementation and write keyring.disk/keyring.memory,
    as isrctl does at checkout. `disk` is the content or a raw file; zero chunks get no record. The memory
    image has chunks of `memory_chunk_size` (default: `chunk_size`)."""
    rng = random.Random(seed)
    state_dir.mkdir(parents=True, exist_ok=True)
    disk_bytes = disk.read_bytes() if isinstance(disk, Path) else disk
    contents = {"disk": disk_bytes, "memory": memory if memory is not None else bytes(memory_size)}
    state = ParcelState(state_dir, rng.randbytes(32), rng.randbytes(32), chunk_size, contents)
    sizes = {"disk": chunk_size, "memory": memory_chunk_size or chunk_size}
    for name, content in contents.items():
        records: dict[int, KeyringRecord] = {}
        size = sizes[name]
        for index in range(chunk_count(size, len(content))):
            plain = content[index * size:(index + 1) * size]
            if is_zero(plain):
                continue
            encoded = encode_chunk(plain, state.secret)
            records[index] = KeyringRecord(index, encoded.flags, encoded.tag,
                                           wrap_chunk_key(state.parcel_key, encoded.key))
            state.objects[encoded.tag] = encoded.data
        keyring = Keyring.create(state_dir / f"keyring.{name}", size, len(content))
        try:
            keyring.put_many(records[i] for i in sorted(records))
        finally:
            keyring.close()
        state.records[name] = records
    return state


def random_image(size: int, seed: int, data_fraction: float = 0.6, chunk_size: int = CHUNK_SIZE) -> bytes:
    """An image where some chunks are random (incompressible), some text-like (compressible), the rest
    zero."""
    rng = random.Random(seed)
    out = bytearray(size)
    for index in range(chunk_count(chunk_size, size)):
        roll = rng.random()
        start, end = index * chunk_size, min(size, (index + 1) * chunk_size)
        if roll < data_fraction / 2:
            out[start:end] = rng.randbytes(end - start)
        elif roll < data_fraction:
            words = b"the quick brown fox jumps over the lazy dog %d\n" % index
            out[start:end] = (words * ((end - start) // len(words) + 1))[:end - start]
    return bytes(out)


# --- a small HTTPS chunk server for fault injection ------------------------------------------------------

def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A throwaway self-signed certificate for 127.0.0.1 / localhost."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "vulpes test server")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "fault.crt", directory / "fault.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def spki_pin(cert_path: Path) -> str:
    """curl's pin for a certificate: sha256// + base64 of the SHA-256 of its SubjectPublicKeyInfo."""
    import base64
    import hashlib

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    spki = cert.public_key().public_bytes(serialization.Encoding.DER,
                                          serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256//" + base64.b64encode(hashlib.sha256(spki).digest()).decode()


class FaultServer:
    """An HTTPS server for GET /v1/chunks/<tag> from a store directory, with switchable faults:
    `corrupt` (how many responses to damage; -1 for all), `status` (answer every request with it),
    `delay` (seconds before answering). It can be stopped and restarted on the same port. Requests are
    counted per tag. Bearer tokens are checked against `token`."""

    def __init__(self, root: Path, workdir: Path, token: str | None = "isr_faulttoken", tls: bool = True) -> None:
        self.root = root
        self.token = token
        self.tls = tls
        self.redirect: str | None = None           # answer GETs with 307 to this base URL
        self.leaked_tokens = 0                     # Authorization headers seen by a server that has no token
        self.cert, self.key = make_certificate(workdir)
        self.port = 0
        self.corrupt = 0
        self.status: int | None = None
        self.delay = 0.0
        self.requests: dict[str, int] = {}
        self.order: list[str] = []                 # the tags of the chunk GETs, in the order they came
        self.puts: list[str] = []
        self.puts_running = self.puts_running_max = 0     # PUTs being answered now, and the most at once
        self.puts_running_at_start: list[int] = []        # puts_running as each PUT came, itself included
        self.auth_failures = 0
        self._httpd: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def handle(self) -> None:
                # vulpes hangs up with requests in flight when it unmounts: not the test's business.
                with contextlib.suppress(OSError):
                    super().handle()

            def _check(self) -> str | None:
                if server.token is None:
                    if self.headers.get("Authorization") is not None:
                        with server._lock:
                            server.leaked_tokens += 1
                elif self.headers.get("Authorization") != f"Bearer {server.token}":
                    with server._lock:
                        server.auth_failures += 1
                    self._reply(401, b"")
                    return None
                m = re.fullmatch(r"/v1/chunks/([0-9a-f]{64})(\?.*)?", self.path)
                if not m:
                    self._reply(404, b"")
                    return None
                if server.delay:
                    time.sleep(server.delay)
                if server.status is not None:
                    self._reply(server.status, b"")
                    return None
                return m.group(1)

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                tag = self._check()
                if tag is None:
                    return
                with server._lock:
                    server.requests[tag] = server.requests.get(tag, 0) + 1
                    server.order.append(tag)
                    damage = server.corrupt != 0
                if server.redirect:
                    self.send_response(307)
                    self.send_header("Location", f"{server.redirect}/v1/chunks/{tag}?X-Signature=abc")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                with server._lock:
                    if server.corrupt > 0:
                        server.corrupt -= 1
                path = chunk_path(server.root, bytes.fromhex(tag))
                if not path.exists():
                    self._reply(404, b"")
                    return
                data = bytearray(path.read_bytes())
                if damage:
                    data[len(data) // 2] ^= 0x40
                self._reply(200, bytes(data))

            def do_PUT(self) -> None:  # noqa: N802
                with server._lock:
                    server.puts_running += 1
                    server.puts_running_max = max(server.puts_running_max, server.puts_running)
                    server.puts_running_at_start.append(server.puts_running)
                try:
                    self._put()
                finally:
                    with server._lock:
                        server.puts_running -= 1

            def _put(self) -> None:
                tag = self._check()
                if tag is None:
                    return
                length = int(self.headers.get("Content-Length", "0"))
                data = self.rfile.read(length)
                import hashlib

                if hashlib.sha256(data).hexdigest() != tag:
                    self._reply(422, b"")
                    return
                path = chunk_path(server.root, bytes.fromhex(tag))
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
                with server._lock:
                    server.puts.append(tag)
                self._reply(201, b"{}")

        return Handler

    def start(self) -> "FaultServer":
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        httpd.daemon_threads = True
        if self.tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(self.cert, self.key)
            httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
        self.port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None


# --- the daemon --------------------------------------------------------------------------------------------

class VulpesError(Exception):
    pass


class Vulpes:
    """One vulpes process on a mountpoint. Use as a context manager: mounts on enter, always unmounts on
    exit, then checks the exit status and the output."""

    def __init__(self, binary: Path, mountpoint: Path, state: ParcelState, cache_dir: Path, *,
                 server: str | None = None, token_file: Path | None = None, ca: Path | None = None,
                 pin: str | None = None, lookaside: Sequence[Path] = (), extra: Sequence[str] = (),
                 expected_output: Sequence[str] = (), log_path: Path | None = None) -> None:
        self.binary = binary
        self.mountpoint = mountpoint
        self.state = state
        self.cache_dir = cache_dir
        self.control_path = mountpoint.parent / f".{mountpoint.name}.control"
        self.log_path = log_path or mountpoint.parent / f"{mountpoint.name}.vulpes.log"
        self.args = [str(binary), str(mountpoint), "-f", f"--state={state.state_dir}", f"--cache={cache_dir}",
                     f"--control={self.control_path}"]
        if server:
            self.args.append(f"--server={server}")
        if token_file:
            self.args.append(f"--token-file={token_file}")
        if ca:
            self.args.append(f"--ca={ca}")
        if pin:
            self.args.append(f"--pin={pin}")
        self.args += [f"--lookaside={d}" for d in lookaside]
        self.args += list(extra)
        self.expected = [re.compile(p) for p in (*NORMAL_OUTPUT, *expected_output)]
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0

    # life cycle

    def start(self) -> "Vulpes":
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        if self.log_path.exists():
            self._log_offset = self.log_path.stat().st_size
        read_fd, write_fd = os.pipe()
        try:
            os.write(write_fd, self.state.keys)
            os.close(write_fd)
            write_fd = -1
            log = open(self.log_path, "ab")
            self.proc = subprocess.Popen([*self.args, f"--key-fd={read_fd}"], stdout=log, stderr=log,
                                         pass_fds=(read_fd,), start_new_session=True)
            log.close()
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
        deadline = time.monotonic() + START_TIMEOUT
        while not (os.path.ismount(self.mountpoint) and self.control_path.exists()):
            if self.proc.poll() is not None:
                raise VulpesError(f"vulpes exited with {self.proc.returncode} before mounting:\n{self.output()}\n"
                                  f"command: {' '.join(self.args)}")
            if time.monotonic() > deadline:
                self.kill()
                raise VulpesError(f"vulpes did not mount within {START_TIMEOUT} s:\n{self.output()}")
            time.sleep(0.02)
        return self

    def stop(self, check: bool = True) -> int:
        """Unmount and wait for the daemon (by PID: fusermount3 -u has been seen to leave it running)."""
        assert self.proc is not None
        if os.path.ismount(self.mountpoint):
            subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True, timeout=60)
        try:
            code = self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise VulpesError(f"vulpes did not exit after unmount:\n{self.output()}") from None
        if check:
            self.check_output()
            if code != 0:
                raise VulpesError(f"vulpes exited with {code}:\n{self.output()}")
        return code

    def kill(self) -> None:
        """kill -9, then clean up the dead mount."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=STOP_TIMEOUT)
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, timeout=60)

    def __enter__(self) -> "Vulpes":
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            return
        if exc_type is None:
            self.stop()
        else:
            with contextlib.suppress(Exception):
                self.stop(check=False)
            self.kill()

    # output checker

    def output(self) -> str:
        with contextlib.suppress(OSError):
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return f.read().decode(errors="replace")
        return ""

    def check_output(self) -> None:
        unexpected = []
        for line in self.output().splitlines():
            text = line.removeprefix("vulpes: ")
            if not any(p.fullmatch(text) for p in self.expected):
                unexpected.append(line)
        if unexpected:
            pytest.fail("vulpes printed unexpected output:\n" + "\n".join(unexpected) +
                        f"\nreproduce with: {' '.join(self.args)} --key-fd=N")

    # files and control

    def path(self, name: str) -> Path:
        return self.mountpoint / name

    def control(self, request: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        return control_request(self.control_path, request, timeout)

    def status(self) -> dict[str, Any]:
        response = self.control({"op": "status"})
        assert response["ok"], response
        status: dict[str, Any] = response["status"]
        return status

    def stats_file(self) -> dict[str, Any]:
        stats: dict[str, Any] = json.loads(self.path("stats").read_text())
        return stats


@pytest.fixture(scope="session")
def vulpes_binary(build_dir: Path) -> Path:
    path = build_dir / "vulpes" / "vulpes"
    if not path.exists():
        pytest.fail(f"{path} is not built: run ninja -C {build_dir}")
    return path


@dataclass
class IsrServer:
    """The real isr-server for the vulpes tests: where its chunk store is, and how to reach it."""

    url: str
    ca: Path
    token_file: Path
    store: Path
    env: Any


@pytest.fixture(scope="module")
def isr_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[IsrServer]:
    """A real isr-server (sqlite metadata, directory store) with a logged-in user; tests put chunk objects
    straight into its store directory, as a completed upload would have."""
    from tests.server_fixtures import start_env

    root = tmp_path_factory.mktemp("isr-server")
    env = start_env("sqlite-directory", root, request)
    try:
        with env.client("alice"):
            pass
        token_file = root / "token"
        token_file.write_text(env.tokens["alice"] + "\n")
        store = Path(env.settings["server.data_dir"]) / "store"
        ca = Path(env.settings["server.data_dir"]) / "tls" / "server.crt"
        yield IsrServer(env.server.url, ca, token_file, store, env)
    finally:
        env.server.stop()


def read_all(path: Path, chunk: int = 1 << 20) -> bytes:
    out = bytearray()
    with open(path, "rb", buffering=0) as f:
        while True:
            data = f.read(chunk)
            if not data:
                return bytes(out)
            out += data


def drop_caches(path: Path) -> None:
    """Forget the kernel's cached pages of one file (so the next read reaches vulpes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True)


@contextlib.contextmanager
def small_tmpfs(path: Path, mib: int) -> Iterator[Path]:
    """A tmpfs of ``mib`` MiB mounted on ``path`` (a cache on a small file system), unmounted in finally;
    stop whatever uses it before leaving the block."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0755", "tmpfs", str(path)], check=True,
                   capture_output=True, timeout=30)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)
