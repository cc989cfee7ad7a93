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


def sign_in(page: Page, base: str, user: str) -> None:
    page.goto(base + "/signin")
    page.fill("#user", user)
    page.fill("#password", PASSWORDS[user])
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
