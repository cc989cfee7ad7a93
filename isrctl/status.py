"""What `isr stat` knows about a parcel at this site: its checkout, local changes, session, and how much of
it the chunk cache holds. Reads only local state (and asks a running session); no server, no keys."""
from __future__ import annotations

from typing import Any

from isrprogress import NullReporter
from parcels.errors import ParcelError
from parcels.keyring import decode_stream
from parcels.manifest import IMAGES

from . import checkin as checkinmod
from . import control, paths, workingset
from . import mount as mountmod
from .errors import IsrError
from .localstate import RUNNING, ParcelState
from .vulpes import cache_object_path, cache_usage


def parcel_status(state: ParcelState) -> dict[str, Any]:
    """Everything `isr stat` knows about a parcel at this site (no server contact, no keys needed)."""
    checkout = state.checkout()
    change = state.effective_local_change()
    info: dict[str, Any] = {"parcel": state.parcel, "state_dir": str(state.dir)}
    if checkout is None:
        return info
    info.update({"name": checkout.name, "server": checkout.server, "version": checkout.version,
                 "lock": checkout.lock.__dict__ if checkout.lock else None, "policy": checkout.policy,
                 "local": change.to_json() if change else None})
    mounted = mountmod.info(state)
    if mounted is not None:
        info["mount"] = {key: mounted[key] for key in ("dir", "rw", "version", "pid")}
    session = state.session_info()
    if session is not None:
        info["session"] = session
        try:
            info["session_status"] = control.request(state, "status", NullReporter(), timeout=10)
        except IsrError as exc:
            info["session_status"] = {"error": str(exc)}
    cache = paths.chunk_cache_dir()
    images: dict[str, Any] = {}
    try:
        base_total = base_cached = 0
        for image in IMAGES:
            base_records = decode_stream(state.base_stream(image))
            _, size, records = base_records
            cover = workingset.coverage(cache, records)
            base_total += cover.chunks
            base_cached += cover.cached
            images[image] = {"size": size, "base_chunks": len(records), "base_cached": cover.cached}
        if change is None or change.state != RUNNING or session is None:
            changes = checkinmod.compare(state)
            for image in IMAGES:
                images[image]["changed_chunks"] = changes.changed[image]
                local_records = decode_stream(changes.streams[image])[2]
                images[image]["chunks"] = len(local_records)
                images[image]["stored_bytes"] = sum(
                    p.stat().st_size for r in local_records if (p := cache_object_path(cache, r.tag)).is_file())
        info["hoard"] = {"version": checkout.version, "chunks": base_total, "cached": base_cached,
                         "fraction": round(base_cached / base_total, 4) if base_total else 1.0}
        # What of it exists only here: objects the server does not have yet (and a running VM's dirty RAM).
        dirty = cache_usage(cache, owner=state.dir).own_pinned_bytes
        vulpes = info.get("session_status", {}).get("vulpes") or {}
        dirty += sum(int(vulpes.get("images", {}).get(i, {}).get("dirty_bytes", 0)) for i in IMAGES)
        info["not_uploaded_bytes"] = dirty
    except (IsrError, ParcelError) as exc:
        info["error"] = str(exc)
    info["images"] = images
    return info
