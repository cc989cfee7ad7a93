"""The HTTP primitives the API (`server.api`) and the web pages (`server.web`) share.

Requests and responses are Starlette's. Every path of the route table (`server.app`) is an `Endpoint`: the
handler for each method, called with the request and the path's parameters. This module adds what Starlette
leaves to the application:

- request bodies read with a size limit (`read_body`, `body_pieces`): a body over the limit is answered
  413 as soon as that is known, after reading and dropping what the client already sent, because an HTTP/2
  client often cannot read an answer to a request it has not finished sending;
- JSON bodies as objects, with one-line errors (`read_json`);
- a file answered through granian's ASGI ``http.response.pathsend`` extension (`PathsendResponse`), so
  chunk bytes never pass through Python;
- every exception turned into an `ApiError` (`as_api_error`), which the API answers as JSON and the web
  pages as an HTML page; a client that went away (`ClientDisconnect`) gets no answer.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .errors import ApiError, BadRequest, InternalError, MethodNotAllowed, StorageError, TooLarge, Unavailable

log = logging.getLogger("server")

#: The most bytes of a refused body that are read and dropped before answering 413 (see the module doc).
DRAIN_LIMIT = 64 * 1024 * 1024

Handler = Callable[..., Awaitable[Response]]


class Endpoint:
    """One path of the route table as an ASGI app. HEAD is answered like GET, without the body; a method
    with no handler is 405. Subclasses say how a handler is called (`call`), how an error looks
    (`error_response`) and what every answer carries (`finish`)."""

    def __init__(self, **handlers: Handler) -> None:
        self.handlers = {method.upper(): handler for method, handler in handlers.items()}
        if "GET" in self.handlers:
            self.handlers.setdefault("HEAD", self.handlers["GET"])
        self.allow = ", ".join(sorted(self.handlers))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            handler = self.handlers.get(request.method)
            if handler is None:
                raise MethodNotAllowed(f"{request.method} is not allowed on {scope['path']}", allow=self.allow)
            response = await self.call(handler, request)
        except ClientDisconnect:
            return
        except Exception as e:  # every error becomes an answer; as_api_error logs the unexpected ones
            response = self.error_response(request, e)
        self.finish(response)
        if request.method == "HEAD":
            response.body = b""  # Content-Length stays that of the GET
        await response(scope, receive, send)

    async def call(self, handler: Handler, request: Request) -> Response:
        return await handler(request, **request.path_params)

    def error_response(self, request: Request, error: Exception) -> Response:
        raise NotImplementedError

    def finish(self, response: Response) -> None:
        """Add what every answer of this endpoint carries (nothing here)."""


def as_api_error(request: Request, error: Exception) -> ApiError:
    """The `ApiError` to answer with for an exception a handler raised: itself, 503 for a failing database
    or store, 500 for anything else (a bug: logged with its traceback)."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, StorageError):
        log.error("storage failure on %s %s: %s", request.method, request.scope["path"], error)
        return Unavailable("the server's storage is unavailable; try again later", code="storage_unavailable")
    log.error("unexpected error on %s %s", request.method, request.scope["path"], exc_info=error)
    return InternalError("internal server error")


def error_headers(error: ApiError) -> dict[str, str]:
    """The headers an error answer carries: the ones its status needs (``Allow`` for 405, ``Retry-After``
    for 429 and a busy 503, ``WWW-Authenticate`` for 401 on the API)."""
    headers = {}
    if "allow" in error.details:
        headers["allow"] = str(error.details["allow"])
    if "retry_after" in error.details:
        headers["retry-after"] = str(error.details["retry_after"])
    return headers


def remote(request: Request) -> str:
    """The client's ``address:port`` for logs and the audit trail ("" if unknown)."""
    client = request.client
    return f"{client.host}:{client.port}" if client else ""


class PathsendResponse(Response):
    """A file, handed to granian by its path (ASGI ``http.response.pathsend``): zero-copy, no bytes in
    Python. `size` is the file's size, for Content-Length."""

    def __init__(self, path: str, size: int, headers: dict[str, str]) -> None:
        self.status_code = 200
        self.path = path
        self.background = None
        self.body = b""
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self.raw_headers.append((b"content-length", str(size).encode()))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if scope["method"] == "HEAD":
            await send({"type": "http.response.body", "body": b""})
        else:
            await send({"type": "http.response.pathsend", "path": self.path})


# --- request bodies ---------------------------------------------------------------------------------------


def _declared_length(request: Request) -> int | None:
    text = request.headers.get("content-length")
    if text is None:
        return None
    if not text.isdigit() or len(text) > 18:
        raise BadRequest("Content-Length must be a non-negative integer", code="bad_length")
    return int(text)


async def _drain(request: Request, received: int) -> None:
    """Read and drop the rest of a body we refuse, up to DRAIN_LIMIT bytes (see the module doc)."""
    while received <= DRAIN_LIMIT:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        received += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def body_pieces(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The body in pieces as they arrive, raising `TooLarge` as soon as it exceeds `limit` bytes."""
    declared = _declared_length(request)
    too_large = TooLarge(f"the body exceeds the limit of {limit} bytes here", limit=limit)
    if declared is not None and declared > limit:
        if declared <= DRAIN_LIMIT:
            await _drain(request, 0)
        raise too_large
    total = 0
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        piece = message.get("body", b"")
        total += len(piece)
        if total > limit:
            if message.get("more_body", False):
                await _drain(request, total)
            raise too_large
        if piece:
            yield piece
        if not message.get("more_body", False):
            return


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, at most `limit` bytes (`TooLarge` beyond)."""
    return b"".join([piece async for piece in body_pieces(request, limit)])


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, at most `limit` bytes."""
    return json_object(await read_body(request, limit))


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
