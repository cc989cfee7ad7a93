"""The workload's source archive: real source files in a byte-for-byte reproducible tar.gz.

Reproducible because the workload's result is compared with a value the host computes: names are sorted,
every member has the same owner, mode and modification time, and gzip's header carries no name or date.
`expected_workload` computes, from the archive alone, what ``run.sh`` in the guest must report.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import re
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import GuestBuildError

#: Every member's modification time (2000-01-01): any fixed value will do.
FIXED_MTIME = 946684800
#: Path components the workload's shell pipelines handle without quoting (xargs splits on blanks and quotes).
_SAFE_COMPONENT = re.compile(r"[A-Za-z0-9_.+-]+")
#: The fixed strings the workload greps for (one match counted per line).
SEARCH_PATTERNS = (b"def ", b"import ", b"class ")


@dataclass(frozen=True)
class WorkloadExpectation:
    """What the guest's workload must report for a given archive."""

    files: int
    matches: int
    digest: str
    #: run.sh deletes every third file of the copied tree (in sorted order).
    deleted: int

    def to_json(self) -> dict[str, int | str]:
        return asdict(self)


def collect_python_sources(root: Path, prefix: str) -> dict[str, Path]:
    """The ``.py`` files under ``root``, keyed by their name in the archive (``prefix/relative/path``)."""
    found: dict[str, Path] = {}
    for path in root.rglob("*.py"):
        if not path.is_file() or path.is_symlink():
            continue
        relative = path.relative_to(root)
        if not all(_SAFE_COMPONENT.fullmatch(part) for part in relative.parts):
            continue
        found[f"{prefix}/{relative.as_posix()}"] = path
    return found


def write_archive(files: dict[str, Path], dest: Path) -> None:
    """Write ``files`` (archive name -> source file) as a reproducible tar.gz at ``dest``."""
    if not files:
        raise GuestBuildError("no source files for the workload archive")
    names = set(files)
    directories = {"/".join(name.split("/")[:i]) for name in names for i in range(1, name.count("/") + 1)}
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        # Sorted, so every directory comes right before its contents and the order never varies.
        for name in sorted(names | directories):
            info = tarfile.TarInfo(name)
            info.mtime = FIXED_MTIME
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if name in directories:
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            else:
                data = files[name].read_bytes()
                info.mode = 0o644
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with open(dest, "wb") as out:
        # filename="" and mtime=0 keep the gzip header free of anything that varies between builds.
        with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=6) as gz:
            gz.write(raw.getvalue())


def expected_workload(archive: Path) -> WorkloadExpectation:
    """Compute from the archive what ``run.sh`` must print: files, matches, digest, deleted.

    Mirrors the guest's pipelines: ``find . -type f | sort | xargs sha256sum`` gives lines
    ``"<hex>  ./<name>\\n"`` in byte order of the path, the digest is the sha256 of those lines, and
    ``grep -c -F`` counts lines (the last one even without a newline) that contain any pattern.
    """
    sums: list[tuple[str, str]] = []
    matches = 0
    with tarfile.open(archive, mode="r:gz") as tar:
        for member in tar:
            if not member.isfile():
                continue
            handle = tar.extractfile(member)
            assert handle is not None
            data = handle.read()
            path = "./" + member.name
            sums.append((path, hashlib.sha256(data).hexdigest()))
            lines = data.split(b"\n")
            if lines and lines[-1] == b"":
                lines.pop()
            matches += sum(1 for line in lines if any(p in line for p in SEARCH_PATTERNS))
    sums.sort(key=lambda item: item[0].encode())
    listing = "".join(f"{digest}  {path}\n" for path, digest in sums)
    return WorkloadExpectation(files=len(sums), matches=matches,
                               digest=hashlib.sha256(listing.encode()).hexdigest(), deleted=len(sums) // 3)
