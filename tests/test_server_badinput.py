"""Bad input to isr-server: every malformed, oversized, tricky or unauthorized request gets a clear 4xx
JSON error, never a 500, and nothing is ever written outside the store. Runs against every backend set."""
from __future__ import annotations

import hashlib
import http.client
import json
import os

import pytest

from isrctl.remote import _pinned_context
from tests.server_fixtures import ServerEnv, postgres_dsn, s3_server, server_env  # noqa: F401

pytestmark = pytest.mark.timeout(120)


class Raw:
    """Requests sent byte for byte (http.client does not normalize paths), over the pinned TLS context."""

    def __init__(self, env: ServerEnv) -> None:
        host, port = env.server.url.removeprefix("https://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.context = _pinned_context(env.server.fingerprint)

    def send(self, method: str, path: str, body: bytes | None = None, token: str | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPSConnection(self.host, self.port, context=self.context, timeout=30)
        all_headers = dict(headers or {})
        if token:
            all_headers["Authorization"] = f"Bearer {token}"
        try:
            conn.request(method, path, body=body, headers=all_headers)
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        try:
            parsed = json.loads(data) if data else {}
        except ValueError:
            pytest.fail(f"{method} {path}: non-JSON error body {data[:200]!r}")
        return response.status, parsed


@pytest.fixture(scope="module")
def raw(server_env: ServerEnv) -> Raw:
    return Raw(server_env)


@pytest.fixture(scope="module")
def alice(server_env: ServerEnv) -> str:
    server_env.client("alice").close()
    return server_env.tokens["alice"]


@pytest.fixture(scope="module")
def bob(server_env: ServerEnv) -> str:
    server_env.client("bob").close()
    return server_env.tokens["bob"]


def assert_4xx(result: tuple[int, dict], expected: int | tuple[int, ...]) -> dict:
    status, body = result
    wanted = expected if isinstance(expected, tuple) else (expected,)
    assert status in wanted, (status, body)
    assert isinstance(body.get("error"), str) and body["error"], body
    return body


def test_malformed_json(raw: Raw, alice: str, server_env: ServerEnv) -> None:
    parcel = server_env.new_parcel("alice")
    for path in ("/v1/login", "/v1/chunks/missing", f"/v1/parcels/{parcel}/lock"):
        for body in (b"{not json", b"[1,2]", b"\xff\xfe", b'"string"', b""):
            assert_4xx(raw.send("POST", path, body, token=alice), 400)


def test_deeply_nested_json_is_400(raw: Raw, alice: str, server_env: ServerEnv) -> None:
    """A body nested deeper than Python's JSON parser can go (a RecursionError inside it) is bad input:
    a 400 with a one-line error, also before any login, never a 500."""
    parcel = server_env.new_parcel("alice")
    status, body = raw.send("POST", f"/v1/parcels/{parcel}/lock", b'{"host": "h"}', token=alice)
    assert status == 201, body
    lock = {"ISR-Lock": body["nonce"]}
    for depth in (1000, 10_000):  # both under the 64 KiB limit of a login body
        for nested in (b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth):
            for path, token, headers in (("/v1/login", None, None), ("/v1/chunks/missing", alice, None),
                                         (f"/v1/parcels/{parcel}/lock/renew", alice, lock),
                                         (f"/v1/parcels/{parcel}/versions", alice, lock)):
                body = assert_4xx(raw.send("POST", path, nested, token=token, headers=headers), 400)
                assert body["code"] == "bad_json", body
                assert "\n" not in body["error"] and "nested" in body["error"], body
    raw.send("DELETE", f"/v1/parcels/{parcel}/lock", token=alice, headers=lock)


def test_wrong_field_types(raw: Raw, alice: str, server_env: ServerEnv) -> None:
    parcel = server_env.new_parcel("alice")
    assert_4xx(raw.send("POST", "/v1/login", json.dumps({"user": 5, "password": []}).encode()), 400)
    assert_4xx(raw.send("POST", "/v1/chunks/missing", b'{"tags": "abc"}', token=alice), 400)
    assert_4xx(raw.send("POST", "/v1/chunks/missing", b'{"tags": ["XYZ"]}', token=alice), 400)
    assert_4xx(raw.send("POST", f"/v1/parcels/{parcel}/lock", b'{"host": 7}', token=alice), 400)
    assert_4xx(raw.send("POST", f"/v1/parcels/{parcel}/lock", b'{"host": "h", "force": "yes"}', token=alice), 400)
    assert_4xx(raw.send("POST", f"/v1/parcels/{parcel}/lock", b'{"host": "h\\u0000x"}', token=alice), 400)
    status, body = raw.send("POST", f"/v1/parcels/{parcel}/lock", b'{"host": "h"}', token=alice)
    assert status == 201
    nonce = body["nonce"]
    lock = {"ISR-Lock": nonce}
    commits = [
        {"parent": "1", "blobs": [], "tags": []},
        {"parent": 0, "blobs": "manifest", "tags": []},
        {"parent": 0, "blobs": ["manifest"], "tags": []},  # keyrings missing
        {"parent": 0, "blobs": ["manifest", "keyring.disk", "keyring.memory"], "tags": [1]},
        {"parent": 0, "blobs": ["manifest", "keyring.disk", "keyring.memory", "manifest"], "tags": []},
        {"parent": 0, "blobs": ["../manifest", "keyring.disk", "keyring.memory"], "tags": []},
        {"parent": -1, "blobs": ["manifest", "keyring.disk", "keyring.memory"], "tags": []},
    ]
    for commit in commits:
        assert_4xx(raw.send("POST", f"/v1/parcels/{parcel}/versions", json.dumps(commit).encode(), token=alice,
                            headers=lock), 400)
    assert_4xx(raw.send("POST", f"/v1/parcels/{parcel}/versions", b"{}", token=alice), 400)  # no ISR-Lock
    assert_4xx(raw.send("POST", f"/v1/parcels/{parcel}/versions", b"{}", token=alice,
                        headers={"ISR-Lock": "short"}), 400)
    assert_4xx(raw.send("POST", f"/v1/parcels/{parcel}/versions",
                        json.dumps({"parent": 0, "blobs": ["manifest", "keyring.disk", "keyring.memory"]}).encode(),
                        token=alice, headers={"ISR-Lock": "A" * 43}), 409)  # a well-formed but wrong nonce
    raw.send("DELETE", f"/v1/parcels/{parcel}/lock", token=alice, headers=lock)


def test_bad_tags_and_ids_in_paths(raw: Raw, alice: str) -> None:
    for path in ("/v1/chunks/abc", "/v1/chunks/" + "A" * 64, "/v1/chunks/" + "g" * 64, "/v1/chunks/" + "0" * 65):
        assert_4xx(raw.send("GET", path, token=alice), 400)
    for path in ("/v1/parcels/not-a-uuid", "/v1/parcels/6F1C2A4E-8D3B-4F0E-9A55-0C1D2E3F4A5B",
                 "/v1/parcels/00000000-0000-4000-8000-000000000000/versions/abc",
                 "/v1/parcels/00000000-0000-4000-8000-000000000000/versions/-1"):
        assert_4xx(raw.send("GET", path, token=alice), (400, 404))


def test_path_traversal_never_escapes_the_store(raw: Raw, alice: str, server_env: ServerEnv) -> None:
    parcel = server_env.new_parcel("alice")
    status, body = raw.send("POST", f"/v1/parcels/{parcel}/lock", b'{"host": "h"}', token=alice)
    lock = {"ISR-Lock": body["nonce"]}
    outside = server_env.root / "escaped"
    tricks = [
        f"/v1/parcels/{parcel}/staging/..%2F..%2F..%2F..%2Fescaped",
        f"/v1/parcels/{parcel}/staging/../../../../escaped",
        f"/v1/parcels/{parcel}/staging/%2e%2e",
        f"/v1/parcels/{parcel}/staging/.hidden",
        f"/v1/parcels/{parcel}/staging/a%00b",
        f"/v1/parcels/{parcel}/staging/UPPER",
        f"/v1/parcels/{parcel}/staging/" + "a" * 65,
        f"/v1/parcels/..%2F..%2Fescaped/staging/manifest",
    ]
    for path in tricks:
        assert_4xx(raw.send("PUT", path, b"payload", token=alice, headers=lock), (400, 404, 405))
    for path in ("/v1/chunks/../../../etc/passwd", "/v1/chunks/..%2F..%2Fetc%2Fpasswd",
                 f"/v1/parcels/{parcel}/versions/1/..%2F..%2Fkeyenvelope", "/v1/../../etc/passwd"):
        assert_4xx(raw.send("GET", path, token=alice), (400, 404))
    # Paths outside /v1 are the web pages (HTML answers): tests/test_web.py tries the same tricks there.
    assert not outside.exists()
    found = [p for p in server_env.root.rglob("escaped")]
    assert found == []
    raw.send("DELETE", f"/v1/parcels/{parcel}/lock", token=alice, headers=lock)


def test_oversize_bodies(raw: Raw, alice: str) -> None:
    big = os.urandom(4194304 + 29)
    body = assert_4xx(raw.send("PUT", f"/v1/chunks/{hashlib.sha256(big).hexdigest()}", big, token=alice), 413)
    assert body["code"] == "too_large"
    huge_json = b'{"tags": [' + b'"' + b"0" * 64 + b'",' * 1 + b'"' + b"1" * 5_000_000 + b'"]}'
    assert_4xx(raw.send("POST", "/v1/chunks/missing", huge_json, token=alice), 413)
    assert_4xx(raw.send("POST", "/v1/login", b'{"user": "alice", "password": "' + b"x" * 70000 + b'"}'), 413)
    many = json.dumps({"tags": ["0" * 64] * 100001}).encode()
    assert_4xx(raw.send("POST", "/v1/chunks/missing", many, token=alice), 413)


def test_wrong_tag_is_422(raw: Raw, alice: str) -> None:
    data = os.urandom(5000)
    body = assert_4xx(raw.send("PUT", f"/v1/chunks/{hashlib.sha256(b'other').hexdigest()}", data, token=alice), 422)
    assert body["code"] == "tag_mismatch"
    tiny = b"x" * 10
    assert_4xx(raw.send("PUT", f"/v1/chunks/{hashlib.sha256(tiny).hexdigest()}", tiny, token=alice), 422)


def test_bad_tokens(raw: Raw, server_env: ServerEnv) -> None:
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Basic YWxpY2U6eA=="},
                    {"Authorization": "Bearer isr_" + "x" * 43}, {"Authorization": "Bearer " + "y" * 500},
                    {"Authorization": "Bearer not-a-token"}):
        for method, path in (("GET", "/v1/parcels"), ("GET", "/v1/chunks/" + "0" * 64), ("POST", "/v1/logout")):
            body = assert_4xx(raw.send(method, path, headers=headers), 401)
            assert body["code"] == "unauthorized"


def test_expired_and_revoked_tokens(raw: Raw, server_env: ServerEnv) -> None:
    from server import auth

    meta, store = server_env.open_backends()
    try:
        user = meta.get_user("alice")
        assert user is not None
        expired = auth.new_token()
        meta.add_token(os.urandom(8).hex(), auth.secret_hash(expired), user[0].id, "expired", -10)
    finally:
        meta.close()
        store.close()
    assert_4xx(raw.send("GET", "/v1/parcels", token=expired), 401)
    assert_4xx(raw.send("GET", "/v1/chunks/" + "0" * 64, token=expired), 401)
    with server_env.server.client() as client:
        token = client.login("alice", "alice-password")
        client.logout()
    assert_4xx(raw.send("GET", "/v1/whoami", token=token), 401)


def test_foreign_tokens_get_403(raw: Raw, alice: str, bob: str, server_env: ServerEnv) -> None:
    parcel = server_env.new_parcel("alice")
    status, body = raw.send("POST", f"/v1/parcels/{parcel}/lock", b'{"host": "h"}', token=alice)
    nonce = body["nonce"]
    for method, path, data in (
        ("GET", f"/v1/parcels/{parcel}", None),
        ("GET", f"/v1/parcels/{parcel}/keyenvelope", None),
        ("GET", f"/v1/parcels/{parcel}/versions", None),
        ("GET", f"/v1/parcels/{parcel}/lock", None),
        ("POST", f"/v1/parcels/{parcel}/lock", b'{"host": "bob"}'),
        ("POST", f"/v1/parcels/{parcel}/lock/break", b'{"force": true}'),
        ("POST", f"/v1/parcels/{parcel}/lock/renew", None),
        ("DELETE", f"/v1/parcels/{parcel}/lock", None),
        ("PUT", f"/v1/parcels/{parcel}/staging/manifest", b"x"),
        ("POST", f"/v1/parcels/{parcel}/versions", b"{}"),
    ):
        # Even with the right nonce, another user's token is refused.
        assert_4xx(raw.send(method, path, data, token=bob, headers={"ISR-Lock": nonce}), 403)
    raw.send("DELETE", f"/v1/parcels/{parcel}/lock", token=alice, headers={"ISR-Lock": nonce})


def test_unknown_endpoints_and_methods(raw: Raw, alice: str) -> None:
    assert_4xx(raw.send("GET", "/v1", token=alice), 404)  # "/" itself is the web pages' (tests/test_web.py)
    assert_4xx(raw.send("GET", "/v2/parcels", token=alice), 404)
    assert_4xx(raw.send("DELETE", "/v1/parcels", token=alice), 405)
    assert_4xx(raw.send("POST", "/v1/chunks/" + "0" * 64, b"x", token=alice), 405)
    # Broken HTTP framing is refused by the HTTP layer itself (granian), before the app: a bare 400.
    status, _ = raw.send("PUT", "/v1/chunks/" + "0" * 64, token=alice, headers={"Content-Length": "abc"})
    assert status == 400


def test_server_logged_no_internal_error(server_env: ServerEnv) -> None:
    """Runs last in this module: the server's log must hold no traceback from all of the above."""
    log = server_env.server.output()
    assert "unexpected error" not in log and "Traceback" not in log, log
