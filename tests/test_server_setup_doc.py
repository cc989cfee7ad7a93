"""doc/server.md's "PostgreSQL and S3, step by step", run as written: every shell block marked
``<!-- run: NAME -->`` in the document, in order, in one bash, against the PostgreSQL and S3 (versitygw)
servers the suite starts. Only the first block (the names and secrets) is replaced by the test's own. Then
an isr-server started from the configuration those steps wrote serves a user, so the steps cannot rot.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import uuid
from pathlib import Path

import psycopg
import pytest

from tests.server_fixtures import BIN, S3Server, ServerProcess, postgres_dsn, s3_server  # noqa: F401

pytestmark = pytest.mark.timeout(180)

DOC = Path(__file__).resolve().parent.parent / "doc" / "server.md"
S3_MODULE = Path(__file__).resolve().parent.parent / "server" / "store" / "s3.py"
RUN_BLOCK = re.compile(r"<!-- run: ([a-z0-9-]+) -->\n```sh\n(.*?)\n```", re.S)
STEPS = ["settings", "postgres", "postgres-check", "s3-bucket", "s3-policy", "config", "check", "pg-backup"]
#: The IAM actions each boto3 call of server/store/s3.py needs.
S3_ACTIONS = {
    "head_bucket": {"s3:ListBucket"}, "get_object": {"s3:GetObject"}, "head_object": {"s3:GetObject"},
    "put_object": {"s3:PutObject"}, "upload_fileobj": {"s3:PutObject", "s3:AbortMultipartUpload"},
    "copy_object": {"s3:GetObject", "s3:PutObject"}, "delete_object": {"s3:DeleteObject"},
    "delete_objects": {"s3:DeleteObject"}, "list_objects_v2": {"s3:ListBucket"},
}


def doc_steps() -> list[tuple[str, str]]:
    return RUN_BLOCK.findall(DOC.read_text())


def test_the_documented_steps_are_the_ones_this_test_runs() -> None:
    assert [name for name, _ in doc_steps()] == STEPS


def test_the_policy_allows_every_call_of_the_s3_store() -> None:
    """Each boto3 call in server/store/s3.py needs an action the documented policy grants: a new call
    without a line in the policy fails here, not at a user's site."""
    source = S3_MODULE.read_text()
    calls = set(re.findall(r"client\.([a-z_0-9]+)\(", source)) - {"close", "get_paginator", "generate_presigned_url"}
    calls |= set(re.findall(r'get_paginator\("([a-z_0-9]+)"\)', source))
    calls |= set(re.findall(r'generate_presigned_url\(\s*"([a-z_0-9]+)"', source))
    unknown = calls - set(S3_ACTIONS)
    assert not unknown, f"server/store/s3.py calls {sorted(unknown)}: add them to S3_ACTIONS and the doc's policy"
    policy_block = dict(doc_steps())["s3-policy"]
    granted = set(re.findall(r'"(s3:[A-Za-z]+)"', policy_block))
    needed = set().union(*(S3_ACTIONS[call] for call in calls))
    assert needed <= granted, f"the policy in doc/server.md lacks {sorted(needed - granted)}"


def test_postgres_and_s3_setup_as_written(postgres_dsn: str, s3_server: S3Server, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    port = re.search(r"port=(\d+)", postgres_dsn)
    assert port
    suffix = uuid.uuid4().hex[:8]
    names = {
        "ISR_CONFIG": str(tmp_path / "etc" / "server.toml"), "ISR_DATA_DIR": str(tmp_path / "data"),
        "ISR_LISTEN": "127.0.0.1:0", "DB_HOST": "127.0.0.1", "DB_NAME": f"isrdoc_{suffix}",
        "DB_USER": f"isrdoc_{suffix}", "DB_PASSWORD": f"pw-{uuid.uuid4().hex}", "S3_ENDPOINT": s3_server.endpoint,
        "S3_REGION": "us-east-1", "S3_BUCKET": f"isr-doc-{suffix}", "S3_ADMIN_ACCESS_KEY": s3_server.access,
        "S3_ADMIN_SECRET_KEY": s3_server.secret, "S3_ACCESS_KEY": s3_server.access, "S3_SECRET_KEY": s3_server.secret,
    }
    steps = doc_steps()
    documented = set(re.findall(r"([A-Z0-9_]+)=", steps[0][1]))
    assert documented == set(names), "the doc's settings block and this test name different variables"
    script = "\n".join([f"{k}='{v}'" for k, v in names.items()] + [f"# --- {name}\n{body}" for name, body in steps[1:]])
    # The superuser step runs as PostgreSQL's superuser, as the doc says, through libpq's variables.
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", PGHOST="127.0.0.1", PGPORT=port.group(1),
               PGUSER="postgres")
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, f"the documented steps failed:\n{run.stdout}\n{run.stderr}"
    out = run.stdout.splitlines()
    assert out[:4] == ["CREATE ROLE", "CREATE DATABASE", "REVOKE", names["DB_USER"]], run.stdout  # psql, as the role
    assert "checked 0 chunk object(s) and 0 version(s)" in run.stdout and "ok" in out, run.stdout  # isr-admin fsck
    assert int(out[-1]) > 5, run.stdout                                 # pg_dump has the server's tables

    # The role got what the doc says and no more; the database is closed to others.
    with psycopg.connect(f"host=127.0.0.1 port={port.group(1)} user=postgres dbname=postgres", autocommit=True) as db:
        row = db.execute("SELECT rolsuper, rolcreatedb, rolcreaterole, rolpassword IS NOT NULL FROM pg_authid "
                         "WHERE rolname = %s", (names["DB_USER"],)).fetchone()
        assert row == (False, False, False, True)
        owner = db.execute("SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = %s",
                           (names["DB_NAME"],)).fetchone()
        assert owner == (names["DB_USER"],)
        outsider = f"outsider_{suffix}"
        db.execute(f'CREATE ROLE "{outsider}" LOGIN')
        allowed = db.execute("SELECT has_database_privilege(%s, %s, 'CONNECT')", (outsider, names["DB_NAME"])).fetchone()
        assert allowed == (False,)
        db.execute(f'DROP ROLE "{outsider}"')
    policy = json.loads((tmp_path / "isr-policy.json").read_text())
    resources = {r for statement in policy["Statement"] for r in [statement["Resource"]]}
    assert resources == {f"arn:aws:s3:::{names['S3_BUCKET']}", f"arn:aws:s3:::{names['S3_BUCKET']}/*"}
    config = Path(names["ISR_CONFIG"])
    assert config.stat().st_mode & 0o007 == 0  # the secrets in it are not world-readable

    # The server runs from that configuration: a user signs in and a chunk goes to the bucket and back.
    # (The test's PostgreSQL listens on a port of its own, which the doc's connection string leaves to libpq.)
    monkeypatch.setenv("PGPORT", port.group(1))
    add = subprocess.run([str(BIN / "isr-admin"), "-c", str(config), "user", "add", "alice", "--password-file", "-"],
                         input="alice-password\n", capture_output=True, text=True, timeout=60)
    assert add.returncode == 0, add.stderr
    server = ServerProcess(config, tmp_path / "server.log").start()
    try:
        with server.client() as anonymous:
            token = anonymous.login("alice", "alice-password", label="doc test")
        data = os.urandom(5000)
        tag = hashlib.sha256(data).hexdigest()
        with server.client(token=token) as alice:
            alice.put_chunk(tag, data)
            assert alice.get_chunk(tag) == data
    finally:
        server.stop()
    stored = [p for p in (s3_server.root / "data" / names["S3_BUCKET"]).rglob("*") if p.is_file()]
    assert any(p.name == tag for p in stored), stored


def test_a_wrong_connection_string_is_one_line_without_the_password(postgres_dsn: str, tmp_path: Path) -> None:
    """A typo in metadata.dsn: PostgreSQL's reason in one line, the password left out of it, and no
    half-made database files."""
    port = re.search(r"port=(\d+)", postgres_dsn)
    assert port
    cases = [
        ("host=127.0.0.1 port=1 dbname=isr user=isr password=s3cret-pw", "Connection refused"),
        (f"host=127.0.0.1 port={port.group(1)} dbname=no_such_db_{uuid.uuid4().hex[:6]} user=postgres "
         "password=s3cret-pw", "does not exist"),
        (f"postgresql://postgres:s3cret-pw@127.0.0.1:{port.group(1)}/no_such_db", "does not exist"),
    ]
    for dsn, reason in cases:
        result = subprocess.run([str(BIN / "isr-admin"), "--data-dir", str(tmp_path), "--set", "metadata.backend=postgres",
                                 "--set", f"metadata.dsn={dsn}", "user", "list"], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 1 and result.stderr.count("\n") == 1, (dsn, result.stderr)
        assert "cannot connect to PostgreSQL" in result.stderr and reason in result.stderr, (dsn, result.stderr)
        assert "s3cret-pw" not in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_wrong_s3_key_is_one_line(s3_server: S3Server, tmp_path: Path) -> None:
    """isr-server refuses to start with a key the S3 server does not accept, in one line that names the key
    and the bucket (never the secret)."""
    bucket = s3_server.make_bucket(f"isr-key-{uuid.uuid4().hex[:8]}")
    settings = ["--set", "store.backend=s3", "--set", f"store.endpoint={s3_server.endpoint}", "--set",
                f"store.bucket={bucket}", "--set", f"store.access_key={s3_server.access}", "--set",
                "store.secret_key=not-the-secret-0123", "--data-dir", str(tmp_path), "--listen", "127.0.0.1:0"]
    result = subprocess.run([str(BIN / "isr-server"), *settings], capture_output=True, text=True, timeout=120)
    error = result.stderr.strip().splitlines()[-1]  # after the log line of the certificate made at first start
    assert result.returncode == 1 and error.startswith("isr-server: S3 access to bucket"), result.stderr
    assert f"the key {s3_server.access} may not use bucket {bucket}" in error and "Traceback" not in result.stderr
    assert "not-the-secret-0123" not in result.stderr
