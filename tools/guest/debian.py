"""Debian packages for the test guest: resolve their versions, download and unpack them.

Uses only apt's ordinary clients (``apt-cache``, ``apt-get download``) and ``dpkg-deb``; nothing is
installed on the host. Versions are the candidates apt would install now, so they go into the guest's cache
key: after ``apt-get update`` brings a new kernel, the guest is rebuilt with it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import GuestBuildError

log = logging.getLogger(__name__)

_APT_TIMEOUT = 300


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    depends: str = ""

    @property
    def spec(self) -> str:
        """``name=version``, as ``apt-get download`` takes it."""
        return f"{self.name}={self.version}"


def resolve(names: list[str], *, memo: Path | None = None) -> dict[str, Package]:
    """The candidate version (and dependencies) of each named package, from one ``apt-cache show``.

    With ``memo`` (a JSON file), answers are remembered per state of apt's inputs (package lists, sources,
    preferences, dpkg status): ``apt-cache`` takes about a second here, since the image keeps no binary
    package cache, and a warm guest lookup should not.
    """
    if memo is None:
        return _resolve(names)
    state = hashlib.sha256(("\0".join(sorted(names)) + "\0" + _apt_fingerprint()).encode()).hexdigest()
    try:
        remembered = json.loads(memo.read_text())
        if remembered.get("state") == state:
            return {name: Package(**fields) for name, fields in remembered["packages"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    packages = _resolve(names)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"state": state,
                                   "packages": {n: asdict(p) for n, p in packages.items()}}, indent=1))
        os.replace(tmp, memo)
    except OSError as exc:
        log.debug("cannot remember package versions in %s: %s", memo, exc)
    return packages


def _apt_fingerprint() -> str:
    """Names, sizes and times of every file that decides apt's candidate versions."""
    parts: list[str] = []
    for top in (Path("/var/lib/apt/lists"), Path("/etc/apt"), Path("/var/lib/dpkg/status")):
        paths = [top] if top.is_file() else sorted(p for p in top.rglob("*") if "partial" not in p.parts)
        for path in paths:
            try:
                st = path.stat()
            except OSError:
                continue
            if path.is_file():
                parts.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)


def _resolve(names: list[str]) -> dict[str, Package]:
    out = _run(["apt-cache", "show", "--no-all-versions", *names], "look up Debian packages")
    found: dict[str, Package] = {}
    for stanza in out.split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): (.*)$", stanza, re.MULTILINE))
        if "Package" in fields and "Version" in fields:
            found[fields["Package"]] = Package(fields["Package"], fields["Version"], fields.get("Depends", ""))
    missing = [n for n in names if n not in found]
    if missing:
        raise GuestBuildError(f"apt knows no candidate for {', '.join(missing)}: run apt-get update")
    return found


def kernel_package(meta: Package) -> Package:
    """The versioned kernel image a metapackage such as ``linux-image-cloud-amd64`` points at now.

    The metapackage pins it exactly (``linux-image-6.1.0-56-cloud-amd64 (= 6.1.192-2)``).
    """
    match = re.search(r"\b(linux-image-\d[^\s,(]*) \(= ([^)\s]+)\)", meta.depends)
    if not match:
        raise GuestBuildError(f"{meta.name} {meta.version} depends on no exact linux-image-<version> package")
    return Package(match.group(1), match.group(2))


def download_and_unpack(packages: list[Package], workdir: Path) -> dict[str, Path]:
    """Fetch the exact versions with ``apt-get download`` and unpack each into its own directory.

    Returns ``{package name: unpacked root}``. If apt's lists are so stale that the mirror no longer has a
    version, says so (the caller may run ``apt-get update`` and resolve again).
    """
    debs = workdir / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s", " ".join(p.spec for p in packages))
    # APT::Sandbox::User=root: the temporary directory is not readable by the _apt user, and does not
    # need to be; without it apt warns about every file.
    _run(["apt-get", "-q", "-o", "APT::Sandbox::User=root", "download", *[p.spec for p in packages]],
         "download Debian packages", cwd=debs)
    roots: dict[str, Path] = {}
    for package in packages:
        matches = sorted(debs.glob(f"{package.name}_*.deb"))
        if len(matches) != 1:
            raise GuestBuildError(f"apt-get download left {len(matches)} files for {package.name} in {debs}")
        root = workdir / "root" / package.name
        root.mkdir(parents=True)
        _run(["dpkg-deb", "-x", str(matches[0]), str(root)], f"unpack {matches[0].name}")
        roots[package.name] = root
    return roots


#: Where debootstrap fetches from when apt's own sources name no Debian mirror.
DEFAULT_MIRROR = "http://deb.debian.org/debian"
_DEBOOTSTRAP_TIMEOUT = 1200


def mirror() -> str:
    """The Debian mirror apt uses here (the first ``URIs:`` or ``deb`` line of its sources that serves the
    main archive, not the security one), so the guest's root comes from the same place as the host's."""
    for path in sorted(Path("/etc/apt").glob("sources.list.d/*.sources")) + [Path("/etc/apt/sources.list")]:
        try:
            text = path.read_text()
        except OSError:
            continue
        for uri in re.findall(r"^(?:URIs:|deb)\s+(?:\[[^]]*\]\s+)?(\S+)", text, re.MULTILINE):
            if "security" not in uri and uri.startswith(("http://", "https://")):
                return uri.rstrip("/")
    return DEFAULT_MIRROR


def host_suite() -> str:
    """This Debian's code name (``bookworm``), from /etc/os-release."""
    try:
        match = re.search(r"^VERSION_CODENAME=\"?([a-z]+)", Path("/etc/os-release").read_text(), re.MULTILINE)
    except OSError:
        match = None
    if match is None:
        raise GuestBuildError("cannot tell this Debian's code name from /etc/os-release (VERSION_CODENAME)")
    return match.group(1)


def debootstrap(target: Path, *, suite: str) -> None:
    """A minimal Debian system (``debootstrap --variant=minbase``) in ``target``.

    Needs root (debootstrap runs the packages' scripts in a chroot). Its output goes to the log only when it
    fails; it takes about a minute here and downloads ~40 MB.
    """
    args = ["debootstrap", "--variant=minbase", suite, str(target), mirror()]
    log.info("debootstrap %s into %s (from %s)", suite, target, args[-1])
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=_DEBOOTSTRAP_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GuestBuildError(f"failed to run debootstrap (Debian: apt-get install debootstrap): {exc}") from exc
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise GuestBuildError(f"debootstrap {suite} failed (is the mirror reachable? are you root?): "
                              + " / ".join(tail))


def apt_update() -> None:
    """Refresh apt's package lists (only when a download showed them to be stale)."""
    log.info("refreshing apt's package lists (apt-get update)")
    _run(["apt-get", "-q", "update"], "refresh the apt package lists")


def _run(args: list[str], doing: str, cwd: Path | None = None) -> str:
    try:
        result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=_APT_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GuestBuildError(f"failed to {doing}: {exc}") from exc
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise GuestBuildError(f"failed to {doing} ({' '.join(args[:3])} ...): " + " / ".join(tail))
    return result.stdout
