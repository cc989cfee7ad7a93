"""The web pages in a real headless Chromium: sign in, find the parcel locked by a running site, release
its lock, and see the old site's commit refused; then the administrator's pages and audit log.

Screenshots of each page are written to a temporary directory; with ISR_UPDATE_SCREENSHOTS=1 (or
``doc/screenshots/make.py``) they also replace the ones in doc/screenshots/.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from isrctl.remote import LockLost, Remote
from tests.browser_fixtures import Browser, Page, chromium, spki_pin
from tests.server_fixtures import PASSWORDS, ServerEnv, start_env

pytestmark = pytest.mark.timeout(120)

SCREENSHOT_DIR = Path(__file__).resolve().parent.parent / "doc" / "screenshots"
OFFICE_HOST = "office-pc.cs.example.edu"
OFFICE_SITE = "office"
REQUIRED_BLOBS = ["manifest", "keyring.disk", "keyring.memory"]


@pytest.fixture(scope="module")
def web_env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerEnv]:
    """A server of its own (sqlite + directory), with a 15-minute lock lease as a real deployment might use."""
    env = start_env("sqlite-directory", tmp_path_factory.mktemp("web"), request,
                    **{"server.lock_lease_seconds": 900})
    try:
        yield env
    finally:
        env.server.stop()


@pytest.fixture(scope="module")
def browser(web_env: ServerEnv) -> Iterator[Browser]:
    """Headless Chromium trusting exactly this server's self-signed key."""
    cert = Path(web_env.settings["server.data_dir"]) / "tls" / "server.crt"
    with chromium((spki_pin(cert.read_bytes()),)) as started:
        yield started


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Where the screenshots go; copied to doc/screenshots/ at the end if ISR_UPDATE_SCREENSHOTS=1."""
    out = tmp_path_factory.mktemp("screenshots")
    yield out
    if os.environ.get("ISR_UPDATE_SCREENSHOTS") == "1":
        SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
        for png in sorted(out.glob("*.png")):
            shutil.copyfile(png, SCREENSHOT_DIR / png.name)


def commit_version(client: Remote, parcel: str, nonce: str, parent: int, chunks: list[bytes]) -> dict:
    tags = [hashlib.sha256(c).hexdigest() for c in chunks]
    for tag in client.missing(tags):
        client.put_chunk(tag, chunks[tags.index(tag)])
    for name in REQUIRED_BLOBS:
        client.put_blob(parcel, name, os.urandom(4096), nonce)
    return client.commit(parcel, nonce, parent, REQUIRED_BLOBS, tags)


def sign_in(page: Page, base: str, user: str, password: str | None = None) -> None:
    page.goto(base + "/signin")
    page.fill("#user", user)
    page.fill("#password", password or PASSWORDS[user])
    page.click("form.stacked button[type=submit]")
    assert page.url == base + "/", page.text()


def assert_clean(page: Page) -> None:
    """The stylesheet applied under the CSP, nothing was blocked, nothing failed to load."""
    assert page.evaluate("getComputedStyle(document.querySelector('header.top')).backgroundColor") == "rgb(31, 78, 121)"
    assert page.problems() == []


def test_release_a_lock_held_by_a_running_site(web_env: ServerEnv, browser: Browser, shots: Path) -> None:
    base = web_env.server.url
    parcel = web_env.new_parcel("alice", "workstation")
    spare = web_env.new_parcel("alice", "experiments")
    thesis = web_env.new_parcel("bob", "thesis")
    block = [os.urandom(131072 + 28) for _ in range(16)]
    with web_env.client("alice") as office:
        # The office PC resumed the parcel, suspended and synced twice, and is running again with changes.
        nonce = office.acquire(parcel, host=OFFICE_HOST, site=OFFICE_SITE)["nonce"]
        commit_version(office, parcel, nonce, 0, block[:12])
        commit_version(office, parcel, nonce, 1, block[:12] + block[12:14])
        commit_version(office, parcel, nonce, 2, block[2:16])
        office.report_dirty(parcel, nonce, 1834, 240_400_000)
        lock = office.acquire(spare, host="laptop.example.org", site="home")
        commit_version(office, spare, lock["nonce"], 0, block[:4])
        office.release(spare, lock["nonce"])
    with web_env.client("bob") as lab:  # bob's parcel stays locked in a lab, for the administrator's pages
        lab_nonce = lab.acquire(thesis, host="lab-3.example.edu", site="lab")["nonce"]
        commit_version(lab, thesis, lab_nonce, 0, block[:2] + [os.urandom(131072 + 28) for _ in range(6)])
    with web_env.client("alice") as office:

        page = browser.new_page(isolated=True)
        page.goto(base + "/")
        assert page.url == base + "/signin"
        assert "Sign in" in page.text("h1")
        page.screenshot(shots / "signin.png")
        sign_in(page, base, "alice")

        # The parcel, where it runs, since when, at which version, and what it has not synced.
        card = page.text(f"#parcel-{parcel}")
        for expected in ("workstation", "LOCKED", OFFICE_HOST, OFFICE_SITE, "At version\n3",
                         "1834 changed chunk(s), 229.3 MiB", "Version history"):
            assert expected in card, (expected, card)
        assert page.count(f"#parcel-{parcel} table.versions tbody tr") == 3
        assert "NOT LOCKED" in page.text(f"#parcel-{spare}")
        assert "thesis" not in page.text()  # bob's
        cookies = {c["name"]: c for c in page.cookies()}
        session = cookies["__Host-isr_session"]
        assert session["secure"] and session["httpOnly"] and session["sameSite"] == "Strict"
        assert page.evaluate("document.cookie") == ""  # HttpOnly: no script could read the session
        assert_clean(page)
        page.screenshot(shots / "my-parcels.png")

        # Release: first the confirmation with the warning, then the real thing.
        page.click(f"#parcel-{parcel} a.button.danger")
        assert page.url == f"{base}/parcels/{parcel}/release"
        warning = page.text(".warning")
        assert f"Work not yet synced at {OFFICE_SITE} ({OFFICE_HOST}) will not be committable." in warning
        assert "1834 changed chunk(s), 229.3 MiB" in warning
        assert_clean(page)
        page.screenshot(shots / "release-confirm.png")
        page.click("form.confirm button.danger")
        assert page.url == f"{base}/parcels/{parcel}?done=released"
        assert "The lock was released" in page.text(".notice")
        assert "NOT LOCKED" in page.text(f"#parcel-{parcel}")
        page.screenshot(shots / "released.png")
        page.goto(base + "/")
        assert "NOT LOCKED" in page.text(f"#parcel-{parcel}")

        # The office PC is still running; its next commit (with its old nonce) is refused.
        with pytest.raises(LockLost) as refused:
            commit_version(office, parcel, nonce, 3, block[:3])
        assert refused.value.status == 409 and refused.value.code == "lock_lost"
        assert office.lock_status(parcel)["locked"] is False

        page.click("form button.link")  # sign out
        assert page.url == base + "/signin"
        page.goto(base + "/")
        assert page.url == base + "/signin"


def test_administrator_sees_usage_and_the_audit_log(web_env: ServerEnv, browser: Browser, shots: Path) -> None:
    base = web_env.server.url
    page = browser.new_page(isolated=True)
    sign_in(page, base, "root")
    page.click('nav a[href="/admin/users"]')
    users = page.text("table")
    assert all(name in users for name in PASSWORDS)
    page.click('nav a[href="/admin/parcels"]')
    assert "workstation" in page.text("table") and "lab-3.example.edu" in page.text("table")
    page.screenshot(shots / "admin-parcels.png")
    page.click('nav a[href="/admin/usage"]')
    summary = page.text("dl.summary")
    assert "Deduplication ratio" in summary and "Bytes stored" in summary
    assert_clean(page)
    page.screenshot(shots / "admin-usage.png")

    page.click('nav a[href="/admin/audit"]')
    page.fill("#parcel", "alice/workstation")
    page.click("form.inline button")
    log = page.text("table.audit")
    assert "lock.break" in log and "released on the web page" in log and OFFICE_HOST in log
    assert "lock.renew" in log and "dirty_chunks: 1834" in log
    assert "experiments" not in log  # filtered to one parcel
    assert_clean(page)
    page.screenshot(shots / "admin-audit.png")


def test_hostile_names_stay_text_in_the_browser(web_env: ServerEnv, browser: Browser) -> None:
    """Runs after the screenshots: a parcel and site named like markup show up as text and run nothing."""
    base = web_env.server.url
    name = '<img src=x onerror="document.title=\'owned\'">'
    site = "<script>document.title='owned'</script>"
    parcel = web_env.new_parcel("bob", name)
    with web_env.client("bob") as client:
        client.acquire(parcel, host='"><b>host</b>', site=site)
    page = browser.new_page(isolated=True)
    sign_in(page, base, "bob")
    for path in ("/", f"/parcels/{parcel}/release"):
        page.goto(base + path)
        assert page.count("img") == 0 and page.count("main script") == 0 and page.count("main b") == 0
        assert name in page.text() and site in page.text() and '"><b>host</b>' in page.text()
        assert page.evaluate("document.title") != "owned"
        assert page.problems() == []


def test_my_history_and_rolling_back(web_env: ServerEnv, browser: Browser, shots: Path) -> None:
    """A user reads what happened to a parcel (a site left it locked, an administrator released it), then
    picks an older version to roll back to and gets the command that does it, refused while locked."""
    base = web_env.server.url
    parcel = web_env.new_parcel("alice", "diary")
    block = [os.urandom(131072 + 28) for _ in range(4)]
    with web_env.client("alice") as laptop:
        nonce = laptop.acquire(parcel, host="laptop.example.org", site="home")["nonce"]
        for parent in range(3):
            commit_version(laptop, parcel, nonce, parent, block[:parent + 2])
        laptop.release(parcel, nonce)
        nonce = laptop.acquire(parcel, host=OFFICE_HOST, site=OFFICE_SITE)["nonce"]
    with web_env.client("root") as admin:
        admin.break_lock(parcel, reason="left running over the weekend")

    page = browser.new_page(isolated=True)
    sign_in(page, base, "alice")
    page.click(f"#parcel-{parcel} a.history")
    assert page.url == f"{base}/history?parcel={parcel}"
    rows = page.text("table.history tbody").splitlines()
    assert "broke the lock of alice on" in rows[0] and OFFICE_HOST in rows[0] and "root" in rows[0], rows
    assert "left running over the weekend" in rows[0]
    assert "took the lock (resume or checkout) at version 3" in rows[1] and OFFICE_HOST in rows[1], rows
    assert [r for r in rows if "checked in version" in r][0].count("laptop.example.org (home)") == 1
    assert "renewed" not in page.text("table.history")
    assert_clean(page)
    page.screenshot(shots / "my-history.png")

    # Roll back: choose version 1 from the parcel's page.
    page.goto(base + "/")
    page.click(f"#parcel-{parcel} a.rollback")
    assert page.url == f"{base}/parcels/{parcel}/rollback"
    page.click(f'a[href="/parcels/{parcel}/rollback?version=1"]')
    assert page.text("#rollback-command pre") == "isr rollback diary 1"
    assert "commits version 4 with version 1's content" in page.text("#rollback-command")
    assert page.count("#rollback-locked") == 0
    assert_clean(page)
    page.screenshot(shots / "rollback.png")
    with web_env.client("alice") as office:
        nonce = office.acquire(parcel, host=OFFICE_HOST, site=OFFICE_SITE)["nonce"]
        page.goto(f"{base}/parcels/{parcel}/rollback?version=1")
        warning = page.text("#rollback-locked")
        assert f"is locked by alice on {OFFICE_HOST} ({OFFICE_SITE})" in warning and "release the lock" in warning
        page.click("#rollback-locked a")
        assert page.url == f"{base}/parcels/{parcel}/release"
        office.release(parcel, nonce)


def test_changing_my_password(web_env: ServerEnv, browser: Browser, shots: Path) -> None:
    """The password form: a wrong current password is refused, the right one changes it, the old one no
    longer signs in, another browser's session ends, and the new password works on the pages and the API."""
    base = web_env.server.url
    web_env.admin("user", "add", "carol", "--password-file", "-", input_text="carol-old-password\n")
    elsewhere = browser.new_page(isolated=True)
    sign_in(elsewhere, base, "carol", "carol-old-password")
    page = browser.new_page(isolated=True)
    sign_in(page, base, "carol", "carol-old-password")
    page.click('nav a[href="/account/password"]')
    assert page.url == base + "/account/password"
    assert_clean(page)
    page.screenshot(shots / "password.png")

    page.fill("#current", "not-my-password")
    page.fill("#new", "carol-new-password")
    page.fill("#again", "carol-new-password")
    page.click("form.stacked button[type=submit]")
    assert "Your current password is not right." in page.text(".notice.error")

    page.fill("#current", "carol-old-password")
    page.fill("#new", "carol-new-password")
    page.fill("#again", "carol-new-password")
    page.click("form.stacked button[type=submit]")
    assert page.url == base + "/account/password?done=changed"
    assert "Your password was changed" in page.text(".notice")
    page.goto(base + "/")
    assert page.url == base + "/"  # this browser stays signed in (with a new session)
    elsewhere.goto(base + "/")
    assert elsewhere.url == base + "/signin"  # the other one was signed out

    other = browser.new_page(isolated=True)
    other.goto(base + "/signin")
    other.fill("#user", "carol")
    other.fill("#password", "carol-old-password")
    other.click("form.stacked button[type=submit]")
    assert "Wrong user name or password" in other.text()
    sign_in(other, base, "carol", "carol-new-password")
    with web_env.server.client() as api:
        assert api.login("carol", "carol-new-password", label="test")
