"""HTML for the web pages: the Jinja2 templates in ``templates/``, with autoescape, and the filters they use.

Every value that goes into a page (parcel names, host and site names, audit details, anything from a
request or the database) is HTML-escaped by Jinja2's autoescape, attributes included; no template marks
anything safe, so the only markup on a page is the templates' own. Undefined names are errors, not empty
strings. Pages carry no JavaScript: the Content-Security-Policy forbids scripts altogether.
"""
from __future__ import annotations

import datetime
import json
import shlex
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
from starlette.responses import HTMLResponse

from isrprogress import human_bytes

from ..meta import VersionInfo

APP_TITLE = "ISR lock server"
TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"


def when(ts: float | None) -> str:
    """A Unix time as ``2026-11-22 05:21:27 UTC``."""
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def ago(ts: float, now: float | None = None) -> str:
    """How long ago (or how far ahead) `ts` is, roughly: ``5 min ago``, ``in 2 h 10 min``."""
    now = time.time() if now is None else now
    delta = now - ts
    future = delta < 0
    seconds = int(abs(delta))
    if seconds < 10:
        return "just now"
    if seconds < 60:
        text = f"{seconds} s"
    elif seconds < 3600:
        text = f"{seconds // 60} min"
    elif seconds < 86400:
        text = f"{seconds // 3600} h {seconds % 3600 // 60} min"
    else:
        text = f"{seconds // 86400} days" if seconds >= 2 * 86400 else "1 day"
    return f"in {text}" if future else f"{text} ago"


def new_blob_bytes(version: VersionInfo) -> int:
    """The bytes of the blobs a version uploaded (not those it inherited from its parent)."""
    return sum(b["size"] for b in version.blobs if not b.get("inherited"))


def audit_detail(detail: Mapping[str, Any]) -> str:
    """An audit entry's details as ``key: value`` pairs; a lock record (the holder of a broken lock) is
    summarized as who held it from where, since when, at which version."""
    parts = []
    for key in sorted(detail):
        value = detail[key]
        if isinstance(value, dict) and "host" in value and "acquired" in value:
            text = f"{value.get('user')} on {value.get('host')}"
            if value.get("site"):
                text += f" ({value['site']})"
            text += f" since {when(value.get('acquired'))} at version {value.get('version')}"
            dirty = value.get("dirty")
            if isinstance(dirty, dict):
                text += f", unsynced {dirty.get('dirty_chunks')} chunk(s) / {human_bytes(dirty.get('dirty_bytes'))}"
        else:
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(", ", ": "))
        parts.append(f"{key}: {text}")
    return "; ".join(parts)


def _holder(value: Any) -> str:
    """Who held a lock, from a lock record in an audit entry's details."""
    if not isinstance(value, dict):
        return "someone"
    text = f"{value.get('user')} on {value.get('host')}"
    return text + (f" ({value['site']})" if value.get("site") else "")


def audit_what(action: str, detail: Mapping[str, Any]) -> str:
    """What an audit entry of a parcel means to its owner, in words (the "My history" page)."""
    version = detail.get("version")
    if action == "lock.acquire":
        return f"took the lock (resume or checkout) at version {version}"
    if action == "lock.release":
        return "released the lock (suspended and checked in, or gave the parcel up)"
    if action == "lock.renew":
        if "dirty_chunks" in detail:
            return (f"renewed the lock, reporting {detail['dirty_chunks']} unsynced chunk(s), "
                    f"{human_bytes(detail.get('dirty_bytes'))}")
        return "renewed the lock"
    if action == "lock.break":
        reason = detail.get("reason")
        return f"broke the lock of {_holder(detail.get('holder'))}" + (f" ({reason})" if reason else "")
    if action == "lock.refused":
        return "was refused the lock: the parcel was locked elsewhere"
    if action == "version.commit":
        return f"checked in version {version}"
    if action == "version.refused":
        return f"tried to check in, refused ({detail.get('code')})"
    if action == "version.prune":
        return f"deleted old version {version}"
    if action == "parcel.create":
        return "created the parcel"
    if action == "envelope.replace":
        return "changed the parcel's passphrase or key file"
    return action


def audit_where(detail: Mapping[str, Any]) -> str:
    """The host (and site) an audit entry names, if any."""
    host = detail.get("host")
    if not isinstance(host, str) or not host:
        return ""
    site = detail.get("site")
    return f"{host} ({site})" if isinstance(site, str) and site else host


def nav_links(admin: bool) -> list[tuple[str, str]]:
    """The navigation of a signed-in user: (path, label)."""
    links = [("/", "My parcels"), ("/history", "My history"), ("/account/password", "Password")]
    if admin:
        links += [("/admin/users", "Users"), ("/admin/parcels", "All parcels"), ("/admin/usage", "Storage"),
                  ("/admin/audit", "Audit log")]
    return links


ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), autoescape=True,
                         undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
ENV.filters.update(when=when, ago=ago, size=human_bytes, new_blob_bytes=new_blob_bytes, audit_detail=audit_detail,
                   audit_where=audit_where, shell_word=shlex.quote)
ENV.globals.update(audit_what=audit_what)
ENV.globals.update(app_title=APP_TITLE, nav_links=nav_links)


def render(template: str, status: int = 200, **context: Any) -> HTMLResponse:
    """A page from a template of ``templates/``. `context` needs at least ``title``; ``session`` (the
    signed-in `WebSession`, for the header), ``current``, ``notice`` and ``notice_kind`` are optional."""
    context.setdefault("session", None)
    context.setdefault("current", "")
    context.setdefault("notice", "")
    context.setdefault("notice_kind", "info")
    return HTMLResponse(ENV.get_template(template).render(context), status)
