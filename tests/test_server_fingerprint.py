"""`isr-admin fingerprint`: the certificate fingerprint and the `isr login` line an administrator hands a
user, checked against the running server and followed by the real `isr login`."""
from __future__ import annotations

import os
import shlex
import socket
import subprocess
from pathlib import Path

import pytest

from tests.server_fixtures import BIN, PASSWORDS, ServerEnv, postgres_dsn, s3_server, server_env  # noqa: F401

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("server_env", ["sqlite-directory"], indirect=True)  # the certificate is the same on both
def test_fingerprint_and_login_line_work_with_isr_login(server_env: ServerEnv, tmp_path: Path) -> None:
    url = server_env.server.url
    result = server_env.admin("fingerprint", "--user", "alice", "--url", url)
    lines = result.stdout.splitlines()
    assert f"fingerprint {server_env.server.fingerprint}" in lines, result.stdout
    login = lines[-1]
    assert login == f"isr login {url} --user alice --fingerprint {server_env.server.fingerprint}", result.stdout
    # The line works as handed over: the real isr logs in with it (password from the environment).
    home = {name: str(tmp_path / name) for name in ("config", "data", "cache")}
    env = dict(os.environ, XDG_CONFIG_HOME=home["config"], XDG_DATA_HOME=home["data"], XDG_CACHE_HOME=home["cache"],
               ISR_PASSWORD=PASSWORDS["alice"])
    argv = shlex.split(login)
    logged = subprocess.run([str(BIN / argv[0]), *argv[1:], "--password-env", "ISR_PASSWORD"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert logged.returncode == 0, logged.stderr
    assert f"logged in to {url} as alice" in logged.stdout
    assert server_env.server.fingerprint in (tmp_path / "config" / "isr" / "config.toml").read_text()

    data = server_env.admin_json("fingerprint", "--url", url)
    assert data["fingerprint"] == server_env.server.fingerprint and data["user"] is None
    assert data["certificate"] == str(Path(server_env.settings["server.data_dir"]) / "tls" / "server.crt")
    assert data["login"].endswith(f"--user NAME --fingerprint {server_env.server.fingerprint}")


@pytest.mark.parametrize("server_env", ["sqlite-directory"], indirect=True)
def test_fingerprint_url_comes_from_the_listen_address(server_env: ServerEnv) -> None:
    fixed = server_env.admin_json("--set", "server.listen=127.0.0.1:8443", "fingerprint", "--user", "bob")
    assert fixed["url"] == "https://127.0.0.1:8443" and " --user bob " in fixed["login"]
    # Listening on every address: the self-signed certificate's name for this machine, not 0.0.0.0.
    wildcard = server_env.admin_json("--set", "server.listen=0.0.0.0:9443", "fingerprint")
    assert wildcard["url"] == f"https://{socket.gethostname()}:9443", wildcard


@pytest.mark.parametrize("server_env", ["sqlite-directory"], indirect=True)
def test_fingerprint_refusals_are_one_line(server_env: ServerEnv, tmp_path: Path) -> None:
    cases = [
        (("fingerprint", "--user", "nobody-here", "--url", "https://h:1"), "no user nobody-here"),
        (("fingerprint", "--url", "http://plain:80"), "--url must be https://HOST:PORT"),
        (("fingerprint",), "port 0"),  # the test server listens on port 0
        (("--data-dir", str(tmp_path / "new"), "fingerprint", "--url", "https://h:1"), "no certificate"),
        (("--set", f"server.tls_cert={tmp_path / 'missing.pem'}", "--set", f"server.tls_key={tmp_path / 'k.pem'}",
          "fingerprint", "--url", "https://h:1"),
         "cannot read certificate"),
    ]
    for args, expected in cases:
        result = server_env.admin(*args, check=False)
        assert result.returncode == 1 and result.stderr.count("\n") == 1, (args, result.stderr)
        assert expected in result.stderr and "Traceback" not in result.stderr, (args, result.stderr)
        assert result.stdout == "", (args, result.stdout)
    assert not (tmp_path / "new" / "tls").exists()  # a read-only command makes no certificate

