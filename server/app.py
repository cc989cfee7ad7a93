"""The ISR HTTP API as a plain ASGI application (served by granian, see `server.main`).

One route table maps method and path to a handler; every handler validates its input with
`server.names`, calls the metadata database and object store in a thread pool, and returns a `Response`.
Every error leaves as JSON ``{"error": …, "code": …}`` with a 4xx status (5xx only for a failing
database or store). The API is documented in doc/protocol.md, one endpoint per section.

Chunk GETs are the hot path: the token check is cached for a few seconds per worker
(``server.token_cache_seconds``) and, with the directory store, the file is handed to granian with the
ASGI ``http.response.pathsend`` extension so its bytes never pass through Python.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import auth, names
from .config import ENV_CONFIG, MAX_CHUNK_OBJECT, Config
from .errors import (ApiError, BadRequest, Conflict, Forbidden, MethodNotAllowed, NotFound, StorageError,
                     TooLarge, TooManyAttempts, Unauthorized, Unavailable, Unprocessable)
from .groupcommit import ChunkCommitter
from .meta import LockInfo, ParcelInfo, TokenInfo, open_meta
from .meta.sql import SqlMeta
from .ops import publisher
from .store import ObjectStore, chunk_key, envelope_key, open_store, staging_prefix, version_prefix

log = logging.getLogger("server")
audit_log = logging.getLogger("server.audit")

API_VERSION = 1
DRAIN_LIMIT = 64 * 1024 * 1024
CHUNK_CACHE_CONTROL = b"private, max-age=31536000, immutable"
#: Default page size of a version's chunk list (GET …/versions/{n}/chunks): about 1 MB of JSON.
CHUNK_PAGE = 10000
T = TypeVar("T")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected while we were reading its request."""


@dataclass
class Response:
    """What a handler returns: a status and exactly one of a JSON value, bytes or a file path."""

    status: int = 200
    json: Any = None
    body: bytes | None = None
    path: str | None = None
    size: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


class Request:
    """One HTTP request: method, path, headers, and the body read on demand with a size limit."""

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope = scope
        self.receive = receive
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers: dict[str, str] = {}
        for key, value in scope["headers"]:
            self.headers[key.decode("latin-1").lower()] = value.decode("latin-1")
        client = scope.get("client")
        self.remote = f"{client[0]}:{client[1]}" if client else ""
        self.token: TokenInfo | None = None

    def query(self, name: str, default: str) -> str:
        """One query-string parameter (the last if repeated), or ``default``."""
        values = urllib.parse.parse_qs(self.scope.get("query_string", b"").decode("latin-1")).get(name)
        return values[-1] if values else default

    def _declared_length(self, limit: int) -> int | None:
        text = self.headers.get("content-length")
        if text is None:
            return None
        if not text.isdigit() or len(text) > 18:
            raise BadRequest("Content-Length must be a non-negative integer", code="bad_length")
        return int(text)

    async def _drain(self, received: int) -> None:
        """Read and drop the rest of a body we refuse, up to DRAIN_LIMIT bytes, so that the client sees
        our 413 answer instead of a reset stream (HTTP/2 clients often cannot read an early answer)."""
        while received <= DRAIN_LIMIT:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def chunks(self, limit: int):  # type: ignore[no-untyped-def]
        """Yield the body in pieces, raising `TooLarge` as soon as it exceeds `limit` bytes."""
        declared = self._declared_length(limit)
        too_large = TooLarge(f"the body exceeds the limit of {limit} bytes here", limit=limit)
        if declared is not None and declared > limit:
            if declared <= DRAIN_LIMIT:
                await self._drain(0)
            raise too_large
        total = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            piece = message.get("body", b"")
            total += len(piece)
            if total > limit:
                if message.get("more_body", False):
                    await self._drain(total)
                raise too_large
            if piece:
                yield piece
            if not message.get("more_body", False):
                return

    async def body(self, limit: int) -> bytes:
        parts = [piece async for piece in self.chunks(limit)]
        return b"".join(parts)

    async def json(self, limit: int) -> dict[str, Any]:
        """The body as a JSON object (400 if it is not one)."""
        return json_object(await self.body(limit))

    def lock_nonce(self) -> str:
        value = self.headers.get("isr-lock")
        if value is None:
            raise BadRequest("this request needs the ISR-Lock header with your lock nonce", code="no_lock_nonce")
        return names.nonce(value)


Handler = Callable[..., Awaitable[Response]]


@dataclass(frozen=True)
class Route:
    method: str
    pattern: re.Pattern[str]
    handler: str
    chunk_read: bool = False


def _routes() -> list[Route]:
    seg = r"([^/]+)"
    table = [
        ("GET", r"/v1/health", "health"),
        ("POST", r"/v1/login", "login"),
        ("POST", r"/v1/logout", "logout"),
        ("GET", r"/v1/whoami", "whoami"),
        ("GET", r"/v1/tokens", "list_tokens"),
        ("DELETE", rf"/v1/tokens/{seg}", "revoke_token"),
        ("GET", r"/v1/parcels", "list_parcels"),
        ("GET", rf"/v1/parcels/{seg}", "get_parcel"),
        ("GET", rf"/v1/parcels/{seg}/keyenvelope", "get_envelope"),
        ("PUT", rf"/v1/parcels/{seg}/keyenvelope", "put_envelope"),
        ("GET", rf"/v1/parcels/{seg}/versions", "list_versions"),
        ("POST", rf"/v1/parcels/{seg}/versions", "commit"),
        ("GET", rf"/v1/parcels/{seg}/versions/{seg}", "get_version"),
        # Before the blob route: "chunks" is reserved (names.RESERVED_BLOB_NAMES), never a blob's name.
        ("GET", rf"/v1/parcels/{seg}/versions/{seg}/chunks", "version_chunks"),
        ("GET", rf"/v1/parcels/{seg}/versions/{seg}/{seg}", "get_blob"),
        ("HEAD", rf"/v1/parcels/{seg}/versions/{seg}/{seg}", "get_blob"),
        ("PUT", rf"/v1/parcels/{seg}/staging/{seg}", "put_staged"),
        ("GET", rf"/v1/parcels/{seg}/lock", "get_lock"),
        ("POST", rf"/v1/parcels/{seg}/lock", "acquire"),
        ("DELETE", rf"/v1/parcels/{seg}/lock", "release"),
        ("POST", rf"/v1/parcels/{seg}/lock/renew", "renew"),
        ("POST", rf"/v1/parcels/{seg}/lock/break", "break_lock"),
        ("POST", r"/v1/chunks/missing", "missing"),
        ("GET", rf"/v1/chunks/{seg}", "get_chunk"),
        ("HEAD", rf"/v1/chunks/{seg}", "get_chunk"),
        ("PUT", rf"/v1/chunks/{seg}", "put_chunk"),
    ]
    return [Route(m, re.compile(p), h, chunk_read=(h == "get_chunk")) for m, p, h in table]


ROUTES = _routes()
#: Paths of the API (``/v1/…``, and any other ``/v<n>`` so that unknown API versions get a JSON 404);
#: every other path belongs to the web pages (`server.web`).
API_PATH = re.compile(r"/v[0-9]+(/.*)?")


class IsrApp:
    """The ASGI application. One instance per worker process; it keeps no state of its own beyond
    connections and the short-lived token cache, so any number of workers and processes can serve."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.meta: SqlMeta | None = None
        self.store: ObjectStore | None = None
        self.chunk_commits: ChunkCommitter | None = None
        self.serving = config.chunk_serving
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="isr-io")
        self.token_cache: dict[str, tuple[float, TokenInfo]] = {}
        self.token_cache_seconds = config["server.token_cache_seconds"]
        self._opening: asyncio.Lock | None = None
        from .web import WebPages  # the web pages use this module's Request and Response

        self.web = WebPages(self)

    # --- plumbing ---------------------------------------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run blocking database or store work in the thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, lambda: fn(*args, **kwargs))

    async def _open(self) -> None:
        if self.meta is not None:
            return
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self.meta is None:
                store = await self.run(open_store, self.config)
                meta = await self.run(open_meta, self.config)
                assert isinstance(meta, SqlMeta)
                self.chunk_commits = ChunkCommitter(self.run, store, meta)
                self.store, self.meta = store, meta

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        try:
            await self._open()
            response = await self._dispatch(request)
        except ApiError as e:
            response = Response(e.status, json=e.body())
            if e.status == 401:
                response.headers.append((b"www-authenticate", b'Bearer realm="isr"'))
            if "retry_after" in e.details:
                response.headers.append((b"retry-after", str(e.details["retry_after"]).encode()))
        except ClientGone:
            return
        except StorageError as e:
            log.error("storage failure on %s %s: %s", request.method, request.path, e)
            response = Response(503, json={"error": "the server's storage is unavailable; try again later",
                                           "code": "storage_unavailable"})
        except Exception:
            log.exception("unexpected error on %s %s", request.method, request.path)
            response = Response(500, json={"error": "internal server error", "code": "internal"})
        await self._send(request, response, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self._open()
                except Exception as e:  # reported to granian, which logs it and stops
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.meta is not None:
                    self.meta.close()
                if self.store is not None:
                    self.store.close()
                self.pool.shutdown(wait=False)
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _send(self, request: Request, response: Response, send: Send) -> None:
        headers = list(response.headers)
        body = b""
        if response.json is not None:
            body = json.dumps(response.json, separators=(",", ":")).encode()
            headers.append((b"content-type", b"application/json"))
            headers.append((b"content-length", str(len(body)).encode()))
        elif response.body is not None:
            body = response.body
            headers.append((b"content-length", str(len(body)).encode()))
        elif response.path is not None:
            headers.append((b"content-length", str(response.size).encode()))
        else:
            headers.append((b"content-length", b"0"))
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        if response.path is not None and request.method != "HEAD":
            await send({"type": "http.response.pathsend", "path": response.path})
        else:
            await send({"type": "http.response.body", "body": b"" if request.method == "HEAD" else body})

    async def _dispatch(self, request: Request) -> Response:
        # The hot path first: chunk reads skip the route table.
        if request.method in ("GET", "HEAD") and request.path.startswith("/v1/chunks/") and \
                len(request.path) == 75:
            request.token = await self.authenticate(request, cached=True)
            return await self.h_get_chunk(request, request.path[11:])
        if not API_PATH.fullmatch(request.path):
            return await self.web.handle(request)
        path_matched = False
        for route in ROUTES:
            match = route.pattern.fullmatch(request.path)
            if match is None:
                continue
            path_matched = True
            if route.method != request.method:
                continue
            handler: Handler = getattr(self, "h_" + route.handler)
            if route.handler not in ("health", "login"):
                request.token = await self.authenticate(request, cached=route.chunk_read)
            return await handler(request, *match.groups())
        if path_matched:
            raise MethodNotAllowed(f"{request.method} is not allowed on {request.path}")
        raise NotFound(f"no such endpoint: {request.path}")

    # --- authentication and access ----------------------------------------------------------------

    async def authenticate(self, request: Request, cached: bool = False) -> TokenInfo:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("this request needs an Authorization: Bearer token (POST /v1/login)")
        if not token.startswith(auth.TOKEN_PREFIX) or len(token) > 128:
            raise Unauthorized("malformed bearer token")
        token_hash = auth.secret_hash(token)
        now = time.monotonic()
        if cached and self.token_cache_seconds:
            hit = self.token_cache.get(token_hash)
            if hit is not None and hit[0] > now and hit[1].expires > time.time():
                return hit[1]
        assert self.meta is not None
        info = await self.run(self.meta.lookup_token, token_hash)
        if info is None:
            self.token_cache.pop(token_hash, None)
            raise Unauthorized("unknown, revoked or expired token; log in again")
        if cached and self.token_cache_seconds:
            if len(self.token_cache) > 10000:
                self.token_cache.clear()
            self.token_cache[token_hash] = (now + self.token_cache_seconds, info)
        return info

    async def parcel(self, request: Request, text: str, *, admin_ok: bool = False) -> ParcelInfo:
        """The parcel named in the path if the caller owns it (403 if not, 404 if there is none)."""
        parcel_id = names.parcel_id(text)
        assert self.meta is not None and request.token is not None
        parcel = await self.run(self.meta.get_parcel, parcel_id)
        if parcel.owner_id != request.token.user_id and not (admin_ok and request.token.admin):
            raise Forbidden("this parcel belongs to another user")
        return parcel

    def _audit_line(self, request: Request, action: str, parcel: str, actor: str | None = None,
                    **detail: Any) -> None:
        if actor is None:
            actor = request.token.user if request.token else "-"
        audit_log.info("%s %s parcel=%s remote=%s %s", actor, action, parcel, request.remote,
                       json.dumps(detail, sort_keys=True))

    # --- handlers: service and sessions -----------------------------------------------------------

    async def h_health(self, request: Request) -> Response:
        return Response(json={"status": "ok", "api": API_VERSION, "chunk_serving": self.serving})

    async def h_login(self, request: Request) -> Response:
        body = await request.json(64 * 1024)
        user = body.get("user")
        password = body.get("password")
        label = names.label(body.get("label", ""), "label", 100)
        if not isinstance(user, str) or not isinstance(password, str) or len(password) > auth.MAX_PASSWORD_BYTES:
            raise BadRequest("login needs string fields user and password", code="bad_login")
        assert self.meta is not None
        valid_name = names.USER_RE.fullmatch(user) is not None
        # The same failure counters as the web sign-in: guessing through either door counts for both.
        limits = auth.signin_subjects(user if valid_name else None, auth.client_address(request.scope))
        subjects = [subject for subject, _ in limits]
        wait = await self.run(self.meta.signin_wait, limits, auth.SIGNIN_WINDOW, auth.SIGNIN_DELAY)
        if wait > 0:
            raise TooManyAttempts(f"too many failed logins: try again in {int(wait) + 1} s",
                                  retry_after=int(wait) + 1)
        found = await self.run(self.meta.get_user, user) if valid_name else None
        stored = found[1] if found else auth.DUMMY_HASH
        ok = await self.run(auth.verify_password, password, stored)
        if not found or not ok:
            await self.run(self.meta.signin_failed, subjects, auth.SIGNIN_WINDOW)
            log.warning("failed login for user %r from %s", user[:40], request.remote)
            raise Unauthorized("wrong user name or password", code="bad_credentials")
        await self.run(self.meta.signin_succeeded, subjects[0])
        token = auth.new_token()
        info = await self.run(self.meta.add_token, os.urandom(8).hex(), auth.secret_hash(token), found[0].id,
                              label, self.config["server.token_ttl_seconds"])
        return Response(201, json={"token": token, "id": info.id, "user": info.user, "admin": info.admin,
                                   "expires": info.expires})

    async def h_logout(self, request: Request) -> Response:
        assert self.meta is not None and request.token is not None
        await self.run(self.meta.revoke_token, request.token.user_id, request.token.id)
        return Response(json={"revoked": request.token.id})

    async def h_whoami(self, request: Request) -> Response:
        token = request.token
        assert token is not None
        return Response(json={"user": token.user, "admin": token.admin,
                              "token": {"id": token.id, "label": token.label, "created": token.created,
                                        "expires": token.expires}})

    async def h_list_tokens(self, request: Request) -> Response:
        assert self.meta is not None and request.token is not None
        tokens = await self.run(self.meta.list_tokens, request.token.user_id)
        return Response(json={"tokens": [{"id": t.id, "label": t.label, "created": t.created, "expires": t.expires,
                                          "current": t.id == request.token.id} for t in tokens]})

    async def h_revoke_token(self, request: Request, token_id: str) -> Response:
        if not re.fullmatch(r"[0-9a-f]{16}", token_id):
            raise BadRequest("not a token id", code="bad_token_id")
        assert self.meta is not None and request.token is not None
        await self.run(self.meta.revoke_token, request.token.user_id, token_id)
        return Response(json={"revoked": token_id})

    # --- handlers: parcels and versions -----------------------------------------------------------

    async def h_list_parcels(self, request: Request) -> Response:
        assert self.meta is not None and request.token is not None
        parcels = await self.run(self.meta.list_parcels, request.token.user_id)
        out = []
        for parcel in parcels:
            versions = await self.run(self.meta.list_versions, parcel.id)
            item = parcel.to_json()
            item["versions"] = [{"version": v.version, "created": v.created, "chunk_count": v.chunk_count,
                                 "chunk_bytes": v.chunk_bytes} for v in versions]
            out.append(item)
        return Response(json={"parcels": out})

    async def h_get_parcel(self, request: Request, parcel_text: str) -> Response:
        parcel = await self.parcel(request, parcel_text)
        assert self.meta is not None
        versions = await self.run(self.meta.list_versions, parcel.id)
        item = parcel.to_json()
        item["versions"] = [v.to_json() for v in versions]
        return Response(json=item)

    async def h_get_envelope(self, request: Request, parcel_text: str) -> Response:
        parcel = await self.parcel(request, parcel_text)
        assert self.store is not None
        data = await self.run(self.store.get_bytes, envelope_key(parcel.id))
        return Response(body=data, headers=[(b"content-type", b"application/octet-stream"),
                                            (b"cache-control", b"no-store")])

    async def h_put_envelope(self, request: Request, parcel_text: str) -> Response:
        parcel = await self.parcel(request, parcel_text)
        nonce = request.lock_nonce()
        data = await request.body(names.KEYENVELOPE_SIZE)
        import uuid as _uuid

        if len(data) != names.KEYENVELOPE_SIZE or data[:4] != b"ISRE" or data[8:24] != _uuid.UUID(parcel.id).bytes:
            raise Unprocessable("not a key envelope of this parcel (148 bytes, magic ISRE, this parcel's UUID)",
                                code="bad_envelope")
        assert self.meta is not None and self.store is not None
        await self.run(self.meta.check_lock, parcel.id, auth.secret_hash(nonce))
        await self.run(self.store.put_bytes, envelope_key(parcel.id), data)
        await self.run(self.meta.audit, request.token.user if request.token else "-", "envelope.replace", parcel.id,
                       request.remote, {})
        self._audit_line(request, "envelope.replace", parcel.id)
        return Response(json={"replaced": True})

    async def h_list_versions(self, request: Request, parcel_text: str) -> Response:
        parcel = await self.parcel(request, parcel_text)
        assert self.meta is not None
        versions = await self.run(self.meta.list_versions, parcel.id)
        return Response(json={"current": parcel.current_version, "versions": [v.to_json() for v in versions]})

    async def h_get_version(self, request: Request, parcel_text: str, version_text: str) -> Response:
        parcel = await self.parcel(request, parcel_text)
        assert self.meta is not None
        version = await self.run(self.meta.get_version, parcel.id, names.version(version_text))
        return Response(json=version.to_json())

    async def h_get_blob(self, request: Request, parcel_text: str, version_text: str, name_text: str) -> Response:
        parcel = await self.parcel(request, parcel_text)
        number = names.version(version_text)
        name = names.blob_name(name_text)
        assert self.meta is not None and self.store is not None
        version = await self.run(self.meta.get_version, parcel.id, number)
        if not any(b["name"] == name for b in version.blobs):
            raise NotFound(f"version {number} has no blob {name}")
        key = version_prefix(parcel.id, number) + name
        headers = [(b"content-type", b"application/octet-stream"), (b"cache-control", CHUNK_CACHE_CONTROL)]
        return await self._object_response(key, headers, allow_redirect=False)

    async def h_version_chunks(self, request: Request, parcel_text: str, version_text: str) -> Response:
        parcel = await self.parcel(request, parcel_text)
        number = names.version(version_text)
        which = request.query("set", "all")
        if which not in ("all", "working"):
            raise BadRequest("set must be all or working", code="bad_set")
        limit_max = self.config["server.max_tags_per_query"]
        offset = _query_int(request, "offset", 0, 0, 2**62)
        limit = _query_int(request, "limit", min(CHUNK_PAGE, limit_max), 1, limit_max)
        assert self.meta is not None
        recorded, tags = await self.run(self.meta.version_chunk_tags, parcel.id, number, which)
        page = tags[offset:offset + limit]
        sizes = await self.run(self.meta.chunk_sizes, page)
        following = offset + len(page)
        return Response(json={"parcel": parcel.id, "version": number, "set": which, "recorded": recorded,
                              "total": len(tags), "offset": offset,
                              "chunks": [{"tag": t, "size": sizes.get(t)} for t in page],
                              "next": following if following < len(tags) else None})

    async def h_put_staged(self, request: Request, parcel_text: str, name_text: str) -> Response:
        parcel = await self.parcel(request, parcel_text)
        name = names.blob_name(name_text)
        nonce_hash = auth.secret_hash(request.lock_nonce())
        assert self.meta is not None and self.store is not None
        lock = await self.run(self.meta.check_lock, parcel.id, nonce_hash)
        upload = await self.run(self.store.new_upload)
        digest = hashlib.sha256()
        try:
            async for piece in request.chunks(self.config["server.max_blob_bytes"]):
                digest.update(piece)
                upload.write(piece)
            await self.run(upload.commit, staging_prefix(parcel.id, lock.lock_id) + name)
        except BaseException:
            upload.abort()
            raise
        return Response(201, json={"name": name, "size": upload.size, "sha256": digest.hexdigest()})

    async def h_commit(self, request: Request, parcel_text: str) -> Response:
        parcel = await self.parcel(request, parcel_text)
        nonce_hash = auth.secret_hash(request.lock_nonce())
        body = await request.json(self.config["server.max_json_bytes"])
        parent = body.get("parent", 0)
        if parent is None:
            parent = 0
        if isinstance(parent, bool) or not isinstance(parent, int) or parent < 0:
            raise BadRequest("parent must be the current version number (0 or null for the first)", code="bad_parent")
        blobs = _name_list(body.get("blobs", []), "blobs")
        inherit = _name_list(body.get("inherit", []), "inherit")
        tags_value = body.get("tags", [])
        if not isinstance(tags_value, list):
            raise BadRequest("tags must be a JSON array of chunk tags", code="bad_tags")
        tags = [names.tag(t) for t in tags_value]
        working_value = body.get("working_tags")
        working: list[str] | None = None
        if working_value is not None:
            if not isinstance(working_value, list):
                raise BadRequest("working_tags must be a JSON array of chunk tags", code="bad_working_tags")
            working = [names.tag(t) for t in working_value]
            if not set(working) <= set(tags):
                raise BadRequest("working_tags must be among the version's tags", code="bad_working_tags")
        if set(blobs) & set(inherit):
            raise BadRequest("a blob cannot be both uploaded and inherited", code="bad_blobs")
        missing_required = [n for n in names.REQUIRED_BLOBS if n not in blobs and n not in inherit]
        if missing_required:
            raise BadRequest(f"a version needs the blobs {', '.join(missing_required)}", code="bad_blobs")
        assert self.meta is not None and self.store is not None
        meta, store = self.meta, self.store
        lock = await self.run(meta.check_lock, parcel.id, nonce_hash)
        staging = staging_prefix(parcel.id, lock.lock_id)
        staged = {info.key[len(staging):]: info.size for info in await self.run(lambda: list(store.list(staging)))}
        not_staged = [n for n in blobs if n not in staged]
        inherited_sizes: dict[str, int] = {}
        if inherit:
            if parent == 0:
                raise BadRequest("the first version cannot inherit blobs", code="bad_blobs")
            parent_version = await self.run(meta.get_version, parcel.id, parent)
            parent_blobs = {b["name"]: b["size"] for b in parent_version.blobs}
            not_staged += [n for n in inherit if n not in parent_blobs]
            inherited_sizes = {n: parent_blobs[n] for n in inherit if n in parent_blobs}
        if not_staged:
            raise Conflict(f"blobs not uploaded: {', '.join(not_staged)}", code="blobs_missing", missing=not_staged)
        blob_list = [{"name": n, "size": staged[n]} for n in blobs]
        blob_list += [{"name": n, "size": inherited_sizes[n], "inherited": True} for n in inherit]

        publish = publisher(store, parcel.id, staging, blobs, inherit, parent)

        actor = request.token.user if request.token else "-"
        try:
            version = await self.run(meta.commit_version, parcel.id, nonce_hash, parent, tags, blob_list,
                                     lock.host, lock.site, actor, request.remote, publish, working)
        except Conflict as e:
            await self.run(meta.audit, actor, "version.refused", parcel.id, request.remote,
                           {"parent": parent, "code": e.code})
            self._audit_line(request, "version.refused", parcel.id, parent=parent, code=e.code)
            raise
        self._audit_line(request, "version.commit", parcel.id, version=version.version, chunks=version.chunk_count)
        return Response(201, json=version.to_json())

    # --- handlers: the lock -----------------------------------------------------------------------

    async def h_get_lock(self, request: Request, parcel_text: str) -> Response:
        parcel = await self.parcel(request, parcel_text, admin_ok=True)
        return Response(json={"locked": parcel.lock is not None,
                              "lock": parcel.lock.to_json() if parcel.lock else None})

    async def h_acquire(self, request: Request, parcel_text: str) -> Response:
        parcel = await self.parcel(request, parcel_text)
        body = await request.json(64 * 1024)
        host = names.label(body.get("host"), "host")
        site = names.label(body.get("site", ""), "site")
        force = _flag(body, "force")
        take_expired = _flag(body, "take_expired")
        nonce = auth.new_nonce()
        assert self.meta is not None and self.store is not None and request.token is not None
        actor = request.token.user
        try:
            lock, old = await self.run(self.meta.acquire_lock, parcel.id, request.token.user_id,
                                       auth.secret_hash(nonce), host, site, self.config["server.lock_lease_seconds"],
                                       actor, request.remote, force=force, take_expired=take_expired)
        except Conflict as e:
            await self.run(self.meta.audit, actor, "lock.refused", parcel.id, request.remote,
                           {"host": host, "site": site, "holder": e.details.get("holder")})
            self._audit_line(request, "lock.refused", parcel.id, host=host, site=site)
            raise
        if old is not None:
            await self.run(self.store.delete_prefix, staging_prefix(parcel.id, old.lock_id))
            self._audit_line(request, "lock.break", parcel.id, holder=old.to_json())
        self._audit_line(request, "lock.acquire", parcel.id, host=host, site=site, version=lock.version)
        return Response(201, json={"nonce": nonce, "lock": lock.to_json(),
                                   "replaced": old.to_json() if old else None})

    async def h_renew(self, request: Request, parcel_text: str) -> Response:
        parcel = await self.parcel(request, parcel_text)
        nonce_hash = auth.secret_hash(request.lock_nonce())
        dirty = _dirty_report(await request.body(64 * 1024))
        assert self.meta is not None and request.token is not None
        lock = await self.run(self.meta.renew_lock, parcel.id, nonce_hash, self.config["server.lock_lease_seconds"],
                              request.token.user, request.remote, dirty)
        if dirty is None:
            self._audit_line(request, "lock.renew", parcel.id)
        else:
            self._audit_line(request, "lock.renew", parcel.id, dirty_chunks=dirty[0], dirty_bytes=dirty[1])
        return Response(json={"lock": lock.to_json()})

    async def h_release(self, request: Request, parcel_text: str) -> Response:
        parcel = await self.parcel(request, parcel_text)
        nonce_hash = auth.secret_hash(request.lock_nonce())
        assert self.meta is not None and self.store is not None and request.token is not None
        lock = await self.run(self.meta.release_lock, parcel.id, nonce_hash, request.token.user, request.remote)
        await self.run(self.store.delete_prefix, staging_prefix(parcel.id, lock.lock_id))
        self._audit_line(request, "lock.release", parcel.id)
        return Response(json={"released": True})

    async def h_break_lock(self, request: Request, parcel_text: str) -> Response:
        parcel = await self.parcel(request, parcel_text, admin_ok=True)
        body = await request.json(64 * 1024)
        force = _flag(body, "force")
        reason = names.label(body.get("reason", ""), "reason")
        assert self.meta is not None and self.store is not None and request.token is not None
        is_owner = parcel.owner_id == request.token.user_id
        if parcel.lock is None:
            raise NotFound("the parcel is not locked", code="not_locked")
        if not request.token.admin and not (is_owner and (force or parcel.lock.expired())):
            raise Conflict("breaking a lock that has not expired needs \"force\": true", code="force_required",
                           holder=parcel.lock.to_json())
        old = await self.break_parcel_lock(request, parcel.id, request.token.user,
                                           reason or ("admin" if not is_owner else "force"))
        return Response(json={"broken": old.to_json()})

    async def break_parcel_lock(self, request: Request, parcel: str, actor: str, reason: str,
                                expect_lock_id: str | None = None) -> LockInfo:
        """Break a parcel's lock and drop its staging area, audited. The API's break and the web page's
        release both come here, so either way the old holder's next commit is refused (``lock_lost``).
        The caller has checked that `actor` may do it."""
        assert self.meta is not None and self.store is not None
        old = await self.run(self.meta.break_lock, parcel, actor, request.remote, reason, expect_lock_id)
        await self.run(self.store.delete_prefix, staging_prefix(parcel, old.lock_id))
        self._audit_line(request, "lock.break", parcel, actor=actor, holder=old.to_json(), reason=reason)
        return old

    # --- handlers: chunks -------------------------------------------------------------------------

    async def _object_response(self, key: str, headers: list[tuple[bytes, bytes]], allow_redirect: bool) -> Response:
        assert self.store is not None
        if self.serving == "sendfile":
            path = self.store.local_path(key)
            assert path is not None
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                raise NotFound("no such object") from None
            return Response(path=str(path), size=size, headers=headers)
        if self.serving == "redirect" and allow_redirect:
            url = self.store.presigned_url(key, self.config["store.presign_seconds"])
            assert url is not None
            return Response(307, headers=[(b"location", url.encode()), (b"cache-control", b"no-store")])
        data = await self.run(self.store.get_bytes, key)
        return Response(body=data, headers=headers)

    async def h_get_chunk(self, request: Request, tag_text: str) -> Response:
        tag = names.tag(tag_text)
        etag = b'"' + tag.encode() + b'"'
        headers = [(b"content-type", b"application/octet-stream"), (b"cache-control", CHUNK_CACHE_CONTROL),
                   (b"etag", etag)]
        if request.headers.get("if-none-match") in (etag.decode(), "*"):
            return Response(304, headers=headers[1:])
        return await self._object_response(chunk_key(tag), headers, allow_redirect=True)

    async def h_put_chunk(self, request: Request, tag_text: str) -> Response:
        tag = names.tag(tag_text)
        data = await request.body(MAX_CHUNK_OBJECT)
        if len(data) < 28:
            raise Unprocessable("a chunk object is at least 28 bytes", code="bad_chunk")
        if hashlib.sha256(data).hexdigest() != tag:
            raise Unprocessable("the SHA-256 of the body is not the tag it was sent under", code="tag_mismatch")
        assert self.meta is not None and self.store is not None and self.chunk_commits is not None
        meta, store = self.meta, self.store
        key = chunk_key(tag)
        existed = await self.run(store.size, key) == len(data)
        deadline = time.monotonic() + 10
        while True:
            # Answered only once the batch it joins is durable and recorded (server.groupcommit).
            staged = None if existed else await self.run(store.stage, key, data)
            if await self.chunk_commits.add(tag, len(data), staged):
                break
            # gc is deleting this chunk right now: wait until it is done, then store it again.
            while await self.run(meta.chunk_state, tag) == 1:
                if time.monotonic() > deadline:
                    raise Unavailable("this chunk is being garbage-collected; retry in a moment", code="gc_busy")
                await asyncio.sleep(0.05)
            existed = False
        return Response(200 if existed else 201, json={"tag": tag, "size": len(data), "stored": not existed})

    async def h_missing(self, request: Request) -> Response:
        body = await request.json(self.config["server.max_json_bytes"])
        tags_value = body.get("tags")
        if not isinstance(tags_value, list):
            raise BadRequest("the body must be {\"tags\": [...]}", code="bad_tags")
        limit = self.config["server.max_tags_per_query"]
        if len(tags_value) > limit:
            raise TooLarge(f"at most {limit} tags per query", limit=limit)
        tags = [names.tag(t) for t in tags_value]
        assert self.meta is not None
        present = await self.run(self.meta.chunk_claim, tags)
        seen: set[str] = set()
        missing = []
        for tag in tags:
            if tag not in present and tag not in seen:
                missing.append(tag)
                seen.add(tag)
        return Response(json={"missing": missing})


def json_object(data: bytes) -> dict[str, Any]:
    """A request body as a JSON object; `BadRequest` (400, one line) if it is not one. Python's parser
    recurses once per nesting level, so a body of a few thousand ``[`` raises RecursionError: that is bad
    input too, not a server error."""
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}", code="bad_json") from None
    except RecursionError:
        raise BadRequest("the body is not valid JSON: it is nested too deeply", code="bad_json") from None
    if not isinstance(value, dict):
        raise BadRequest("the body must be a JSON object", code="bad_json")
    return value


def _name_list(value: object, what: str) -> list[str]:
    if not isinstance(value, list):
        raise BadRequest(f"{what} must be a JSON array of blob names", code="bad_blobs")
    out = [names.blob_name(v) for v in value]
    if len(set(out)) != len(out):
        raise BadRequest(f"{what} names a blob twice", code="bad_blobs")
    return out


def _dirty_report(body: bytes) -> tuple[int, int, float] | None:
    """The optional body of a lock renew: the holder's report of changes it has not committed yet,
    ``{"dirty_chunks": n, "dirty_bytes": b, "reported": t}`` (`reported` defaults to now)."""
    if not body.strip():
        return None
    value = json_object(body)
    if not value:
        return None
    counts = []
    for name in ("dirty_chunks", "dirty_bytes"):
        number = value.get(name)
        if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number < 2**62:
            raise BadRequest(f"{name} must be a non-negative integer", code=f"bad_{name}")
        counts.append(number)
    reported = value.get("reported", time.time())
    if isinstance(reported, bool) or not isinstance(reported, (int, float)) or not math.isfinite(reported) \
            or reported < 0:
        raise BadRequest("reported must be a Unix time in seconds", code="bad_reported")
    return counts[0], counts[1], float(reported)


def _query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query(name, str(default))
    if not re.fullmatch(r"[0-9]{1,19}", text) or not low <= int(text) <= high:
        raise BadRequest(f"{name} must be a whole number from {low} to {high}", code=f"bad_{name}")
    return int(text)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false", code=f"bad_{name}")
    return value


def create_app() -> IsrApp:
    """Granian's factory: build the app from the configuration isr-server put in the environment."""
    from .main import setup_logging

    config = Config.from_json(os.environ[ENV_CONFIG])
    setup_logging(config)
    return IsrApp(config)
