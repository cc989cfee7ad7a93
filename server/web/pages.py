"""The web pages of isr-server: sign-in, "My parcels", releasing a lock, and the administrator's pages.

Served by the same ASGI app and HTTPS listener as the API (`server.app` hands every path outside
``/v<n>/`` to `WebPages.handle`), signed in with the same users and passwords. Pages are rendered on the
server (`server.web.templates`), carry no JavaScript, and go out with a strict Content-Security-Policy.
Every POST is checked for its origin and its CSRF token (`server.web.sessions`).

Releasing a lock here breaks it exactly like the API's ``POST …/lock/break`` (`IsrApp.break_parcel_lock`:
audited, staging dropped), so the site that held it can no longer commit.
"""
from __future__ import annotations

import hashlib
import logging
import re
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import auth, names, ops
from ..errors import ApiError, BadRequest, Conflict, Forbidden, NotFound, StorageError
from ..meta import LockInfo, ParcelInfo, WebSession
from . import sessions
from .templates import (Markup, audit_detail, escape, hidden, html, join, layout, lock_details, parcel_card,
                        size, table, timestamp, when)

if TYPE_CHECKING:
    from ..app import IsrApp, Request, Response
    from ..meta.sql import SqlMeta

log = logging.getLogger("server.web")

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_TYPES = {".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
FORM_LIMIT = 64 * 1024
AUDIT_PAGE = 50
HOME_VERSIONS = 8

CONTENT_SECURITY_POLICY = ("default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
                           "frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = [
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
]


class SignInRequired(Exception):
    """The page needs a signed-in user: GET requests are sent to the sign-in page."""


@dataclass(frozen=True)
class Page:
    method: str
    pattern: re.Pattern[str]
    handler: str


def _pages() -> list[Page]:
    seg = r"([^/]+)"
    table_ = [
        ("GET", r"/", "home"),
        ("GET", r"/signin", "signin_form"),
        ("POST", r"/signin", "signin"),
        ("POST", r"/signout", "signout"),
        ("GET", rf"/parcels/{seg}", "parcel"),
        ("GET", rf"/parcels/{seg}/release", "release_confirm"),
        ("POST", rf"/parcels/{seg}/release", "release"),
        ("GET", r"/admin", "admin_index"),
        ("GET", r"/admin/users", "admin_users"),
        ("GET", r"/admin/parcels", "admin_parcels"),
        ("GET", r"/admin/usage", "admin_usage"),
        ("GET", r"/admin/audit", "admin_audit"),
        ("GET", rf"/static/{seg}", "static"),
    ]
    return [Page(m, re.compile(p), h) for m, p, h in table_]


PAGES = _pages()


def release_token(lock: LockInfo) -> str:
    """Names one particular lock in the release form, so that confirming never breaks a lock that changed
    hands after the page was shown (derived from the lock id, which stays on the server)."""
    return hashlib.sha256(b"isr-web-release\0" + lock.lock_id.encode()).hexdigest()[:32]


class WebPages:
    """Page handlers; one instance per `IsrApp` (so per worker), holding nothing but the static files."""

    def __init__(self, app: "IsrApp") -> None:
        self.app = app
        self.static_files: dict[str, tuple[bytes, str]] = {}
        for path in sorted(STATIC_DIR.iterdir()):
            if path.suffix in STATIC_TYPES:
                self.static_files[path.name] = (path.read_bytes(), STATIC_TYPES[path.suffix])

    @property
    def meta(self) -> "SqlMeta":
        assert self.app.meta is not None
        return self.app.meta

    def run(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        return self.app.run(fn, *args)

    # --- plumbing ---------------------------------------------------------------------------------

    async def handle(self, request: "Request") -> "Response":
        """Answer one request for a page (never raises an `ApiError`: errors become HTML pages)."""
        from ..app import ClientGone

        try:
            response = await self._route(request)
        except SignInRequired:
            response = self.redirect("/signin")
        except ApiError as e:
            response = self.error_page(e.status, str(e))
            if e.status == 405:
                response.headers.append((b"allow", e.details.get("allow", "GET").encode()))
        except StorageError as e:
            log.error("storage failure on %s %s: %s", request.method, request.path, e)
            response = self.error_page(503, "The server's storage is unavailable right now; try again later.")
        except ClientGone:
            raise
        except Exception:
            log.exception("unexpected error on %s %s", request.method, request.path)
            response = self.error_page(500, "Something went wrong on the server.")
        response.headers.extend(SECURITY_HEADERS)
        if not any(name == b"cache-control" for name, _ in response.headers):
            response.headers.append((b"cache-control", b"no-store"))
        return response

    async def _route(self, request: "Request") -> "Response":
        method = "GET" if request.method == "HEAD" else request.method
        allowed = []
        for page in PAGES:
            match = page.pattern.fullmatch(request.path)
            if match is None:
                continue
            allowed.append(page.method)
            if page.method == method:
                handler: Callable[..., Awaitable[Response]] = getattr(self, "p_" + page.handler)
                return await handler(request, *match.groups())
        if allowed:
            from ..errors import MethodNotAllowed

            raise MethodNotAllowed(f"{request.method} is not allowed here.", allow=", ".join(sorted(set(allowed))))
        raise NotFound("There is no such page.")

    def page(self, status: int, content: Markup, headers: list[tuple[bytes, bytes]] | None = None) -> "Response":
        from ..app import Response

        return Response(status, body=content.encode("utf-8"),
                        headers=[(b"content-type", b"text/html; charset=utf-8"), *(headers or [])])

    def redirect(self, location: str, headers: list[tuple[bytes, bytes]] | None = None) -> "Response":
        """303 See Other to a path of this server (after a POST, or to the sign-in page)."""
        from ..app import Response

        assert location.startswith("/") and not location.startswith("//")
        return Response(303, headers=[(b"location", location.encode()), *(headers or [])])

    def error_page(self, status: int, message: str) -> "Response":
        titles = {400: "Bad request", 401: "Not signed in", 403: "Not allowed", 404: "Not found",
                  405: "Method not allowed", 409: "Conflict", 413: "Too large", 429: "Too many attempts",
                  500: "Server error", 503: "Unavailable"}
        body = html('<p class="error">{message}</p><p><a href="/">Back to my parcels</a></p>', message=message)
        return self.page(status, layout(titles.get(status, "Error"), body))

    @staticmethod
    def query(request: "Request") -> dict[str, str]:
        """The query string's parameters (the first value of each)."""
        raw = request.scope.get("query_string", b"").decode("latin-1")
        try:
            pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, max_num_fields=20, errors="strict")
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("The query string is malformed.") from None
        out: dict[str, str] = {}
        for key, value in pairs:
            out.setdefault(key, value)
        return out

    async def form(self, request: "Request") -> dict[str, str]:
        """The POSTed form (application/x-www-form-urlencoded, at most 64 KiB), first value of each field."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/x-www-form-urlencoded":
            raise BadRequest("Expected a form submitted from this site's pages.")
        body = await request.body(FORM_LIMIT)
        try:
            pairs = urllib.parse.parse_qsl(body.decode("ascii"), keep_blank_values=True, max_num_fields=20,
                                           errors="strict")
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("The form data is malformed.") from None
        out: dict[str, str] = {}
        for key, value in pairs:
            out.setdefault(key, value)
        return out

    # --- sessions ---------------------------------------------------------------------------------

    async def session(self, request: "Request") -> WebSession | None:
        value = sessions.cookies(request).get(sessions.SESSION_COOKIE)
        if not sessions.is_token(value):
            return None
        assert value is not None
        return await self.run(self.meta.lookup_web_session, auth.secret_hash(value))

    async def signed_in(self, request: "Request", *, admin: bool = False) -> WebSession:
        """The session of a page that needs one (GET: else off to the sign-in page)."""
        session = await self.session(request)
        if session is None:
            raise SignInRequired()
        if admin and not session.admin:
            raise Forbidden("This page is for administrators.")
        return session

    async def checked_post(self, request: "Request", *, admin: bool = False) -> tuple[WebSession, dict[str, str]]:
        """The session and form of a POST that changes something: it must come from one of our pages
        (Origin/Referer) and carry the session's CSRF token."""
        if not sessions.same_origin(request):
            log.warning("refused a cross-origin POST %s from %s (Origin %r)", request.path, request.remote,
                        request.headers.get("origin"))
            raise Forbidden("This form was not sent from a page of this server.", code="bad_origin")
        session = await self.session(request)
        if session is None:
            raise Forbidden("Your session has ended. Sign in again.", code="no_session")
        form = await self.form(request)
        if not sessions.same_token(form.get("csrf"), session.csrf):
            log.warning("refused a POST %s from %s without the right CSRF token", request.path, request.remote)
            raise Forbidden("The form's security token is missing or out of date. Reload the page and try again.",
                            code="bad_csrf")
        if admin and not session.admin:
            raise Forbidden("Only administrators may do this.")
        return session, form

    def frame(self, session: WebSession, title: str, body: Markup, *, current: str = "",
              notice: Markup | str = "", notice_kind: str = "info") -> Markup:
        return layout(title, body, user=session.user, admin=session.admin, csrf=session.csrf, current=current,
                      notice=notice, notice_kind=notice_kind)

    async def visible_parcel(self, session: WebSession, text: str) -> ParcelInfo:
        """A parcel the signed-in user owns (or any, for an administrator): 403 for another's, 404 for none."""
        parcel = await self.run(self.meta.get_parcel, names.parcel_id(text))
        if parcel.owner_id != session.user_id and not session.admin:
            raise Forbidden("This parcel belongs to another user.")
        return parcel

    # --- sign-in ----------------------------------------------------------------------------------

    def signin_page(self, request: "Request", status: int = 200, message: str = "", user: str = "",
                    headers: list[tuple[bytes, bytes]] | None = None) -> "Response":
        token = sessions.cookies(request).get(sessions.SIGNIN_COOKIE)
        if not sessions.is_token(token):
            token = sessions.new_secret()
        assert token is not None
        error = html('<p class="notice error" role="alert">{m}</p>', m=message) if message else Markup("")
        body = html(
            '<div class="signin">{error}'
            "<p>Use the user name and password of your ISR account, the same as for <code>isrctl</code>.</p>"
            '<form method="post" action="/signin" class="stacked">{csrf}'
            '<label for="user">User name</label>'
            '<input id="user" name="user" autocomplete="username" required autofocus maxlength="32" value="{user}">'
            '<label for="password">Password</label>'
            '<input id="password" name="password" type="password" autocomplete="current-password" required>'
            '<button type="submit" class="primary">Sign in</button></form></div>',
            error=error, csrf=hidden("csrf", token), user=user)
        cookie = sessions.set_cookie(sessions.SIGNIN_COOKIE, token, sessions.SIGNIN_COOKIE_SECONDS)
        return self.page(status, layout("Sign in", body), [cookie, *(headers or [])])

    async def p_signin_form(self, request: "Request") -> "Response":
        if await self.session(request) is not None:
            return self.redirect("/")
        return self.signin_page(request)

    async def p_signin(self, request: "Request") -> "Response":
        if not sessions.same_origin(request):
            log.warning("refused a cross-origin sign-in from %s (Origin %r)", request.remote,
                        request.headers.get("origin"))
            raise Forbidden("This form was not sent from a page of this server.", code="bad_origin")
        form = await self.form(request)
        user = form.get("user", "").strip()
        password = form.get("password", "")
        shown_user = user[:32]
        if not sessions.same_token(form.get("csrf"), sessions.cookies(request).get(sessions.SIGNIN_COOKIE, "")):
            return self.signin_page(request, 403, "The sign-in form had expired. Please sign in again.", shown_user)
        valid_name = names.USER_RE.fullmatch(user) is not None
        limits = auth.signin_subjects(user if valid_name else None, auth.client_address(request.scope))
        subjects = [subject for subject, _ in limits]
        wait = await self.run(self.meta.signin_wait, limits, auth.SIGNIN_WINDOW, auth.SIGNIN_DELAY)
        if wait > 0:
            minutes = max(1, round(wait / 60))
            return self.signin_page(request, 429, f"Too many failed sign-ins. Try again in {minutes} minute(s).",
                                    shown_user, [(b"retry-after", str(int(wait) + 1).encode())])
        found = await self.run(self.meta.get_user, user) if valid_name else None
        stored = found[1] if found else auth.DUMMY_HASH
        ok = len(password.encode()) <= auth.MAX_PASSWORD_BYTES and await self.run(auth.verify_password, password,
                                                                                   stored)
        if not found or not ok:
            await self.run(self.meta.signin_failed, subjects, auth.SIGNIN_WINDOW)
            log.warning("failed web sign-in for user %r from %s", user[:40], request.remote)
            return self.signin_page(request, 401, "Wrong user name or password.", shown_user)
        await self.run(self.meta.signin_succeeded, subjects[0])
        old = sessions.cookies(request).get(sessions.SESSION_COOKIE)
        if sessions.is_token(old):
            assert old is not None
            await self.run(self.meta.delete_web_session, auth.secret_hash(old))
        secret = sessions.new_secret()
        ttl = self.app.config["server.web_session_seconds"]
        await self.run(self.meta.add_web_session, auth.secret_hash(secret), found[0].id, sessions.new_secret(), ttl,
                       request.remote)
        log.info("web sign-in of %s from %s", user, request.remote)
        return self.redirect("/", [sessions.set_cookie(sessions.SESSION_COOKIE, secret, ttl),
                                   sessions.clear_cookie(sessions.SIGNIN_COOKIE)])

    async def p_signout(self, request: "Request") -> "Response":
        await self.checked_post(request)
        value = sessions.cookies(request)[sessions.SESSION_COOKIE]
        await self.run(self.meta.delete_web_session, auth.secret_hash(value))
        return self.redirect("/signin", [sessions.clear_cookie(sessions.SESSION_COOKIE)])

    # --- parcels ----------------------------------------------------------------------------------

    async def p_home(self, request: "Request") -> "Response":
        session = await self.signed_in(request)
        now = time.time()
        parcels = await self.run(self.meta.list_parcels, session.user_id)
        cards = []
        for parcel in parcels:
            versions = await self.run(self.meta.list_versions, parcel.id)
            cards.append(parcel_card(parcel, versions, version_limit=HOME_VERSIONS, now=now))
        intro = Markup("<p class=\"lead\">A parcel runs at one site at a time: the site that resumes it holds its "
                       "lock until it suspends and syncs. If you left a parcel running somewhere, you can release "
                       "its lock here.</p>")
        body = intro + (join(cards) if cards else Markup(
            '<p class="muted">You have no parcels yet. An administrator creates them with '
            "<code>isr-admin parcel create</code>.</p>"))
        return self.page(200, self.frame(session, "My parcels", Markup(body), current="/"))

    async def p_parcel(self, request: "Request", parcel_text: str) -> "Response":
        session = await self.signed_in(request)
        parcel = await self.visible_parcel(session, parcel_text)
        versions = await self.run(self.meta.list_versions, parcel.id)
        done = self.query(request).get("done")
        notice: Markup | str = ""
        if done == "released" and parcel.lock is None:
            notice = ("The lock was released. The site that held it can no longer commit; "
                      "you can resume the parcel anywhere.")
        elif done == "not-locked":
            notice = "The parcel was not locked any more: nothing was released."
        card = parcel_card(parcel, versions, show_owner=parcel.owner_id != session.user_id, heading=False)
        return self.page(200, self.frame(session, parcel.name, card, notice=notice))

    async def p_release_confirm(self, request: "Request", parcel_text: str) -> "Response":
        session = await self.signed_in(request)
        parcel = await self.visible_parcel(session, parcel_text)
        lock = parcel.lock
        if lock is None:
            body = html('<p>“{name}” is not locked: there is nothing to release.</p>'
                        '<p><a href="/parcels/{id}">Back to the parcel</a></p>', name=parcel.name, id=parcel.id)
            return self.page(200, self.frame(session, "Nothing to release", body))
        return self.page(200, self.frame(session, f"Release the lock of “{parcel.name}”?",
                                         self.release_form(session, parcel, lock)))

    def release_form(self, session: WebSession, parcel: ParcelInfo, lock: LockInfo) -> Markup:
        now = time.time()
        where = html("<strong>{site}</strong> (<strong>{host}</strong>)", site=lock.site, host=lock.host) \
            if lock.site else html("<strong>{host}</strong>", host=lock.host)
        if lock.dirty_reported is None:
            report = html("That site has not reported whether it has unsynced changes: assume it does.")
        elif not lock.dirty_chunks and not lock.dirty_bytes:
            report = html("That site last reported no unsynced changes, <time>{when}</time>. Anything it changed "
                          "after that is at stake.", when=when(lock.dirty_reported))
        else:
            report = html("That site last reported <strong>{chunks} changed chunk(s), {size}</strong> not yet synced "
                          "(<time>{when}</time>). That work will be lost to this parcel.",
                          chunks=lock.dirty_chunks or 0, size=size(lock.dirty_bytes), when=when(lock.dirty_reported))
        other = "" if lock.user == session.user else f" It is held by user {lock.user}."
        return html(
            '<div class="warning" role="alert">'
            "<p><strong>Work not yet synced at {where_text} will not be committable.</strong></p>"
            "<p>Releasing the lock does not stop the VM there. It keeps running, but from now on the server "
            "refuses every commit it tries, so whatever changed there since version {version} and was not "
            "uploaded cannot be saved to this parcel.{other}</p>"
            "<p>{report}</p>"
            "<p>Do this only if you cannot suspend the VM at that site, for example because you left it running "
            "and are now somewhere else.</p></div>"
            "<h2>The lock</h2>{details}"
            '<form method="post" action="/parcels/{id}/release" class="confirm">{csrf}{lock}'
            '<button type="submit" class="danger">Release the lock</button> '
            '<a class="button" href="/parcels/{id}">Cancel</a></form>',
            where_text=where, version=lock.version, other=other, report=report, details=lock_details(lock, now),
            id=parcel.id, csrf=hidden("csrf", session.csrf), lock=hidden("lock", release_token(lock)))

    async def p_release(self, request: "Request", parcel_text: str) -> "Response":
        session, form = await self.checked_post(request)
        parcel = await self.visible_parcel(session, parcel_text)
        lock = parcel.lock
        if lock is None:
            return self.redirect(f"/parcels/{parcel.id}?done=not-locked")
        if not sessions.same_token(form.get("lock"), release_token(lock)):
            return self.lock_changed(session, parcel, lock)
        try:
            await self.app.break_parcel_lock(request, parcel.id, session.user, "released on the web page",
                                             expect_lock_id=lock.lock_id)
        except Conflict as e:
            if e.code != "lock_changed":
                raise
            current = await self.run(self.meta.get_parcel, parcel.id)
            if current.lock is None:
                return self.redirect(f"/parcels/{parcel.id}?done=not-locked")
            return self.lock_changed(session, parcel, current.lock)
        except NotFound as e:
            if e.code != "not_locked":
                raise
            return self.redirect(f"/parcels/{parcel.id}?done=not-locked")
        return self.redirect(f"/parcels/{parcel.id}?done=released")

    def lock_changed(self, session: WebSession, parcel: ParcelInfo, lock: LockInfo) -> "Response":
        body = html("<p>The lock changed hands after you looked at it, so nothing was released. It is now held "
                    "from <strong>{host}</strong> ({site}) since <time>{since}</time>.</p>"
                    '<p><a href="/parcels/{id}/release">Look again</a></p>',
                    host=lock.host, site=lock.site or "-", since=when(lock.acquired), id=parcel.id)
        return self.page(409, self.frame(session, "The lock changed", body))

    # --- administrators ---------------------------------------------------------------------------

    async def p_admin_index(self, request: "Request") -> "Response":
        await self.signed_in(request, admin=True)
        return self.redirect("/admin/users")

    async def p_admin_users(self, request: "Request") -> "Response":
        session = await self.signed_in(request, admin=True)
        users = await self.run(self.meta.list_users)
        parcels = await self.run(self.meta.list_parcels)
        owned: dict[str, int] = {}
        locks: dict[str, int] = {}
        for parcel in parcels:
            owned[parcel.owner] = owned.get(parcel.owner, 0) + 1
            if parcel.lock is not None:
                locks[parcel.lock.user] = locks.get(parcel.lock.user, 0) + 1
        rows = [[u.name, Markup('<span class="badge">admin</span>') if u.admin else "user", timestamp(u.created),
                 owned.get(u.name, 0), locks.get(u.name, 0)] for u in users]
        body = table(["User", "Role", "Added", "Parcels", "Locks held"], rows, numeric=(3, 4)) + Markup(
            '<p class="muted">Users are added and removed with <code>isr-admin user</code>.</p>')
        return self.page(200, self.frame(session, "Users", Markup(body), current="/admin/users"))

    async def p_admin_parcels(self, request: "Request") -> "Response":
        session = await self.signed_in(request, admin=True)
        now = time.time()
        parcels = await self.run(self.meta.list_parcels)
        rows = []
        for parcel in parcels:
            versions = await self.run(self.meta.list_versions, parcel.id)
            if parcel.lock is None:
                lock_cell: Markup = Markup('<span class="badge free">free</span>')
                dirty: object = ""
            else:
                lock = parcel.lock
                lock_cell = html('<span class="badge held">locked</span> {host} ({site}) since {since}{expired}',
                                 host=lock.host, site=lock.site or "-", since=timestamp(lock.acquired, now),
                                 expired=Markup(' <span class="badge expired">expired</span>')
                                 if lock.expired(now) else Markup(""))
                dirty = "-" if lock.dirty_reported is None else \
                    f"{lock.dirty_chunks or 0} chunk(s), {size(lock.dirty_bytes)}"
            rows.append([parcel.owner, html('<a href="/parcels/{id}">{name}</a>', id=parcel.id, name=parcel.name),
                         parcel.current_version or "-", len(versions), size(sum(v.chunk_bytes for v in versions)),
                         lock_cell, dirty,
                         html('<a href="/admin/audit?parcel={id}">audit</a>', id=parcel.id)])
        body = table(["Owner", "Parcel", "Version", "Versions", "Chunk data (all versions)", "Lock", "Unsynced",
                      ""], rows, numeric=(2, 3, 4))
        return self.page(200, self.frame(session, "All parcels", body, current="/admin/parcels"))

    async def p_admin_usage(self, request: "Request") -> "Response":
        session = await self.signed_in(request, admin=True)
        data = await self.run(ops.usage, self.meta)
        ratio = f"{data['dedup_ratio']:.2f}" if data["dedup_ratio"] else "-"
        summary = html(
            '<dl class="summary">'
            "<dt>Chunks stored</dt><dd>{chunks:,}</dd>"
            "<dt>Bytes stored</dt><dd>{stored}</dd>"
            "<dt>Referenced by all versions</dt><dd>{logical}</dd>"
            "<dt>Deduplication ratio</dt><dd>{ratio}</dd></dl>",
            chunks=data["chunks"], stored=size(data["chunk_bytes"]), logical=size(data["logical_bytes"]), ratio=ratio)
        rows = [[name, u["parcels"], u["versions"], size(u["logical_bytes"]), size(u["unique_chunk_bytes"]),
                 size(u["blob_bytes"]), f"{u['dedup_ratio']:.2f}" if u["dedup_ratio"] else "-"]
                for name, u in sorted(data["users"].items())]
        per_user = table(["User", "Parcels", "Versions", "Referenced", "Unique chunks", "Blobs", "Dedup"], rows,
                         numeric=(1, 2, 3, 4, 5, 6))
        body = summary + html("<h2>Per user</h2>{t}", t=per_user) + Markup(
            '<p class="muted">Referenced: chunk bytes of every version, counted once per version. Unique: the '
            "bytes of the distinct chunks a user's versions reference. Chunks are shared between users, so the "
            "unique bytes of all users can add up to more than the bytes stored.</p>")
        return self.page(200, self.frame(session, "Storage", Markup(body), current="/admin/usage"))

    async def p_admin_audit(self, request: "Request") -> "Response":
        session = await self.signed_in(request, admin=True)
        query = self.query(request)
        wanted = query.get("parcel", "").strip()
        parcel_id: str | None = None
        if wanted:
            if "/" in wanted:
                owner, _, name = wanted.partition("/")
                parcel_id = (await self.run(self.meta.find_parcel, owner, name)).id
            else:
                parcel_id = names.parcel_id(wanted)
        before: int | None = None
        if query.get("before"):
            if not query["before"].isdigit() or len(query["before"]) > 18:
                raise BadRequest("'before' must be an audit entry number.")
            before = int(query["before"])
        entries = await self.run(self.meta.list_audit, parcel_id, AUDIT_PAGE + 1, before)
        entries = list(reversed(entries))
        more = len(entries) > AUDIT_PAGE
        entries = entries[:AUDIT_PAGE]
        labels = {p.id: f"{p.owner}/{p.name}" for p in await self.run(self.meta.list_parcels)}
        rows = []
        for e in entries:
            parcel_cell: object = "-"
            if e.parcel:
                parcel_cell = html('<a href="/admin/audit?parcel={id}" title="{id}">{label}</a>', id=e.parcel,
                                   label=labels.get(e.parcel, e.parcel[:8] + "…"))
            rows.append([e.id, html('<time>{t}</time>', t=when(e.at)), e.actor,
                         html('<span class="action act-{cls}">{a}</span>', a=e.action, cls=e.action.split(".")[0]),
                         parcel_cell, e.remote or "-", audit_detail(e.detail)])
        filter_form = html(
            '<form method="get" action="/admin/audit" class="inline">'
            '<label for="parcel">Parcel</label>'
            '<input id="parcel" name="parcel" value="{wanted}" placeholder="owner/name or UUID" size="40">'
            '<button type="submit">Filter</button> <a href="/admin/audit">all entries</a></form>', wanted=wanted)
        pager = []
        if before is not None:
            pager.append(html('<a href="/admin/audit?{q}">newest</a>',
                              q=urllib.parse.urlencode({"parcel": wanted} if wanted else {})))
        if more and entries:
            params = {"parcel": wanted} if wanted else {}
            params["before"] = str(entries[-1].id)
            pager.append(html('<a href="/admin/audit?{q}">older entries →</a>', q=urllib.parse.urlencode(params)))
        body = filter_form + table(["#", "Time", "Actor", "Action", "Parcel", "Remote", "Details"], rows,
                                   empty="no entries", numeric=(0,), css="audit") + \
            html('<p class="pager">{links}</p>', links=join(pager, " · "))
        return self.page(200, self.frame(session, "Audit log", Markup(body), current="/admin/audit"))

    # --- static files -----------------------------------------------------------------------------

    async def p_static(self, request: "Request", name: str) -> "Response":
        from ..app import Response

        found = self.static_files.get(name)
        if found is None:
            raise NotFound("There is no such file.")
        data, kind = found
        return Response(body=data, headers=[(b"content-type", kind.encode()),
                                            (b"cache-control", b"public, max-age=3600")])


__all__ = ["WebPages", "escape"]
