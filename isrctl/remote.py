"""The client side of the ISR server protocol (doc/protocol.md): the only isrctl module that speaks it.

`Remote` makes the control calls (login, parcels, the lock, versions, blobs) and modest chunk transfers
over HTTPS with HTTP/2 (httpx + h2). Bulk chunk transfer belongs to vulpes (libcurl); this class is for
everything else and for tests.

The server is trusted either through a CA file or by pinning the SHA-256 fingerprint of its certificate
(``sha256:<hex>``, as isr-server prints it at start-up). A pinned fingerprint is checked during the TLS
handshake, before any request (and so before any password or token) is sent.

Errors are `RemoteError` subclasses (roots in `isrctl.errors.IsrError`); each carries the HTTP status,
the server's error code and its JSON details.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import socket
import ssl
import struct
import sys
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

# httpx's package imports its command-line client (click, pygments, rich) whenever click is installed, as it is
# here for isr-server; isr never runs that client, and loading it took a tenth of `isr hoard`'s start. None in
# sys.modules makes that import fail, and httpx then goes without it, as it does where click is missing.
sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
import httpx  # noqa: E402

from .errors import IsrError  # noqa: E402

DEFAULT_TIMEOUT = 60.0
MISSING_BATCH = 10000
#: A bundle's frame: the length of the blob that follows, 8 bytes big-endian (doc/protocol.md).
BUNDLE_FRAME = struct.Struct(">Q")
#: A frame announcing more than this is broken: no sealed blob comes near it (the server's default limit is
#: 256 MiB).
BUNDLE_BLOB_MAX = 1 << 32


class RemoteError(IsrError):
    """The server refused a request or could not be reached."""

    def __init__(self, message: str, *, status: int = 0, code: str = "", details: dict[str, Any] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.details = details or {}


class RemoteUnreachable(RemoteError):
    """No connection: DNS, refused connection, timeout, or a TLS failure."""


class CertificateMismatch(RemoteUnreachable):
    """The server's certificate does not have the pinned fingerprint."""


class AuthenticationFailed(RemoteError):
    """401: wrong user or password, or the token is unknown, revoked or expired."""


class AccessDenied(RemoteError):
    """403: the parcel belongs to another user."""


class RemoteNotFound(RemoteError):
    """404: no such parcel, version, blob or chunk."""


class RemoteConflict(RemoteError):
    """409: a conflict other than the specific ones below."""


class LockHeld(RemoteConflict):
    """409 ``locked``: someone holds the lock; `holder` says who, from where, since when, at which version."""

    @property
    def holder(self) -> dict[str, Any]:
        return self.details.get("holder") or {}


class LockLost(RemoteConflict):
    """409 ``lock_lost``: the nonce no longer holds the lock (released, broken or taken over)."""


class VersionConflict(RemoteConflict):
    """409 ``parent_mismatch``: the parent is not the current version (`current` is)."""


class ChunksMissing(RemoteConflict):
    """409 ``chunks_missing``: the commit references chunks the server does not have (`missing`)."""

    @property
    def missing(self) -> list[str]:
        return list(self.details.get("missing", []))


class RequestRejected(RemoteError):
    """400, 405, 413 or 422: the request itself was wrong (malformed, too large, tag mismatch)."""


class ServerFailure(RemoteError):
    """5xx: the server failed (its storage may be down); retrying later may help."""


class IncompleteBundle(RemoteError):
    """A bundle of blobs (`Remote.get_blobs`) ended before its last blob arrived, or its framing is broken."""


_CONFLICTS: dict[str, type[RemoteConflict]] = {
    "locked": LockHeld, "lock_lost": LockLost, "parent_mismatch": VersionConflict, "chunks_missing": ChunksMissing,
}


def normalize_fingerprint(text: str) -> str:
    """Accept ``sha256:<hex>``, bare hex, and colon-separated hex; return 64 lowercase hex digits."""
    value = text.strip().lower()
    if value.startswith("sha256:"):
        value = value[len("sha256:"):]
    value = value.replace(":", "")
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise RemoteError(f"not a SHA-256 certificate fingerprint: {text!r}")
    return value


def _pinned_context(fingerprint: str) -> ssl.SSLContext:
    """An SSL context that accepts exactly the certificate with this fingerprint (checked in the handshake)."""
    want = bytes.fromhex(normalize_fingerprint(fingerprint))

    class PinnedSocket(ssl.SSLSocket):
        def do_handshake(self, block: bool = False) -> None:
            super().do_handshake(block)
            der = self.getpeercert(binary_form=True) or b""
            if not hmac.compare_digest(hashlib.sha256(der).digest(), want):
                raise ssl.SSLCertVerificationError(
                    f"server certificate fingerprint sha256:{hashlib.sha256(der).hexdigest()} is not the pinned "
                    f"sha256:{want.hex()}")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the fingerprint check above replaces chain verification
    context.sslsocket_class = PinnedSocket
    return context


class BundleReader:
    """The body of a bundle (doc/protocol.md, GET …/versions/{n}/_bundle) parsed as it arrives: per blob, its
    length as 8 bytes big-endian (`BUNDLE_FRAME`), then its bytes. `feed` returns the blobs that the bytes
    so far complete; `finish` checks that all of ``names`` came. ``what`` begins the error messages."""

    def __init__(self, names: Sequence[str], what: str) -> None:
        self.names = list(names)
        self.what = what
        self.done = 0                       # blobs complete
        self.buffer = bytearray()
        self.length: int | None = None      # of the blob being read, once its frame is in

    def feed(self, data: bytes) -> list[tuple[str, bytes]]:
        self.buffer += data
        out = []
        while True:
            if self.length is None:
                if len(self.buffer) < BUNDLE_FRAME.size:
                    break
                if self.done == len(self.names):
                    raise self.incomplete(f"{len(self.buffer)} bytes follow the last blob", bad=True)
                (self.length,) = BUNDLE_FRAME.unpack_from(self.buffer)
                if self.length > BUNDLE_BLOB_MAX:
                    raise self.incomplete(f"blob {self.names[self.done]} is framed as {self.length} bytes", bad=True)
                del self.buffer[:BUNDLE_FRAME.size]
            if len(self.buffer) < self.length:
                break
            out.append((self.names[self.done], bytes(self.buffer[:self.length])))
            del self.buffer[:self.length]
            self.done += 1
            self.length = None
        return out

    def finish(self) -> None:
        """Raise `IncompleteBundle` unless every blob arrived whole and nothing followed: the answer ended."""
        if self.done == len(self.names) and self.buffer:
            raise self.incomplete(f"{len(self.buffer)} bytes follow the last blob", bad=True)
        if self.done < len(self.names):
            raise self.incomplete()

    def incomplete(self, why: str = "", *, bad: bool = False) -> IncompleteBundle:
        """The error for a body that ended (or, with ``bad``, was misframed) after the blobs done so far."""
        how = "is broken" if bad else "ended"
        return IncompleteBundle(f"{self.what} {how} after {self.done} of {len(self.names)} blobs"
                                + (f" ({why})" if why else ""))


def bundle_unsupported(error: RemoteError) -> bool:
    """Whether a refused bundle request only means that the server has no bundle route, so that one GET per
    blob will do. A server from before the route takes ``_bundle`` for a blob name and refuses it with 400
    ``bad_blob_name`` (a server with the route refuses a bad list as ``bad_names``); a 404 for a path the
    server does not know lists no ``missing`` blobs (one with the route lists the blobs the version lacks).
    A 404 for the parcel or version itself is also taken so: the first GET of the fallback then raises it."""
    return (error.status == 400 and error.code == "bad_blob_name") or \
        (error.status == 404 and "missing" not in error.details)


class Remote:
    """A connection to one isr-server. Use as a context manager or call `close`."""

    #: The path segment of the bundle route under a version (a class attribute, so that a test can point an
    #: instance at a route the server lacks and see the fallback).
    bundle_segment = "_bundle"

    def __init__(self, url: str, *, fingerprint: str | None = None, ca_file: str | Path | None = None,
                 token: str | None = None, timeout: float = DEFAULT_TIMEOUT, http2: bool = True) -> None:
        if not url.startswith("https://"):
            raise RemoteError(f"the server URL must start with https://, got {url!r}")
        if fingerprint:
            verify: ssl.SSLContext | bool = _pinned_context(fingerprint)
        else:
            context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            verify = context
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.verify = verify
        self.http2 = http2
        self.client = self._new_client()

    def _new_client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, verify=self.verify, http2=self.http2, timeout=self.timeout,
                            follow_redirects=True)

    def _drop_connections(self) -> None:
        """Close every connection; the next request opens a new one. For an answer left unread: httpcore
        neither resets the HTTP/2 stream of a response closed before its end nor gives back the flow-control
        window its unread bytes hold, so a connection stalls for good after a few abandoned bundles."""
        self.client.close()
        self.client = self._new_client()

    def __enter__(self) -> "Remote":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.client.close()

    # --- transport --------------------------------------------------------------------------------

    def request(self, method: str, path: str, *, json_body: Any = None, content: bytes | None = None,
                nonce: str | None = None, auth: bool = True, headers: dict[str, str] | None = None,
                idempotent: bool | None = None) -> httpx.Response:
        """Send one request; return the response if it is 2xx, raise the matching `RemoteError` if not.

        A request is sent once more, on a new connection, when its connection closes before the request could
        go out (a TLS handshake cut off), and an idempotent one (by default GET, HEAD and PUT) also when its
        connection breaks or fails with an HTTP/2 protocol error: that is how h2 meets a kept-alive connection
        that the server closed with GOAWAY and a PING while it was idle. An isr-server reload closes connections
        so as it stops its old workers (doc/server.md "Reloading")."""
        send_headers = self._headers(auth, headers)
        if nonce is not None:
            send_headers["ISR-Lock"] = nonce
        if json_body is not None:
            content = json.dumps(json_body).encode()
            send_headers["Content-Type"] = "application/json"
        if idempotent is None:
            idempotent = method in ("GET", "HEAD", "PUT")
        with self._transport(method, path):
            try:
                response = self.client.request(method, path, content=content, headers=send_headers)
            except (httpx.NetworkError, httpx.ProtocolError) as e:
                if not (idempotent or isinstance(e, httpx.ConnectError)):
                    raise
                response = self.client.request(method, path, content=content, headers=send_headers)
        if response.status_code < 300 or response.status_code == 304:
            return response
        raise self._error(method, path, response)

    def download(self, path: str, progress: Callable[[int, int | None], None]) -> bytes:
        """GET ``path`` as `request` does, calling ``progress(bytes so far, total)`` as the body arrives (total:
        its Content-Length, None if the server sent none)."""
        with self._transport("GET", path), self.client.stream("GET", path, headers=self._headers(True)) as response:
            if response.status_code >= 300:
                response.read()
                raise self._error("GET", path, response)
            total = int(response.headers.get("content-length") or 0) or None
            body = bytearray()
            progress(0, total)
            for block in response.iter_bytes():
                body += block
                progress(len(body), total)
            return bytes(body)

    def _headers(self, auth: bool, headers: dict[str, str] | None = None) -> dict[str, str]:
        send_headers = dict(headers or {})
        if auth:
            if not self.token:
                raise AuthenticationFailed("not logged in: call login() first", status=401, code="unauthorized")
            send_headers["Authorization"] = f"Bearer {self.token}"
        return send_headers

    @contextlib.contextmanager
    def _transport(self, method: str, path: str) -> Iterator[None]:
        """Turn httpx's transport errors into `RemoteUnreachable` (or `CertificateMismatch`)."""
        try:
            yield
        except httpx.ConnectError as e:
            cause: BaseException | None = e
            while cause is not None:
                if isinstance(cause, ssl.SSLCertVerificationError):
                    raise CertificateMismatch(f"{self.url}: {getattr(cause, 'verify_message', None) or cause}") from None
                cause = cause.__cause__ or cause.__context__
            raise RemoteUnreachable(f"cannot connect to {self.url}: {e}") from None
        except httpx.TimeoutException:
            raise RemoteUnreachable(f"{method} {self.url}{path}: the server did not answer within {self.timeout:g} s "
                                    f"(it is overloaded, stopped, or the network drops packets)") from None
        except httpx.TransportError as e:
            raise RemoteUnreachable(f"{method} {self.url}{path}: {type(e).__name__}: {e}") from None

    def _error(self, method: str, path: str, response: httpx.Response) -> RemoteError:
        status = response.status_code
        try:
            body = response.json()
            if not isinstance(body, dict):
                body = {}
        except ValueError:
            body = {}
        message = str(body.get("error") or response.reason_phrase or "error")
        code = str(body.get("code", ""))
        details = {k: v for k, v in body.items() if k not in ("error", "code")}
        text = f"{method} {path}: {status} {message}"
        kind: type[RemoteError]
        if status == 401:
            kind = AuthenticationFailed
        elif status == 403:
            kind = AccessDenied
        elif status == 404:
            kind = RemoteNotFound
        elif status == 409:
            kind = _CONFLICTS.get(code, RemoteConflict)
        elif status >= 500:
            kind = ServerFailure
        else:
            kind = RequestRejected
        return kind(text, status=status, code=code, details=details)

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.request(method, path, **kwargs).json()

    # --- sessions ---------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self._json("GET", "/v1/health", auth=False)

    def login(self, user: str, password: str, label: str = "") -> str:
        """Exchange a user name and password for a bearer token (kept in this object and returned)."""
        body = self._json("POST", "/v1/login", json_body={"user": user, "password": password, "label": label},
                          auth=False)
        self.token = body["token"]
        return self.token

    def logout(self) -> None:
        """Revoke the current token."""
        self.request("POST", "/v1/logout")
        self.token = None

    def whoami(self) -> dict[str, Any]:
        return self._json("GET", "/v1/whoami")

    def tokens(self) -> list[dict[str, Any]]:
        return self._json("GET", "/v1/tokens")["tokens"]

    def revoke_token(self, token_id: str) -> None:
        self.request("DELETE", f"/v1/tokens/{token_id}")

    # --- parcels and versions ---------------------------------------------------------------------

    def parcels(self) -> list[dict[str, Any]]:
        """The caller's parcels with their lock state and versions."""
        return self._json("GET", "/v1/parcels")["parcels"]

    def parcel(self, parcel: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/parcels/{parcel}")

    def versions(self, parcel: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/parcels/{parcel}/versions")

    def version(self, parcel: str, version: int) -> dict[str, Any]:
        return self._json("GET", f"/v1/parcels/{parcel}/versions/{version}")

    def key_envelope(self, parcel: str) -> bytes:
        return self.request("GET", f"/v1/parcels/{parcel}/keyenvelope").content

    def put_key_envelope(self, parcel: str, data: bytes, nonce: str) -> None:
        self.request("PUT", f"/v1/parcels/{parcel}/keyenvelope", content=data, nonce=nonce)

    def get_blob(self, parcel: str, version: int, name: str,
                 progress: Callable[[int, int | None], None] | None = None) -> bytes:
        """A version's sealed blob; with ``progress``, reported as it arrives (see `download`)."""
        path = f"/v1/parcels/{parcel}/versions/{version}/{name}"
        return self.request("GET", path).content if progress is None else self.download(path, progress)

    def get_blobs(self, parcel: str, version: int, names: Sequence[str],
                  progress: Callable[[int], None] | None = None) -> Generator[tuple[str, bytes], None, None]:
        """A version's sealed blobs ``names`` as (name, bytes), in that order, each yielded as soon as it has
        arrived whole: one request (GET …/versions/{n}/_bundle, doc/protocol.md) whose answer streams them one
        after another, so the link does not idle for a round trip between them. ``progress`` is called with the
        bytes of the answer so far as they arrive.

        Raises `IncompleteBundle` if the answer breaks off or its framing is wrong (the blobs yielded before
        stay good), `RemoteNotFound` if the version lacks one of them (before any is yielded), and what
        `request` raises. A server without the bundle route (`bundle_unsupported`) gets one `get_blob` per
        name instead, yielding the same way."""
        names = list(names)
        if not names:
            return
        path = f"/v1/parcels/{parcel}/versions/{version}/{self.bundle_segment}?names={','.join(names)}"
        request = self.client.build_request("GET", path, headers=self._headers(True))
        with self._transport("GET", path):
            try:
                response = self.client.send(request, stream=True)
            except (httpx.NetworkError, httpx.ProtocolError):  # retried once, as `request` retries a GET
                response = self.client.send(request, stream=True)
        try:
            if response.status_code >= 300:
                with self._transport("GET", path):
                    response.read()
                error = self._error("GET", path, response)
                if not bundle_unsupported(error):
                    raise error
            else:
                bundle = BundleReader(names, f"the bundle of version {version}")
                ended = False
                try:
                    received = 0
                    for block in response.iter_bytes():
                        received += len(block)
                        if progress is not None:
                            progress(received)
                        yield from bundle.feed(block)
                    ended = True
                except httpx.TransportError as e:
                    raise bundle.incomplete(f"{type(e).__name__}: {e}") from None
                finally:
                    if not ended:       # the consumer stopped early, the framing or the connection broke
                        response.close()
                        self._drop_connections()
                bundle.finish()
                return
        finally:
            response.close()
        received = 0
        for name in names:
            blob = self.get_blob(parcel, version, name)
            received += len(blob)
            if progress is not None:
                progress(received)
            yield name, blob

    def put_blob(self, parcel: str, name: str, data: bytes, nonce: str) -> dict[str, Any]:
        """Stage a sealed blob for the next commit; the reply has its size and SHA-256."""
        reply = self._json("PUT", f"/v1/parcels/{parcel}/staging/{name}", content=data, nonce=nonce)
        if reply.get("sha256") != hashlib.sha256(data).hexdigest():
            raise RemoteError(f"the server stored blob {name} with another SHA-256 than was sent")
        return reply

    def commit(self, parcel: str, nonce: str, parent: int, blobs: Sequence[str], tags: Iterable[str],
               inherit: Sequence[str] = (), working_tags: Sequence[str] | None = None) -> dict[str, Any]:
        """Commit version parent+1 from the staged `blobs` (plus `inherit`ed ones from the parent),
        referencing the chunk `tags`; `working_tags` (first touch first) lets sites hoard the working set
        without the parcel key."""
        body: dict[str, Any] = {"parent": parent, "blobs": list(blobs), "inherit": list(inherit), "tags": list(tags)}
        if working_tags is not None:
            body["working_tags"] = list(working_tags)
        return self._json("POST", f"/v1/parcels/{parcel}/versions", json_body=body, nonce=nonce)

    def version_chunks(self, parcel: str, version: int, which: str = "all") -> tuple[bool, list[tuple[str, int]]]:
        """A version's chunk objects as (tag, stored size) pairs, fetched page by page: every one
        (``which="all"``) or its working set (``"working"``, in first-touch order). Returns whether the set
        was recorded (a version committed without a working set has none) and the pairs; a size the server
        does not know counts as 0."""
        chunks: list[tuple[str, int]] = []
        offset: int | None = 0
        recorded = True
        while offset is not None:
            page = self._json("GET", f"/v1/parcels/{parcel}/versions/{version}/chunks?set={which}&offset={offset}")
            recorded = bool(page["recorded"])
            chunks += [(c["tag"], int(c["size"] or 0)) for c in page["chunks"]]
            offset = page["next"]
        return recorded, chunks

    # --- the lock ---------------------------------------------------------------------------------

    def lock_status(self, parcel: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/parcels/{parcel}/lock")

    def acquire(self, parcel: str, host: str, site: str = "", *, force: bool = False,
                take_expired: bool = False) -> dict[str, Any]:
        """Take the parcel's lock; the reply's ``nonce`` authorizes uploads, commits, renew and release.
        Raises `LockHeld` (with `holder`) if someone else has it."""
        body = {"host": host, "site": site, "force": force, "take_expired": take_expired}
        return self._json("POST", f"/v1/parcels/{parcel}/lock", json_body=body)

    def renew(self, parcel: str, nonce: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/parcels/{parcel}/lock/renew", nonce=nonce, idempotent=True)

    def report_dirty(self, parcel: str, nonce: str, dirty_chunks: int, dirty_bytes: int,
                     reported: float | None = None) -> dict[str, Any]:
        """Renew the lock and tell the server how much this site has changed but not yet committed
        (shown to the owner on the web pages before they release the lock from elsewhere)."""
        body: dict[str, Any] = {"dirty_chunks": dirty_chunks, "dirty_bytes": dirty_bytes}
        if reported is not None:
            body["reported"] = reported
        return self._json("POST", f"/v1/parcels/{parcel}/lock/renew", json_body=body, nonce=nonce)

    def release(self, parcel: str, nonce: str) -> None:
        self.request("DELETE", f"/v1/parcels/{parcel}/lock", nonce=nonce)

    def break_lock(self, parcel: str, *, force: bool = False, reason: str = "") -> dict[str, Any]:
        return self._json("POST", f"/v1/parcels/{parcel}/lock/break", json_body={"force": force, "reason": reason})

    # --- chunks -----------------------------------------------------------------------------------

    def missing(self, tags: Sequence[str]) -> list[str]:
        """Which of `tags` the server does not have (asked in batches)."""
        out: list[str] = []
        for start in range(0, len(tags), MISSING_BATCH):
            batch = {"tags": list(tags[start:start + MISSING_BATCH])}
            out += self._json("POST", "/v1/chunks/missing", json_body=batch, idempotent=True)["missing"]
        return out

    def put_chunk(self, tag: str, data: bytes) -> bool:
        """Upload a chunk object; True if the server did not have it yet."""
        return bool(self._json("PUT", f"/v1/chunks/{tag}", content=data)["stored"])

    def get_chunk(self, tag: str) -> bytes:
        """Download a chunk object and check its tag (never return bytes that are not the object)."""
        data = self.request("GET", f"/v1/chunks/{tag}").content
        if hashlib.sha256(data).hexdigest() != tag:
            raise RemoteError(f"chunk {tag} arrived with another SHA-256", code="tag_mismatch")
        return data

    def has_chunk(self, tag: str) -> bool:
        try:
            self.request("HEAD", f"/v1/chunks/{tag}")
        except RemoteNotFound:
            return False
        return True


def fetch_certificate(url: str, timeout: float = 10.0) -> bytes:
    """The DER certificate the server at ``url`` presents in the TLS handshake.

    Nothing is verified here and nothing is sent: the caller compares the certificate's fingerprint with
    the one it was given (as `isr login` does) before trusting it. Raises RemoteUnreachable if no TLS
    connection can be made.
    """
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise RemoteError(f"the server URL must look like https://HOST:PORT, got {url!r}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((parts.hostname, parts.port or 443), timeout=timeout) as raw:
            with context.wrap_socket(raw, server_hostname=parts.hostname) as tls:
                der = tls.getpeercert(binary_form=True)
    except (OSError, ssl.SSLError) as exc:
        raise RemoteUnreachable(f"cannot connect to {url}: {exc}") from None
    if not der:
        raise RemoteUnreachable(f"{url} presented no certificate")
    return der
