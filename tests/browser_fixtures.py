"""A real headless Chromium for the web page tests, driven over the DevTools protocol on a pipe.

Chromium is Debian's ``/usr/bin/chromium``, started with ``--remote-debugging-pipe``: it reads DevTools
(CDP) commands as NUL-terminated JSON on file descriptor 3 and writes replies and events on descriptor 4.
That needs no driver binary, no Node and no Python package: `Browser` is the whole client. Pages are
used the way a person would: real navigation, mouse clicks at an element's position, typed text.

The server's self-signed certificate is trusted by pinning its public key
(``--ignore-certificate-errors-spki-list``), so every other certificate error still fails, and secure
(``__Host-``) cookies behave as on any HTTPS site. A browser that does not start fails the test with its
output; nothing is skipped.
"""
from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("ISR_CHROMIUM", "/usr/bin/chromium")
START_TIMEOUT = 30.0
COMMAND_TIMEOUT = 30.0
WINDOW = (1200, 900)
# The flags this machine needs (doc: .library machines/polyglot.md): no sandbox as root, no GPU, and no
# background connections, which a closed network refuses.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--disable-extensions", "--hide-scrollbars", "--mute-audio",
         "--force-device-scale-factor=1", "--lang=en-US", "--remote-debugging-pipe")


class BrowserError(Exception):
    """The browser failed, answered a command with an error, or did not do something in time."""


def spki_pin(cert_pem: bytes) -> str:
    """base64(SHA-256(SubjectPublicKeyInfo)) of a PEM certificate, as Chromium's SPKI allow-list wants it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(cert_pem)
    spki = cert.public_key().public_bytes(serialization.Encoding.DER,
                                          serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


class Browser:
    """One Chromium process and the CDP connection to it."""

    def __init__(self, profile: Path, spki_pins: tuple[str, ...] = ()) -> None:
        self.profile = profile
        self.spki_pins = spki_pins
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr_path = profile.parent / f"{profile.name}.stderr"
        self._write_fd = -1
        self._read_fd = -1
        self._next_id = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self._reader: threading.Thread | None = None
        self._closed = False

    # --- process ----------------------------------------------------------------------------------

    def start(self) -> "Browser":
        to_browser_r, to_browser_w = os.pipe()
        from_browser_r, from_browser_w = os.pipe()
        # Chromium wants its ends as fds 3 and 4. Move them above 9 first, then let bash put them in place
        # (bash, unlike dash, can redirect descriptors above 9).
        child_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD_CLOEXEC, 10)
        child_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(to_browser_r)
        os.close(from_browser_w)
        args = [CHROMIUM, *FLAGS, f"--user-data-dir={self.profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}"]
        if self.spki_pins:
            args.append("--ignore-certificate-errors-spki-list=" + ",".join(self.spki_pins))
        args.append("about:blank")
        script = f'exec "$0" "$@" 3<&{child_r} 4>&{child_w} {child_r}<&- {child_w}>&-'
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(["/bin/bash", "-c", script, *args], stdin=subprocess.DEVNULL,
                                         stdout=err, stderr=err, pass_fds=(child_r, child_w),
                                         start_new_session=True)
        os.close(child_r)
        os.close(child_w)
        self._write_fd, self._read_fd = to_browser_w, from_browser_r
        self._reader = threading.Thread(target=self._read_loop, name="cdp-reader", daemon=True)
        self._reader.start()
        version = self.send("Browser.getVersion", timeout=START_TIMEOUT)
        self.version = version["product"]
        return self

    def output(self) -> str:
        with contextlib.suppress(OSError):
            return self.stderr_path.read_text(errors="replace")[-4000:]
        return ""

    def close(self) -> None:
        if self.proc is None or self._closed:
            return
        self._closed = True
        with contextlib.suppress(BrowserError, OSError):
            self.send("Browser.close", timeout=5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=10)
        for fd in (self._write_fd, self._read_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    # --- the protocol -----------------------------------------------------------------------------

    def _read_loop(self) -> None:
        buffer = b""
        while True:
            try:
                data = os.read(self._read_fd, 1 << 16)
            except OSError:
                data = b""
            if not data:
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
                return
            buffer += data
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                message = json.loads(raw)
                with self._cond:
                    if "id" in message:
                        self._replies[message["id"]] = message
                    else:
                        self.events.append(message)
                    self._cond.notify_all()

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = COMMAND_TIMEOUT) -> dict[str, Any]:
        """Send one command and wait for its reply; `BrowserError` on an error reply or a timeout."""
        with self._lock:
            self._next_id += 1
            ident = self._next_id
        message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        try:
            while data:
                data = data[os.write(self._write_fd, data):]
        except OSError as e:
            raise BrowserError(f"{method}: cannot write to the browser: {e}") from None
        deadline = time.monotonic() + timeout
        with self._cond:
            while ident not in self._replies:
                left = deadline - time.monotonic()
                if self._closed:
                    raise BrowserError(f"{method}: the browser exited without answering")
                if left <= 0:
                    raise BrowserError(f"{method}: no answer from the browser within {timeout:.0f} s")
                self._cond.wait(left)
            reply = self._replies.pop(ident)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')} {reply['error'].get('data', '')}".strip())
        return reply.get("result", {})

    def wait_event(self, method: str, session: str | None, after: int, timeout: float = COMMAND_TIMEOUT
                   ) -> dict[str, Any]:
        """The first event `method` (of `session`) that arrived after event number `after`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self.events[after:]:
                    if event.get("method") == method and event.get("sessionId") == session:
                        return event
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise BrowserError(f"no {method} event within {timeout:.0f} s")
                self._cond.wait(left)

    def new_page(self, isolated: bool = False) -> "Page":
        """A new tab; `isolated`: in a browser context of its own (no cookies shared with other tabs)."""
        params: dict[str, Any] = {"url": "about:blank"}
        if isolated:
            params["browserContextId"] = self.send("Target.createBrowserContext")["browserContextId"]
        target = self.send("Target.createTarget", params)["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        for domain in ("Page", "Runtime", "Log", "Network"):
            page.send(f"{domain}.enable")
        page.send("Emulation.setDeviceMetricsOverride",
                  {"width": WINDOW[0], "height": WINDOW[1], "deviceScaleFactor": 1, "mobile": False})
        return page


class Page:
    """One tab: navigate, read, type, click, screenshot."""

    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session

    def send(self, method: str, params: dict[str, Any] | None = None, timeout: float = COMMAND_TIMEOUT
             ) -> dict[str, Any]:
        return self.browser.send(method, params, self.session, timeout)

    def _mark(self) -> int:
        with self.browser._cond:
            return len(self.browser.events)

    def goto(self, url: str) -> None:
        mark = self._mark()
        result = self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise BrowserError(f"cannot open {url}: {result['errorText']}")
        self.browser.wait_event("Page.loadEventFired", self.session, mark)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (run by the test through the DevTools
        protocol; the pages themselves carry no script)."""
        reply = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in reply:
            raise BrowserError(f"evaluating {expression!r}: {reply['exceptionDetails'].get('text')}")
        return reply["result"].get("value")

    @property
    def url(self) -> str:
        return str(self.evaluate("location.href"))

    def text(self, selector: str = "body") -> str:
        value = self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                              "return e ? e.innerText : null; })()")
        if value is None:
            raise BrowserError(f"no element {selector} on {self.url}")
        return str(value)

    def count(self, selector: str) -> int:
        return int(self.evaluate(f"document.querySelectorAll({json.dumps(selector)}).length"))

    def fill(self, selector: str, text: str) -> None:
        """Focus a field, clear it and type `text` into it."""
        ok = self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return false; "
                           "e.focus(); e.select && e.select(); return true; })()")
        if not ok:
            raise BrowserError(f"no field {selector} on {self.url}")
        self.send("Input.dispatchKeyEvent", {"type": "keyDown", "key": "Backspace", "code": "Backspace",
                                             "windowsVirtualKeyCode": 8})
        self.send("Input.dispatchKeyEvent", {"type": "keyUp", "key": "Backspace", "code": "Backspace",
                                             "windowsVirtualKeyCode": 8})
        self.send("Input.insertText", {"text": text})

    def click(self, selector: str, navigates: bool = True) -> None:
        """Click the middle of an element with the mouse; wait for the page it leads to."""
        where = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return null; "
            "e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect(); "
            "return [r.left + r.width / 2, r.top + r.height / 2]; })()")
        if where is None:
            raise BrowserError(f"nothing to click at {selector} on {self.url}")
        x, y = where
        mark = self._mark()
        self.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1})
        if navigates:
            self.browser.wait_event("Page.loadEventFired", self.session, mark)

    def screenshot(self, path: Path) -> Path:
        """A PNG of the whole page (as tall as its content), at the window's width."""
        # The body's own height: the document is never shorter than the window, the content may be.
        height = int(max(self.evaluate("Math.ceil(document.body.getBoundingClientRect().height)") or 0, 200))
        data = self.send("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": WINDOW[0], "height": height, "scale": 1}})["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def cookies(self) -> list[dict[str, Any]]:
        return self.send("Network.getCookies")["cookies"]

    def problems(self) -> list[str]:
        """Errors the browser logged for this page: CSP violations, failed loads, script errors."""
        out = []
        with self.browser._cond:
            events = list(self.browser.events)
        for event in events:
            if event.get("sessionId") != self.session:
                continue
            if event["method"] == "Log.entryAdded" and event["params"]["entry"]["level"] == "error":
                entry = event["params"]["entry"]
                out.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip())
            elif event["method"] == "Runtime.exceptionThrown":
                out.append("exception: " + event["params"]["exceptionDetails"].get("text", ""))
        return out


@contextlib.contextmanager
def chromium(spki_pins: tuple[str, ...] = ()) -> Iterator[Browser]:
    """A started browser with a fresh profile; `pytest.fail` (never skip) if it cannot start."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: run ./bootstrap setup (it installs Debian's chromium package)")
    base = Path(tempfile.mkdtemp(prefix="isr-chromium-"))
    browser = Browser(base / "profile", spki_pins)
    try:
        try:
            browser.start()
        except (BrowserError, OSError) as e:
            browser.close()
            pytest.fail(f"headless Chromium did not start ({e}):\n{browser.output()}")
        yield browser
    finally:
        browser.close()
        shutil.rmtree(base, ignore_errors=True)
