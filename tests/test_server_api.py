"""The isr-server API suite, run against every backend set (sqlite+directory, PostgreSQL+S3).

Each test talks to a real isr-server over real TLS (HTTP/2) through isrctl.remote, the client isrctl uses.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import socket
import ssl
import threading
import time
from pathlib import Path

import httpx
import pytest

from isrctl.remote import (AccessDenied, AuthenticationFailed, BundleReader, CertificateMismatch, ChunksMissing,
                           IncompleteBundle, LockHeld, LockLost, Remote, RemoteConflict, RemoteError, RemoteNotFound,
                           RequestRejected, VersionConflict, bundle_unsupported)
from parcels import resumepack
from server import names
from tests.server_fixtures import (LOCK_LEASE, ServerEnv, free_port, postgres_dsn, s3_server, server_env,  # noqa: F401
                                   wait_until)

pytestmark = pytest.mark.timeout(120)


def make_chunk(size: int = 4096) -> tuple[str, bytes]:
    data = os.urandom(size)
    return hashlib.sha256(data).hexdigest(), data


def make_version(client: Remote, parcel: str, nonce: str, parent: int, n_chunks: int = 3,
                 extra_blobs: dict[str, bytes] | None = None) -> tuple[dict, list[str], dict[str, bytes]]:
    """Upload new chunks and placeholder sealed blobs, then commit; return (version, tags, blobs)."""
    chunks = [make_chunk() for _ in range(n_chunks)]
    tags = [t for t, _ in chunks]
    assert sorted(client.missing(tags)) == sorted(tags)
    for tag, data in chunks:
        assert client.put_chunk(tag, data) is True
    assert client.missing(tags) == []
    blobs = {"manifest": os.urandom(300), "keyring.disk": os.urandom(200), "keyring.memory": os.urandom(28)}
    blobs.update(extra_blobs or {})
    for name, data in blobs.items():
        reply = client.put_blob(parcel, name, data, nonce)
        assert reply["size"] == len(data)
    version = client.commit(parcel, nonce, parent, list(blobs), tags)
    return version, tags, blobs


def test_health_is_https_with_http2(server_env: ServerEnv) -> None:
    with server_env.client() as client:
        assert client.health()["status"] == "ok"
        assert client.client.get("/v1/health").http_version == "HTTP/2"
    with server_env.server.client(http2=False) as client:
        assert client.client.get("/v1/health").http_version == "HTTP/1.1"


def _peer_socket(pgid: int, client: socket.socket) -> socket.socket | None:
    """The server's end of ``client``: a duplicate of the socket, taken from whichever isr-server process
    (the granian workers share the session) holds it, with pidfd_getfd(2)."""
    pidfd_getfd = {"x86_64": 438, "aarch64": 438}[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    want = client.getsockname()
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.getpgid(pid) != pgid:
                continue
            fds = [(int(fd), os.readlink(f"/proc/{pid}/fd/{fd}")) for fd in os.listdir(f"/proc/{pid}/fd")]
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            for fd, target in fds:
                if not target.startswith("socket:"):
                    continue
                dup = libc.syscall(pidfd_getfd, pidfd, fd, 0)
                if dup < 0:
                    continue
                sock = socket.socket(fileno=dup)
                try:
                    if sock.type == socket.SOCK_STREAM and sock.getpeername() == want:
                        return sock
                except OSError:
                    pass
                sock.close()
        finally:
            os.close(pidfd)
    return None


def test_connections_send_without_nagle(server_env: ServerEnv) -> None:
    """Every accepted connection has TCP_NODELAY: granian sets none, and with Nagle the tail of one chunk
    GET in every few on an HTTP/2 connection waited for the client's delayed ACK (40 ms on top of the RTT)."""
    proc = server_env.server.proc
    assert proc is not None
    host, port = server_env.server.url.removeprefix("https://").rsplit(":", 1)
    with socket.create_connection((host.strip("[]"), int(port))) as client:
        peer = wait_until(lambda: _peer_socket(proc.pid, client), timeout=30, what="the server's end of a connection")
        with peer:
            assert peer.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def _tls_client(version: ssl.TLSVersion) -> ssl.SSLContext:
    """A client context that offers exactly ``version``; security level 0 lets OpenSSL 3 offer TLS 1.1 at
    all (by default it refuses to, before a byte is sent, which would make a refusal test pass vacuously)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    context.minimum_version = context.maximum_version = version
    return context


def _handshake(context: ssl.SSLContext, host: str, port: int) -> str | None:
    with socket.create_connection((host, port), timeout=10) as raw:
        with context.wrap_socket(raw) as tls:
            return tls.version()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_tls_versions(server_env: ServerEnv, tmp_path: Path) -> None:
    host, port = server_env.server.url.removeprefix("https://").rsplit(":", 1)
    for version, name in ((ssl.TLSVersion.TLSv1_2, "TLSv1.2"), (ssl.TLSVersion.TLSv1_3, "TLSv1.3")):
        assert _handshake(_tls_client(version), host, int(port)) == name
    # The same TLS 1.1 client first completes a handshake with a server that allows TLS 1.1 (openssl
    # s_server), so the refusal below is isr-server's answer, not the client declining to try.
    old = _tls_client(ssl.TLSVersion.TLSv1_1)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / "k.pem"),
                    "-out", str(tmp_path / "c.pem"), "-subj", "/CN=localhost", "-days", "1"],
                   check=True, capture_output=True, timeout=60)
    control_port = free_port()
    control = subprocess.Popen(["openssl", "s_server", "-accept", f"127.0.0.1:{control_port}", "-cert",
                                str(tmp_path / "c.pem"), "-key", str(tmp_path / "k.pem"), "-tls1_1", "-cipher",
                                "DEFAULT:@SECLEVEL=0", "-naccept", "2", "-quiet"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _port_open(control_port), timeout=30, what="openssl s_server")
        assert _handshake(old, "127.0.0.1", control_port) == "TLSv1.1"
    finally:
        control.kill()
        control.wait(timeout=10)
    with pytest.raises(ssl.SSLError) as refused:
        _handshake(old, host, int(port))
    # An alert from the server (granian answers handshake_failure), not the client's NO_PROTOCOLS_AVAILABLE.
    assert refused.value.reason in ("TLSV1_ALERT_PROTOCOL_VERSION", "SSLV3_ALERT_HANDSHAKE_FAILURE",
                                    "UNSUPPORTED_PROTOCOL"), refused.value


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_pinned_fingerprint_is_checked(server_env: ServerEnv) -> None:
    wrong = "sha256:" + "00" * 32
    with Remote(server_env.server.url, fingerprint=wrong) as client:
        with pytest.raises(CertificateMismatch):
            client.login("alice", "alice-password")
    with pytest.raises(CertificateMismatch, match="self-signed certificate") as refused:
        with Remote(server_env.server.url) as client:  # system CAs do not trust the self-signed certificate
            client.health()
    assert refused.value.status == 0  # refused in the handshake: no request was sent


def test_login_is_throttled_after_failures(server_env: ServerEnv) -> None:
    """Five wrong passwords for one user: the next login, even with the right password, gets 429 with a
    Retry-After, and the web sign-in counts the same failures."""
    server_env.admin("user", "add", "mallory", "--password-file", "-", input_text="mallory-password\n")
    with httpx.Client(verify=False, timeout=30) as http:
        def login(password: str) -> httpx.Response:
            return http.post(f"{server_env.server.url}/v1/login", json={"user": "mallory", "password": password})
        for _ in range(5):
            assert login("wrong").status_code == 401
        refused = login("mallory-password")
        assert refused.status_code == 429, refused.text
        assert refused.json()["code"] == "too_many_attempts"
        assert 0 < int(refused.headers["retry-after"]) <= 15 * 60
    with server_env.client() as client:
        with pytest.raises(RemoteError, match="too many failed logins"):
            client.login("mallory", "mallory-password")


def test_login_tokens_logout(server_env: ServerEnv) -> None:
    with server_env.client() as client:
        with pytest.raises(AuthenticationFailed):
            client.login("alice", "wrong")
        with pytest.raises(AuthenticationFailed):
            client.login("nobody", "x")
        token = client.login("alice", "alice-password", label="laptop")
        assert token.startswith("isr_")
        me = client.whoami()
        assert me["user"] == "alice" and me["admin"] is False and me["token"]["label"] == "laptop"
        listed = client.tokens()
        assert any(t["current"] for t in listed)
        other = Remote(server_env.server.url, fingerprint=server_env.server.fingerprint)
        second = other.login("alice", "alice-password", label="desktop")
        second_id = other.whoami()["token"]["id"]
        client.revoke_token(second_id)
        with pytest.raises(AuthenticationFailed):
            other.whoami()
        other.close()
        assert second != token
        client.logout()
        client.token = token
        with pytest.raises(AuthenticationFailed):
            client.whoami()


def test_parcels_are_private(server_env: ServerEnv) -> None:
    mine = server_env.new_parcel("alice")
    theirs = server_env.new_parcel("bob")
    with server_env.client("alice") as alice, server_env.client("bob") as bob:
        ids = [p["id"] for p in alice.parcels()]
        assert mine in ids and theirs not in ids
        listed = next(p for p in alice.parcels() if p["id"] == mine)
        assert listed["lock"] is None and listed["versions"] == [] and listed["current_version"] == 0
        with pytest.raises(AccessDenied):
            alice.parcel(theirs)
        with pytest.raises(AccessDenied):
            alice.key_envelope(theirs)
        with pytest.raises(AccessDenied):
            alice.acquire(theirs, host="h")
        with pytest.raises(RemoteNotFound):
            alice.parcel("00000000-0000-4000-8000-000000000000")
        assert len(bob.key_envelope(theirs)) == 148


def test_chunks_put_get_head_missing(server_env: ServerEnv) -> None:
    tag, data = make_chunk(131072 + 28)
    with server_env.client("alice") as client:
        assert client.missing([tag, tag]) == [tag]
        assert client.has_chunk(tag) is False
        with pytest.raises(RemoteNotFound):
            client.get_chunk(tag)
        assert client.put_chunk(tag, data) is True
        assert client.put_chunk(tag, data) is False  # idempotent
        assert client.missing([tag]) == []
        assert client.get_chunk(tag) == data
        assert client.has_chunk(tag)
        response = client.request("GET", f"/v1/chunks/{tag}")
        assert "immutable" in response.headers["cache-control"]
        assert response.headers["etag"] == f'"{tag}"'
        assert int(response.headers["content-length"]) == len(data)
        head = client.request("HEAD", f"/v1/chunks/{tag}")
        assert int(head.headers["content-length"]) == len(data) and head.content == b""
        again = client.request("GET", f"/v1/chunks/{tag}", headers={"If-None-Match": f'"{tag}"'})
        assert again.status_code == 304
        with pytest.raises(RequestRejected) as e:
            client.request("PUT", f"/v1/chunks/{'0' * 64}", content=data)
        assert e.value.status == 422 and e.value.code == "tag_mismatch"


def test_version_commit_cycle(server_env: ServerEnv) -> None:
    parcel = server_env.new_parcel("alice")
    with server_env.client("alice") as client:
        nonce = client.acquire(parcel, host="laptop", site="home")["nonce"]
        v1, tags1, blobs1 = make_version(client, parcel, nonce, parent=0, extra_blobs={"devstate": b"d" * 1000})
        assert v1["version"] == 1 and v1["parent"] is None and v1["chunk_count"] == 3
        assert v1["host"] == "laptop" and v1["site"] == "home"
        for name, data in blobs1.items():
            assert client.get_blob(parcel, 1, name) == data
        head = client.request("HEAD", f"/v1/parcels/{parcel}/versions/1/devstate")
        assert int(head.headers["content-length"]) == 1000
        with pytest.raises(RemoteNotFound):
            client.get_blob(parcel, 1, "nosuchblob")
        # Version 2 inherits the devstate, references one old chunk and one new one.
        new_tag, new_data = make_chunk()
        client.put_chunk(new_tag, new_data)
        blobs2 = {"manifest": b"m2", "keyring.disk": b"k2", "keyring.memory": b"km2"}
        for name, data in blobs2.items():
            client.put_blob(parcel, name, data, nonce)
        client.put_blob(parcel, "unlisted", b"dropped at commit", nonce)
        v2 = client.commit(parcel, nonce, 1, list(blobs2), [tags1[0], new_tag], inherit=["devstate"])
        assert v2["version"] == 2 and v2["parent"] == 1 and v2["chunk_count"] == 2
        assert client.get_blob(parcel, 2, "devstate") == b"d" * 1000
        assert client.get_blob(parcel, 2, "manifest") == b"m2"
        with pytest.raises(RemoteNotFound):
            client.get_blob(parcel, 2, "unlisted")
        assert client.get_blob(parcel, 1, "manifest") == blobs1["manifest"]  # old versions stay intact
        # A stale parent is refused.
        for name, data in blobs2.items():
            client.put_blob(parcel, name, data, nonce)
        with pytest.raises(VersionConflict) as e:
            client.commit(parcel, nonce, 1, list(blobs2), [new_tag])
        assert e.value.details["current"] == 2
        # A missing chunk is refused, with the list of what is missing.
        absent = hashlib.sha256(b"never uploaded").hexdigest()
        with pytest.raises(ChunksMissing) as e:
            client.commit(parcel, nonce, 2, list(blobs2), [new_tag, absent])
        assert e.value.missing == [absent]
        # A blob that was not staged is refused.
        with pytest.raises(RemoteConflict) as e:
            client.commit(parcel, nonce, 2, [*blobs2, "kernel"], [new_tag])
        assert e.value.code == "blobs_missing"
        info = client.parcel(parcel)
        assert info["current_version"] == 2 and [v["version"] for v in info["versions"]] == [1, 2]
        assert client.versions(parcel)["current"] == 2
        assert client.version(parcel, 1)["chunk_count"] == 3
        client.release(parcel, nonce)
        # After release the nonce is worthless.
        with pytest.raises(LockLost):
            client.commit(parcel, nonce, 2, list(blobs2), [new_tag])
        with pytest.raises(LockLost):
            client.put_blob(parcel, "manifest", b"x", nonce)
        listed = next(p for p in client.parcels() if p["id"] == parcel)
        assert listed["lock"] is None and [v["version"] for v in listed["versions"]] == [1, 2]


def test_version_chunk_lists_for_keyless_hoards(server_env: ServerEnv) -> None:
    """GET …/versions/{n}/chunks lists a version's tags with their stored sizes, page by page, and the
    working set the committing client reported (in its order); nothing of it needs the parcel key."""
    parcel = server_env.new_parcel("alice")
    theirs = server_env.new_parcel("bob")
    with server_env.client("alice") as client:
        nonce = client.acquire(parcel, host="laptop", site="home")["nonce"]
        chunks = [make_chunk(size) for size in (1000, 2000, 3000)]
        tags = [t for t, _ in chunks]
        for tag, data in chunks:
            client.put_chunk(tag, data)
        blobs = {"manifest": b"m", "keyring.disk": b"k", "keyring.memory": b"km"}
        for name, data in blobs.items():
            client.put_blob(parcel, name, data, nonce)
        # The working set must be among the version's tags.
        with pytest.raises(RequestRejected) as e:
            client.commit(parcel, nonce, 0, list(blobs), tags[:2], working_tags=[tags[2]])
        assert e.value.status == 400 and e.value.code == "bad_working_tags"
        client.commit(parcel, nonce, 0, list(blobs), tags, working_tags=[tags[2], tags[0], tags[2]])

        recorded, listed = client.version_chunks(parcel, 1)
        assert recorded and listed == sorted((t, len(d)) for t, d in chunks)
        recorded, working = client.version_chunks(parcel, 1, "working")
        assert recorded and working == [(tags[2], 3000), (tags[0], 1000)]  # first touch first, once each
        path = f"/v1/parcels/{parcel}/versions/1/chunks"
        first = client.request("GET", f"{path}?limit=2").json()
        assert first["total"] == 3 and first["next"] == 2 and len(first["chunks"]) == 2
        last = client.request("GET", f"{path}?offset=2&limit=2").json()
        assert last["next"] is None and [c["tag"] for c in last["chunks"]] == [sorted(tags)[2]]
        assert client.request("GET", f"{path}?offset=9").json()["chunks"] == []
        for query, code in (("set=hot", "bad_set"), ("limit=0", "bad_limit"), ("offset=-1", "bad_offset")):
            with pytest.raises(RequestRejected) as e:
                client.request("GET", f"{path}?{query}")
            assert e.value.code == code
        # A version committed without a working set has none recorded.
        for name, data in blobs.items():
            client.put_blob(parcel, name, data, nonce)
        client.commit(parcel, nonce, 1, list(blobs), tags[:1])
        assert client.version_chunks(parcel, 2, "working") == (False, [])
        assert client.version_chunks(parcel, 2) == (True, [(tags[0], 1000)])
        with pytest.raises(RemoteNotFound):
            client.version_chunks(parcel, 3)
        with pytest.raises(AccessDenied):
            client.version_chunks(theirs, 1)
        with server_env.server.client(token="isr_" + "x" * 40) as stranger, pytest.raises(AuthenticationFailed):
            stranger.version_chunks(parcel, 1)
        # "chunks" is the API's word under a version, so no blob may have that name.
        with pytest.raises(RequestRejected) as e:
            client.put_blob(parcel, "chunks", b"x", nonce)
        assert e.value.code == "bad_blob_name"
        client.release(parcel, nonce)


def _bundle_body(blobs: list[bytes]) -> bytes:
    """A bundle's body as doc/protocol.md frames it: per blob, its length in 8 bytes big-endian, then it."""
    return b"".join(len(data).to_bytes(8, "big") + data for data in blobs)


def test_version_blob_bundles(server_env: ServerEnv) -> None:
    """GET …/versions/{n}/_bundle streams the named blobs in the order asked, framed; a name the version
    lacks is 404 before anything is sent, a bad list 400 bad_names, another user's parcel 403, as for one blob;
    `Remote.get_blobs` yields what `get_blob` returns."""
    parcel = server_env.new_parcel("alice")
    theirs = server_env.new_parcel("bob")
    extra = {"devstate": os.urandom(70000), "resumepack": os.urandom(5), "resumepack.1": b""}
    with server_env.client("alice") as client:
        nonce = client.acquire(parcel, host="laptop", site="home")["nonce"]
        _, _, blobs = make_version(client, parcel, nonce, parent=0, n_chunks=1, extra_blobs=extra)
        client.release(parcel, nonce)
        order = ["resumepack.1", "keyring.memory", "devstate", "manifest", "resumepack"]
        path = f"/v1/parcels/{parcel}/versions/1/_bundle"
        answer = client.request("GET", f"{path}?names={','.join(order)}")
        assert answer.content == _bundle_body([blobs[name] for name in order])
        assert answer.headers["content-type"] == "application/vnd.isr.bundle"
        assert "immutable" in answer.headers["cache-control"]
        assert list(client.get_blobs(parcel, 1, order)) == [(name, client.get_blob(parcel, 1, name))
                                                            for name in order]
        assert list(client.get_blobs(parcel, 1, [])) == []
        head = client.request("HEAD", f"{path}?names=manifest")
        assert head.status_code == 200 and head.content == b""
        # Every name is checked before a byte is sent.
        got: list[tuple[str, bytes]] = []
        with pytest.raises(RemoteNotFound) as e:
            got.extend(client.get_blobs(parcel, 1, ["manifest", "kernel", "devstate", "initrd"]))
        assert got == [] and e.value.details["missing"] == ["kernel", "initrd"]
        for query in ("names=manifest,Manifest", "names=manifest,devstate,manifest", "names=", "",
                      "names=manifest,", "names=" + ",".join(f"b{i}" for i in range(301))):
            with pytest.raises(RequestRejected) as e:
                client.request("GET", f"{path}?{query}")
            assert e.value.status == 400 and e.value.code == "bad_names", query
        # The longest list the server takes fits through HTTP/2's header limit.
        longest = [f"{i:03d}".ljust(64, "x") for i in range(300)]
        with pytest.raises(RemoteNotFound) as e:
            list(client.get_blobs(parcel, 1, longest))
        assert e.value.details["missing"] == longest
        with pytest.raises(RemoteNotFound):
            list(client.get_blobs(parcel, 2, ["manifest"]))
        with pytest.raises(AccessDenied):
            list(client.get_blobs(theirs, 1, ["manifest"]))
    with server_env.client("bob") as bob, pytest.raises(AccessDenied):
        list(bob.get_blobs(parcel, 1, ["manifest"]))
    with server_env.server.client(token="isr_" + "x" * 40) as stranger, pytest.raises(AuthenticationFailed):
        list(stranger.get_blobs(parcel, 1, ["manifest"]))


def test_blob_bundle_left_unread_leaves_the_connection_usable(server_env: ServerEnv) -> None:
    """A consumer that stops after the first blob of a bundle leaves the client usable: the unread rest would
    otherwise hold the HTTP/2 flow-control window of the connection, and after a few such bundles (16 MiB
    unread each) the next one stalled until its read timed out."""
    parcel = server_env.new_parcel("alice")
    big = {f"big{i}": os.urandom(4 << 20) for i in range(4)}
    with server_env.client("alice") as client:
        nonce = client.acquire(parcel, host="laptop")["nonce"]
        make_version(client, parcel, nonce, parent=0, n_chunks=1, extra_blobs=big)
        client.release(parcel, nonce)
        for _ in range(3):
            arriving = client.get_blobs(parcel, 1, list(big))
            assert next(arriving) == ("big0", big["big0"])
            arriving.close()
        assert dict(client.get_blobs(parcel, 1, list(big))) == big


def test_blob_bundle_falls_back_on_a_server_without_the_route(server_env: ServerEnv) -> None:
    """Against a server that lacks the bundle route (here: a route name this one lacks, which it answers as a
    server from before the route answers ``_bundle``), `get_blobs` fetches blob by blob and yields the same;
    a bundle's own 404 for a missing blob is never taken for a missing route."""
    parcel = server_env.new_parcel("alice")
    with server_env.client("alice") as client:
        nonce = client.acquire(parcel, host="laptop")["nonce"]
        _, _, blobs = make_version(client, parcel, nonce, parent=0, n_chunks=1, extra_blobs={"devstate": b"d" * 9})
        client.release(parcel, nonce)
        order = ["devstate", "keyring.disk", "manifest"]
        for segment, status in (("_nobundle", 400), ("_nobundle/deeper", 404)):
            with pytest.raises(RemoteError) as e:
                client.request("GET", f"/v1/parcels/{parcel}/versions/1/{segment}?names=manifest")
            assert e.value.status == status and bundle_unsupported(e.value)
            client.bundle_segment = segment
            assert list(client.get_blobs(parcel, 1, order)) == [(name, blobs[name]) for name in order]
            with pytest.raises(RemoteNotFound):
                list(client.get_blobs(parcel, 1, ["manifest", "kernel"]))
        client.bundle_segment = Remote.bundle_segment
        with pytest.raises(RemoteNotFound) as e:
            list(client.get_blobs(parcel, 1, ["kernel"]))
        assert not bundle_unsupported(e.value)


def test_blob_bundle_reader_refuses_cut_and_misframed_bodies(server_env: ServerEnv) -> None:
    """`BundleReader` yields each blob once it is whole, whatever the pieces the body arrives in, and says
    after how many blobs a real bundle that was cut off, or misframed, ended."""
    parcel = server_env.new_parcel("alice")
    with server_env.client("alice") as client:
        nonce = client.acquire(parcel, host="laptop")["nonce"]
        _, _, blobs = make_version(client, parcel, nonce, parent=0, n_chunks=1)
        client.release(parcel, nonce)
        order = list(blobs)
        body = client.request("GET", f"/v1/parcels/{parcel}/versions/1/_bundle?names={','.join(order)}").content
    whole = [(name, blobs[name]) for name in order]
    for step in (1, 7, 8, 301, len(body)):
        reader = BundleReader(order, "the bundle of version 1")
        got = [blob for start in range(0, len(body), step) for blob in reader.feed(body[start:start + step])]
        reader.finish()
        assert got == whole
    first_end = 8 + len(blobs[order[0]])
    for cut, done in ((0, 0), (5, 0), (first_end - 1, 0), (first_end, 1), (first_end + 8, 1), (len(body) - 1, 2)):
        reader = BundleReader(order, "the bundle of version 1")
        assert len(reader.feed(body[:cut])) == done
        with pytest.raises(IncompleteBundle, match=f"^the bundle of version 1 ended after {done} of 3 blobs$"):
            reader.finish()
    for bad, message in ((body + bytes(3), "broken after 3 of 3 blobs [(]3 bytes follow the last blob[)]"),
                         (body + bytes(9), "broken after 3 of 3 blobs [(]9 bytes follow"),
                         ((1 << 40).to_bytes(8, "big") + body[8:], "broken after 0 of 3 blobs [(]blob manifest is")):
        with pytest.raises(IncompleteBundle, match=message):
            reader = BundleReader(order, "the bundle of version 1")
            reader.feed(bad)
            reader.finish()


def test_blob_bundle_bound_holds_a_whole_resume_pack() -> None:
    """A resume's bundles (its pack's parts; the keyrings and device state) fit in one request."""
    assert names.BUNDLE_MAX >= resumepack.PARTS_MAX


def test_lock_refusal_names_the_holder(server_env: ServerEnv) -> None:
    parcel = server_env.new_parcel("alice")
    with server_env.client("alice") as laptop, server_env.client("alice") as desktop:
        first = laptop.acquire(parcel, host="laptop.example", site="home")
        assert first["lock"]["version"] == 0
        with pytest.raises(LockHeld) as e:
            desktop.acquire(parcel, host="desktop.example", site="office")
        holder = e.value.holder
        assert holder["user"] == "alice" and holder["host"] == "laptop.example" and holder["site"] == "home"
        assert holder["version"] == 0 and abs(holder["acquired"] - time.time()) < 60
        renewed = laptop.renew(parcel, first["nonce"])
        assert renewed["lock"]["renewed"] >= first["lock"]["renewed"]
        status = desktop.lock_status(parcel)
        assert status["locked"] and status["lock"]["host"] == "laptop.example"
        # The owner may break only with force (unless the lease expired).
        with pytest.raises(RemoteConflict) as e:
            desktop.break_lock(parcel)
        if e.value.code != "force_required":
            assert holder  # the lease may have run out meanwhile on a slow machine
        second = desktop.acquire(parcel, host="desktop.example", site="office", force=True)
        assert second["replaced"]["host"] == "laptop.example"
        with pytest.raises(LockLost):
            laptop.renew(parcel, first["nonce"])
        with pytest.raises(LockLost):
            laptop.release(parcel, first["nonce"])
        broken = desktop.break_lock(parcel, force=True, reason="test")
        assert broken["broken"]["host"] == "desktop.example"
        with pytest.raises(LockLost):
            desktop.release(parcel, second["nonce"])
        assert laptop.lock_status(parcel)["locked"] is False


def test_admin_breaks_and_others_cannot(server_env: ServerEnv) -> None:
    parcel = server_env.new_parcel("alice")
    with server_env.client("alice") as alice, server_env.client("bob") as bob, server_env.client("root") as root:
        nonce = alice.acquire(parcel, host="a")["nonce"]
        with pytest.raises(AccessDenied):
            bob.break_lock(parcel, force=True)
        assert root.lock_status(parcel)["locked"]
        root.break_lock(parcel, reason="maintenance")
        with pytest.raises(LockLost):
            alice.renew(parcel, nonce)
        with pytest.raises(AccessDenied):
            root.acquire(parcel, host="root-host")  # an admin breaks locks but does not take parcels


def test_lease_expiry_never_hands_over_silently(server_env: ServerEnv) -> None:
    parcel = server_env.new_parcel("alice")
    with server_env.client("alice") as laptop, server_env.client("alice") as desktop:
        first = laptop.acquire(parcel, host="laptop")
        assert first["lock"]["expires"] is not None
        wait_until(lambda: desktop.lock_status(parcel)["lock"]["expired"], LOCK_LEASE + 10, "the lease to expire")
        with pytest.raises(LockHeld) as e:
            desktop.acquire(parcel, host="desktop")
        assert e.value.holder["expired"] is True and e.value.holder["host"] == "laptop"
        second = desktop.acquire(parcel, host="desktop", take_expired=True)
        assert second["replaced"]["host"] == "laptop"
        with pytest.raises(LockLost):
            laptop.renew(parcel, first["nonce"])
        desktop.release(parcel, second["nonce"])
    entries = server_env.admin_json("audit", "--parcel", parcel)
    assert any(e["action"] == "lock.break" and e["detail"]["reason"] == "expired" for e in entries)


def test_audit_trail_records_lock_actions_and_commits(server_env: ServerEnv) -> None:
    parcel = server_env.new_parcel("alice")
    with server_env.client("alice") as client, server_env.client("alice") as other:
        nonce = client.acquire(parcel, host="h1", site="s1")["nonce"]
        with pytest.raises(LockHeld):
            other.acquire(parcel, host="h2")
        client.renew(parcel, nonce)
        make_version(client, parcel, nonce, parent=0)
        client.release(parcel, nonce)
    actions = [e["action"] for e in server_env.admin_json("audit", "--parcel", parcel)]
    for expected in ("lock.acquire", "lock.refused", "lock.renew", "version.commit", "lock.release"):
        assert expected in actions, actions
    assert actions.index("lock.acquire") < actions.index("version.commit") < actions.index("lock.release")
    log = (server_env.root / "audit.log").read_text()
    assert f"version.commit parcel={parcel}" in log


def test_concurrent_acquires_one_winner(server_env: ServerEnv) -> None:
    parcel = server_env.new_parcel("alice")
    clients = [server_env.client("alice") for _ in range(6)]
    for c in clients:
        c.health()  # connect before the race
    barrier = threading.Barrier(len(clients))
    results: list[str] = []

    def contend(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            clients[i].acquire(parcel, host=f"host{i}")
            results.append("won")
        except LockHeld:
            results.append("refused")

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for c in clients:
        c.close()
    assert sorted(results) == ["refused"] * (len(clients) - 1) + ["won"]


def test_staged_blob_size_limit(server_env: ServerEnv) -> None:
    parcel = server_env.new_parcel("alice")
    limit = server_env.settings["server.max_blob_bytes"]
    with server_env.client("alice") as client:
        nonce = client.acquire(parcel, host="h")["nonce"]
        client.put_blob(parcel, "devstate", os.urandom(limit), nonce)
        with pytest.raises(RequestRejected) as e:
            client.put_blob(parcel, "devstate", os.urandom(limit + 1), nonce)
        assert e.value.status == 413
        client.release(parcel, nonce)


def test_key_envelope_replace_needs_lock(server_env: ServerEnv) -> None:
    import uuid

    parcel = server_env.new_parcel("alice")
    envelope = b"ISRE\x01\x01\x00\x00" + uuid.UUID(parcel).bytes + os.urandom(124)
    with server_env.client("alice") as client:
        nonce = client.acquire(parcel, host="h")["nonce"]
        client.put_key_envelope(parcel, envelope, nonce)
        assert client.key_envelope(parcel) == envelope
        with pytest.raises(RequestRejected) as e:
            client.put_key_envelope(parcel, envelope[:100], nonce)
        assert e.value.status in (413, 422)
        other = b"ISRE\x01\x01\x00\x00" + uuid.uuid4().bytes + os.urandom(124)
        with pytest.raises(RequestRejected):
            client.put_key_envelope(parcel, other, nonce)
        client.release(parcel, nonce)
        with pytest.raises(LockLost):
            client.put_key_envelope(parcel, envelope, nonce)


def test_plain_http_is_not_served(server_env: ServerEnv) -> None:
    url = server_env.server.url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/v1/health", timeout=5)


def test_lock_holder_reports_unsynced_changes(server_env: ServerEnv) -> None:
    parcel = server_env.new_parcel("alice")
    with server_env.client("alice") as site, server_env.client("alice") as elsewhere:
        first = site.acquire(parcel, host="office-pc", site="office")
        assert first["lock"]["dirty"] is None
        reply = site.report_dirty(parcel, first["nonce"], 12, 1572864, reported=1795000000.5)
        assert reply["lock"]["dirty"] == {"dirty_chunks": 12, "dirty_bytes": 1572864, "reported": 1795000000.5}
        # A renew without a report keeps the last one; the owner sees it from another machine.
        site.renew(parcel, first["nonce"])
        assert elsewhere.lock_status(parcel)["lock"]["dirty"]["dirty_chunks"] == 12
        now = time.time()
        reply = site.report_dirty(parcel, first["nonce"], 0, 0)
        assert reply["lock"]["dirty"]["dirty_chunks"] == 0 and abs(reply["lock"]["dirty"]["reported"] - now) < 60
        for body in ({"dirty_chunks": -1, "dirty_bytes": 0}, {"dirty_chunks": 1}, {"dirty_chunks": 1.5, "dirty_bytes": 0},
                     {"dirty_chunks": True, "dirty_bytes": 0}, {"dirty_chunks": 1, "dirty_bytes": 1, "reported": "now"}):
            with pytest.raises(RequestRejected) as e:
                site.request("POST", f"/v1/parcels/{parcel}/lock/renew", json_body=body, nonce=first["nonce"])
            assert e.value.status == 400
        # A report needs the lock: the holder's nonce, not just the owner's token.
        with pytest.raises(LockLost):
            elsewhere.report_dirty(parcel, "x" * 43, 1, 1)
        # Whoever takes the lock over starts without a report.
        second = elsewhere.acquire(parcel, host="laptop", site="home", force=True)
        assert second["lock"]["dirty"] is None and second["replaced"]["dirty"]["dirty_chunks"] == 0
        with pytest.raises(LockLost):
            site.report_dirty(parcel, first["nonce"], 5, 5)
        elsewhere.release(parcel, second["nonce"])
    entries = server_env.admin_json("audit", "--parcel", parcel)
    assert any(e["action"] == "lock.renew" and e["detail"].get("dirty_chunks") == 12 for e in entries)
