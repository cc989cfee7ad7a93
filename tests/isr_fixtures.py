"""Fixtures for the `isr` command's tests: a real isr-server, parcels made from the real test guest with
isr-admin, and "sites" that run the real `isr` command, each with its own XDG directories (so its own
chunk cache, state and token) and, optionally, its own network namespace behind a shaped veth link.

The module-scoped fixtures `isr_env` (one server per test module) and `nets` (two shaped namespaces) are
imported by the test modules that use them. A `Site` runs ``isr`` as a subprocess (through ``nsenter
--net`` when it has a namespace), exactly as a person would type it. Everything a site starts (detached sessions, QEMU, vulpes, mounts) is killed and
unmounted in ``finally`` by `Site.cleanup`, whatever the test did.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from parcels import parcel as parcel_ops
from parcels.store import DirStore
from tests.server_fixtures import BIN, PASSWORDS, ServerEnv, start_env
from tools.guest import GuestArtifacts, GuestConsole, check_ext4
from tools.guest.boot import KERNEL_CMDLINE

ISR = BIN / "isr"
COMMAND_TIMEOUT = 300


def run(args: list[str], *, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr}{result.stdout}")
    return result


# --- network namespaces with a shaped link ----------------------------------------------------------------

@dataclass
class NetSite:
    """A network namespace joined to the host by a veth pair shaped with tbf in both directions."""

    name: str
    host_if: str
    ns_if: str
    host_ip: str
    ns_ip: str

    @property
    def path(self) -> str:
        return f"/run/netns/{self.name}"


@contextlib.contextmanager
def shaped_namespaces(count: int, rate: str = "100mbit") -> Iterator[list[NetSite]]:
    """``count`` namespaces, each with a veth link to the host limited to ``rate`` each way; removed in
    finally. Addresses are 10.<random>.<i>.1 (host side) and .2 (namespace side)."""
    tag = secrets.token_hex(3)
    # A /16 no interface here uses (another run's namespaces, or one a killed run left behind, would make the
    # host route to this one's addresses ambiguous).
    used = subprocess.run(["ip", "-br", "-4", "addr"], capture_output=True, text=True).stdout
    net = next(n for n in (100 + secrets.randbelow(100) for _ in range(1000)) if f" 10.{n}." not in used)
    sites: list[NetSite] = []
    try:
        for i in range(count):
            site = NetSite(name=f"isrt-{tag}-{i}", host_if=f"vh{tag}{i}", ns_if=f"vn{tag}{i}",
                           host_ip=f"10.{net}.{i + 1}.1", ns_ip=f"10.{net}.{i + 1}.2")
            run(["ip", "netns", "add", site.name])
            sites.append(site)
            run(["ip", "link", "add", site.host_if, "type", "veth", "peer", "name", site.ns_if])
            run(["ip", "link", "set", site.ns_if, "netns", site.name])
            run(["ip", "addr", "add", f"{site.host_ip}/24", "dev", site.host_if])
            run(["ip", "link", "set", site.host_if, "up"])
            inside = ["ip", "netns", "exec", site.name]
            run([*inside, "ip", "addr", "add", f"{site.ns_ip}/24", "dev", site.ns_if])
            run([*inside, "ip", "link", "set", site.ns_if, "up"])
            run([*inside, "ip", "link", "set", "lo", "up"])
            tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "400ms"]
            run(["tc", "qdisc", "add", "dev", site.host_if, "root", *tbf])
            run([*inside, "tc", "qdisc", "add", "dev", site.ns_if, "root", *tbf])
        yield sites
    finally:
        for site in sites:
            run(["ip", "netns", "del", site.name], check=False)
            run(["ip", "link", "del", site.host_if], check=False)


# --- the server and parcels ---------------------------------------------------------------------------------

@dataclass
class IsrEnv:
    """A running isr-server for the isr tests, plus what is needed to make parcels on it."""

    server: ServerEnv
    guest: GuestArtifacts
    root: Path
    port: int

    @property
    def fingerprint(self) -> str:
        return self.server.server.fingerprint

    @property
    def store(self) -> Path:
        return Path(self.server.settings["server.data_dir"]) / "store"

    def url(self, host: str = "127.0.0.1") -> str:
        return f"https://{host}:{self.port}"

    def make_parcel(self, name: str | None = None, owner: str = "alice", ram_mib: int = 256,
                    vm: dict[str, Any] | None = None) -> Parcel:
        """A new parcel from the test guest (version 1, powered off) with ``ram_mib`` MiB of guest RAM and the VM
        settings ``vm`` (isr-admin's ``--vm``), protected by a fresh key file. The disk-booted guest's parcel
        has no boot files: it boots through the bootloader on its disk."""
        name = name or f"p{secrets.token_hex(4)}"
        keyfile = self.root / f"{name}.key"
        keyfile.write_bytes(os.urandom(32))
        boot = ["--firmware", self.guest.firmware] if self.guest.boots_from_disk else [
            "--kernel", str(self.guest.kernel), "--initrd", str(self.guest.initrd), "--cmdline", KERNEL_CMDLINE]
        result = self.server.admin("--json", "parcel", "create", "--owner", owner, "--name", name,
                                   "--disk", str(self.guest.disk), "--ram", str(ram_mib), "--machine", "pc-q35-7.2",
                                   *boot, "--key-file", str(keyfile), *(["--vm", json.dumps(vm)] if vm else []))
        return Parcel(name=name, id=json.loads(result.stdout)["id"], keyfile=keyfile)

    def extract_disk(self, parcel: Parcel, out: Path, version: int | None = None) -> Any:
        """Take the disk image of a committed version (default: the newest) out of the server's store."""
        return parcel_ops.extract_image(DirStore(self.store), uuid.UUID(parcel.id), version, "disk", out,
                                        keyfile=parcel.keyfile.read_bytes())

    def check_committed_disk(self, parcel: Parcel, workdir: Path) -> Any:
        """e2fsck -fn the newest committed disk image; returns its manifest."""
        image = workdir / f"{parcel.name}-committed.img"
        manifest = self.extract_disk(parcel, image)
        status, output = check_ext4(image)
        image.unlink()
        assert status == 0, f"e2fsck found problems in version {manifest.version}:\n{output}"
        return manifest

    def current_version(self, parcel: Parcel) -> int:
        with self.server.client("alice") as client:
            return int(client.parcel(parcel.id)["current_version"])


@dataclass
class Parcel:
    name: str
    id: str
    keyfile: Path


def start_isr_env(request: pytest.FixtureRequest | None, root: Path, guest: GuestArtifacts, *,
                  port: int | None = None, **overrides: Any) -> IsrEnv:
    """A real isr-server (sqlite + directory store) listening on all addresses, so that network
    namespaces reach it through their veth links."""
    if port is None:
        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            port = s.getsockname()[1]
    settings = {"server.listen": f"0.0.0.0:{port}", "server.lock_lease_seconds": 30, "server.workers": 2,
                "server.max_blob_bytes": 256 << 20}
    settings.update(overrides)
    env = start_env("sqlite-directory", root / "server", request, **settings)
    return IsrEnv(server=env, guest=guest, root=root, port=port)


@pytest.fixture(scope="module")
def isr_env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            guest_artifacts: GuestArtifacts) -> Iterator[IsrEnv]:
    """A real isr-server for one test module, stopped after it. Import it (with ``guest_artifacts``) into
    the module: ``from tests.isr_fixtures import isr_env  # noqa: F401``."""
    env = start_isr_env(request, tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2]),
                        guest_artifacts)
    try:
        yield env
    finally:
        env.server.server.stop()


@pytest.fixture(scope="module")
def nets() -> Iterator[list[NetSite]]:
    """Two network namespaces behind 100 Mbit/s links, for one test module."""
    with shaped_namespaces(2, rate="100mbit") as made:
        yield made


# --- sites ----------------------------------------------------------------------------------------------------

@dataclass
class Site:
    """One PC running `isr`: its own XDG directories, optionally its own network namespace."""

    name: str
    root: Path
    env: IsrEnv
    net: NetSite | None = None
    runtime: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="isr-rt-")))
    #: "host:port" this site's isr talks to instead of the server itself (a proxy that adds round-trip time)
    server: str | None = None
    #: variables this site's `isr` runs with beyond the test's own
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def server_url(self) -> str:
        if self.server:
            return f"https://{self.server}"
        return self.env.url(self.net.host_ip if self.net else "127.0.0.1")

    def environ(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(XDG_CONFIG_HOME=str(self.root / "config"), XDG_DATA_HOME=str(self.root / "data"),
                   XDG_CACHE_HOME=str(self.root / "cache"), XDG_RUNTIME_DIR=str(self.runtime),
                   ISR_TEST_PASSWORD=PASSWORDS["alice"])
        env.update(self.extra_env)
        return env

    def command(self, *args: str) -> list[str]:
        prefix = ["nsenter", f"--net={self.net.path}"] if self.net else []
        return [*prefix, str(ISR), *args]

    def isr(self, *args: str, check: bool = True, timeout: float = COMMAND_TIMEOUT,
            input_text: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``isr ARGS`` at this site; with ``check``, fail the test (showing all output) unless it
        exits with 0."""
        result = subprocess.run(self.command(*args), capture_output=True, text=True, env=self.environ(),
                                timeout=timeout, input=input_text)
        if check and result.returncode != 0:
            pytest.fail(f"[site {self.name}] isr {' '.join(args)} exited with {result.returncode}:\n"
                        f"--- stdout\n{result.stdout}--- stderr\n{result.stderr}{self.logs()}")
        return result

    def login(self) -> None:
        self.isr("login", self.server_url, "--user", "alice", "--fingerprint", self.env.fingerprint,
                 "--site", self.name, "--password-env", "ISR_TEST_PASSWORD")

    def resume(self, parcel: Parcel, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.isr("resume", parcel.name, "--detach", "--vnc", "unix", "--keyfile", str(parcel.keyfile),
                        *args, check=check)

    def stat(self, parcel: Parcel) -> dict[str, Any]:
        data = json.loads(self.isr("stat", parcel.name, "--json").stdout)
        return dict(data["parcels"][0])

    def state_dir(self, parcel: Parcel) -> Path:
        return self.root / "data" / "isr" / "parcels" / parcel.id

    def session(self, parcel: Parcel) -> dict[str, Any] | None:
        path = self.state_dir(parcel) / "session.json"
        try:
            return dict(json.loads(path.read_text()))
        except FileNotFoundError:
            return None

    def host_path(self, path: str) -> str:
        """A path that this site's isr wrote (in session.json), as this process reaches it."""
        return path

    @contextlib.contextmanager
    def console(self, parcel: Parcel) -> Iterator[GuestConsole]:
        """The running guest's serial console (through the session's console socket)."""
        info = self.session(parcel)
        assert info is not None, f"no session of {parcel.name} at site {self.name}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.host_path(info["console"]))
        console = GuestConsole(sock, name=f"{self.name}-{parcel.name}",
                               log_path=self.root / f"{parcel.name}.console.log")
        try:
            yield console
        finally:
            console.close()
            sock.close()

    def wait_session_end(self, parcel: Parcel, timeout: float = 120) -> None:
        """Wait until the parcel's session at this site has exited."""
        from isrctl.detach import process_alive

        info = self.session(parcel)
        deadline = time.monotonic() + timeout
        while info is not None and process_alive(int(info["pid"])):
            if time.monotonic() > deadline:
                pytest.fail(f"the session of {parcel.name} at site {self.name} did not end:{self.logs()}")
            time.sleep(0.01)        # bench/matrix.py times a checkin by this: a tenth of a second was 4 % of one

    def logs(self) -> str:
        """The tails of the session, vulpes and QEMU logs of every parcel at this site (for failures)."""
        out = []
        parcels = self.root / "data" / "isr" / "parcels"
        if parcels.is_dir():
            for state in parcels.iterdir():
                for name in ("session.log", "vulpes.log", "qemu/vm.log", "qemu/console.log"):
                    path = state / name
                    if path.exists():
                        out.append(f"\n--- site {self.name} {state.name[:8]} {name}\n"
                                   f"{path.read_text(errors='replace')[-3000:]}")
        return "".join(out)

    def cleanup(self) -> None:
        """Kill everything this site started and detach its mounts."""
        parcels = self.root / "data" / "isr" / "parcels"
        if parcels.is_dir():
            for state in parcels.iterdir():
                with contextlib.suppress(FileNotFoundError, ValueError):
                    info = json.loads((state / "session.json").read_text())
                    for key in ("pid", "qemu_pid", "vulpes_pid"):
                        if info.get(key):
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(int(info[key]), signal.SIGKILL)
                with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
                    mounted = json.loads((state / "mount.json").read_text())  # an `isr mount` left behind
                    subprocess.run(["fusermount3", "-u", "-z", mounted["dir"]], capture_output=True, timeout=30)
                    if b"vulpes" in Path(f"/proc/{int(mounted['pid'])}/cmdline").read_bytes():
                        os.kill(int(mounted["pid"]), signal.SIGKILL)
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1] for line in f if str(self.runtime) in line]
        for mount in mounts:
            subprocess.run(["fusermount3", "-u", "-z", mount], capture_output=True, timeout=30)
        shutil.rmtree(self.runtime, ignore_errors=True)


@contextlib.contextmanager
def sites(env: IsrEnv, root: Path, names: list[str], nets: list[NetSite] | None = None,
          servers: list[str] | None = None) -> Iterator[list[Site]]:
    """Logged-in sites, cleaned up afterwards; ``servers`` overrides each site's server address."""
    made = [Site(name, root / name, env, nets[i] if nets else None, server=servers[i] if servers else None)
            for i, name in enumerate(names)]
    try:
        for site in made:
            site.login()
        yield made
    finally:
        for site in made:
            site.cleanup()


def one_line_error(result: subprocess.CompletedProcess[str], *words: str) -> str:
    """Assert that `isr` failed with exit code 1 and one line on stderr containing every word."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr)
    return str(result.stderr)


# --- things done in the guest ---------------------------------------------------------------------------------

@dataclass
class GuestMarks:
    """Visible changes made in a guest: a RAM-only token, a file on disk with its digest, the counter."""

    token: str
    file: str
    digest: str
    counter: int
    when: float


def make_changes(console: GuestConsole, tag: str, *, megabytes: int = 2) -> GuestMarks:
    """Write a RAM token and a random file (synced) in the guest; read the counter."""
    token = console.set_token(f"{tag}-{secrets.token_hex(8)}")
    path = f"/data/{tag}.bin"
    console.check(f"dd if=/dev/urandom of={path} bs=1M count={megabytes} 2>/dev/null && sync", timeout=60)
    digest = console.check(f"md5sum {path}").split()[0]
    counter = console.counter()
    return GuestMarks(token=token, file=path, digest=digest, counter=counter, when=time.monotonic())


def check_continues(console: GuestConsole, marks: GuestMarks) -> int:
    """The guest carries on from `marks`: same token, the file with the same digest, the RAM counter going
    on from where it was (a reboot or a stale memory image would restart it at 0).

    There is no upper bound: under TCG on a loaded host the guest's clock is not a measure of host time
    (its TSC calibration can be off by a large factor), so the counter may run fast.
    """
    assert console.token() == marks.token, "the RAM token did not survive"
    assert console.check(f"md5sum {marks.file}").split()[0] == marks.digest, f"{marks.file} changed"
    counter = console.counter()
    assert counter >= marks.counter, f"counter {counter} does not continue from {marks.counter}"
    return counter


def work_and_check_in(site: Site, parcel: Parcel, tag: str, before: GuestMarks | None = None) -> GuestMarks:
    """Resume the parcel at ``site`` (demand policy), check that the guest carries on from ``before`` (or wait
    for a cold boot), make changes, then suspend and check in. Returns the new marks."""
    site.resume(parcel, "--policy", "demand")
    with site.console(parcel) as console:
        if before is None:
            console.wait_ready(90)
        else:
            check_continues(console, before)
        marks = make_changes(console, tag)
    site.isr("suspend", parcel.name)
    site.wait_session_end(parcel)
    return marks
