"""The ISR HTTP API (doc/protocol.md, one endpoint per section): the handlers behind ``/v1/``.

Every handler validates its input with `server.names`, calls the metadata database and the object store
through the `Service` (in its thread pool) and returns a response. Every error leaves as JSON
``{"error": …, "code": …}`` with a 4xx status (5xx only for a failing database or store, or a bug). The
paths are in the route table of `server.app`; `ApiEndpoint` checks the bearer token before a handler runs,
except for the two public ones (health, login), and hands the handler the token's record.

Chunk GETs are the hot path: their token check is cached for a few seconds per worker
(``server.token_cache_seconds``) and, with the directory store, the file is handed to granian by its path
(`PathsendResponse`), so its bytes never pass through Python.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import re
import struct
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from . import auth, names
from .config import MAX_CHUNK_OBJECT
from .errors import (ApiError, BadRequest, Conflict, Forbidden, NotFound, TooLarge, TooManyAttempts, Unauthorized,
                     Unavailable, Unprocessable)
from .http import (Endpoint, Handler, PathsendResponse, as_api_error, body_pieces, error_headers, json_object,
                   read_body, read_json, remote)
from .meta import ParcelInfo, TokenInfo
from .ops import publisher
from .service import Service
from .store import chunk_key, envelope_key, staging_prefix, version_prefix

log = logging.getLogger("server")

API_VERSION = 1
CHUNK_CACHE_CONTROL = "private, max-age=31536000, immutable"
#: A bundle's body (GET …/versions/{n}/_bundle): per blob, its length as 8 bytes big-endian, then its bytes.
BUNDLE_FRAME = struct.Struct(">Q")
BUNDLE_TYPE = "application/vnd.isr.bundle"
#: Default page size of a version's chunk list (GET …/versions/{n}/chunks): about 1 MB of JSON.
CHUNK_PAGE = 10000
#: The limit of small JSON bodies (login, lock calls).
SMALL_BODY = 64 * 1024


def error_json(error: ApiError) -> JSONResponse:
    """An error as the API answers it: ``{"error": message, "code": word, …details}``."""
    headers = error_headers(error)
    if error.status == 401:
        headers["www-authenticate"] = 'Bearer realm="isr"'
    return JSONResponse(error.body(), error.status, headers)


class ApiEndpoint(Endpoint):
    """An API path: the bearer token is checked before the handler runs (unless `public`), and errors
    are JSON."""

    def __init__(self, api: "Api", *, public: bool = False, **handlers: Handler) -> None:
        super().__init__(**handlers)
        self.api = api
        self.public = public

    async def call(self, handler: Handler, request: Request) -> Response:
        if self.public:
            return await handler(request)
        chunk_read = request.method in ("GET", "HEAD") and request.scope["path"].startswith("/v1/chunks/")
        token = await self.api.check_token(request.headers.get("authorization"), cached=chunk_read)
        return await handler(request, token, **request.path_params)

    def error_response(self, request: Request, error: Exception) -> Response:
        return error_json(as_api_error(request, error))


class Api:
    """The API's handlers, one instance per worker process."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.config = service.config
        self.run = service.run
        self.serving = service.config.chunk_serving
        self.token_cache: dict[str, tuple[float, TokenInfo]] = {}
        self.token_cache_seconds = service.config["server.token_cache_seconds"]

    def endpoint(self, *, public: bool = False, **handlers: Handler) -> ApiEndpoint:
        """An entry of the route table (`server.app`)."""
        return ApiEndpoint(self, public=public, **handlers)

    # --- authentication and access ----------------------------------------------------------------

    async def check_token(self, authorization: str | None, cached: bool = False) -> TokenInfo:
        """The record of the bearer token in an Authorization header (`Unauthorized` without a valid one).
        With `cached`, a token seen in the last ``server.token_cache_seconds`` is not looked up again."""
        scheme, _, token = (authorization or "").partition(" ")
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
        info = await self.run(self.service.meta.lookup_token, token_hash)
        if info is None:
            self.token_cache.pop(token_hash, None)
            raise Unauthorized("unknown, revoked or expired token; log in again")
        if cached and self.token_cache_seconds:
            if len(self.token_cache) > 10000:
                self.token_cache.clear()
            self.token_cache[token_hash] = (now + self.token_cache_seconds, info)
        return info

    async def parcel(self, token: TokenInfo, text: str, *, admin_ok: bool = False) -> ParcelInfo:
        """The parcel named in the path if the caller owns it (403 if not, 404 if there is none)."""
        parcel = await self.run(self.service.meta.get_parcel, names.parcel_id(text))
        if parcel.owner_id != token.user_id and not (admin_ok and token.admin):
            raise Forbidden("this parcel belongs to another user")
        return parcel

    def audit(self, request: Request, token: TokenInfo, action: str, parcel: str, **detail: Any) -> None:
        self.service.audit_line(remote(request), token.user, action, parcel, **detail)

    # --- service and sessions ---------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "api": API_VERSION, "chunk_serving": self.serving})

    async def login(self, request: Request) -> Response:
        body = await read_json(request, SMALL_BODY)
        user = body.get("user")
        password = body.get("password")
        label = names.label(body.get("label", ""), "label", 100)
        if not isinstance(user, str) or not isinstance(password, str) or len(password) > auth.MAX_PASSWORD_BYTES:
            raise BadRequest("login needs string fields user and password", code="bad_login")
        meta = self.service.meta
        valid_name = names.USER_RE.fullmatch(user) is not None
        # The same failure counters as the web sign-in: guessing through either door counts for both.
        limits = auth.signin_subjects(user if valid_name else None, auth.client_address(request.scope))
        subjects = [subject for subject, _ in limits]
        wait = await self.run(meta.signin_wait, limits, auth.SIGNIN_WINDOW, auth.SIGNIN_DELAY)
        if wait > 0:
            raise TooManyAttempts(f"too many failed logins: try again in {int(wait) + 1} s",
                                  retry_after=int(wait) + 1)
        found = await self.run(meta.get_user, user) if valid_name else None
        stored = found[1] if found else auth.DUMMY_HASH
        ok = await self.run(auth.verify_password, password, stored)
        if not found or not ok:
            await self.run(meta.signin_failed, subjects, auth.SIGNIN_WINDOW)
            log.warning("failed login for user %r from %s", user[:40], remote(request))
            raise Unauthorized("wrong user name or password", code="bad_credentials")
        await self.run(meta.signin_succeeded, subjects[0])
        token = auth.new_token()
        info = await self.run(meta.add_token, os.urandom(8).hex(), auth.secret_hash(token), found[0].id,
                              label, self.config["server.token_ttl_seconds"])
        return JSONResponse({"token": token, "id": info.id, "user": info.user, "admin": info.admin,
                             "expires": info.expires}, 201)

    async def logout(self, request: Request, token: TokenInfo) -> Response:
        await self.run(self.service.meta.revoke_token, token.user_id, token.id)
        return JSONResponse({"revoked": token.id})

    async def whoami(self, request: Request, token: TokenInfo) -> Response:
        return JSONResponse({"user": token.user, "admin": token.admin,
                             "token": {"id": token.id, "label": token.label, "created": token.created,
                                       "expires": token.expires}})

    async def list_tokens(self, request: Request, token: TokenInfo) -> Response:
        tokens = await self.run(self.service.meta.list_tokens, token.user_id)
        return JSONResponse({"tokens": [{"id": t.id, "label": t.label, "created": t.created, "expires": t.expires,
                                         "current": t.id == token.id} for t in tokens]})

    async def revoke_token(self, request: Request, token: TokenInfo, token_id: str) -> Response:
        if not re.fullmatch(r"[0-9a-f]{16}", token_id):
            raise BadRequest("not a token id", code="bad_token_id")
        await self.run(self.service.meta.revoke_token, token.user_id, token_id)
        return JSONResponse({"revoked": token_id})

    # --- parcels and versions ---------------------------------------------------------------------

    async def list_parcels(self, request: Request, token: TokenInfo) -> Response:
        meta = self.service.meta
        out = []
        for parcel in await self.run(meta.list_parcels, token.user_id):
            versions = await self.run(meta.list_versions, parcel.id)
            item = parcel.to_json()
            item["versions"] = [{"version": v.version, "created": v.created, "chunk_count": v.chunk_count,
                                 "chunk_bytes": v.chunk_bytes} for v in versions]
            out.append(item)
        return JSONResponse({"parcels": out})

    async def get_parcel(self, request: Request, token: TokenInfo, parcel: str) -> Response:
        found = await self.parcel(token, parcel)
        versions = await self.run(self.service.meta.list_versions, found.id)
        item = found.to_json()
        item["versions"] = [v.to_json() for v in versions]
        return JSONResponse(item)

    async def get_envelope(self, request: Request, token: TokenInfo, parcel: str) -> Response:
        found = await self.parcel(token, parcel)
        data = await self.run(self.service.store.get_bytes, envelope_key(found.id))
        return Response(data, headers={"content-type": "application/octet-stream", "cache-control": "no-store"})

    async def put_envelope(self, request: Request, token: TokenInfo, parcel: str) -> Response:
        found = await self.parcel(token, parcel)
        nonce = lock_nonce(request)
        data = await read_body(request, names.KEYENVELOPE_SIZE)
        if len(data) != names.KEYENVELOPE_SIZE or data[:4] != b"ISRE" or data[8:24] != uuid.UUID(found.id).bytes:
            raise Unprocessable("not a key envelope of this parcel (148 bytes, magic ISRE, this parcel's UUID)",
                                code="bad_envelope")
        meta = self.service.meta
        await self.run(meta.check_lock, found.id, auth.secret_hash(nonce))
        await self.run(self.service.store.put_bytes, envelope_key(found.id), data)
        await self.run(meta.audit, token.user, "envelope.replace", found.id, remote(request), {})
        self.audit(request, token, "envelope.replace", found.id)
        return JSONResponse({"replaced": True})

    async def list_versions(self, request: Request, token: TokenInfo, parcel: str) -> Response:
        found = await self.parcel(token, parcel)
        versions = await self.run(self.service.meta.list_versions, found.id)
        return JSONResponse({"current": found.current_version, "versions": [v.to_json() for v in versions]})

    async def get_version(self, request: Request, token: TokenInfo, parcel: str, version: str) -> Response:
        found = await self.parcel(token, parcel)
        info = await self.run(self.service.meta.get_version, found.id, names.version(version))
        return JSONResponse(info.to_json())

    async def get_blob(self, request: Request, token: TokenInfo, parcel: str, version: str, blob: str) -> Response:
        found = await self.parcel(token, parcel)
        number = names.version(version)
        name = names.blob_name(blob)
        info = await self.run(self.service.meta.get_version, found.id, number)
        if not any(b["name"] == name for b in info.blobs):
            raise NotFound(f"version {number} has no blob {name}")
        headers = {"content-type": "application/octet-stream", "cache-control": CHUNK_CACHE_CONTROL}
        return await self.object_response(version_prefix(found.id, number) + name, headers, allow_redirect=False)

    async def get_bundle(self, request: Request, token: TokenInfo, parcel: str, version: str) -> Response:
        """Several blobs of a version in one streamed answer (doc/protocol.md), in the order of ``names``, each
        framed as its length (`BUNDLE_FRAME`) and its bytes; read from the store one at a time, so a worker
        holds one blob. Every name is checked before the answer starts, and the first blob is read before it
        too: a store that fails then is an error status, not a cut-off body."""
        found = await self.parcel(token, parcel)
        number = names.version(version)
        wanted = names.blob_names(request.query_params.get("names"))
        info = await self.run(self.service.meta.get_version, found.id, number)
        present = {b["name"] for b in info.blobs}
        missing = [name for name in wanted if name not in present]
        if missing:
            raise NotFound(f"version {number} has no blob {', '.join(missing)}", missing=missing)
        headers = {"content-type": BUNDLE_TYPE, "cache-control": CHUNK_CACHE_CONTROL}
        if request.method == "HEAD":
            return StreamingResponse(iter(()), headers=headers)
        keys = [version_prefix(found.id, number) + name for name in wanted]
        first = await self.run(self.service.store.get_bytes, keys[0])
        return StreamingResponse(self.bundle_body(keys, first), headers=headers)

    async def bundle_body(self, keys: list[str], first: bytes) -> AsyncIterator[bytes]:
        """The body of `get_bundle`: the objects ``keys`` (the first already read) one after another, framed."""
        data = first
        for index, key in enumerate(keys):
            if index:
                try:
                    data = await self.run(self.service.store.get_bytes, key)
                except Exception as e:  # the status is sent: all that is left is to cut the body off
                    log.error("failed to read %s for a bundle, which ends after %d of %d blobs: %s", key, index,
                              len(keys), e)
                    raise
            yield BUNDLE_FRAME.pack(len(data))
            yield data

    async def version_chunks(self, request: Request, token: TokenInfo, parcel: str, version: str) -> Response:
        found = await self.parcel(token, parcel)
        number = names.version(version)
        which = request.query_params.get("set", "all")
        if which not in ("all", "working"):
            raise BadRequest("set must be all or working", code="bad_set")
        limit_max = self.config["server.max_tags_per_query"]
        offset = _query_int(request, "offset", 0, 0, 2**62)
        limit = _query_int(request, "limit", min(CHUNK_PAGE, limit_max), 1, limit_max)
        meta = self.service.meta
        recorded, tags = await self.run(meta.version_chunk_tags, found.id, number, which)
        page = tags[offset:offset + limit]
        sizes = await self.run(meta.chunk_sizes, page)
        following = offset + len(page)
        return JSONResponse({"parcel": found.id, "version": number, "set": which, "recorded": recorded,
                             "total": len(tags), "offset": offset,
                             "chunks": [{"tag": t, "size": sizes.get(t)} for t in page],
                             "next": following if following < len(tags) else None})

    async def put_staged(self, request: Request, token: TokenInfo, parcel: str, blob: str) -> Response:
        found = await self.parcel(token, parcel)
        name = names.blob_name(blob)
        nonce_hash = auth.secret_hash(lock_nonce(request))
        store = self.service.store
        lock = await self.run(self.service.meta.check_lock, found.id, nonce_hash)
        upload = await self.run(store.new_upload)
        digest = hashlib.sha256()
        try:
            async for piece in body_pieces(request, self.config["server.max_blob_bytes"]):
                digest.update(piece)
                upload.write(piece)
            await self.run(upload.commit, staging_prefix(found.id, lock.lock_id) + name)
        except BaseException:
            upload.abort()
            raise
        return JSONResponse({"name": name, "size": upload.size, "sha256": digest.hexdigest()}, 201)

    async def commit(self, request: Request, token: TokenInfo, parcel: str) -> Response:
        found = await self.parcel(token, parcel)
        nonce_hash = auth.secret_hash(lock_nonce(request))
        body = await read_json(request, self.config["server.max_json_bytes"])
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
        meta, store = self.service.meta, self.service.store
        lock = await self.run(meta.check_lock, found.id, nonce_hash)
        staging = staging_prefix(found.id, lock.lock_id)
        staged = {info.key[len(staging):]: info.size for info in await self.run(lambda: list(store.list(staging)))}
        not_staged = [n for n in blobs if n not in staged]
        inherited_sizes: dict[str, int] = {}
        if inherit:
            if parent == 0:
                raise BadRequest("the first version cannot inherit blobs", code="bad_blobs")
            parent_version = await self.run(meta.get_version, found.id, parent)
            parent_blobs = {b["name"]: b["size"] for b in parent_version.blobs}
            not_staged += [n for n in inherit if n not in parent_blobs]
            inherited_sizes = {n: parent_blobs[n] for n in inherit if n in parent_blobs}
        if not_staged:
            raise Conflict(f"blobs not uploaded: {', '.join(not_staged)}", code="blobs_missing", missing=not_staged)
        blob_list = [{"name": n, "size": staged[n]} for n in blobs]
        blob_list += [{"name": n, "size": inherited_sizes[n], "inherited": True} for n in inherit]

        publish = publisher(store, found.id, staging, blobs, inherit, parent)
        try:
            version = await self.run(meta.commit_version, found.id, nonce_hash, parent, tags, blob_list,
                                     lock.host, lock.site, token.user, remote(request), publish, working)
        except Conflict as e:
            await self.run(meta.audit, token.user, "version.refused", found.id, remote(request),
                           {"parent": parent, "code": e.code})
            self.audit(request, token, "version.refused", found.id, parent=parent, code=e.code)
            raise
        self.audit(request, token, "version.commit", found.id, version=version.version, chunks=version.chunk_count)
        return JSONResponse(version.to_json(), 201)

    # --- the lock ---------------------------------------------------------------------------------

    async def get_lock(self, request: Request, token: TokenInfo, parcel: str) -> Response:
        found = await self.parcel(token, parcel, admin_ok=True)
        return JSONResponse({"locked": found.lock is not None, "lock": found.lock.to_json() if found.lock else None})

    async def acquire(self, request: Request, token: TokenInfo, parcel: str) -> Response:
        found = await self.parcel(token, parcel)
        body = await read_json(request, SMALL_BODY)
        host = names.label(body.get("host"), "host")
        site = names.label(body.get("site", ""), "site")
        force = _flag(body, "force")
        take_expired = _flag(body, "take_expired")
        nonce = auth.new_nonce()
        meta = self.service.meta
        try:
            lock, old = await self.run(meta.acquire_lock, found.id, token.user_id, auth.secret_hash(nonce), host,
                                       site, self.config["server.lock_lease_seconds"], token.user, remote(request),
                                       force=force, take_expired=take_expired)
        except Conflict as e:
            await self.run(meta.audit, token.user, "lock.refused", found.id, remote(request),
                           {"host": host, "site": site, "holder": e.details.get("holder")})
            self.audit(request, token, "lock.refused", found.id, host=host, site=site)
            raise
        if old is not None:
            await self.run(self.service.store.delete_prefix, staging_prefix(found.id, old.lock_id))
            self.audit(request, token, "lock.break", found.id, holder=old.to_json())
        self.audit(request, token, "lock.acquire", found.id, host=host, site=site, version=lock.version)
        return JSONResponse({"nonce": nonce, "lock": lock.to_json(), "replaced": old.to_json() if old else None}, 201)

    async def renew(self, request: Request, token: TokenInfo, parcel: str) -> Response:
        found = await self.parcel(token, parcel)
        nonce_hash = auth.secret_hash(lock_nonce(request))
        dirty = _dirty_report(await read_body(request, SMALL_BODY))
        lock = await self.run(self.service.meta.renew_lock, found.id, nonce_hash,
                              self.config["server.lock_lease_seconds"], token.user, remote(request), dirty)
        if dirty is None:
            self.audit(request, token, "lock.renew", found.id)
        else:
            self.audit(request, token, "lock.renew", found.id, dirty_chunks=dirty[0], dirty_bytes=dirty[1])
        return JSONResponse({"lock": lock.to_json()})

    async def release(self, request: Request, token: TokenInfo, parcel: str) -> Response:
        found = await self.parcel(token, parcel)
        nonce_hash = auth.secret_hash(lock_nonce(request))
        lock = await self.run(self.service.meta.release_lock, found.id, nonce_hash, token.user, remote(request))
        await self.run(self.service.store.delete_prefix, staging_prefix(found.id, lock.lock_id))
        self.audit(request, token, "lock.release", found.id)
        return JSONResponse({"released": True})

    async def break_lock(self, request: Request, token: TokenInfo, parcel: str) -> Response:
        found = await self.parcel(token, parcel, admin_ok=True)
        body = await read_json(request, SMALL_BODY)
        force = _flag(body, "force")
        reason = names.label(body.get("reason", ""), "reason")
        is_owner = found.owner_id == token.user_id
        if found.lock is None:
            raise NotFound("the parcel is not locked", code="not_locked")
        if not token.admin and not (is_owner and (force or found.lock.expired())):
            raise Conflict("breaking a lock that has not expired needs \"force\": true", code="force_required",
                           holder=found.lock.to_json())
        old = await self.service.break_parcel_lock(remote(request), found.id, token.user,
                                                   reason or ("admin" if not is_owner else "force"))
        return JSONResponse({"broken": old.to_json()})

    # --- chunks -----------------------------------------------------------------------------------

    async def object_response(self, key: str, headers: dict[str, str], allow_redirect: bool) -> Response:
        """An object of the store as the answer, the way ``server.chunk_serving`` says."""
        store = self.service.store
        if self.serving == "sendfile":
            path = store.local_path(key)
            assert path is not None
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                raise NotFound("no such object") from None
            return PathsendResponse(str(path), size, headers)
        if self.serving == "redirect" and allow_redirect:
            url = store.presigned_url(key, self.config["store.presign_seconds"])
            assert url is not None
            return Response(status_code=307, headers={"location": url, "cache-control": "no-store"})
        data = await self.run(store.get_bytes, key)
        return Response(data, headers=headers)

    async def get_chunk(self, request: Request, token: TokenInfo, tag: str) -> Response:
        return await self.chunk_response(tag, request.headers.get("if-none-match"))

    async def read_chunk(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET or HEAD ``/v1/chunks/<tag>``, the hot path, as plain ASGI: no router, no request object,
        headers read straight from the scope (a third less Python per chunk than through the route table;
        BENCHMARKS.md, "isr-server: chunk serving before and after the restructure"). Its answers are
        those of `get_chunk`, which the route table keeps for every other chunk read."""
        authorization = if_none_match = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"if-none-match":
                if_none_match = value.decode("latin-1")
        try:
            await self.check_token(authorization, cached=True)
            response = await self.chunk_response(scope["path"][len("/v1/chunks/"):], if_none_match)
        except Exception as e:  # as in every endpoint: the error becomes the answer
            response = error_json(as_api_error(Request(scope, receive), e))
        if scope["method"] == "HEAD":
            response.body = b""
        await response(scope, receive, send)

    async def chunk_response(self, tag: str, if_none_match: str | None) -> Response:
        checked = names.tag(tag)
        etag = f'"{checked}"'
        headers = {"content-type": "application/octet-stream", "cache-control": CHUNK_CACHE_CONTROL, "etag": etag}
        if if_none_match in (etag, "*"):
            del headers["content-type"]
            return Response(status_code=304, headers=headers)
        return await self.object_response(chunk_key(checked), headers, allow_redirect=True)

    async def put_chunk(self, request: Request, token: TokenInfo, tag: str) -> Response:
        checked = names.tag(tag)
        data = await read_body(request, MAX_CHUNK_OBJECT)
        if len(data) < 28:
            raise Unprocessable("a chunk object is at least 28 bytes", code="bad_chunk")
        if hashlib.sha256(data).hexdigest() != checked:
            raise Unprocessable("the SHA-256 of the body is not the tag it was sent under", code="tag_mismatch")
        meta, store = self.service.meta, self.service.store
        key = chunk_key(checked)
        existed = await self.run(store.size, key) == len(data)
        deadline = time.monotonic() + 10
        while True:
            # Answered only once the batch it joins is durable and recorded (server.groupcommit).
            staged = None if existed else await self.run(store.stage, key, data)
            if await self.service.chunk_commits.add(checked, len(data), staged):
                break
            # gc is deleting this chunk right now: wait until it is done, then store it again.
            while await self.run(meta.chunk_state, checked) == 1:
                if time.monotonic() > deadline:
                    raise Unavailable("this chunk is being garbage-collected; retry in a moment", code="gc_busy")
                await asyncio.sleep(0.05)
            existed = False
        return JSONResponse({"tag": checked, "size": len(data), "stored": not existed}, 200 if existed else 201)

    async def missing(self, request: Request, token: TokenInfo) -> Response:
        body = await read_json(request, self.config["server.max_json_bytes"])
        tags_value = body.get("tags")
        if not isinstance(tags_value, list):
            raise BadRequest("the body must be {\"tags\": [...]}", code="bad_tags")
        limit = self.config["server.max_tags_per_query"]
        if len(tags_value) > limit:
            raise TooLarge(f"at most {limit} tags per query", limit=limit)
        tags = [names.tag(t) for t in tags_value]
        present = await self.run(self.service.meta.chunk_claim, tags)
        return JSONResponse({"missing": [t for t in dict.fromkeys(tags) if t not in present]})


def lock_nonce(request: Request) -> str:
    """The lock nonce of the ISR-Lock header (400 without one)."""
    value = request.headers.get("isr-lock")
    if value is None:
        raise BadRequest("this request needs the ISR-Lock header with your lock nonce", code="no_lock_nonce")
    return names.nonce(value)


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
    text = request.query_params.get(name, str(default))
    if not re.fullmatch(r"[0-9]{1,19}", text) or not low <= int(text) <= high:
        raise BadRequest(f"{name} must be a whole number from {low} to {high}", code=f"bad_{name}")
    return int(text)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false", code=f"bad_{name}")
    return value
