"""isr-server's ASGI application (served by granian, see `server.main`) and its route table.

The route table below is every path the server answers, in one place: the API (`server.api`, JSON and
bearer tokens, doc/protocol.md) and the web pages (`server.web`, HTML and browser sessions). Each path is
an `Endpoint` (`server.http`) with one handler per method; Starlette's router matches the path. A path
under ``/v<n>`` that no route matches gets the API's JSON 404, any other path the pages' HTML 404. Both
doors work through one `Service` per worker process (`server.service`): the metadata database and the
object store behind their interfaces, a thread pool for their blocking calls, and the lock break they share.
"""
from __future__ import annotations

import os
import re

from starlette.responses import Response
from starlette.routing import Route, Router
from starlette.types import Receive, Scope, Send

from .api import Api, error_json
from .config import ENV_CONFIG, Config
from .errors import NotFound
from .logs import setup_logging
from .service import Service
from .web import pages
from .web.pages import WebPages

#: Paths of the API (``/v1/…``, and any other ``/v<n>`` so that unknown API versions get a JSON 404);
#: every other path belongs to the web pages.
API_PATH = re.compile(r"/v[0-9]+(/.*)?")
#: The length of ``/v1/chunks/<tag>``.
CHUNK_PATH_LENGTH = len("/v1/chunks/") + 64


def route_table(api: Api, web: WebPages) -> list[Route]:
    """Every path of the server with its handler per method (HEAD is answered as GET)."""
    a, w = api.endpoint, web.endpoint
    return [
        # The API, one endpoint per section of doc/protocol.md. Chunk reads and writes first: the hot path.
        Route("/v1/chunks/missing", a(post=api.missing)),
        Route("/v1/chunks/{tag}", a(get=api.get_chunk, put=api.put_chunk)),
        Route("/v1/health", a(public=True, get=api.health)),
        Route("/v1/login", a(public=True, post=api.login)),
        Route("/v1/logout", a(post=api.logout)),
        Route("/v1/whoami", a(get=api.whoami)),
        Route("/v1/tokens", a(get=api.list_tokens)),
        Route("/v1/tokens/{token_id}", a(delete=api.revoke_token)),
        Route("/v1/parcels", a(get=api.list_parcels)),
        Route("/v1/parcels/{parcel}", a(get=api.get_parcel)),
        Route("/v1/parcels/{parcel}/keyenvelope", a(get=api.get_envelope, put=api.put_envelope)),
        Route("/v1/parcels/{parcel}/versions", a(get=api.list_versions, post=api.commit)),
        Route("/v1/parcels/{parcel}/versions/{version}", a(get=api.get_version)),
        # Before the blob route: "chunks" is reserved (names.RESERVED_BLOB_NAMES), never a blob's name.
        Route("/v1/parcels/{parcel}/versions/{version}/chunks", a(get=api.version_chunks)),
        # "_bundle" cannot name a blob (a blob name starts with a letter or digit).
        Route("/v1/parcels/{parcel}/versions/{version}/_bundle", a(get=api.get_bundle)),
        Route("/v1/parcels/{parcel}/versions/{version}/{blob}", a(get=api.get_blob)),
        Route("/v1/parcels/{parcel}/staging/{blob}", a(put=api.put_staged)),
        Route("/v1/parcels/{parcel}/lock", a(get=api.get_lock, post=api.acquire, delete=api.release)),
        Route("/v1/parcels/{parcel}/lock/renew", a(post=api.renew)),
        Route("/v1/parcels/{parcel}/lock/break", a(post=api.break_lock)),
        # The web pages.
        Route("/", w(get=web.home)),
        Route("/signin", w(get=web.signin_form, post=web.signin)),
        Route("/signout", w(post=web.signout)),
        Route("/parcels/{parcel}", w(get=web.parcel)),
        Route("/parcels/{parcel}/release", w(get=web.release_confirm, post=web.release)),
        Route("/parcels/{parcel}/rollback", w(get=web.rollback)),
        Route("/history", w(get=web.history)),
        Route("/account/password", w(get=web.password_form, post=web.change_password)),
        Route("/admin", w(get=web.admin_index)),
        Route("/admin/users", w(get=web.admin_users)),
        Route("/admin/parcels", w(get=web.admin_parcels)),
        Route("/admin/usage", w(get=web.admin_usage)),
        Route("/admin/audit", w(get=web.admin_audit)),
        Route("/static/{name}", w(get=web.static)),
    ]


class IsrApp:
    """The ASGI application, one per worker process."""

    def __init__(self, config: Config) -> None:
        self.service = Service(config)
        self.api = Api(self.service)
        self.web = WebPages(self.service)
        self.router = Router(route_table(self.api, self.web), redirect_slashes=False, default=self.not_found)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if len(path) == CHUNK_PATH_LENGTH and path.startswith("/v1/chunks/") and scope["method"] in ("GET", "HEAD"):
                await self.api.read_chunk(scope, receive, send)  # the hot path, past the route table
            else:
                await self.router(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self.lifespan(receive, send)

    async def not_found(self, scope: Scope, receive: Receive, send: Send) -> None:
        response: Response
        if API_PATH.fullmatch(scope["path"]):
            response = error_json(NotFound(f"no such endpoint: {scope['path']}"))
        else:
            response = pages.not_found()
        await response(scope, receive, send)

    async def lifespan(self, receive: Receive, send: Send) -> None:
        """Open the backends at start-up (a failure is one line to granian, which logs it and stops) and
        close them at shutdown."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.service.open()
                except Exception as e:
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.service.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def create_app() -> IsrApp:
    """Granian's factory: build the app from the configuration isr-server put in the environment."""
    config = Config.from_json(os.environ[ENV_CONFIG])
    setup_logging(config)
    return IsrApp(config)
