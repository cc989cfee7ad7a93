"""The client configuration (``config.toml``) and the bearer token, both written by `isr login`.

``config.toml`` holds only non-secret settings::

    server = "https://isr.example.org:8443"
    user = "alice"
    fingerprint = "sha256:9a81…"     # SHA-256 of the server's DER certificate, checked in every handshake
    pin = "sha256//Xy…="             # the same certificate's public-key pin, in the form vulpes (libcurl) takes
    site = "office"                  # shown to others in lock holder information
    accel = "tcg"                    # tcg, or kvm (used only where a probe boot shows that KVM works)
    cache_limit = "20G"              # optional: bound the chunk cache (vulpes evicts least recently used)

The token lives in its own file with mode 0600 (`paths.token_file`). Defaults live here and nowhere else;
every value is checked right after reading, and every complaint is one line that says what to change.
"""
from __future__ import annotations

import json
import os
import re
import socket
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from parcels.durable import fsync_path

from . import paths
from .errors import ConfigError

ACCELERATORS = ("tcg", "kvm")
_FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")
_PIN = re.compile(r"sha256//[A-Za-z0-9+/]{43}=")
_SITE = re.compile(r"[\x20-\x7e]{1,255}")
_LOGIN_HINT = "run `isr login URL --user NAME --fingerprint sha256:...` first"


def default_site() -> str:
    """The site name used when none is configured: this host's name."""
    return socket.gethostname() or "unknown"


@dataclass(frozen=True)
class ClientConfig:
    """The validated contents of ``config.toml``."""

    server: str
    user: str
    fingerprint: str
    pin: str
    site: str
    accel: str = "tcg"
    cache_limit: str = ""

    def validate(self, where: Path | str = "config") -> None:
        """Raise ConfigError (one line naming the setting) unless every value is well-formed."""
        if not self.server.startswith("https://"):
            raise ConfigError(f"{where}: server must be an https:// URL, got {self.server!r}")
        if not self.user or not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", self.user):
            raise ConfigError(f"{where}: user {self.user!r} is not a valid user name")
        if not _FINGERPRINT.fullmatch(self.fingerprint):
            raise ConfigError(f"{where}: fingerprint must be sha256:<64 lowercase hex digits>")
        if not _PIN.fullmatch(self.pin):
            raise ConfigError(f"{where}: pin must be sha256//<base64 of 32 bytes> (log in again to set it)")
        if not _SITE.fullmatch(self.site):
            raise ConfigError(f"{where}: site must be 1-255 printable ASCII characters")
        if self.cache_limit and not re.fullmatch(r"[1-9][0-9]*[KMGT]?", self.cache_limit):
            raise ConfigError(f"{where}: cache_limit must be a size such as 512M or 20G (MiB without a suffix)")
        if self.accel not in ACCELERATORS:
            raise ConfigError(f"{where}: accel must be one of {', '.join(ACCELERATORS)}, got {self.accel!r}")


def load(path: Path | None = None) -> ClientConfig:
    """Read and validate the configuration.

    Raises ConfigError if the file is missing (not logged in), not TOML, lacks a setting or has a bad one.
    """
    path = path or paths.config_file()
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"not logged in ({path} does not exist): {_LOGIN_HINT}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}): fix it, or log in again to rewrite it") \
            from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it: {exc}") from None
    known = {"server", "user", "fingerprint", "pin", "site", "accel", "cache_limit"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown setting {unknown[0]!r} (known: {', '.join(sorted(known))})")
    for required in ("server", "user", "fingerprint", "pin"):
        if not isinstance(raw.get(required), str):
            raise ConfigError(f"{path}: {required} is missing or not a string: {_LOGIN_HINT}")
    config = ClientConfig(server=raw["server"], user=raw["user"], fingerprint=raw["fingerprint"], pin=raw["pin"],
                          site=str(raw.get("site") or default_site()), accel=str(raw.get("accel", "tcg")),
                          cache_limit=str(raw.get("cache_limit", "")))
    config.validate(path)
    return config


def save(config: ClientConfig, path: Path | None = None) -> Path:
    """Validate and write the configuration (temp file + fsync + rename). Returns the path written.

    Raises ConfigError for an invalid value, OSError if the file cannot be written.
    """
    path = path or paths.config_file()
    config.validate(path)
    lines = ["# written by `isr login`; see doc/isrctl.md"]
    for key, value in asdict(config).items():
        lines.append(f"{key} = {json.dumps(value)}")  # a JSON string is a valid TOML basic string here
    write_private(path, ("\n".join(lines) + "\n").encode(), mode=0o644)
    return path


def read_token(path: Path | None = None) -> str:
    """The bearer token. Raises ConfigError if there is none (not logged in) or it is malformed."""
    path = path or paths.token_file()
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        raise ConfigError(f"not logged in (no token in {path}): {_LOGIN_HINT}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the token {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} does not hold an ISR token (not UTF-8 text): log in again") from None
    if not token.startswith("isr_") or any(c.isspace() for c in token):
        raise ConfigError(f"{path} does not hold an ISR token: log in again")
    return token


def write_token(token: str, path: Path | None = None) -> Path:
    """Store the token with mode 0600 (never readable by others, not even briefly)."""
    path = path or paths.token_file()
    write_private(path, (token + "\n").encode(), mode=0o600)
    return path


def write_private(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` crash-safely: a temporary file created with ``mode``, fsync, rename,
    fsync of the directory. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    fsync_path(path.parent)
