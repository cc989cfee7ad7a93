"""Access traces: read them (plain CSV or vulpes' own format, zstd-compressed or not) and write them.

Two formats are read; which one a file holds is told by its first line.

**Plain CSV** (what `capture` writes, and what anyone can write by hand)::

    # workload: rsd                  <- optional metadata, "# key: value", before or between records
    # image_size: 1073741824         <- known keys: image_size (bytes of the image, for the last chunk),
    # data_ranges: 0-4096 8192-65536    data_ranges (bytes holding data at the start: others are zero);
    # data_ranges.memory:               in a trace of several images, image_size.<image> and
                                        data_ranges.<image> say the same per image
    time_s,offset,length,op,image    <- optional header; "image" is an optional fifth column
    0.000000,1024,1024,R,disk
    0.013462,8163328,4096,W,disk

``time_s`` is seconds from the start of the trace (non-decreasing), ``offset`` and ``length`` are bytes
(length > 0), ``op`` is ``R`` or ``W`` (either case). Without a header the columns are positional; without
an image column every access is to the image ``disk``. Byte granularity: any offset and length.

**vulpes trace** (``vulpes/src/trace.c``: what the FUSE daemon writes with tracing on)::

    # vulpes-trace 3 disk.chunk_size=131072 memory.chunk_size=32768
    1795324586.844788 disk 17 r cache 2228224 4096

one line per chunk access: wall-clock time, image name, chunk index, ``r``/``w``, where the access was
satisfied (ram, cache, lookaside, server, zero, new, pack), and the bytes of the image it touched in that chunk
(offset, length): byte granularity. The header gives each image's chunk size; version 2 had one for all
(``# vulpes-trace 2 chunk_size=131072``). Version 1 (vulpes before 2026-11) had no offset and length; such a run
only knows which chunk was touched, so its *granularity* is the chunk size: a simulation with smaller
chunks than that cannot say more than the trace knows (see `Trace.granularity`). A file may hold several
runs, each starting with its header line.

A file whose name ends in ``.zst`` or that starts with zstd's magic number is decompressed on the fly.
"""
from __future__ import annotations

import io
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import zstandard

from .errors import TraceFormatError

READ = "R"
WRITE = "W"
DEFAULT_IMAGE = "disk"
CSV_COLUMNS = ("time_s", "offset", "length", "op")
VULPES_MAGIC = "# vulpes-trace"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: vulpes' "source" names (StatsTier in vulpes/src/stats.h), and ``mapped``: a page the guest touched without a
#: read, which vulpes's warmer had put into the page cache (vulpes/src/warm.c), traced at the suspend.
VULPES_SOURCES = ("ram", "cache", "lookaside", "server", "zero", "new", "pack", "mapped")


@dataclass(frozen=True, slots=True)
class Access:
    """One block access: ``length`` bytes at ``offset`` of ``image``, ``time`` seconds into the trace."""

    time: float
    offset: int
    length: int
    op: str
    image: str = DEFAULT_IMAGE
    #: vulpes traces only: where vulpes found the chunk ('' for plain CSV).
    source: str = ""

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class Trace:
    """A whole trace in memory, accesses in the order they happened."""

    name: str
    accesses: list[Access]
    #: ``# key: value`` lines of a CSV trace (workload, guest, captured, command, ...).
    metadata: dict[str, str] = field(default_factory=dict)
    #: The smallest unit the trace can tell apart, in bytes: 1 for a byte-addressed CSV trace, the chunk
    #: size for a vulpes trace.
    granularity: int = 1
    #: "csv" or "vulpes".
    format: str = "csv"

    @property
    def duration(self) -> float:
        """Seconds from the first access to the last (0 for fewer than two accesses)."""
        return self.accesses[-1].time - self.accesses[0].time if len(self.accesses) > 1 else 0.0

    @property
    def image_size(self) -> int | None:
        """The image's size in bytes, when the trace says (metadata ``image_size``, for a single-image trace)."""
        value = self.metadata.get("image_size")
        return int(value) if value is not None and value.isdigit() else None

    def image_sizes(self) -> dict[str, int]:
        """Each image's size in bytes, where the trace says: metadata ``image_size`` (a single-image trace)
        and ``image_size.<image>`` (any trace)."""
        sizes: dict[str, int] = {}
        images = self.images()
        if self.image_size is not None and len(images) == 1:
            sizes[images[0]] = self.image_size
        for image, value in self._per_image("image_size"):
            if value.isdigit():
                sizes[image] = int(value)
        return sizes

    def data_ranges(self) -> dict[str, list[tuple[int, int]]] | None:
        """Which bytes of each image held data when the trace started, where the trace says: metadata
        ``data_ranges`` (space-separated ``start-end`` byte ranges, for a single-image trace) and
        ``data_ranges.<image>`` (any trace; empty: the image was all zero).

        ISR never stores an all-zero chunk (doc/parcel-format.md), so a chunk outside these ranges costs
        no fetch. An image the trace says nothing about is taken to be all data; None when it says nothing
        about any.
        """
        ranges: dict[str, list[tuple[int, int]]] = {}
        text = self.metadata.get("data_ranges")
        images = self.images()
        if text is not None and len(images) <= 1:
            ranges[images[0] if images else DEFAULT_IMAGE] = parse_ranges(text)
        for image, value in self._per_image("data_ranges"):
            ranges[image] = parse_ranges(value)
        return ranges or None

    def _per_image(self, key: str) -> list[tuple[str, str]]:
        """(image, value) of every ``<key>.<image>`` metadata line."""
        return [(name.split(".", 1)[1], value) for name, value in self.metadata.items()
                if name.startswith(key + ".") and len(name) > len(key) + 1]

    def images(self) -> list[str]:
        return sorted({a.image for a in self.accesses})

    def reads(self) -> Iterator[Access]:
        return (a for a in self.accesses if a.op == READ)

    def writes(self) -> Iterator[Access]:
        return (a for a in self.accesses if a.op == WRITE)


def parse_ranges(text: str) -> list[tuple[int, int]]:
    """``"0-4096 8192-12288"`` -> [(0, 4096), (8192, 12288)]; raises ValueError unless sorted and disjoint."""
    ranges: list[tuple[int, int]] = []
    for part in text.split():
        start_text, sep, end_text = part.partition("-")
        if not sep or not start_text.isdigit() or not end_text.isdigit():
            raise ValueError(f"range {part!r} is not START-END")
        start, end = int(start_text), int(end_text)
        if end <= start or (ranges and start < ranges[-1][1]):
            raise ValueError(f"range {part!r} is empty or not after the one before")
        ranges.append((start, end))
    return ranges


def format_ranges(ranges: Iterable[tuple[int, int]]) -> str:
    return " ".join(f"{start}-{end}" for start, end in ranges)


def trace_name(path: Path) -> str:
    """The name a trace goes by in tables and figures: the file name without .csv/.zst/.trace suffixes."""
    name = path.name
    for suffix in (".zst", ".csv", ".trace", ".log", ".txt"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def _open_text(path: Path) -> IO[str]:
    try:
        raw = open(path, "rb")
    except OSError as exc:
        raise TraceFormatError(path, f"cannot open: {exc.strerror or exc}") from exc
    magic = raw.read(4)
    raw.seek(0)
    if magic == _ZSTD_MAGIC or path.name.endswith(".zst"):
        if magic != _ZSTD_MAGIC:
            raw.close()
            raise TraceFormatError(path, "named .zst but is not zstd-compressed")
        stream: IO[bytes] = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
        return io.TextIOWrapper(stream, encoding="utf-8", newline="")
    return io.TextIOWrapper(raw, encoding="utf-8", newline="")


def read_trace(path: Path | str, *, name: str | None = None) -> Trace:
    """Read a trace file in either format (compressed or not). Raises `TraceFormatError` naming the line."""
    path = Path(path)
    with _open_text(path) as f:
        try:
            lines = list(_numbered_lines(f))
        except (UnicodeDecodeError, zstandard.ZstdError, OSError) as exc:
            raise TraceFormatError(path, f"cannot read: {exc}") from exc
    first = next((text for _, text in lines if text.strip()), "")
    if first.startswith(VULPES_MAGIC):
        trace = _parse_vulpes(path, lines)
    else:
        trace = _parse_csv(path, lines)
    trace.name = name or trace.metadata.get("name") or trace_name(path)
    return trace


def _numbered_lines(f: IO[str]) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(f, start=1):
        yield number, line.rstrip("\r\n")


def _int_field(path: Path, number: int, what: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceFormatError(path, f"{what} {text!r} is not a whole number", number) from None
    return value


def _time_field(path: Path, number: int, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise TraceFormatError(path, f"time {text!r} is not a number", number) from None
    if not math.isfinite(value) or value < 0:
        raise TraceFormatError(path, f"time {text!r} must be a finite number >= 0", number)
    return value


def _parse_csv(path: Path, lines: list[tuple[int, str]]) -> Trace:
    metadata: dict[str, str] = {}
    accesses: list[Access] = []
    columns: tuple[str, ...] | None = None
    last_time = 0.0
    for number, text in lines:
        stripped = text.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            key, sep, value = stripped[1:].partition(":")
            if sep and key.strip() and " " not in key.strip():
                metadata[key.strip()] = value.strip()
            continue
        fields = [part.strip() for part in stripped.split(",")]
        if columns is None and not accesses and fields[0] == CSV_COLUMNS[0]:
            if tuple(fields[:4]) != CSV_COLUMNS or fields[4:] not in ([], ["image"]):
                raise TraceFormatError(path, f"header must be {','.join(CSV_COLUMNS)}[,image], not {stripped!r}",
                                       number)
            columns = tuple(fields)
            continue
        if len(fields) not in (4, 5) or (columns is not None and len(fields) != len(columns)):
            want = len(columns) if columns is not None else "4 or 5"
            raise TraceFormatError(path, f"expected {want} comma-separated fields "
                                         f"(time_s,offset,length,op[,image]), found {len(fields)}", number)
        time = _time_field(path, number, fields[0])
        offset = _int_field(path, number, "offset", fields[1])
        length = _int_field(path, number, "length", fields[2])
        op = fields[3].upper()
        if offset < 0:
            raise TraceFormatError(path, f"offset {offset} is negative", number)
        if length <= 0:
            raise TraceFormatError(path, f"length {length} must be positive", number)
        if op not in (READ, WRITE):
            raise TraceFormatError(path, f"op {fields[3]!r} is neither R nor W", number)
        if time < last_time:
            raise TraceFormatError(path, f"time {fields[0]} goes back (previous record: {last_time})", number)
        image = fields[4] if len(fields) == 5 else DEFAULT_IMAGE
        if not image:
            raise TraceFormatError(path, "empty image name", number)
        accesses.append(Access(time, offset, length, op, image))
        last_time = time
    for key, value in metadata.items():
        if (key == "image_size" or key.startswith("image_size.")) and not value.isdigit():
            raise TraceFormatError(path, f"metadata {key} {value!r} is not a whole number")
        if key == "data_ranges" or key.startswith("data_ranges."):
            try:
                parse_ranges(value)
            except ValueError as exc:
                raise TraceFormatError(path, f"metadata {key}: {exc}") from None
    return Trace(name="", accesses=accesses, metadata=metadata, granularity=1, format="csv")


def _vulpes_header(path: Path, number: int, text: str) -> tuple[int, int, dict[str, int]]:
    """A run's header line: (version, its one chunk size (versions 1 and 2), each image's (version 3))."""
    parts = text.split()
    version = parts[2] if len(parts) > 2 else ""
    fields = [part.partition("=") for part in parts[3:]]
    if (version not in ("1", "2", "3") or not fields or any(not sep for _, sep, _ in fields)
            or (version != "3" and (len(fields) != 1 or fields[0][0] != "chunk_size"))
            or (version == "3" and any(not key.endswith(".chunk_size") for key, _, _ in fields))):
        raise TraceFormatError(path, f"unsupported vulpes trace header {text!r} (expected '# vulpes-trace 1|2 "
                                     "chunk_size=N' or '# vulpes-trace 3 IMAGE.chunk_size=N ...')", number)
    values = {key: _int_field(path, number, key, value) for key, _, value in fields}
    for key, value in values.items():
        if value <= 0:
            raise TraceFormatError(path, f"{key} {value} must be positive", number)
    if version != "3":
        return int(version), values["chunk_size"], {}
    return 3, 0, {key.removesuffix(".chunk_size"): value for key, value in values.items()}


def _parse_vulpes(path: Path, lines: list[tuple[int, str]]) -> Trace:
    accesses: list[Access] = []
    chunk_size = 0
    sizes: dict[str, int] = {}           # version 3: the chunk size of each image
    version = 0
    granularity = 0
    origin: float | None = None
    last_time = 0.0
    for number, text in lines:
        stripped = text.strip()
        if not stripped:
            continue
        if stripped.startswith(VULPES_MAGIC):
            version, chunk_size, sizes = _vulpes_header(path, number, stripped)
            if version == 1:
                granularity = max(granularity, chunk_size)
            continue
        if stripped.startswith("#"):
            continue
        fields = stripped.split()
        if version >= 2 and len(fields) != 7:
            raise TraceFormatError(path, "expected 7 space-separated fields (time image chunk r|w source offset "
                                         f"length), found {len(fields)}", number)
        if version == 1 and len(fields) != 5:
            raise TraceFormatError(path, "expected 5 space-separated fields (time image chunk r|w source), "
                                         f"found {len(fields)}", number)
        when = _time_field(path, number, fields[0])
        index = _int_field(path, number, "chunk index", fields[2])
        if index < 0:
            raise TraceFormatError(path, f"chunk index {index} is negative", number)
        op = fields[3]
        if op not in ("r", "w"):
            raise TraceFormatError(path, f"op {op!r} is neither r nor w", number)
        if fields[4] not in VULPES_SOURCES:
            raise TraceFormatError(path, f"source {fields[4]!r} is not one of {', '.join(VULPES_SOURCES)}",
                                   number)
        if origin is None:
            origin = when
        # Wall-clock times from several threads: a record may be a hair older than the one before.
        rel = max(when - origin, last_time)
        if sizes:
            if fields[1] not in sizes:
                raise TraceFormatError(path, f"image {fields[1]!r} has no chunk size in the run's header", number)
            chunk_size = sizes[fields[1]]
        offset, length = index * chunk_size, chunk_size
        if version >= 2:
            offset = _int_field(path, number, "offset", fields[5])
            length = _int_field(path, number, "length", fields[6])
            if length <= 0 or not index * chunk_size <= offset < offset + length <= (index + 1) * chunk_size:
                raise TraceFormatError(path, f"bytes {offset}+{length} are not inside chunk {index}", number)
        accesses.append(Access(rel, offset, length, op.upper(), fields[1], fields[4]))
        last_time = rel
    return Trace(name="", accesses=accesses, metadata={}, granularity=granularity or 1, format="vulpes")


def format_csv(trace: Trace, *, with_image: bool | None = None) -> Iterable[str]:
    """The lines (with newlines) of ``trace`` as plain CSV, metadata first."""
    if with_image is None:
        with_image = trace.images() not in ([], [DEFAULT_IMAGE])
    for key, value in trace.metadata.items():
        yield f"# {key}: {value}\n"
    yield ",".join(CSV_COLUMNS + (("image",) if with_image else ())) + "\n"
    for a in trace.accesses:
        line = f"{a.time:.6f},{a.offset},{a.length},{a.op}"
        yield (line + f",{a.image}\n") if with_image else (line + "\n")


def write_trace(trace: Trace, path: Path | str, *, level: int = 19) -> Path:
    """Write ``trace`` as plain CSV to ``path`` (zstd-compressed at ``level`` if the name ends in .zst).

    Written to a temporary name and renamed, so a reader never sees half a trace.
    """
    path = Path(path)
    data = "".join(format_csv(trace)).encode()
    if path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor(level=level).compress(data)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path
