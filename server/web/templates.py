"""HTML for the web pages: an escaping formatter, the page layout, and the pieces the pages share.

Every value that goes into a page passes through `html`, which escapes it unless it is already `Markup`
(HTML this module built). Templates are string literals in this package only; nothing that comes from a
request, the database or a client (parcel names, host and site names, audit details) is ever treated as
markup. Pages carry no JavaScript: the Content-Security-Policy forbids scripts altogether.
"""
from __future__ import annotations

import datetime
import html as _html
import json
import string
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..meta import LockInfo, ParcelInfo, VersionInfo
from ..progress import human_size as size

APP_TITLE = "ISR lock server"


class Markup(str):
    """A string that is already HTML and must not be escaped again."""

    def __add__(self, other: str) -> "Markup":
        return Markup(str.__add__(self, escape(other)))

    def __radd__(self, other: str) -> "Markup":
        return Markup(str.__add__(escape(other), self))


def escape(value: object) -> Markup:
    """`value` as text in HTML (quotes escaped too, so it is safe in attribute values)."""
    if isinstance(value, Markup):
        return value
    return Markup(_html.escape(str(value), quote=True))


class _EscapingFormatter(string.Formatter):
    def format_field(self, value: Any, format_spec: str) -> str:
        if isinstance(value, Markup) and not format_spec:
            return value
        return escape(format(value, format_spec))

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion is not None:
            raise ValueError("templates take no !r/!s/!a conversions")
        return value


_FORMATTER = _EscapingFormatter()


def html(template: str, /, **values: Any) -> Markup:
    """Fill `template` (``str.format`` syntax) with `values`, each escaped unless it is `Markup`."""
    return Markup(_FORMATTER.vformat(template, (), values))


def join(parts: Iterable[object], separator: str = "") -> Markup:
    """Concatenate pieces (each escaped unless it is `Markup`)."""
    return Markup(escape(separator).join(escape(p) for p in parts))


# --- formatting ---------------------------------------------------------------------------------------


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


def timestamp(ts: float | None, now: float | None = None) -> Markup:
    """A time with how long ago it was, e.g. for 'since' and 'created' columns."""
    if ts is None:
        return Markup("-")
    return html('<time>{when}</time> <span class="muted">({ago})</span>', when=when(ts), ago=ago(ts, now))


# --- the page frame -----------------------------------------------------------------------------------


def layout(title: str, body: Markup, *, user: str | None = None, admin: bool = False, csrf: str = "",
           current: str = "", notice: Markup | str = "", notice_kind: str = "info") -> Markup:
    """A whole page: header with navigation and the sign-out button, `notice`, `title` and `body`."""
    nav: list[Markup] = []
    if user is not None:
        links = [("/", "My parcels")]
        if admin:
            links += [("/admin/users", "Users"), ("/admin/parcels", "All parcels"), ("/admin/usage", "Storage"),
                      ("/admin/audit", "Audit log")]
        for href, label in links:
            attrs = Markup(' aria-current="page"') if href == current else Markup("")
            nav.append(html('<a href="{href}"{attrs}>{label}</a>', href=href, attrs=attrs, label=label))
    account = Markup("")
    if user is not None:
        account = html('<div class="account"><span>Signed in as <strong>{user}</strong>{role}</span>'
                       '<form method="post" action="/signout"><input type="hidden" name="csrf" value="{csrf}">'
                       '<button type="submit" class="link">Sign out</button></form></div>',
                       user=user, role=Markup(' <span class="badge">admin</span>') if admin else Markup(""),
                       csrf=csrf)
    notice_html = html('<p class="notice {kind}" role="status">{text}</p>', kind=notice_kind, text=notice) \
        if notice else Markup("")
    return html(
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        '<title>{title} · {app}</title>\n<link rel="stylesheet" href="/static/isr.css">\n'
        '<link rel="icon" href="/static/favicon.svg" type="image/svg+xml">\n</head>\n<body>\n'
        '<header class="top"><a class="brand" href="/">{app}</a><nav>{nav}</nav>{account}</header>\n'
        '<main>\n{notice}<h1>{title}</h1>\n{body}\n</main>\n'
        '<footer>Internet Suspend/Resume · all times are UTC</footer>\n</body>\n</html>\n',
        title=title, app=APP_TITLE, nav=join(nav), account=account, notice=notice_html, body=body)


def hidden(name: str, value: str) -> Markup:
    return html('<input type="hidden" name="{name}" value="{value}">', name=name, value=value)


def table(header: Sequence[str], rows: Iterable[Sequence[object]], *, empty: str = "none",
          numeric: Sequence[int] = (), css: str = "") -> Markup:
    """A table; cells are escaped unless they are `Markup`; columns in `numeric` are right-aligned."""
    head = join(html('<th scope="col"{cls}>{h}</th>', h=h,
                     cls=Markup(' class="num"') if i in numeric else Markup("")) for i, h in enumerate(header))
    body_rows = [html("<tr>{cells}</tr>", cells=join(html("<td{cls}>{c}</td>", c=c,
                                                          cls=Markup(' class="num"') if i in numeric else Markup(""))
                                                     for i, c in enumerate(row)))
                 for row in rows]
    if not body_rows:
        body_rows = [html('<tr><td colspan="{n}" class="muted">{empty}</td></tr>', n=len(header), empty=empty)]
    return html('<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>',
                css=css, head=head, rows=join(body_rows))


# --- pieces about parcels and locks ---------------------------------------------------------------------


def dirty_text(lock: LockInfo, now: float | None = None) -> Markup:
    """What the lock holder last said about changes it has not committed."""
    if lock.dirty_reported is None:
        return Markup('<span class="muted">not reported by this site</span>')
    if not lock.dirty_chunks and not lock.dirty_bytes:
        return html("none (reported {ago})", ago=ago(lock.dirty_reported, now))
    return html('<strong class="dirty">{chunks} changed chunk(s), {size}</strong> not yet synced '
                '<span class="muted">(reported <time>{when}</time>, {ago})</span>',
                chunks=lock.dirty_chunks or 0, size=size(lock.dirty_bytes), when=when(lock.dirty_reported),
                ago=ago(lock.dirty_reported, now))


def lease_text(lock: LockInfo, now: float | None = None) -> Markup:
    renewed = html("last renewed {ago}", ago=ago(lock.renewed, now))
    if lock.expires is None:
        return html("{renewed}; no expiry", renewed=renewed)
    if lock.expired(now):
        return html('{renewed}; <strong class="expired">expired</strong> <time>{when}</time> ({ago})',
                    renewed=renewed, when=when(lock.expires), ago=ago(lock.expires, now))
    return html("{renewed}; expires <time>{when}</time> ({ago})", renewed=renewed, when=when(lock.expires),
                ago=ago(lock.expires, now))


def lock_details(lock: LockInfo, now: float | None = None) -> Markup:
    """The holder of a lock as a definition list: host, site, since when, version, lease, unsynced work."""
    return html(
        '<dl class="lock-details">'
        "<dt>Host</dt><dd>{host}</dd>"
        "<dt>Site</dt><dd>{site}</dd>"
        "<dt>Locked since</dt><dd>{since}</dd>"
        "<dt>At version</dt><dd>{version}</dd>"
        "<dt>Lock holder</dt><dd>{user}</dd>"
        "<dt>Lease</dt><dd>{lease}</dd>"
        "<dt>Unsynced changes</dt><dd>{dirty}</dd>"
        "</dl>",
        host=lock.host, site=lock.site or "-", since=timestamp(lock.acquired, now), version=lock.version,
        user=lock.user, lease=lease_text(lock, now), dirty=dirty_text(lock, now))


def version_rows(versions: Sequence[VersionInfo], now: float | None = None) -> list[list[object]]:
    rows: list[list[object]] = []
    for v in reversed(versions):
        new_blobs = sum(b["size"] for b in v.blobs if not b.get("inherited"))
        origin = f"{v.host} ({v.site})" if v.site else v.host
        rows.append([v.version, timestamp(v.created, now), origin, v.user, f"{v.chunk_count:,}", size(v.chunk_bytes),
                     size(new_blobs)])
    return rows


def parcel_card(parcel: ParcelInfo, versions: Sequence[VersionInfo], *, show_owner: bool = False,
                version_limit: int | None = None, heading: bool = True, now: float | None = None) -> Markup:
    """One parcel: its name, lock state (with a button to release the lock) and version history."""
    lock = parcel.lock
    if lock is None:
        state = Markup('<div class="lock free"><p><span class="badge free">not locked</span> '
                       "You can resume this parcel anywhere.</p></div>")
    else:
        expired = Markup(' <span class="badge expired">lease expired</span>') if lock.expired(now) else Markup("")
        state = html(
            '<div class="lock held"><p><span class="badge held">locked</span>{expired} '
            "Running at <strong>{site}</strong> on <strong>{host}</strong>, locked {since}.</p>{details}"
            '<p><a class="button danger" href="/parcels/{id}/release">Release the lock…</a></p></div>',
            expired=expired, site=lock.site or lock.host, host=lock.host, since=ago(lock.acquired, now),
            details=lock_details(lock, now), id=parcel.id)
    shown = list(versions)
    more = Markup("")
    if version_limit is not None and len(shown) > version_limit:
        hidden_count = len(shown) - version_limit
        shown = shown[-version_limit:]
        more = html('<p class="muted">{n} older version(s) not shown: <a href="/parcels/{id}">all versions</a></p>',
                    n=hidden_count, id=parcel.id)
    owner = html(' <span class="muted">owned by {owner}</span>', owner=parcel.owner) if show_owner else Markup("")
    history = table(["Version", "Created", "Committed from", "By", "Chunks", "Chunk data", "New blobs"],
                    version_rows(shown, now), empty="no versions yet", numeric=(0, 4, 5, 6), css="versions")
    title = html('<h2><a href="/parcels/{id}">{name}</a>{owner}</h2>', id=parcel.id, name=parcel.name, owner=owner) \
        if heading else Markup("")
    return html(
        '<section class="parcel" id="parcel-{id}">{title}'
        '<p class="meta">{owned}current version <strong>{current}</strong> · <code>{id}</code> · created {created}</p>'
        "{state}<h3>Version history</h3>{history}{more}</section>",
        id=parcel.id, title=title, owned=html("owned by <strong>{o}</strong> · ", o=parcel.owner) if show_owner and not heading else Markup(""),
        current=parcel.current_version or "none",
        created=when(parcel.created), state=state, history=history, more=more)


def audit_detail(detail: Mapping[str, Any]) -> str:
    """An audit entry's details as ``key: value`` pairs (escaped by the caller's template); a lock record
    (the holder of a broken lock) is summarized as who held it from where, since when, at which version."""
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
                text += f", unsynced {dirty.get('dirty_chunks')} chunk(s) / {size(dirty.get('dirty_bytes'))}"
        else:
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(", ", ": "))
        parts.append(f"{key}: {text}")
    return "; ".join(parts)
