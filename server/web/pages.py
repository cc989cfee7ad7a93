"""The web pages of isr-server: sign-in, "My parcels", releasing a lock, and the administrator's pages.

Served by the same ASGI app and HTTPS listener as the API (the route table of `server.app` sends every
path outside ``/v<n>/`` here), signed in with the same users and passwords. Pages are rendered on the
server from Jinja2 templates with autoescape (`server.web.render`), carry no JavaScript, and go out with a
strict Content-Security-Policy. Every POST is checked for its origin and its CSRF token
(`server.web.sessions`).

Releasing a lock here breaks it exactly like the API's ``POST …/lock/break`` (`Service.break_parcel_lock`:
audited, staging dropped), so the site that held it can no longer commit.
"""
from __future__ import annotations

import hashlib
import logging
import time
import urllib.parse
from pathlib import Path

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from .. import auth, names, ops
from ..errors import BadRequest, Conflict, Forbidden, NotFound
from ..http import Endpoint, Handler, as_api_error, error_headers, read_body, remote
from ..meta import AuditEntry, LockInfo, MetaStore, ParcelInfo, WebSession
from ..service import Service
from . import sessions
from .render import render

log = logging.getLogger("server.web")

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_TYPES = {".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
FORM_LIMIT = 64 * 1024
AUDIT_PAGE = 50
HOME_VERSIONS = 8
#: A running site renews its lock every few minutes: "My history" leaves renewals out unless asked.
QUIET_ACTIONS = ("lock.renew",)

CONTENT_SECURITY_POLICY = ("default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
                           "frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
}
ERROR_TITLES = {400: "Bad request", 401: "Not signed in", 403: "Not allowed", 404: "Not found",
                405: "Method not allowed", 409: "Conflict", 413: "Too large", 429: "Too many attempts",
                500: "Server error", 503: "Unavailable"}
#: The pages' wording of the errors `server.http.as_api_error` makes of failures that are not bad input.
ERROR_MESSAGES = {"storage_unavailable": "The server's storage is unavailable right now; try again later.",
                  "internal": "Something went wrong on the server."}


#: The notice after a password change (``/account/password?done=…``).
PASSWORD_NOTICES = {
    "changed": "Your password was changed. Every other browser was signed out; the isr command on your PCs "
               "keeps working with the token it has.",
    "revoked": "Your password was changed. Every other browser was signed out, and every isr client's token was "
               "revoked: run `isr login` again on each PC.",
}


class SignInRequired(Exception):
    """The page needs a signed-in user: GET requests are sent to the sign-in page."""


def redirect(location: str) -> Response:
    """303 See Other to a path of this server (after a POST, or to the sign-in page)."""
    assert location.startswith("/") and not location.startswith("//")
    return RedirectResponse(location, 303)


def error_page(status: int, message: str) -> Response:
    return render("error.html", status, title=ERROR_TITLES.get(status, "Error"), message=message)


class PageEndpoint(Endpoint):
    """A path of the web pages: errors become HTML pages, and every answer carries the security headers
    (and ``Cache-Control: no-store`` unless it says otherwise)."""

    def error_response(self, request: Request, error: Exception) -> Response:
        if isinstance(error, SignInRequired):
            return redirect("/signin")
        api_error = as_api_error(request, error)
        response = error_page(api_error.status, ERROR_MESSAGES.get(api_error.code, str(api_error)))
        response.headers.update(error_headers(api_error))
        return response

    def finish(self, response: Response) -> None:
        secure(response)


def secure(response: Response) -> Response:
    """Add the security headers, and ``Cache-Control: no-store`` unless the response says otherwise."""
    response.headers.update(SECURITY_HEADERS)
    response.headers.setdefault("cache-control", "no-store")
    return response


def not_found() -> Response:
    """The answer for a path outside the API that no page has."""
    return secure(error_page(404, "There is no such page."))


def release_token(lock: LockInfo) -> str:
    """Names one particular lock in the release form, so that confirming never breaks a lock that changed
    hands after the page was shown (derived from the lock id, which stays on the server)."""
    return hashlib.sha256(b"isr-web-release\0" + lock.lock_id.encode()).hexdigest()[:32]


def audit_before(request: Request) -> int | None:
    """The ``before`` query parameter of an audit page: show entries older than this entry number."""
    text = request.query_params.get("before")
    if not text:
        return None
    if not text.isdigit() or len(text) > 18:
        raise BadRequest("'before' must be an audit entry number.")
    return int(text)


def audit_pager(path: str, filtered: dict[str, str], before: int | None, entries: list[AuditEntry]
                ) -> tuple[list[AuditEntry], str | None, str | None]:
    """One page of an audit list fetched newest first with one entry too many: (the page, the link to
    the newest entries or None, the link to older ones or None)."""
    more = len(entries) > AUDIT_PAGE
    entries = entries[:AUDIT_PAGE]
    newest_url = f"{path}?{urllib.parse.urlencode(filtered)}" if before is not None else None
    older_url = None
    if more and entries:
        older_url = f"{path}?{urllib.parse.urlencode({**filtered, 'before': str(entries[-1].id)})}"
    return entries, newest_url, older_url


async def read_form(request: Request) -> dict[str, str]:
    """The POSTed form (application/x-www-form-urlencoded, at most 64 KiB), first value of each field."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise BadRequest("Expected a form submitted from this site's pages.")
    body = await read_body(request, FORM_LIMIT)
    try:
        pairs = urllib.parse.parse_qsl(body.decode("ascii"), keep_blank_values=True, max_num_fields=20,
                                       errors="strict")
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("The form data is malformed.") from None
    out: dict[str, str] = {}
    for key, value in pairs:
        out.setdefault(key, value)
    return out


class WebPages:
    """Page handlers, one instance per worker process, holding nothing but the static files."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.run = service.run
        self.static_files: dict[str, tuple[bytes, str]] = {}
        for path in sorted(STATIC_DIR.iterdir()):
            if path.suffix in STATIC_TYPES:
                self.static_files[path.name] = (path.read_bytes(), STATIC_TYPES[path.suffix])

    @staticmethod
    def endpoint(**handlers: Handler) -> PageEndpoint:
        """An entry of the route table (`server.app`)."""
        return PageEndpoint(**handlers)

    @property
    def meta(self) -> MetaStore:
        return self.service.meta

    # --- sessions ---------------------------------------------------------------------------------

    async def session(self, request: Request) -> WebSession | None:
        value = sessions.cookie_token(request, sessions.SESSION_COOKIE)
        if value is None:
            return None
        return await self.run(self.meta.lookup_web_session, auth.secret_hash(value))

    async def signed_in(self, request: Request, *, admin: bool = False) -> WebSession:
        """The session of a page that needs one (GET: else off to the sign-in page)."""
        session = await self.session(request)
        if session is None:
            raise SignInRequired()
        if admin and not session.admin:
            raise Forbidden("This page is for administrators.")
        return session

    async def checked_post(self, request: Request) -> tuple[WebSession, dict[str, str]]:
        """The session and form of a POST that changes something: it must come from one of our pages
        (Origin/Referer) and carry the session's CSRF token."""
        if not sessions.same_origin(request):
            log.warning("refused a cross-origin POST %s from %s (Origin %r)", request.url.path, remote(request),
                        request.headers.get("origin"))
            raise Forbidden("This form was not sent from a page of this server.", code="bad_origin")
        session = await self.session(request)
        if session is None:
            raise Forbidden("Your session has ended. Sign in again.", code="no_session")
        form = await read_form(request)
        if not sessions.same_token(form.get("csrf"), session.csrf):
            log.warning("refused a POST %s from %s without the right CSRF token", request.url.path, remote(request))
            raise Forbidden("The form's security token is missing or out of date. Reload the page and try again.",
                            code="bad_csrf")
        return session, form

    async def visible_parcel(self, session: WebSession, text: str) -> ParcelInfo:
        """A parcel the signed-in user owns (or any, for an administrator): 403 for another's, 404 for none."""
        parcel = await self.run(self.meta.get_parcel, names.parcel_id(text))
        if parcel.owner_id != session.user_id and not session.admin:
            raise Forbidden("This parcel belongs to another user.")
        return parcel

    # --- sign-in ----------------------------------------------------------------------------------

    def signin_page(self, request: Request, status: int = 200, message: str = "", user: str = "") -> Response:
        token = sessions.cookie_token(request, sessions.SIGNIN_COOKIE) or sessions.new_secret()
        response = render("signin.html", status, title="Sign in", token=token, message=message, user=user)
        sessions.set_cookie(response, sessions.SIGNIN_COOKIE, token, sessions.SIGNIN_COOKIE_SECONDS)
        return response

    async def signin_form(self, request: Request) -> Response:
        if await self.session(request) is not None:
            return redirect("/")
        return self.signin_page(request)

    async def signin(self, request: Request) -> Response:
        if not sessions.same_origin(request):
            log.warning("refused a cross-origin sign-in from %s (Origin %r)", remote(request),
                        request.headers.get("origin"))
            raise Forbidden("This form was not sent from a page of this server.", code="bad_origin")
        form = await read_form(request)
        user = form.get("user", "").strip()
        password = form.get("password", "")
        shown_user = user[:32]
        if not sessions.same_token(form.get("csrf"), request.cookies.get(sessions.SIGNIN_COOKIE, "")):
            return self.signin_page(request, 403, "The sign-in form had expired. Please sign in again.", shown_user)
        valid_name = names.USER_RE.fullmatch(user) is not None
        limits = auth.signin_subjects(user if valid_name else None, auth.client_address(request.scope))
        subjects = [subject for subject, _ in limits]
        wait = await self.run(self.meta.signin_wait, limits, auth.SIGNIN_WINDOW, auth.SIGNIN_DELAY)
        if wait > 0:
            minutes = max(1, round(wait / 60))
            response = self.signin_page(request, 429, f"Too many failed sign-ins. Try again in {minutes} minute(s).",
                                        shown_user)
            response.headers["retry-after"] = str(int(wait) + 1)
            return response
        found = await self.run(self.meta.get_user, user) if valid_name else None
        stored = found[1] if found else auth.DUMMY_HASH
        ok = len(password.encode()) <= auth.MAX_PASSWORD_BYTES and await self.run(auth.verify_password, password,
                                                                                   stored)
        if not found or not ok:
            await self.run(self.meta.signin_failed, subjects, auth.SIGNIN_WINDOW)
            log.warning("failed web sign-in for user %r from %s", user[:40], remote(request))
            return self.signin_page(request, 401, "Wrong user name or password.", shown_user)
        await self.run(self.meta.signin_succeeded, subjects[0])
        old = sessions.cookie_token(request, sessions.SESSION_COOKIE)
        if old is not None:
            await self.run(self.meta.delete_web_session, auth.secret_hash(old))
        log.info("web sign-in of %s from %s", user, remote(request))
        response = await self.start_session(request, found[0].id, "/")
        sessions.clear_cookie(response, sessions.SIGNIN_COOKIE)
        return response

    async def start_session(self, request: Request, user_id: int, location: str) -> Response:
        """A new session for this browser (a new secret and CSRF token), and the redirect that sets it."""
        secret = sessions.new_secret()
        ttl = self.service.config["server.web_session_seconds"]
        await self.run(self.meta.add_web_session, auth.secret_hash(secret), user_id, sessions.new_secret(), ttl,
                       remote(request))
        response = redirect(location)
        sessions.set_cookie(response, sessions.SESSION_COOKIE, secret, ttl)
        return response

    async def signout(self, request: Request) -> Response:
        await self.checked_post(request)
        value = sessions.cookie_token(request, sessions.SESSION_COOKIE)
        assert value is not None  # checked_post found the session
        await self.run(self.meta.delete_web_session, auth.secret_hash(value))
        response = redirect("/signin")
        sessions.clear_cookie(response, sessions.SESSION_COOKIE)
        return response

    # --- parcels ----------------------------------------------------------------------------------

    async def home(self, request: Request) -> Response:
        session = await self.signed_in(request)
        parcels = await self.run(self.meta.list_parcels, session.user_id)
        cards = [(parcel, await self.run(self.meta.list_versions, parcel.id)) for parcel in parcels]
        return render("home.html", title="My parcels", session=session, current="/", cards=cards,
                      version_limit=HOME_VERSIONS, now=time.time())

    async def parcel(self, request: Request, parcel: str) -> Response:
        session = await self.signed_in(request)
        found = await self.visible_parcel(session, parcel)
        versions = await self.run(self.meta.list_versions, found.id)
        done = request.query_params.get("done")
        notice = ""
        if done == "released" and found.lock is None:
            notice = ("The lock was released. The site that held it can no longer commit; "
                      "you can resume the parcel anywhere.")
        elif done == "not-locked":
            notice = "The parcel was not locked any more: nothing was released."
        return render("parcel.html", title=found.name, session=session, notice=notice, parcel=found,
                      versions=versions, show_owner=found.owner_id != session.user_id, now=time.time())

    async def release_confirm(self, request: Request, parcel: str) -> Response:
        session = await self.signed_in(request)
        found = await self.visible_parcel(session, parcel)
        lock = found.lock
        title = "Nothing to release" if lock is None else f"Release the lock of “{found.name}”?"
        return render("release.html", title=title, session=session, parcel=found, lock=lock,
                      release_token=release_token(lock) if lock else "", now=time.time())

    async def release(self, request: Request, parcel: str) -> Response:
        session, form = await self.checked_post(request)
        found = await self.visible_parcel(session, parcel)
        lock = found.lock
        if lock is None:
            return redirect(f"/parcels/{found.id}?done=not-locked")
        if not sessions.same_token(form.get("lock"), release_token(lock)):
            return self.lock_changed(session, found, lock)
        try:
            await self.service.break_parcel_lock(remote(request), found.id, session.user, "released on the web page",
                                                 expect_lock_id=lock.lock_id)
        except Conflict as e:
            if e.code != "lock_changed":
                raise
            current = await self.run(self.meta.get_parcel, found.id)
            if current.lock is None:
                return redirect(f"/parcels/{found.id}?done=not-locked")
            return self.lock_changed(session, found, current.lock)
        except NotFound as e:
            if e.code != "not_locked":
                raise
            return redirect(f"/parcels/{found.id}?done=not-locked")
        return redirect(f"/parcels/{found.id}?done=released")

    @staticmethod
    def lock_changed(session: WebSession, parcel: ParcelInfo, lock: LockInfo) -> Response:
        return render("lock_changed.html", 409, title="The lock changed", session=session, parcel=parcel, lock=lock)

    async def rollback(self, request: Request, parcel: str) -> Response:
        """Rolling back to a chosen version: what it takes, checked against the lock as `isr rollback` does.

        The server cannot make the new version itself: its manifest must be sealed under the parcel key,
        which never reaches the server (doc/parcel-format.md, threat model; a server that could turn an old
        version into the newest could also replay old versions unnoticed). So the page checks the choice
        (a known, older version; the lock) and gives the `isr rollback` command that does it.
        """
        session = await self.signed_in(request)
        found = await self.visible_parcel(session, parcel)
        versions = await self.run(self.meta.list_versions, found.id)
        text = request.query_params.get("version")
        chosen = None
        status = 200
        if text is not None:
            if not text.isdigit() or len(text) > 18:
                raise BadRequest("'version' must be a version number.")
            chosen = next((v for v in versions if v.version == int(text)), None)
            if chosen is None:
                raise NotFound(f"“{found.name}” has no version {int(text)}.", code="no_version")
            if chosen.version == found.current_version or found.lock is not None:
                status = 409
        title = f"Roll back “{found.name}”" if chosen is None else f"Roll back “{found.name}” to version {chosen.version}"
        return render("rollback.html", status, title=title, session=session, parcel=found, versions=versions,
                      chosen=chosen, show_owner=found.owner_id != session.user_id, now=time.time())

    # --- my history and my account ----------------------------------------------------------------

    async def history(self, request: Request) -> Response:
        """The audit trail of my own parcels: who took and released their locks, checked in, broke a lock,
        from where and when."""
        session = await self.signed_in(request)
        mine = {p.id: p.name for p in await self.run(self.meta.list_parcels, session.user_id)}
        wanted = request.query_params.get("parcel", "").strip()
        parcel_id = names.parcel_id(wanted) if wanted else None
        if parcel_id is not None and parcel_id not in mine:
            raise NotFound("You have no such parcel.")
        renewals = request.query_params.get("renewals") == "1"
        before = audit_before(request)
        fetched = await self.run(self.meta.list_audit, parcel_id, AUDIT_PAGE + 1, before, owner_id=session.user_id,
                                 skip_actions=() if renewals else QUIET_ACTIONS)
        filtered = {**({"parcel": parcel_id} if parcel_id else {}), **({"renewals": "1"} if renewals else {})}
        entries, newest_url, older_url = audit_pager("/history", filtered, before, list(reversed(fetched)))
        return render("history.html", title="My history", session=session, current="/history", entries=entries,
                      mine=mine, wanted=parcel_id or "", renewals=renewals, newest_url=newest_url,
                      older_url=older_url)

    def password_page(self, session: WebSession, status: int = 200, message: str = "", notice: str = "",
                      revoke: bool = False) -> Response:
        return render("password.html", status, title="Change your password", session=session,
                      current="/account/password", message=message, notice=notice, revoke=revoke)

    async def password_form(self, request: Request) -> Response:
        session = await self.signed_in(request)
        notice = PASSWORD_NOTICES.get(request.query_params.get("done", ""), "")
        return self.password_page(session, notice=notice)

    async def change_password(self, request: Request) -> Response:
        """Change the signed-in user's password: the current one is checked (and a wrong one counts as a
        failed sign-in), every web session ends and this browser gets a new one; API tokens are revoked
        only if the user asks (a running site would otherwise be unable to check in)."""
        session, form = await self.checked_post(request)
        current, new, again = form.get("current", ""), form.get("new", ""), form.get("again", "")
        revoke = form.get("revoke") == "yes"
        limits = auth.signin_subjects(session.user, auth.client_address(request.scope))
        wait = await self.run(self.meta.signin_wait, limits, auth.SIGNIN_WINDOW, auth.SIGNIN_DELAY)
        if wait > 0:
            response = self.password_page(session, 429, f"Too many wrong passwords. Try again in "
                                                        f"{max(1, round(wait / 60))} minute(s).", revoke=revoke)
            response.headers["retry-after"] = str(int(wait) + 1)
            return response
        found = await self.run(self.meta.get_user, session.user)
        stored = found[1] if found else auth.DUMMY_HASH
        ok = len(current.encode()) <= auth.MAX_PASSWORD_BYTES and await self.run(auth.verify_password, current, stored)
        if not found or not ok:
            await self.run(self.meta.signin_failed, [subject for subject, _ in limits], auth.SIGNIN_WINDOW)
            log.warning("wrong current password in a password change by %s from %s", session.user, remote(request))
            return self.password_page(session, 403, "Your current password is not right.", revoke=revoke)
        problem = ("Type a new password." if not new else
                   "The two new passwords differ." if new != again else
                   f"The new password is longer than {auth.MAX_PASSWORD_BYTES} bytes."
                   if len(new.encode()) > auth.MAX_PASSWORD_BYTES else
                   "The new password is the same as the current one." if new == current else "")
        if problem:
            return self.password_page(session, 400, problem, revoke=revoke)
        await self.run(self.meta.signin_succeeded, limits[0][0])
        pwhash = await self.run(auth.hash_password, new)
        await self.run(self.meta.set_password, session.user, pwhash, actor=session.user, remote=remote(request),
                       revoke_tokens=revoke)
        self.service.audit_line(remote(request), session.user, "user.password", "-",
                                tokens="revoked" if revoke else "kept")
        return await self.start_session(request, session.user_id,
                                        "/account/password?done=" + ("revoked" if revoke else "changed"))

    # --- administrators ---------------------------------------------------------------------------

    async def admin_index(self, request: Request) -> Response:
        await self.signed_in(request, admin=True)
        return redirect("/admin/users")

    async def admin_users(self, request: Request) -> Response:
        session = await self.signed_in(request, admin=True)
        users = await self.run(self.meta.list_users)
        owned: dict[str, int] = {}
        locks: dict[str, int] = {}
        for parcel in await self.run(self.meta.list_parcels):
            owned[parcel.owner] = owned.get(parcel.owner, 0) + 1
            if parcel.lock is not None:
                locks[parcel.lock.user] = locks.get(parcel.lock.user, 0) + 1
        return render("admin_users.html", title="Users", session=session, current="/admin/users", users=users,
                      owned=owned, locks=locks, now=time.time())

    async def admin_parcels(self, request: Request) -> Response:
        session = await self.signed_in(request, admin=True)
        parcels = await self.run(self.meta.list_parcels)
        rows = [(parcel, await self.run(self.meta.list_versions, parcel.id)) for parcel in parcels]
        return render("admin_parcels.html", title="All parcels", session=session, current="/admin/parcels",
                      rows=rows, now=time.time())

    async def admin_usage(self, request: Request) -> Response:
        session = await self.signed_in(request, admin=True)
        usage = await self.run(ops.usage, self.meta)
        return render("admin_usage.html", title="Storage", session=session, current="/admin/usage", usage=usage)

    async def admin_audit(self, request: Request) -> Response:
        session = await self.signed_in(request, admin=True)
        wanted = request.query_params.get("parcel", "").strip()
        parcel_id: str | None = None
        if wanted:
            if "/" in wanted:
                owner, _, name = wanted.partition("/")
                parcel_id = (await self.run(self.meta.find_parcel, owner, name)).id
            else:
                parcel_id = names.parcel_id(wanted)
        before = audit_before(request)
        fetched = await self.run(self.meta.list_audit, parcel_id, AUDIT_PAGE + 1, before)
        labels = {p.id: f"{p.owner}/{p.name}" for p in await self.run(self.meta.list_parcels)}
        entries, newest_url, older_url = audit_pager("/admin/audit", {"parcel": wanted} if wanted else {}, before,
                                                     list(reversed(fetched)))
        return render("admin_audit.html", title="Audit log", session=session, current="/admin/audit",
                      entries=entries, labels=labels, wanted=wanted, newest_url=newest_url, older_url=older_url)

    # --- static files -----------------------------------------------------------------------------

    async def static(self, request: Request, name: str) -> Response:
        found = self.static_files.get(name)
        if found is None:
            raise NotFound("There is no such file.")
        data, kind = found
        return Response(data, headers={"content-type": kind, "cache-control": "public, max-age=3600"})
