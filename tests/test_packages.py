"""The Debian packages (debian/, built by ``./bootstrap package``) on a clean Debian 12 system, as an
administrator and a user would meet them.

A minimal bookworm root is made once with debootstrap, with the packages' dependencies and systemd in it,
and cached in /var/cache/isr-ci. Each run lays a fresh overlay on it, installs isr-client and isr-server
with dpkg, and boots it with ``systemd-nspawn --boot`` (systemd is PID 1 in there, the service starts as
the postinst enabled it, `systemctl reload` and `dpkg --purge` meet a real systemd). isr-admin in the
container makes a user and a parcel from the test guest; the installed `isr` runs a resume/suspend/checkin
cycle (in a chroot of the same root, on this host's network, with /dev/fuse); an upgrade keeps the edited
configuration and the data and restarts the service; then `dpkg --remove` keeps the configuration, data and
user, and `dpkg --purge` leaves nothing behind.

The build takes a minute and a half and this test two to three, so it is not part of ``./bootstrap test``:
``./bootstrap package --test`` runs it (with ISR_PACKAGE_TEST=1), and `.ci/run` calls that.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from isrctl.remote import Remote, RemoteError
from tests.conftest import wait_until
from tests.guest_fixtures import guest_artifacts  # noqa: F401
from tests.isr_fixtures import Parcel, Site, work_and_check_in
from tests.server_fixtures import PASSWORDS, free_port
from tools.guest import GuestArtifacts
from tools.guest.boot import KERNEL_CMDLINE

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(os.environ.get("ISR_PACKAGE_TEST") != "1",
                                 reason="run by ./bootstrap package --test (it needs the built packages)")]

TOP = Path(__file__).resolve().parent.parent
DEBS = TOP / "build" / "deb"
CACHE = Path("/var/cache/isr-ci")
MIRROR = "http://deb.debian.org/debian"
#: What the root needs besides the packages' own dependencies: systemd to boot it.
BOOT_PACKAGES = ["systemd", "systemd-sysv", "dbus"]


def run(args: list[str], timeout: float = 300, input_text: str | None = None,
        env: dict[str, str] | None = None) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, input=input_text, env=env)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited with {result.returncode}:\n{result.stdout}{result.stderr}")
    return result.stdout


def built_debs() -> list[Path]:
    debs = sorted(DEBS.glob("isr-*.deb"))
    if {d.name.split("_")[0] for d in debs} != {"isr-client", "isr-server"}:
        pytest.fail(f"build the packages first (./bootstrap package): {DEBS} has {[d.name for d in debs]}")
    return debs


def dependencies(debs: list[Path]) -> list[str]:
    """The names the packages depend on (versions and alternatives dropped: bookworm satisfies them)."""
    names = set(BOOT_PACKAGES)
    for deb in debs:
        for item in run(["dpkg-deb", "-f", str(deb), "Depends"]).split(","):
            names.add(item.split("|")[0].split("(")[0].strip())
    return sorted(n for n in names if n)


def base_root(packages: list[str]) -> Path:
    """A minimal bookworm root with `packages` installed, made once per package list and cached."""
    key = hashlib.sha256(" ".join(packages).encode()).hexdigest()[:12]
    root = CACHE / f"bookworm-{key}"
    if (root / "etc" / "debian_version").exists():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{root.name}.", dir=CACHE))
    try:
        run(["debootstrap", "--variant=minbase", "bookworm", str(tmp), MIRROR], timeout=900)
        with mounted_proc(tmp):
            run(["chroot", str(tmp), "apt-get", "install", "-y", "-q", "--no-install-recommends", *packages],
                timeout=900, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
            run(["chroot", str(tmp), "apt-get", "clean"])
        tmp.rename(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


@contextlib.contextmanager
def mounted_proc(root: Path) -> Iterator[None]:
    run(["mount", "-t", "proc", "proc", str(root / "proc")])
    try:
        yield
    finally:
        run(["umount", str(root / "proc")])


@contextlib.contextmanager
def overlay(lower: Path) -> Iterator[Path]:
    """A fresh writable root on top of `lower` (which it never changes), unmounted in finally. A short path:
    the guest's console socket in there is reached by its path from this host."""
    top = Path(tempfile.mkdtemp(prefix="isr-pkg-"))
    for name in ("upper", "work", "root"):
        (top / name).mkdir()
    root = top / "root"
    run(["mount", "-t", "overlay", "overlay", "-o",
         f"lowerdir={lower},upperdir={top / 'upper'},workdir={top / 'work'}", str(root)])
    try:
        # The container gets its own copy of this mount; mounts made here later (the client's chroot) stay here.
        run(["mount", "--make-private", str(root)])
        yield root
    finally:
        subprocess.run(["umount", "-R", str(root)], capture_output=True, timeout=60)
        shutil.rmtree(top, ignore_errors=True)


class Container:
    """The root booted with systemd-nspawn (host network, /dev/fuse passed in); commands run in it with
    nsenter into its init's namespaces."""

    def __init__(self, root: Path, log: Path) -> None:
        self.root = root
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.init_pid = 0

    def boot(self) -> None:
        with open(self.log, "wb") as out:
            # --register=no --keep-unit: this host's init is not systemd, so there is no machined to register
            # with and no unit to make a scope in (without them nspawn stops at "Failed to open system bus").
            self.proc = subprocess.Popen(
                ["systemd-nspawn", "--quiet", "-D", str(self.root), "-M", f"isrpkg{os.getpid()}", "--register=no",
                 "--keep-unit", "--bind=/dev/fuse", "--boot"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.init_pid = wait_until(self._find_init, 60, "the container's init")
        wait_until(self._booted, 120, f"the container to boot:\n{self.log.read_text(errors='replace')[-3000:]}",
                   interval=0.5)

    def _find_init(self) -> int:
        """The container's systemd: a process named systemd that descends from our nspawn."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail(f"systemd-nspawn exited with {self.proc.returncode}:\n{self.log.read_text(errors='replace')}")
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if (entry / "comm").read_text().strip() != "systemd":
                    continue
                pid = int(entry.name)
                while pid > 1:
                    status = Path(f"/proc/{pid}/status").read_text()
                    pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
                    if pid == self.proc.pid:
                        return int(entry.name)
        return 0

    def _booted(self) -> bool:
        state = self.run("systemctl", "is-system-running", check=False).stdout.strip()
        return state in ("running", "degraded")

    def run(self, *args: str, check: bool = True, input_text: str | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(["nsenter", "-t", str(self.init_pid), "-a", "env", "-i",
                                 "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", *args],
                                capture_output=True, text=True, input=input_text, timeout=timeout)
        if check and result.returncode != 0:
            pytest.fail(f"in the container: {' '.join(args)} exited with {result.returncode}:\n"
                        f"{result.stdout}{result.stderr}")
        return result

    def journal(self, unit: str) -> str:
        return self.run("journalctl", "--no-pager", "-u", unit, check=False).stdout

    def poweroff(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # nspawn asks the container's systemd to halt
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


class ChrootSite(Site):
    """A `Site` whose `isr` is the installed one, run in a chroot of the package root: its paths are inside
    the root, seen from there without the root's prefix."""

    def inside(self, path: Path) -> str:
        return "/" + str(path.relative_to(self.chroot))

    @property
    def chroot(self) -> Path:
        return self.root.parents[1]  # ROOT/root/<site>

    def environ(self) -> dict[str, str]:
        env = {k: v for k, v in super().environ().items() if not k.startswith(("ISR_BUILD", "ISR_VULPES"))}
        for key in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_RUNTIME_DIR"):
            env[key] = self.inside(Path(env[key]))
        env.update(HOME="/root", PATH="/usr/sbin:/usr/bin:/sbin:/bin")
        return env

    def command(self, *args: str) -> list[str]:
        return ["chroot", str(self.chroot), "/usr/bin/isr", *args]

    def host_path(self, path: str) -> str:
        return str(self.chroot) + path


@contextlib.contextmanager
def system_mounts(root: Path) -> Iterator[None]:
    """/proc, /sys and /dev of this host in the root, for the client's chroot (QEMU, FUSE)."""
    done: list[Path] = []
    try:
        for source, options in (("/proc", ["--rbind"]), ("/sys", ["--rbind"]), ("/dev", ["--rbind"])):
            target = root / source.lstrip("/")
            run(["mount", *options, source, str(target)])
            run(["mount", "--make-rslave", str(target)])
            done.append(target)
        yield
    finally:
        for target in reversed(done):
            subprocess.run(["umount", "-R", "-l", str(target)], capture_output=True, timeout=60)


def service_workers(container: Container) -> set[str]:
    """The worker processes of the running isr-server service (its main process's children)."""
    main = container.run("systemctl", "show", "-p", "MainPID", "--value", "isr-server").stdout.strip()
    listed = container.run("sh", "-c", f"cat /proc/{main}/task/*/children", check=False).stdout.split()
    assert main != "0" and listed, (main, listed)
    return set(listed)


def package_files(container: Container, package: str) -> list[str]:
    listed = container.run("dpkg-query", "-L", package).stdout.split("\n")
    return [f for f in listed if f.startswith("/") and f not in ("/.",)]


def left_behind(root: Path, files: list[str]) -> list[str]:
    """Of a package's files, those still in the root (directories that other packages share aside)."""
    shared = {"/etc", "/usr", "/usr/bin", "/usr/lib", "/usr/share", "/usr/share/doc", "/usr/share/man",
              "/usr/share/man/man1", "/lib", "/lib/systemd", "/lib/systemd/system", "/usr/lib/systemd",
              "/usr/lib/systemd/user", "/usr/share/bash-completion", "/usr/share/bash-completion/completions",
              "/usr/share/zsh", "/usr/share/zsh/vendor-completions", "/usr/lib/debug"}
    return [f for f in files if f not in shared and os.path.lexists(str(root) + f)]


def test_packages_install_serve_resume_and_purge(guest_artifacts: GuestArtifacts,  # noqa: F811
                                                 tmp_path: Path) -> None:
    debs = built_debs()
    started = time.monotonic()
    base = base_root(dependencies(debs))
    print(f"clean Debian 12 root: {base} ({time.monotonic() - started:.0f} s)")
    port = free_port()
    with overlay(base) as root:
        # Install as an administrator would, before the first boot.
        for deb in debs:
            shutil.copy(deb, root / "var/tmp" / deb.name)  # (the booted container has a tmpfs on /tmp)
        with mounted_proc(root):
            run(["chroot", str(root), "dpkg", "-i", *(f"/var/tmp/{d.name}" for d in debs)],
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        config = root / "etc/isr/server.toml"
        config.write_text(config.read_text().replace('listen = "0.0.0.0:8443"', f'listen = "127.0.0.1:{port}"'))
        guest = root / "srv/guest"
        guest.mkdir(parents=True)
        for source in (guest_artifacts.disk, guest_artifacts.kernel, guest_artifacts.initrd):
            shutil.copy(source, guest / source.name)
        (guest / "parcel.key").write_bytes(os.urandom(32))
        for path in (guest, *guest.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)  # isr-admin runs as the isr user

        container = Container(root, tmp_path / "container.log")
        try:
            container.boot()
            # The postinst enabled the service and it started at boot; `systemctl start` finds it running.
            container.run("systemctl", "start", "isr-server")
            assert container.run("systemctl", "is-active", "isr-server").stdout.strip() == "active"
            unit_user = container.run("systemctl", "show", "-p", "User", "--value", "isr-server").stdout.strip()
            assert unit_user == "isr"
            assert container.run("stat", "-c", "%U:%G %a", "/var/lib/isr").stdout.split() == ["isr:isr", "750"]

            admin = ["/usr/bin/isr-admin"]
            container.run(*admin, "user", "add", "alice", "--password-file", "-", input_text=PASSWORDS["alice"] + "\n")
            line = container.run(*admin, "fingerprint", "--user", "alice",
                                 "--url", f"https://127.0.0.1:{port}").stdout
            fingerprint = next(w for w in line.split() if w.startswith("sha256:"))

            def answers() -> bool:
                try:
                    with Remote(f"https://127.0.0.1:{port}", fingerprint=fingerprint) as remote:
                        return remote.health()["status"] == "ok"
                except RemoteError:
                    return False

            wait_until(answers, 60, f"the service on port {port}:\n{container.journal('isr-server')}")
            created = json.loads(container.run(
                *admin, "--json", "parcel", "create", "--owner", "alice", "--name", "pkgparcel",
                "--disk", f"/srv/guest/{guest_artifacts.disk.name}", "--ram", "256", "--machine", "pc-q35-7.2",
                "--kernel", f"/srv/guest/{guest_artifacts.kernel.name}",
                "--initrd", f"/srv/guest/{guest_artifacts.initrd.name}", "--cmdline", KERNEL_CMDLINE,
                "--key-file", "/srv/guest/parcel.key").stdout)
            parcel = Parcel(name="pkgparcel", id=created["id"], keyfile=Path("/srv/guest/parcel.key"))

            # `systemctl reload`: the running service re-reads its configuration, replaces its workers and
            # keeps answering. (A commit sent while an old worker stops can be cut off: tests/test_server_reload.py
            # covers requests during a reload; here the user's cycle comes after it.)
            before = service_workers(container)
            container.run("systemctl", "reload", "isr-server")
            wait_until(lambda: "reloaded" in container.journal("isr-server"), 60, "the reload in the journal")
            wait_until(lambda: service_workers(container).isdisjoint(before), 120, "the service's new workers")
            assert answers()

            # The user's side: the installed isr, in a chroot of the same root.
            site = ChrootSite("pkgsite", root / "root" / "pkgsite", env=None,  # type: ignore[arg-type]
                              runtime=root / "run" / "isr-rt", server=f"127.0.0.1:{port}")
            site.runtime.mkdir(mode=0o700, parents=True)
            with system_mounts(root):
                try:
                    site.isr("login", site.server_url, "--user", "alice", "--fingerprint", fingerprint,
                             "--site", site.name, "--password-env", "ISR_TEST_PASSWORD")
                    work_and_check_in(site, parcel, "pkg")
                finally:
                    site.cleanup()
            with Remote(f"https://127.0.0.1:{port}", fingerprint=fingerprint) as remote:
                remote.login("alice", PASSWORDS["alice"])
                assert remote.parcel(parcel.id)["current_version"] == 2
            # An upgrade (here: the same packages again) keeps the edited configuration, the data and the
            # user, and restarts the service.
            workers_before = service_workers(container)
            container.run("dpkg", "-i", *(f"/var/tmp/{d.name}" for d in debs))
            assert f'listen = "127.0.0.1:{port}"' in config.read_text()
            assert container.run("systemctl", "is-active", "isr-server").stdout.strip() == "active"
            wait_until(answers, 60, f"the service after the upgrade:\n{container.journal('isr-server')}")
            assert service_workers(container).isdisjoint(workers_before)
            with Remote(f"https://127.0.0.1:{port}", fingerprint=fingerprint) as remote:
                remote.login("alice", PASSWORDS["alice"])
                assert remote.parcel(parcel.id)["current_version"] == 2
            assert "Traceback" not in container.journal("isr-server")

            # Remove keeps the configuration, the data and the user; purge takes them all.
            files = {p: package_files(container, p) for p in ("isr-client", "isr-server")}
            assert all(f"/usr/lib/{p}/venv/bin/python" in listed for p, listed in files.items()), files.keys()
            container.run("dpkg", "--remove", "isr-server", "isr-client")
            assert container.run("systemctl", "is-active", "isr-server", check=False).stdout.strip() != "active"
            assert (root / "etc/isr/server.toml").exists() and (root / "var/lib/isr/meta.sqlite").exists()
            assert container.run("getent", "passwd", "isr", check=False).returncode == 0
            container.run("dpkg", "--purge", "isr-server", "isr-client")
            for package, listed in files.items():
                assert left_behind(root, listed) == [], (package, left_behind(root, listed))
            for path in ("etc/isr", "var/lib/isr", "usr/lib/isr-client", "usr/lib/isr-server",
                         "etc/systemd/system/multi-user.target.wants/isr-server.service"):
                assert not os.path.lexists(root / path), path
            assert container.run("getent", "passwd", "isr", check=False).returncode != 0
            assert container.run("getent", "group", "isr", check=False).returncode != 0
            assert container.run("dpkg-query", "-W", "isr-client", "isr-server", check=False).returncode != 0
        finally:
            container.poweroff()
    print(f"package test: {time.monotonic() - started:.0f} s")
