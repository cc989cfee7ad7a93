"""The web pages of isr-server, checked from the server side: sessions and cookies, CSRF and origin checks,
escaping, who may see and release what, and that a release from the web is the API's break.

Runs against every backend set (the pages' SQL runs on sqlite and PostgreSQL) with plain HTTP requests
over the server's real TLS. The real-browser walk-through is tests/test_web_browser.py.
"""
from __future__ import annotations

import hashlib
import os
import re
import sqlite3
import urllib.parse
import uuid
from pathlib import Path

import httpx
import pytest

from isrctl.remote import LockLost, _pinned_context
from tests.server_fixtures import PASSWORDS, ServerEnv, postgres_dsn, s3_server, server_env  # noqa: F401

pytestmark = pytest.mark.timeout(120)

SESSION_COOKIE = "__Host-isr_session"
SIGNIN_COOKIE = "__Host-isr_signin"
HOSTILE = "<script>alert('x')</script>"
HOSTILE_ATTR = '"><img src=x onerror=alert(1)>'


class Web:
    """A browser-like HTTP client for the pages: keeps cookies, sends the server's own Origin on POSTs
    (as a browser does for a form of the same site) unless told otherwise."""

    def __init__(self, env: ServerEnv) -> None:
        self.url = env.server.url
        self.http = httpx.Client(base_url=self.url, verify=_pinned_context(env.server.fingerprint), http2=True,
                                 timeout=30, follow_redirects=False)

    def __enter__(self) -> "Web":
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def get(self, path: str) -> httpx.Response:
        return self.http.get(path)

    def post(self, path: str, data: dict[str, str], *, origin: str | None = "", referer: str | None = None
             ) -> httpx.Response:
        headers = {}
        if origin is not None:
            headers["Origin"] = origin or self.url
        if referer is not None:
            headers["Referer"] = referer
        return self.http.post(path, data=data, headers=headers)

    def sign_in(self, user: str, password: str | None = None) -> httpx.Response:
        form = self.get("/signin")
        assert form.status_code == 200
        return self.post("/signin", {"user": user, "password": password or PASSWORDS[user],
                                     "csrf": self.http.cookies[SIGNIN_COOKIE]})

    def csrf(self, path: str = "/") -> str:
        """The CSRF token of the signed-in session, read from a page's sign-out form."""
        page = self.get(path)
        assert page.status_code == 200, page.text
        match = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert match, page.text
        return match.group(1)


def locked_parcel(env: ServerEnv, owner: str = "alice", name: str | None = None, host: str = "office-pc",
                  site: str = "office") -> tuple[str, str]:
    """A parcel of `owner` whose lock is held through the API by a 'running site'; returns (parcel, nonce)."""
    parcel = env.new_parcel(owner, name)
    with env.client(owner) as client:
        nonce = client.acquire(parcel, host=host, site=site)["nonce"]
    return parcel, nonce


def release_form(web: Web, parcel: str) -> dict[str, str]:
    page = web.get(f"/parcels/{parcel}/release")
    assert page.status_code == 200, page.text
    fields = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', page.text.split('class="confirm"')[1]))
    assert set(fields) == {"csrf", "lock"}, fields
    return fields


def test_signin_sets_strict_cookies_and_headers(server_env: ServerEnv) -> None:
    with Web(server_env) as web:
        form = web.get("/signin")
        assert form.status_code == 200 and form.headers["content-type"] == "text/html; charset=utf-8"
        csp = form.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src" not in csp and "frame-ancestors 'none'" in csp
        assert form.headers["x-frame-options"] == "DENY" and form.headers["x-content-type-options"] == "nosniff"
        assert form.headers["cache-control"] == "no-store"
        signed = web.sign_in("alice")
        assert signed.status_code == 303 and signed.headers["location"] == "/"
        cookies = [c for c in signed.headers.get_list("set-cookie") if c.startswith(SESSION_COOKIE + "=")]
        assert len(cookies) == 1
        flags = {part.strip().split("=")[0].lower() for part in cookies[0].split(";")[1:]}
        assert {"secure", "httponly", "samesite", "path", "max-age"} <= flags and "domain" not in flags
        assert "samesite=strict" in cookies[0].lower() and "Path=/;" in cookies[0]
        home = web.get("/")
        assert home.status_code == 200 and "My parcels" in home.text and "Signed in as <strong>alice</strong>" in home.text
        assert "<script" not in home.text.lower()  # the pages carry no script at all
        css = web.get("/static/isr.css")
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")


def test_pages_need_a_session(server_env: ServerEnv) -> None:
    parcel, _ = locked_parcel(server_env)
    with Web(server_env) as web:
        for path in ("/", f"/parcels/{parcel}", f"/parcels/{parcel}/release", "/admin/users", "/admin/audit"):
            response = web.get(path)
            assert response.status_code == 303 and response.headers["location"] == "/signin", path
        refused = web.post(f"/parcels/{parcel}/release", {"csrf": "x" * 43, "lock": "y" * 32})
        assert refused.status_code == 403
        forged = web.http.get("/", headers={"Cookie": f"{SESSION_COOKIE}={'A' * 43}"})
        assert forged.status_code == 303
    with server_env.client("alice") as alice:
        assert alice.lock_status(parcel)["locked"]


def test_wrong_password_and_signout(server_env: ServerEnv) -> None:
    with Web(server_env) as web:
        wrong = web.sign_in("alice", "not-her-password")
        assert wrong.status_code == 401 and "Wrong user name or password" in wrong.text
        assert not any(c.startswith(SESSION_COOKIE) for c in wrong.headers.get_list("set-cookie"))
        assert web.sign_in("alice").status_code == 303
        session = web.http.cookies[SESSION_COOKIE]
        token = web.csrf()
        out = web.post("/signout", {"csrf": token})
        assert out.status_code == 303 and out.headers["location"] == "/signin"
        # The old cookie is dead on the server, not just deleted in the browser.
        replay = web.http.get("/", headers={"Cookie": f"{SESSION_COOKIE}={session}"})
        assert replay.status_code == 303


def test_signin_form_is_protected_too(server_env: ServerEnv) -> None:
    with Web(server_env) as web:
        web.get("/signin")
        token = web.http.cookies[SIGNIN_COOKIE]
        # Another site cannot post a sign-in (login CSRF): wrong origin, or no form token.
        assert web.post("/signin", {"user": "alice", "password": PASSWORDS["alice"], "csrf": token},
                        origin="https://evil.example").status_code == 403
        no_token = web.post("/signin", {"user": "alice", "password": PASSWORDS["alice"]})
        assert no_token.status_code == 403 and SESSION_COOKIE not in no_token.headers.get("set-cookie", "")
        wrong_token = web.post("/signin", {"user": "alice", "password": PASSWORDS["alice"], "csrf": "z" * 43})
        assert wrong_token.status_code == 403


def test_release_needs_csrf_token_and_same_origin(server_env: ServerEnv) -> None:
    parcel, nonce = locked_parcel(server_env)
    with Web(server_env) as web, Web(server_env) as other:
        assert web.sign_in("alice").status_code == 303
        assert other.sign_in("alice").status_code == 303
        fields = release_form(web, parcel)
        path = f"/parcels/{parcel}/release"
        attempts = [
            ({"lock": fields["lock"]}, ""),                                  # no CSRF token
            ({"lock": fields["lock"], "csrf": "A" * 43}, ""),                # a wrong one
            ({"lock": fields["lock"], "csrf": other.csrf()}, ""),            # another session's
            (fields, "https://evil.example"),                                # the right token from another site
            (fields, "null"),                                                # an opaque origin
            (fields, f"{web.url}.evil.example"),                             # a look-alike origin
        ]
        for data, origin in attempts:
            refused = web.post(path, data, origin=origin)
            assert refused.status_code == 403, (data, origin, refused.text)
        # Neither Origin nor Referer: refused; a same-origin Referer alone is accepted (older browsers).
        assert web.post(path, fields, origin=None).status_code == 403
        assert web.post(path, fields, origin=None, referer="https://evil.example/x").status_code == 403
        with server_env.client("alice") as alice:
            assert alice.lock_status(parcel)["locked"], "a refused form must not have released the lock"
        done = web.post(path, fields, origin=None, referer=f"{web.url}/parcels/{parcel}/release")
        assert done.status_code == 303 and done.headers["location"] == f"/parcels/{parcel}?done=released"
    with server_env.client("alice") as alice:
        assert not alice.lock_status(parcel)["locked"]
        with pytest.raises(LockLost):
            alice.renew(parcel, nonce)


def test_release_is_the_api_break_and_the_old_site_cannot_commit(server_env: ServerEnv) -> None:
    parcel, nonce = locked_parcel(server_env, host="office-pc.example", site="office")
    with server_env.client("alice") as office:
        office.report_dirty(parcel, nonce, 7, 917504)
        tag_data = os.urandom(4096)
        tag = hashlib.sha256(tag_data).hexdigest()
        office.put_chunk(tag, tag_data)
        for name in ("manifest", "keyring.disk", "keyring.memory"):
            office.put_blob(parcel, name, os.urandom(64), nonce)
        with Web(server_env) as web:
            web.sign_in("alice")
            confirm = web.get(f"/parcels/{parcel}/release")
            assert "will not be committable" in confirm.text and "office-pc.example" in confirm.text
            assert "7 changed chunk(s), 896.0 KiB" in confirm.text
            result = web.post(f"/parcels/{parcel}/release", release_form(web, parcel))
            assert result.status_code == 303
            after = web.get(result.headers["location"])
            assert "The lock was released" in after.text and "not locked" in after.text
        with pytest.raises(LockLost) as refused:
            office.commit(parcel, nonce, 0, ["manifest", "keyring.disk", "keyring.memory"], [tag])
        assert refused.value.status == 409 and refused.value.code == "lock_lost"
    entries = server_env.admin_json("audit", "--parcel", parcel)
    broken = [e for e in entries if e["action"] == "lock.break"]
    assert len(broken) == 1 and broken[0]["actor"] == "alice"
    assert broken[0]["detail"]["reason"] == "released on the web page"
    assert broken[0]["detail"]["holder"]["host"] == "office-pc.example"


def test_release_never_breaks_a_lock_that_changed_hands(server_env: ServerEnv) -> None:
    parcel, nonce = locked_parcel(server_env, host="first-host")
    with Web(server_env) as web:
        web.sign_in("alice")
        stale = release_form(web, parcel)
        with server_env.client("alice") as client:
            taken = client.acquire(parcel, host="second-host", site="home", force=True)
            refused = web.post(f"/parcels/{parcel}/release", stale)
            assert refused.status_code == 409 and "second-host" in refused.text
            assert client.lock_status(parcel)["lock"]["host"] == "second-host"
            client.renew(parcel, taken["nonce"])  # still held by the second site
            client.release(parcel, taken["nonce"])
        gone = web.post(f"/parcels/{parcel}/release", stale)
        assert gone.status_code == 303 and gone.headers["location"].endswith("done=not-locked")


def test_names_from_clients_are_escaped(server_env: ServerEnv) -> None:
    parcel = server_env.new_parcel("alice", HOSTILE)
    with server_env.client("alice") as client:
        nonce = client.acquire(parcel, host=HOSTILE_ATTR, site=HOSTILE)["nonce"]
        client.report_dirty(parcel, nonce, 1, 1)
    with Web(server_env) as web, Web(server_env) as admin:
        web.sign_in("alice")
        admin.sign_in("root")
        pages = [web.get("/"), web.get(f"/parcels/{parcel}"), web.get(f"/parcels/{parcel}/release"),
                 admin.get("/admin/parcels"), admin.get(f"/admin/audit?parcel={parcel}"),
                 admin.get("/admin/audit?parcel=" + urllib.parse.quote(f"alice/{HOSTILE}"))]
        for page in pages:
            assert page.status_code == 200, page.url
            assert HOSTILE not in page.text and HOSTILE_ATTR not in page.text, page.url
            assert "<script" not in page.text.lower() and "<img" not in page.text.lower(), page.url
        assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in pages[0].text
        assert "&#34;&gt;&lt;img src=x onerror=alert(1)&gt;" in pages[0].text
        # A hostile value in the query string comes back escaped in the filter field.
        echoed = admin.get("/admin/audit?parcel=" + urllib.parse.quote(HOSTILE_ATTR))
        assert echoed.status_code in (400, 404) and HOSTILE_ATTR not in echoed.text
        # The rollback page's refusal names the parcel, escaped; in its command the name is one shell word.
        rollback = web.get(f"/parcels/{parcel}/rollback?version=1")
        assert rollback.status_code == 404 and "has no version 1" in rollback.text and HOSTILE not in rollback.text
    quoted = committed_parcel(server_env, "alice", 2, "it's $(rm -rf ~) <b>")
    with Web(server_env) as web:
        web.sign_in("alice")
        page = web.get(f"/parcels/{quoted}/rollback?version=1").text
        assert "<code>isr rollback &#39;it&#39;&#34;&#39;&#34;&#39;s $(rm -rf ~) &lt;b&gt;&#39; 1</code>" in page
    with server_env.client("alice") as client:
        client.release(parcel, nonce)


def test_users_see_and_release_only_their_own(server_env: ServerEnv) -> None:
    parcel, _ = locked_parcel(server_env, owner="alice", name=f"alice-only-{uuid.uuid4().hex[:6]}")
    with Web(server_env) as bob:
        bob.sign_in("bob")
        assert f"alice-only-" not in bob.get("/").text
        assert bob.get(f"/parcels/{parcel}").status_code == 403
        assert bob.get(f"/parcels/{parcel}/release").status_code == 403
        token = bob.csrf()
        refused = bob.post(f"/parcels/{parcel}/release", {"csrf": token, "lock": "0" * 32})
        assert refused.status_code == 403
        assert bob.get(f"/parcels/{uuid.uuid4()}").status_code == 404
        assert bob.get("/parcels/not-a-uuid").status_code == 400
        for path in ("/admin", "/admin/users", "/admin/parcels", "/admin/usage", "/admin/audit"):
            assert bob.get(path).status_code == 403, path
    with server_env.client("alice") as alice:
        assert alice.lock_status(parcel)["locked"]


def test_admin_pages(server_env: ServerEnv) -> None:
    parcel, nonce = locked_parcel(server_env, owner="bob", name=f"bobs-{uuid.uuid4().hex[:6]}", host="lab-host")
    with Web(server_env) as admin:
        admin.sign_in("root")
        assert admin.get("/admin").headers["location"] == "/admin/users"
        users = admin.get("/admin/users").text
        assert all(f"<td>{name}</td>" in users for name in PASSWORDS)
        parcels = admin.get("/admin/parcels").text
        assert parcel in parcels and "lab-host" in parcels
        usage = admin.get("/admin/usage").text
        assert "Bytes stored" in usage and "Deduplication ratio" in usage
        audit = admin.get(f"/admin/audit?parcel={parcel}").text
        assert "lock.acquire" in audit and "parcel.create" in audit
        # An administrator may release anyone's lock, with the same confirmation.
        admin_view = admin.get(f"/parcels/{parcel}")
        assert admin_view.status_code == 200 and "owned by <strong>bob</strong>" in admin_view.text
        assert admin.post(f"/parcels/{parcel}/release", release_form(admin, parcel)).status_code == 303
        everything = admin.get("/admin/audit").text
        assert "released on the web page" in everything
    with server_env.client("bob") as bob, pytest.raises(LockLost):
        bob.renew(parcel, nonce)


def test_audit_paging(server_env: ServerEnv) -> None:
    parcel = server_env.new_parcel("alice")
    with server_env.client("alice") as client:
        nonce = client.acquire(parcel, host="h")["nonce"]
        for _ in range(60):
            client.renew(parcel, nonce)
        client.release(parcel, nonce)
    with Web(server_env) as admin:
        admin.sign_in("root")
        first = admin.get(f"/admin/audit?parcel={parcel}").text
        ids = [int(i) for i in re.findall(r'<tr><td class="num">(\d+)</td>', first)]
        assert len(ids) == 50 and ids == sorted(ids, reverse=True) and "lock.release" in first
        older = re.search(r'href="(/admin/audit\?[^"]*before=\d+)"', first)
        assert older, first
        second = admin.get(older.group(1).replace("&amp;", "&")).text
        more = [int(i) for i in re.findall(r'<tr><td class="num">(\d+)</td>', second)]
        assert more and max(more) < min(ids) and len(ids) + len(more) == 63  # create, acquire, 60 renews, release
        assert "parcel.create" in second and "lock.release" not in second


def test_failed_signins_are_throttled(server_env: ServerEnv) -> None:
    name = "t" + uuid.uuid4().hex[:10]
    server_env.admin("user", "add", name, "--password-file", "-", input_text="right-password\n")
    with Web(server_env) as web:
        for _ in range(5):
            assert web.sign_in(name, "wrong-password").status_code == 401
        throttled = web.sign_in(name, "right-password")
        assert throttled.status_code == 429 and int(throttled.headers["retry-after"]) > 0
        assert "Too many failed sign-ins" in throttled.text
        assert not any(c.startswith(SESSION_COOKIE) for c in throttled.headers.get_list("set-cookie"))
        # Other users are not affected.
        assert web.sign_in("alice").status_code == 303


def test_unknown_pages_and_methods(server_env: ServerEnv) -> None:
    with Web(server_env) as web:
        missing = web.get("/no/such/page")
        assert missing.status_code == 404 and missing.headers["content-type"].startswith("text/html")
        for path in ("/etc/passwd", "/static/../meta.sqlite", "/static/..%2F..%2Fmeta.sqlite",
                     "/static/..%2F..%2F..%2F..%2Fetc%2Fpasswd", "/static/%2e%2e", "/static/isr.css%00.png",
                     "/static/"):
            response = web.get(path)
            assert response.status_code in (400, 404), path
            assert "root:" not in response.text and "SQLite" not in response.text, path
        assert web.http.delete("/").status_code == 405
        assert web.get("/signout").status_code == 405
        # API paths keep answering JSON.
        assert web.get("/v1/nothing").json()["code"] == "not_found"


def test_schema_1_database_is_upgraded(tmp_path: Path) -> None:
    """A database made before the web pages gets the lock report columns, the session tables and the
    versions' working-set column."""
    from server.meta.sqlite import SqliteMeta

    path = tmp_path / "meta.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE schema_info (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
        db.execute("INSERT INTO schema_info VALUES ('version', 1)")
        db.execute("CREATE TABLE locks (parcel_id TEXT PRIMARY KEY, nonce_hash TEXT NOT NULL, user_id BIGINT NOT NULL, "
                   "host TEXT NOT NULL, site TEXT NOT NULL, acquired DOUBLE PRECISION NOT NULL, "
                   "renewed DOUBLE PRECISION NOT NULL, expires DOUBLE PRECISION, version BIGINT NOT NULL)")
        db.execute("CREATE TABLE versions (parcel_id TEXT NOT NULL, version BIGINT NOT NULL, parent BIGINT, "
                   "created DOUBLE PRECISION NOT NULL, user_id BIGINT, host TEXT NOT NULL, site TEXT NOT NULL, "
                   "blobs TEXT NOT NULL, tags BLOB NOT NULL, chunk_count BIGINT NOT NULL, "
                   "chunk_bytes BIGINT NOT NULL, PRIMARY KEY (parcel_id, version))")
    meta = SqliteMeta(path)
    meta.close()
    with sqlite3.connect(path) as db:
        columns = {row[1] for row in db.execute("PRAGMA table_info(locks)")}
        version_columns = {row[1] for row in db.execute("PRAGMA table_info(versions)")}
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        version = db.execute("SELECT value FROM schema_info WHERE name = 'version'").fetchone()[0]
    assert {"dirty_chunks", "dirty_bytes", "dirty_reported"} <= columns
    assert "working_tags" in version_columns  # schema 3: the working sets of keyless hoards
    assert {"web_sessions", "signin_failures"} <= tables and version == 3
    SqliteMeta(path).close()  # opening again changes nothing


def test_server_logged_no_internal_error(server_env: ServerEnv) -> None:
    log = server_env.server.output()
    assert "unexpected error" not in log and "Traceback" not in log, log


# --- my history, rollback, password ---------------------------------------------------------------------


def committed_parcel(env: ServerEnv, owner: str, versions: int, name: str | None = None) -> str:
    """A parcel of `owner` with `versions` versions committed through the API from host 'desk' (site 'home')."""
    from tests.test_web_browser import commit_version

    parcel = env.new_parcel(owner, name or f"r-{uuid.uuid4().hex[:8]}")
    with env.client(owner) as client:
        nonce = client.acquire(parcel, host="desk", site="home")["nonce"]
        for parent in range(versions):
            commit_version(client, parcel, nonce, parent, [os.urandom(1000 + parent)])
        client.release(parcel, nonce)
    return parcel


def test_history_shows_what_happened_to_my_parcels_only(server_env: ServerEnv) -> None:
    mine = committed_parcel(server_env, "alice", 1, f"diary-{uuid.uuid4().hex[:6]}")
    theirs = committed_parcel(server_env, "bob", 1, f"bobs-{uuid.uuid4().hex[:6]}")
    with server_env.client("alice") as office:
        nonce = office.acquire(mine, host="office-pc", site="office")["nonce"]
        office.report_dirty(mine, nonce, 3, 3 << 20)
    with Web(server_env) as web, Web(server_env) as admin:
        assert web.get("/history").headers["location"] == "/signin"
        web.sign_in("alice")
        admin.sign_in("root")
        release = admin.post(f"/parcels/{mine}/release", release_form(admin, mine))
        assert release.status_code == 303
        page = web.get(f"/history?parcel={mine}")
        assert page.status_code == 200, page.text
        rows = re.findall(r"<tr><td><time>.*?</tr>", page.text)
        # Newest first: the administrator's break, the office's lock, the release and commit from the desk.
        assert "broke the lock of alice on office-pc (office) (released on the web page)" in rows[0]
        assert "<td>root</td>" in rows[0]
        assert "took the lock (resume or checkout) at version 1" in rows[1] and "office-pc (office)" in rows[1]
        assert "released the lock" in rows[2] and "checked in version 1" in rows[3] and "desk (home)" in rows[3]
        assert "renewed the lock" not in page.text  # renewals only on request
        with_renewals = web.get(f"/history?parcel={mine}&renewals=1").text
        assert "renewed the lock, reporting 3 unsynced chunk(s), 3.0 MiB" in with_renewals
        everything = web.get("/history").text
        assert mine in everything and theirs not in everything
        assert web.get(f"/history?parcel={theirs}").status_code == 404  # bob's: not in my history
        assert web.get("/history?parcel=not-a-uuid").status_code == 400
        assert web.get("/history?before=x").status_code == 400


def test_rollback_page_checks_the_version_and_the_lock(server_env: ServerEnv) -> None:
    name = f"thesis-{uuid.uuid4().hex[:6]}"
    parcel = committed_parcel(server_env, "alice", 3, name)
    with Web(server_env) as web, Web(server_env) as bob:
        web.sign_in("alice")
        choose = web.get(f"/parcels/{parcel}/rollback")
        assert choose.status_code == 200
        links = re.findall(rf'href="/parcels/{parcel}/rollback\?version=(\d+)"', choose.text)
        assert links == ["2", "1"], links  # the older versions, newest first; not the current one
        chosen = web.get(f"/parcels/{parcel}/rollback?version=1")
        assert chosen.status_code == 200
        assert f"<code>isr rollback {name} 1</code>" in chosen.text and "commits version 4" in chosen.text
        assert "sealed with the parcel" in chosen.text  # says why the server cannot do it itself
        current = web.get(f"/parcels/{parcel}/rollback?version=3")
        assert current.status_code == 409 and "already the current version" in current.text
        assert "isr rollback" not in current.text
        unknown = web.get(f"/parcels/{parcel}/rollback?version=9")
        assert unknown.status_code == 404 and "has no version 9" in unknown.text
        for bad in ("x", "-1", "1e3", "9" * 19):
            assert web.get(f"/parcels/{parcel}/rollback?version={bad}").status_code == 400, bad
        with server_env.client("alice") as office:
            nonce = office.acquire(parcel, host="office-pc", site="office")["nonce"]
            locked = web.get(f"/parcels/{parcel}/rollback?version=2")
            assert locked.status_code == 409
            assert "is locked by alice on office-pc (office)" in locked.text and f"/parcels/{parcel}/release" in locked.text
            office.release(parcel, nonce)
        with Web(server_env) as admin:
            admin.sign_in("root")
            shown = admin.get(f"/parcels/{parcel}/rollback?version=1")
            assert shown.status_code == 200 and "<strong>alice</strong>, who owns the parcel, has logged in" in shown.text
        bob.sign_in("bob")
        assert bob.get(f"/parcels/{parcel}/rollback").status_code == 403
        assert bob.get(f"/parcels/{parcel}/rollback?version=1").status_code == 403
        assert web.get(f"/parcels/{uuid.uuid4()}/rollback").status_code == 404
    assert server_env.admin_json("version", "list", parcel)[-1]["version"] == 3  # the page changed nothing


def test_password_change(server_env: ServerEnv) -> None:
    from isrctl.remote import AuthenticationFailed

    user = "pw" + uuid.uuid4().hex[:8]
    server_env.admin("user", "add", user, "--password-file", "-", input_text="first-password\n")
    with server_env.server.client() as c:
        token = c.login(user, "first-password", label="a PC")
    with Web(server_env) as web, Web(server_env) as other:
        assert web.sign_in(user, "first-password").status_code == 303
        assert other.sign_in(user, "first-password").status_code == 303
        form = web.get("/account/password")
        assert form.status_code == 200 and 'name="current"' in form.text
        csrf = web.csrf("/account/password")
        change = {"csrf": csrf, "current": "first-password", "new": "second-password", "again": "second-password"}
        # Refused: a wrong current password, new ones that differ, an empty one, another site's form, no token.
        wrong = web.post("/account/password", {**change, "current": "guess"})
        assert wrong.status_code == 403 and "current password is not right" in wrong.text
        differ = web.post("/account/password", {**change, "again": "second-passw0rd"})
        assert differ.status_code == 400 and "differ" in differ.text
        assert web.post("/account/password", {**change, "new": "", "again": ""}).status_code == 400
        assert web.post("/account/password", change, origin="https://evil.example").status_code == 403
        assert web.post("/account/password", {**change, "csrf": "A" * 43}).status_code == 403
        assert other.get("/").status_code == 200  # nothing changed so far: the other browser is still in
        done = web.post("/account/password", change)
        assert done.status_code == 303 and done.headers["location"] == "/account/password?done=changed"
        assert any(c.startswith(SESSION_COOKIE + "=") for c in done.headers.get_list("set-cookie"))
        notice = web.get(done.headers["location"])
        assert notice.status_code == 200 and "Your password was changed" in notice.text  # this browser: new session
        assert other.get("/").status_code == 303  # every other browser is signed out
    with server_env.server.client(token=token) as pc:
        assert pc.whoami()["user"] == user  # the isr client's token was kept
    with server_env.server.client() as c, pytest.raises(AuthenticationFailed):
        c.login(user, "first-password")
    with Web(server_env) as web:
        assert web.sign_in(user, "first-password").status_code == 401
        assert web.sign_in(user, "second-password").status_code == 303
        revoke = {"csrf": web.csrf(), "current": "second-password", "new": "third-password",
                  "again": "third-password", "revoke": "yes"}
        done = web.post("/account/password", revoke)
        assert done.headers["location"] == "/account/password?done=revoked"
    with server_env.server.client(token=token) as pc, pytest.raises(AuthenticationFailed):
        pc.whoami()
    changes = [e for e in server_env.admin_json("audit", "--limit", "1000")
               if e["action"] == "user.password" and e["detail"]["user"] == user]
    assert [(e["actor"], e["detail"]["tokens"]) for e in changes] == [(user, "kept"), (user, "revoked")]


def test_wrong_current_passwords_are_throttled_like_sign_ins(server_env: ServerEnv) -> None:
    user = "pt" + uuid.uuid4().hex[:8]
    server_env.admin("user", "add", user, "--password-file", "-", input_text="right-password\n")
    with Web(server_env) as web:
        web.sign_in(user, "right-password")
        csrf = web.csrf()
        guess = {"csrf": csrf, "new": "x-password", "again": "x-password"}
        for i in range(5):
            assert web.post("/account/password", {**guess, "current": f"guess-{i}"}).status_code == 403
        throttled = web.post("/account/password", {**guess, "current": "right-password"})
        assert throttled.status_code == 429 and int(throttled.headers["retry-after"]) > 0
    with Web(server_env) as web:
        assert web.sign_in(user, "right-password").status_code == 429  # the same count as sign-ins
