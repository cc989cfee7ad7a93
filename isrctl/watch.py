"""`isr stat --watch` (`isr top`): a live view of a parcel in use at this site, like OpenISR's dirtometer.

Each interval it asks the parcel's vulpes for its status report (doc/vulpes.md, "Status report"), through the
running session or, for `isr mount`, vulpes's own control socket, and turns two reports into figures: dirty
bytes (in vulpes's RAM, not yet in the cache), bytes not uploaded yet, the cache's fill, the fetch and upload
rates, demand misses per second (guest reads that had to wait for the server), and the hoard's progress.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from isrprogress import human_bytes, human_rate
from parcels.manifest import IMAGES


@dataclass
class Sample:
    """One status report of vulpes and when it was taken (monotonic seconds)."""

    at: float
    status: dict[str, Any]


def _int(status: dict[str, Any], *path: str) -> int:
    value: Any = status
    for key in path:
        value = value.get(key, {}) if isinstance(value, dict) else {}
    return int(value) if isinstance(value, (int, float)) else 0


def figures(previous: Sample | None, current: Sample) -> dict[str, Any]:
    """The figures of the live view (the JSON of `isr stat --watch --json`): amounts from ``current``, rates
    from the difference to ``previous`` (0 for the first sample)."""
    s = current.status
    seconds = current.at - previous.at if previous is not None else 0.0

    def rate(*path: str) -> float:
        if previous is None or seconds <= 0:
            return 0.0
        return max(0, _int(s, *path) - _int(previous.status, *path)) / seconds

    cache = s.get("cache", {})
    used, room, limit = _int(cache, "bytes"), _int(cache, "room"), _int(cache, "limit")
    hoard = s.get("hoard", {})
    return {
        "dirty_bytes": sum(_int(s, "images", image, "dirty_bytes") for image in IMAGES),
        "dirty_chunks": sum(_int(s, "images", image, "dirty_chunks") for image in IMAGES),
        "not_uploaded_bytes": _int(cache, "own_pinned_bytes"),
        "cache_bytes": used, "cache_room": room, "cache_limit": limit,
        "cache_fill": round(used / (used + room), 4) if used + room else 0.0,
        "fetch_bytes_per_s": round(rate("fetch", "bytes")),
        "upload_bytes_per_s": round(rate("writeback", "uploaded_bytes")),
        "demand_misses_per_s": round(rate("hits", "server"), 2),
        "read_bytes_per_s": round(rate("io", "bytes_read")),
        "write_bytes_per_s": round(rate("io", "bytes_written")),
        "hoard": {"state": hoard.get("state", "idle"), "chunks_done": _int(hoard, "chunks_done"),
                  "chunks_total": _int(hoard, "chunks_total"), "bytes_done": _int(hoard, "bytes_done"),
                  "bytes_total": _int(hoard, "bytes_total")},
    }


def panel(name: str, f: dict[str, Any]) -> list[str]:
    """The view on a terminal: a few labelled lines."""
    limit = f", limit {human_bytes(f['cache_limit'])}" if f["cache_limit"] else ""
    lines = [f"{name}    (Ctrl-C to stop watching)",
             f"  dirty      {human_bytes(f['dirty_bytes'])} in {f['dirty_chunks']} chunks not yet in the cache; "
             f"{human_bytes(f['not_uploaded_bytes'])} not yet uploaded",
             f"  cache      {f['cache_fill']:.0%} full: {human_bytes(f['cache_bytes'])}, room for "
             f"{human_bytes(f['cache_room'])} more{limit}",
             f"  fetch      {human_rate(f['fetch_bytes_per_s'], 'B')}, {f['demand_misses_per_s']:g} demand misses/s",
             f"  upload     {human_rate(f['upload_bytes_per_s'], 'B')}",
             f"  guest I/O  read {human_rate(f['read_bytes_per_s'], 'B')}, write {human_rate(f['write_bytes_per_s'], 'B')}"]
    h = f["hoard"]
    if h["chunks_total"]:
        lines.append(f"  hoard      {h['state']}: {h['chunks_done']} of {h['chunks_total']} chunks, "
                     f"{human_bytes(h['bytes_done'])} of {human_bytes(h['bytes_total'])}")
    else:
        lines.append(f"  hoard      {h['state']}")
    return lines


def line(name: str, f: dict[str, Any]) -> str:
    """The view as one line (not a terminal): one per interval."""
    h = f["hoard"]
    hoard = f", hoard {h['chunks_done']}/{h['chunks_total']}" if h["chunks_total"] else ""
    return (f"{time.strftime('%H:%M:%S')} {name}: dirty {human_bytes(f['dirty_bytes'])}, not uploaded "
            f"{human_bytes(f['not_uploaded_bytes'])}, cache {f['cache_fill']:.0%} ({human_bytes(f['cache_bytes'])}), "
            f"fetch {human_rate(f['fetch_bytes_per_s'], 'B')}, upload {human_rate(f['upload_bytes_per_s'], 'B')}, "
            f"{f['demand_misses_per_s']:g} misses/s{hoard}")


def watch(status: Callable[[], dict[str, Any] | None], show: Callable[[dict[str, Any]], None], *,
          interval: float = 1.0, count: int = 0, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> bool:
    """Call ``show`` with the figures every ``interval`` seconds (``count`` times; 0: until stopped) while
    ``status`` returns a report. Returns False if it stopped because ``status`` returned None (the parcel is
    no longer in use), True otherwise."""
    previous: Sample | None = None
    shown = 0
    while count <= 0 or shown < count:
        report = status()
        if report is None:
            return False
        current = Sample(clock(), report)
        show(figures(previous, current))
        shown += 1
        previous = current
        if count <= 0 or shown < count:
            sleep(max(0.0, interval - (clock() - current.at)))
    return True
