"""The working set: which chunks a resumed guest touched, in the order it first touched them.

vulpes writes an access trace (one line per chunk access: ``<time> <image> <index> <r|w> <source>``,
vulpes/src/trace.c) from the moment a session mounts it. At suspend, the first touch of each chunk since
the resume, in order, is the working-set estimate recorded in the new version's manifest; the next
resume site hoards it first (lazy working set) or ahead of time (eager working set). This module also
answers "how much of a version is in this site's cache already?" for the proactive policies and
`isr stat`.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from parcels.keyring import KeyringRecord, decode_stream
from parcels.manifest import IMAGES

from .vulpes import cache_object_path


def from_trace(path: Path, chunk_counts: dict[str, int], *, limit: int | None = None) -> dict[str, list[int]]:
    """First-touch order per image from a vulpes trace file (missing file: empty working sets).

    Indices outside an image (``chunk_counts``) and malformed lines are skipped. ``limit`` caps each list.
    """
    seen: dict[str, set[int]] = {image: set() for image in IMAGES}
    order: dict[str, list[int]] = {image: [] for image in IMAGES}
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith("#"):
                    continue
                parts = line.split()
                if len(parts) < 4 or parts[1] not in seen:
                    continue
                try:
                    index = int(parts[2])
                except ValueError:
                    continue
                image = parts[1]
                if index in seen[image] or not 0 <= index < chunk_counts.get(image, 0):
                    continue
                if limit is not None and len(order[image]) >= limit:
                    continue
                seen[image].add(index)
                order[image].append(index)
    except FileNotFoundError:
        pass
    return order


@dataclass
class CacheCoverage:
    """How much of a set of chunk objects this site's cache holds."""

    chunks: int
    cached: int
    missing_chunks: int

    @property
    def complete(self) -> bool:
        return self.missing_chunks == 0

    @property
    def fraction(self) -> float:
        return self.cached / self.chunks if self.chunks else 1.0


def checked(working_set: object, chunk_counts: dict[str, int]) -> tuple[dict[str, list[int]], str | None]:
    """``working_set`` if it is a usable list per image (whole numbers, each below that image's chunk count,
    none twice), else empty lists and the reason: a damaged record, or one from a version with other image
    sizes, must only cost the prefetch, never the resume."""
    empty: dict[str, list[int]] = {image: [] for image in IMAGES}
    if not isinstance(working_set, dict):
        return empty, "it is not a list per image"
    out: dict[str, list[int]] = {}
    for image in IMAGES:
        indices = working_set.get(image, [])
        if not isinstance(indices, list) or not all(type(i) is int for i in indices):
            return empty, f"its {image} list is not a list of chunk numbers"
        if any(not 0 <= i < chunk_counts.get(image, 0) for i in indices):
            return empty, f"its {image} list names chunks this version's {image} image does not have"
        if len(set(indices)) != len(indices):
            return empty, f"its {image} list names a chunk twice"
        out[image] = list(indices)
    return out, None


def coverage(cache_dir: Path, records: Iterable[KeyringRecord]) -> CacheCoverage:
    """Count the records whose chunk object is in the cache (by file; the files are the truth)."""
    tags = {record.tag for record in records}
    cached = sum(1 for tag in tags if cache_object_path(cache_dir, tag).is_file())
    return CacheCoverage(chunks=len(tags), cached=cached, missing_chunks=len(tags) - cached)


def stream_records(stream: bytes) -> list[KeyringRecord]:
    """The records of a keyring stream."""
    return decode_stream(stream)[2]


def select(records: Iterable[KeyringRecord], indices: Iterable[int]) -> list[KeyringRecord]:
    """The records of the listed chunk indices (absent indices are all-zero chunks and need nothing)."""
    wanted = set(indices)
    return [record for record in records if record.idx in wanted]


def tags(working_set: dict[str, list[int]], records: dict[str, list[KeyringRecord]]) -> list[str]:
    """The chunk tags (hex) of a working set, image by image in first-touch order, each once: what a
    commit tells the server so that other sites can hoard the working set without the parcel key."""
    out: dict[str, None] = {}
    for image in IMAGES:
        by_index = {record.idx: record for record in records.get(image, [])}
        for index in working_set.get(image, []):
            record = by_index.get(index)
            if record is not None:
                out.setdefault(record.tag.hex(), None)
    return list(out)
