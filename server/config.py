"""Server configuration: defaults in one place, read from one TOML file plus command-line overrides.

Both ``isr-server`` and ``isr-admin`` read the same file, so the admin tool always works on the same
metadata database and object store as the server. Every value is validated right after parsing and every
error is one line naming the setting to change. ``doc/server.md`` lists the settings; keep it in step with
`SETTINGS` below.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigError

#: The environment variable through which isr-server hands the validated configuration to its workers.
ENV_CONFIG = "ISR_SERVER_CONFIG_JSON"
#: The environment variable naming the config file when --config is not given.
ENV_CONFIG_FILE = "ISR_SERVER_CONFIG"

MAX_CHUNK_OBJECT = 4194304 + 28
"""The largest chunk object the format allows: the largest chunk size plus the 28-byte overhead."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One configuration key: its section, name, type, default and a one-line description."""

    section: str
    name: str
    kind: type
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: int | None = None


SETTINGS: tuple[Setting, ...] = (
    Setting("server", "listen", str, "127.0.0.1:8443", "host:port to listen on (port 0 picks a free port)"),
    Setting("server", "workers", int, 1, "worker processes (each one serves requests independently)", minimum=1),
    Setting("server", "data_dir", str, "/var/lib/isr-server",
            "directory for the default sqlite database, chunk directory and self-signed certificate"),
    Setting("server", "tls_cert", str, "", "PEM certificate chain; empty: a self-signed one in data_dir/tls"),
    Setting("server", "tls_key", str, "", "PEM private key (PKCS#8) matching tls_cert"),
    Setting("server", "audit_log", str, "", "file that receives a copy of every audit line (always also in the database and on stderr)"),
    Setting("server", "max_blob_bytes", int, 256 * 1024 * 1024, "largest sealed blob or key envelope accepted", minimum=1024),
    Setting("server", "max_json_bytes", int, 32 * 1024 * 1024, "largest JSON request body (a commit lists every tag)", minimum=1024),
    Setting("server", "max_tags_per_query", int, 100000, "most tags in one missing-chunks query", minimum=1),
    Setting("server", "token_ttl_seconds", int, 30 * 86400, "lifetime of a bearer token", minimum=60),
    Setting("server", "token_cache_seconds", int, 5,
            "how long a worker trusts a checked token for chunk reads (0: check every request)", minimum=0),
    Setting("server", "web_session_seconds", int, 12 * 3600,
            "lifetime of a web page sign-in (the browser session cookie)", minimum=60),
    Setting("server", "lock_lease_seconds", int, 0,
            "lock lease; a lock not renewed for this long is reported expired (0: locks never expire)", minimum=0),
    Setting("server", "chunk_serving", str, "auto",
            "how chunk GETs are answered: sendfile (zero-copy from the directory store), stream (bytes through Python), redirect (presigned S3 URL), auto",
            choices=("auto", "sendfile", "stream", "redirect")),
    Setting("server", "gc_grace_seconds", int, 86400,
            "gc never deletes a chunk uploaded or claimed less than this long ago", minimum=0),
    Setting("metadata", "backend", str, "sqlite", "metadata database", choices=("sqlite", "postgres")),
    Setting("metadata", "path", str, "", "sqlite database file; empty: data_dir/meta.sqlite"),
    Setting("metadata", "dsn", str, "", "PostgreSQL connection string (libpq syntax), for backend = postgres"),
    Setting("metadata", "pool_size", int, 8, "PostgreSQL connections per worker process", minimum=1),
    Setting("store", "backend", str, "directory", "object store for chunks and blobs", choices=("directory", "s3")),
    Setting("store", "path", str, "", "directory store root; empty: data_dir/store"),
    Setting("store", "endpoint", str, "", "S3 endpoint URL, e.g. https://s3.example.org:9000"),
    Setting("store", "bucket", str, "", "S3 bucket"),
    Setting("store", "region", str, "us-east-1", "S3 region used for request signing"),
    Setting("store", "prefix", str, "", "key prefix inside the bucket, e.g. isr/"),
    Setting("store", "access_key", str, "", "S3 access key id; empty: the usual AWS environment and files"),
    Setting("store", "secret_key", str, "", "S3 secret access key"),
    Setting("store", "ca_bundle", str, "", "CA bundle to verify the S3 endpoint's certificate; empty: system CAs"),
    Setting("store", "presign_seconds", int, 300, "lifetime of presigned chunk URLs (chunk_serving = redirect)", minimum=1),
)

_BY_KEY = {(s.section, s.name): s for s in SETTINGS}


@dataclasses.dataclass(frozen=True)
class Config:
    """The validated configuration. `values` maps ``"section.name"`` to a value of the setting's type."""

    values: Mapping[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    @property
    def data_dir(self) -> Path:
        return Path(self.values["server.data_dir"])

    @property
    def sqlite_path(self) -> Path:
        """The sqlite database file (default: data_dir/meta.sqlite)."""
        return Path(self.values["metadata.path"] or self.data_dir / "meta.sqlite")

    @property
    def store_path(self) -> Path:
        """The directory store root (default: data_dir/store)."""
        return Path(self.values["store.path"] or self.data_dir / "store")

    @property
    def listen(self) -> tuple[str, int]:
        """The listen address as (host, port)."""
        return parse_listen(self.values["server.listen"])

    @property
    def chunk_serving(self) -> str:
        """The effective chunk serving mode ("auto" resolved by the store backend)."""
        mode = self.values["server.chunk_serving"]
        if mode == "auto":
            return "sendfile" if self.values["store.backend"] == "directory" else "stream"
        return mode

    def to_json(self) -> str:
        """Serialize (for handing to worker processes)."""
        return json.dumps(dict(self.values), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Config":
        """Inverse of `to_json`; validates again."""
        raw = json.loads(text)
        return build({k: v for k, v in raw.items()})


def parse_listen(text: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) and check the port range."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"server.listen = {text!r}: expected host:port, e.g. 127.0.0.1:8443")
    host = host.strip("[]")
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"server.listen = {text!r}: the port must be a number") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"server.listen = {text!r}: the port must be between 0 and 65535")
    return host, number


def _coerce(setting: Setting, value: Any, origin: str) -> Any:
    key = f"{setting.section}.{setting.name}"
    if setting.kind is int:
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                raise ConfigError(f"{key} ({origin}): expected an integer, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} ({origin}): expected an integer, got {value!r}")
        if setting.minimum is not None and value < setting.minimum:
            raise ConfigError(f"{key} ({origin}): must be at least {setting.minimum}, got {value}")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{key} ({origin}): expected a string, got {value!r}")
    if setting.choices and value not in setting.choices:
        raise ConfigError(f"{key} ({origin}): must be one of {', '.join(setting.choices)}, got {value!r}")
    return value


def build(raw: Mapping[str, Any], origin: str = "settings") -> Config:
    """Validate a flat ``{"section.name": value}`` mapping on top of the defaults."""
    values: dict[str, Any] = {f"{s.section}.{s.name}": s.default for s in SETTINGS}
    for key, value in raw.items():
        section, _, name = key.partition(".")
        setting = _BY_KEY.get((section, name))
        if setting is None:
            raise ConfigError(f"{key} ({origin}): unknown setting; see doc/server.md for the list")
        values[key] = _coerce(setting, value, origin)
    _check_combination(values)
    return Config(values)


def _check_combination(values: dict[str, Any]) -> None:
    parse_listen(values["server.listen"])
    if bool(values["server.tls_cert"]) != bool(values["server.tls_key"]):
        raise ConfigError("server.tls_cert and server.tls_key: set both or neither")
    if values["metadata.backend"] == "postgres" and not values["metadata.dsn"]:
        raise ConfigError("metadata.dsn: required when metadata.backend = postgres")
    if values["store.backend"] == "s3":
        for name in ("endpoint", "bucket"):
            if not values[f"store.{name}"]:
                raise ConfigError(f"store.{name}: required when store.backend = s3")
        if bool(values["store.access_key"]) != bool(values["store.secret_key"]):
            raise ConfigError("store.access_key and store.secret_key: set both or neither")
    serving = values["server.chunk_serving"]
    if serving == "sendfile" and values["store.backend"] != "directory":
        raise ConfigError("server.chunk_serving = sendfile needs store.backend = directory")
    if serving == "redirect" and values["store.backend"] != "s3":
        raise ConfigError("server.chunk_serving = redirect needs store.backend = s3")


def read_file(path: Path) -> dict[str, Any]:
    """Read a TOML config file into a flat ``{"section.name": value}`` mapping."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {e.start})") from None
    flat: dict[str, Any] = {}
    for section, table in doc.items():
        if not isinstance(table, dict):
            raise ConfigError(f"config file {path}: {section!r} must be a [section], not a top-level value")
        for name, value in table.items():
            flat[f"{section}.{name}"] = value
    return flat


def parse_overrides(items: Iterable[str]) -> dict[str, str]:
    """Parse ``--set section.name=value`` flags."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"--set {item!r}: expected section.name=value, e.g. server.workers=2")
        out[key.strip()] = value
    return out


def load(path: str | Path | None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Defaults, then the config file (if any; $ISR_SERVER_CONFIG when `path` is None), then overrides."""
    raw: dict[str, Any] = {}
    if path is None:
        path = os.environ.get(ENV_CONFIG_FILE) or None
    origin = "defaults"
    if path is not None:
        raw.update(read_file(Path(path)))
        origin = str(path)
        base = Path(path).resolve().parent
        # Relative paths in the file are relative to the file, so a config dir can be moved as a whole.
        for key in ("server.data_dir", "server.tls_cert", "server.tls_key", "server.audit_log",
                    "metadata.path", "store.path", "store.ca_bundle"):
            if isinstance(raw.get(key), str) and raw[key] and not os.path.isabs(raw[key]):
                raw[key] = str(base / raw[key])
    config = build(raw, origin)
    if overrides:
        merged = dict(config.values)
        merged.update(overrides)
        config = build(merged, "command line")
    return config


def describe() -> str:
    """A plain-text list of every setting with its default (for ``isr-server --help-config``)."""
    lines = []
    section = None
    for s in SETTINGS:
        if s.section != section:
            section = s.section
            lines.append(f"[{section}]")
        default = json.dumps(s.default)
        lines.append(f"{s.name} = {default:<24} # {s.help}")
    return "\n".join(lines)
