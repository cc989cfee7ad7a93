"""Fixtures for the server tests: real isr-server processes over real TLS, a real PostgreSQL, a real S3 server.

Like curl's test environment: session-scoped fixtures start each server once on a free port, wait until
it answers (polling, never a bare sleep), `pytest.fail` with the server's output if it does not come up,
and stop it in ``finally``. The API suite runs against every backend set in `BACKENDS`.
"""
from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from isrctl.remote import Remote, RemoteError
from tests.conftest import wait_until

BIN = Path(sys.executable).parent
PG_BIN = Path("/usr/lib/postgresql/15/bin")
VERSITYGW_PATHS = ("/usr/local/bin/versitygw", str(Path.home() / "go/bin/versitygw"))
S3_ACCESS = "isrtestaccess"
S3_SECRET = "isrtestsecret0123456789"
PASSWORDS = {"alice": "alice-password", "bob": "bob-password", "root": "root-password"}
BACKENDS = ["sqlite-directory", "postgres-s3"]
START_TIMEOUT = 30.0
LOCK_LEASE = 2


def free_port() -> int:
    """A port that was free a moment ago (bind port 0, read it, close)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toml_value(value: Any) -> str:
    return json.dumps(value)


def write_config(path: Path, settings: dict[str, Any]) -> Path:
    """Write a TOML config from a flat {"section.name": value} mapping."""
    sections: dict[str, list[str]] = {}
    for key, value in settings.items():
        section, _, name = key.partition(".")
        sections.setdefault(section, []).append(f"{name} = {toml_value(value)}")
    path.write_text("".join(f"[{s}]\n" + "\n".join(lines) + "\n\n" for s, lines in sections.items()))
    return path


class ServerProcess:
    """One isr-server process started from a config file."""

    def __init__(self, config: Path, log_path: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.config = config
        self.log_path = log_path
        self.extra_args = extra_args
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.fingerprint = ""
        self.stdout_lines: list[str] = []

    def start(self, timeout: float = START_TIMEOUT) -> "ServerProcess":
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen([str(BIN / "isr-server"), "-c", str(self.config), *self.extra_args],
                                     stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        log.close()
        reader = threading.Thread(target=self._read_stdout, daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout
        while not (self.url and self.fingerprint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"isr-server did not start (exit {self.proc.returncode}):\n{self.output()}")
            time.sleep(0.02)
        with self.client() as client:
            while True:
                try:
                    client.health()
                    break
                except RemoteError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        pytest.fail(f"isr-server at {self.url} did not answer:\n{self.output()}")
                    time.sleep(0.05)
        return self

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_lines.append(line)
            if "listening on " in line:
                self.url = line.split("listening on ", 1)[1].strip()
            elif "certificate fingerprint " in line:
                self.fingerprint = line.split("certificate fingerprint ", 1)[1].strip()

    def output(self) -> str:
        text = "".join(self.stdout_lines)
        with contextlib.suppress(OSError):
            text += self.log_path.read_text()[-5000:]
        return text

    def client(self, token: str | None = None, **kwargs: Any) -> Remote:
        return Remote(self.url, fingerprint=self.fingerprint, token=token, **kwargs)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=10)


@dataclass
class ServerEnv:
    """A running server with its config, an admin runner and logged-in clients for the test users."""

    name: str
    root: Path
    config: Path
    settings: dict[str, Any]
    server: ServerProcess
    tokens: dict[str, str] = field(default_factory=dict)

    def admin(self, *args: str, check: bool = True, input_text: str | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run isr-admin with this server's config."""
        result = subprocess.run([str(BIN / "isr-admin"), "-c", str(self.config), *args], capture_output=True,
                                text=True, input=input_text, timeout=timeout)
        if check and result.returncode != 0:
            pytest.fail(f"isr-admin {' '.join(args)} failed ({result.returncode}):\n{result.stderr}{result.stdout}")
        return result

    def admin_json(self, *args: str) -> Any:
        return json.loads(self.admin("--json", *args).stdout)

    def client(self, user: str | None = None) -> Remote:
        """A client logged in as `user` (one token per user, made once)."""
        if user is None:
            return self.server.client()
        if user not in self.tokens:
            with self.server.client() as c:
                self.tokens[user] = c.login(user, PASSWORDS[user], label="tests")
        return self.server.client(token=self.tokens[user])

    def open_backends(self) -> tuple[Any, Any]:
        """The server's metadata database and object store, opened in the test process."""
        from server import config as configmod
        from server.meta import open_meta
        from server.store import open_store

        cfg = configmod.load(self.config)
        return open_meta(cfg), open_store(cfg)

    def new_parcel(self, owner: str, name: str | None = None) -> str:
        """An empty parcel (no versions yet) with a placeholder key envelope, made directly in the backends
        the way isr-admin does, for protocol tests that make version 1 through the API."""
        from server.store import envelope_key

        parcel = str(uuid.uuid4())
        meta, store = self.open_backends()
        try:
            store.put_bytes(envelope_key(parcel), b"ISRE" + bytes(4) + uuid.UUID(parcel).bytes + bytes(124))
            meta.create_parcel(parcel, owner, name or f"p-{parcel[:8]}")
        finally:
            meta.close()
            store.close()
        return parcel


def _postgres_cluster(base: Path) -> Iterator[str]:
    """initdb + pg_ctl start as the postgres user on a free port; yield a DSN; stop in finally."""
    if not (PG_BIN / "initdb").exists():
        pytest.fail(f"PostgreSQL 15 is not installed ({PG_BIN}/initdb missing)")
    data = base / "pgdata"
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base.parent, 0o755)
    as_postgres: list[str] = []
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(base, pw.pw_uid, pw.pw_gid)
        as_postgres = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    subprocess.run([*as_postgres, str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
                    "--no-sync", "-E", "UTF8"], check=True, capture_output=True, timeout=120)
    started = subprocess.run(
        [*as_postgres, str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(base / "postgres.log"), "-w", "-t", "60",
         "-o", f"-c listen_addresses=127.0.0.1 -p {port} -k {base} -c fsync=off -c max_connections=200", "start"],
        capture_output=True, text=True, timeout=90)
    if started.returncode != 0:
        log = (base / "postgres.log").read_text() if (base / "postgres.log").exists() else ""
        pytest.fail(f"PostgreSQL did not start: {started.stderr}\n{log}")
    try:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=postgres", autocommit=True) as conn:
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = 'isr'").fetchone():
                conn.execute("CREATE DATABASE isr")
        yield f"host=127.0.0.1 port={port} user=postgres dbname=isr"
    finally:
        subprocess.run([*as_postgres, str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                       capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    """A real PostgreSQL 15 server for the session (database ``isr``). Its directory is outside pytest's
    private tmp tree, which the postgres user cannot enter."""
    base = Path(tempfile.mkdtemp(prefix="isr-test-pg-"))
    try:
        yield from _postgres_cluster(base / "cluster")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def find_versitygw() -> str:
    for path in (shutil.which("versitygw"), *VERSITYGW_PATHS):
        if path and os.access(path, os.X_OK):
            return path
    pytest.fail("versitygw is not installed: run ./bootstrap setup (it installs it into /usr/local/bin)")


@dataclass
class S3Server:
    endpoint: str
    access: str
    secret: str
    root: Path
    access_log: Path  # one line per request (operation, bucket, key, status, how it was signed)

    def make_bucket(self, name: str) -> str:
        import boto3
        import botocore.config

        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access,
                              aws_secret_access_key=self.secret, region_name="us-east-1",
                              config=botocore.config.Config(s3={"addressing_style": "path"}))
        client.create_bucket(Bucket=name)
        client.close()
        return name


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3-compatible server (versitygw over a posix directory) for the session."""
    binary = find_versitygw()
    root = tmp_path_factory.mktemp("versitygw")
    (root / "data").mkdir()
    port = free_port()
    log = open(root / "versitygw.log", "w")
    proc = subprocess.Popen([binary, "--access", S3_ACCESS, "--secret", S3_SECRET, "--port", f"127.0.0.1:{port}",
                             "--quiet", "--access-log", str(root / "access.log"), "posix", str(root / "data")],
                            stdout=log, stderr=log, start_new_session=True)
    log.close()
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"versitygw did not start:\n{(root / 'versitygw.log').read_text()}")
                time.sleep(0.05)
        yield S3Server(f"http://127.0.0.1:{port}", S3_ACCESS, S3_SECRET, root, root / "access.log")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def backend_settings(kind: str, root: Path, request: pytest.FixtureRequest | None) -> dict[str, Any]:
    """The config settings for one backend set, starting the database and S3 server it needs (through pytest's
    fixtures: outside pytest, as in bench/, request is None and only sqlite-directory can be had)."""
    settings: dict[str, Any] = {
        "server.listen": "127.0.0.1:0",
        "server.workers": 2,
        "server.data_dir": str(root / "data"),
        "server.lock_lease_seconds": LOCK_LEASE,
        "server.max_blob_bytes": 4 * 1024 * 1024,
        "server.max_json_bytes": 4 * 1024 * 1024,
        "server.audit_log": str(root / "audit.log"),
    }
    if kind == "postgres-s3":
        if request is None:
            raise ValueError("the postgres-s3 backends come from pytest fixtures: pass the test's request")
        dsn: str = request.getfixturevalue("postgres_dsn")
        s3: S3Server = request.getfixturevalue("s3_server")
        bucket = s3.make_bucket(f"isr-{uuid.uuid4().hex[:12]}")
        database = f"isr_{uuid.uuid4().hex[:8]}"
        import psycopg

        with psycopg.connect(dsn.replace("dbname=isr", "dbname=postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {database}")
        settings.update({
            "metadata.backend": "postgres", "metadata.dsn": dsn.replace("dbname=isr", f"dbname={database}"),
            "store.backend": "s3", "store.endpoint": s3.endpoint, "store.bucket": bucket,
            "store.access_key": s3.access, "store.secret_key": s3.secret, "store.region": "us-east-1",
            "store.prefix": "isr/",
        })
    return settings


def start_env(kind: str, root: Path, request: pytest.FixtureRequest | None, **overrides: Any) -> ServerEnv:
    """Configure and start a server for a backend set, with users alice, bob and root (an admin)."""
    root.mkdir(parents=True, exist_ok=True)
    settings = backend_settings(kind, root, request)
    settings.update(overrides)
    config = write_config(root / "isr-server.toml", settings)
    server = ServerProcess(config, root / "server.log")
    env = ServerEnv(kind, root, config, settings, server)
    for user, password in PASSWORDS.items():
        env.admin("user", "add", user, "--password-file", "-", *(["--admin"] if user == "root" else []),
                  input_text=password + "\n")
    server.start()
    return env


@pytest.fixture(scope="session", params=BACKENDS)
def server_env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerEnv]:
    """A running isr-server for each backend set (the API suite runs once per set)."""
    env = start_env(request.param, tmp_path_factory.mktemp(request.param), request)
    try:
        yield env
    finally:
        env.server.stop()
        log = env.server.output()
        if "unexpected error" in log or "Traceback" in log:
            pytest.fail(f"isr-server ({env.name}) logged an unexpected error:\n{log}")


def image_with_data(path: Path, size: int, seed: int, data_ranges: list[tuple[int, int]]) -> bytes:
    """Write a sparse raw image of `size` bytes with pseudo-random data in `data_ranges`; return its bytes."""
    import random

    rng = random.Random(seed)
    content = bytearray(size)
    for start, length in data_ranges:
        content[start:start + length] = rng.randbytes(length)
    path.write_bytes(bytes(content))
    return bytes(content)
