"""isr-server: serve the ISR API over HTTPS (HTTP/2 and HTTP/1.1, TLS 1.2+) with granian.

Start-up: read the configuration, make a self-signed certificate if none is configured, create the
database schema, bind the listening socket (port 0 picks a free port), print the URL and the certificate
fingerprint on stdout, then hand the socket to granian's worker processes. Every worker runs
`server.app.IsrApp`; they share nothing but the metadata database and the object store. granian is imported
only to serve: isr-admin shares `load_config` with this module and should not pay for it. SIGHUP reloads the
configuration and the certificate (`serve`).
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from importlib import metadata
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import config as configmod
from .config import ENV_CONFIG, Config
from .errors import ServerError
from .logs import setup_logging
from .meta import open_meta
from .store import open_store
from .tls import ensure_certificate

log = logging.getLogger("server")

#: Seconds an old worker gets to finish its requests when it stops (at a reload or a shutdown) before it is
#: killed: a client that keeps an idle HTTP/2 connection open and never reads the server's GOAWAY would
#: otherwise hold it, and the reload, forever.
WORKER_STOP_SECONDS = 20

#: `--version` of isr-server and isr-admin: the installed project's version (VERSION at the top of the tree).
VERSION_TEXT = f"%(prog)s {metadata.version('isr')}"

_GRANIAN_LOGGING = {
    "handlers": {
        "console": {"formatter": "generic", "class": "logging.StreamHandler", "stream": "ext://sys.stderr"},
        "access": {"formatter": "access", "class": "logging.StreamHandler", "stream": "ext://sys.stderr"},
    },
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="isr-server",
        description="Serve ISR parcels over HTTPS. Settings come from the config file (TOML), then flags.")
    parser.add_argument("--version", action="version", version=VERSION_TEXT, help="print the version and exit")
    parser.add_argument("-c", "--config", help="config file (default: $ISR_SERVER_CONFIG, else built-in defaults)")
    parser.add_argument("--listen", help="host:port to listen on (port 0: any free port)")
    parser.add_argument("--data-dir", help="directory for the default database, chunks and certificate")
    parser.add_argument("--workers", type=int, help="worker processes")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.NAME=VALUE",
                        help="override any setting, e.g. --set server.lock_lease_seconds=600 (repeatable)")
    parser.add_argument("--help-config", action="store_true", help="list every setting with its default and exit")
    parser.add_argument("--print-config", action="store_true", help="print the effective settings as JSON and exit")
    return parser


def load_config(args: argparse.Namespace) -> Config:
    """The configuration from the file named by --config plus the flags."""
    overrides: dict[str, Any] = configmod.parse_overrides(args.set)
    if getattr(args, "listen", None):
        overrides["server.listen"] = args.listen
    if getattr(args, "data_dir", None):
        overrides["server.data_dir"] = str(Path(args.data_dir).resolve())
    if getattr(args, "workers", None) is not None:
        overrides["server.workers"] = args.workers
    return configmod.load(args.config, overrides)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the workers start so port 0 yields one known port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this on Linux, and granian sets no TCP_NODELAY of its own: without it,
    # Nagle holds back the tail of a response until the client's delayed ACK (40 ms), once in every few
    # chunk GETs on an HTTP/2 connection.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServerError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def prepare(config: Config) -> tuple[Path, Path, str]:
    """Create the data directory, certificate and schema; check the store is reachable."""
    try:
        config.data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ServerError(f"cannot create server.data_dir {config.data_dir}: {e.strerror}") from None
    cert, key, fingerprint, created = ensure_certificate(config.data_dir, config["server.tls_cert"],
                                                         config["server.tls_key"])
    if created:
        log.info("made a self-signed certificate %s", cert)
    store = open_store(config)
    check = getattr(store, "check", None)
    if check is not None:
        check()
    store.close()
    meta = open_meta(config)
    meta.close()
    return cert, key, fingerprint


def serve(config: Config, sock: socket.socket, cert: Path, key: Path,
          reread: Callable[[], tuple[Config, Path, Path, str]] | None = None) -> None:
    """Run granian on the bound socket until SIGINT/SIGTERM.

    SIGHUP (``systemctl reload``) reloads: `reread` reads the configuration again and prepares it (the
    certificate too), then granian starts new workers with it and stops the old ones one by one, each after
    its successor runs; the old ones finish the requests they have (for at most `WORKER_STOP_SECONDS`). The
    socket stays open throughout, so no connection attempt is refused. A configuration that does not load is
    logged and the running one kept; server.listen and server.workers change only at a restart.
    """
    # Imported only to serve (see the module doc): isr-admin imports this module for load_config.
    from granian._granian import SocketHolder
    from granian.constants import HTTPModes, Interfaces, SSLProtocols
    from granian.log import LogLevels
    from granian.server.mp import MPServer

    class _BoundServer(MPServer):
        """granian with a socket bound by us (granian binds its own by default and cannot report port 0)."""

        def _init_shared_socket(self) -> None:
            self._ssp = None
            # granian's stubs are narrower than granian: SocketHolder(fd, uds, backlog) is missing from
            # _granian.pyi, and Server.__init__ sets _shd and _sfd to None without an annotation.
            self._shd = SocketHolder(sock.fileno(), False, 1024)  # type: ignore[call-arg,assignment]
            self._sfd = sock.fileno()  # type: ignore[assignment]
            self._sso = sock

        def _drop_shared_socket(self) -> None:
            pass

    host, port = sock.getsockname()[:2]
    os.environ[ENV_CONFIG] = config.to_json()
    server = _BoundServer(
        "server.app:create_app",
        address=host,
        port=port,
        interface=Interfaces.ASGI,
        workers=config["server.workers"],
        http=HTTPModes.auto,
        websockets=False,
        factory=True,
        ssl_cert=cert.resolve(),
        ssl_key=key.resolve(),
        ssl_protocol_min=SSLProtocols.tls12,
        log_level=LogLevels.warning,
        log_dictconfig=_GRANIAN_LOGGING,
        workers_kill_timeout=WORKER_STOP_SECONDS,
    )

    def reload() -> None:
        nonlocal config
        if reread is None:
            return
        try:
            new, new_cert, new_key, fingerprint = reread()
        except ServerError as e:
            log.error("reload: %s; the workers keep the running configuration", e)
            return
        for fixed in ("server.listen", "server.workers"):
            if new[fixed] != config[fixed]:
                log.warning("reload: %s changes at the next restart, not at a reload", fixed)
        os.environ[ENV_CONFIG] = new.to_json()
        server.build_ssl_context(new_cert.resolve(), new_key.resolve(), None, SSLProtocols.tls12, None, [], False)
        config = new
        print(f"isr-server: reloaded; certificate fingerprint {fingerprint}", flush=True)

    server.on_reload(reload)
    server.serve()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.help_config:
        print(configmod.describe())
        return 0
    setup_logging()
    try:
        config = load_config(args)
        if args.print_config:
            print(config.to_json())
            return 0
        cert, key, fingerprint = prepare(config)
        host, port = config.listen
        sock = bind(host, port)
    except ServerError as e:
        print(f"isr-server: {e}", file=sys.stderr)
        return 1
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"isr-server: listening on https://{shown}:{bound_port}", flush=True)
    print(f"isr-server: certificate fingerprint {fingerprint}", flush=True)
    print(f"isr-server: metadata {config['metadata.backend']}, store {config['store.backend']}, "
          f"chunk serving {config.chunk_serving}, {config['server.workers']} worker(s)", flush=True)
    def reread() -> tuple[Config, Path, Path, str]:
        again = load_config(args)
        return (again, *prepare(again))

    try:
        serve(config, sock, cert, key, reread)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
