"""The shared parcel-format test vectors (see README.md here): reading and writing their text format."""
from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

from parcels.errors import FormatError

VECTOR_DIR = Path(__file__).resolve().parent
FILES = {
    "chunks.txt": "chunk",
    "blobs.txt": "blob",
    "keyenvelopes.txt": "envelope",
    "keyrings.txt": "keyring",
    "manifests.txt": "manifest",
}
_SECTION = re.compile(r"\[([a-z0-9_]+)\]")
# "key = " with nothing after it is an empty value; tolerate an editor having stripped the last space.
_FIELD = re.compile(r"([a-z0-9_]+) =(?: (.*))?")


class Vector(NamedTuple):
    """One vector: its section type and its fields in file order (values as text)."""

    section: str
    fields: dict[str, str]

    @property
    def name(self) -> str:
        return self.fields["name"]

    @property
    def ok(self) -> bool:
        return self.fields["result"] == "ok"

    def hex(self, key: str) -> bytes:
        """The field `key` decoded from hex."""
        return bytes.fromhex(self.fields[key])

    def int(self, key: str) -> int:
        return int(self.fields[key])


def parse(text: str, source: str = "<vectors>") -> list[Vector]:
    """Parse a vector file. Raises FormatError for a line that is neither a comment, a section header
    nor `key = value`, a field outside a section, a duplicate key, or a vector without name and a
    result of ok or reject."""
    vectors: list[Vector] = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{number}"
        if section := _SECTION.fullmatch(line):
            vectors.append(Vector(section.group(1), {}))
            continue
        field = _FIELD.fullmatch(line)
        if field is None:
            raise FormatError(f"{where}: not a comment, [section] or 'key = value' line")
        if not vectors:
            raise FormatError(f"{where}: field before the first [section]")
        key, value = field.group(1), field.group(2) or ""
        if key in vectors[-1].fields:
            raise FormatError(f"{where}: duplicate key {key}")
        vectors[-1].fields[key] = value
    names = set()
    for vector in vectors:
        if "name" not in vector.fields or vector.fields.get("result") not in ("ok", "reject"):
            raise FormatError(f"{source}: a vector lacks name or result = ok|reject")
        if vector.name in names:
            raise FormatError(f"{source}: duplicate vector name {vector.name}")
        names.add(vector.name)
    return vectors


def load(filename: str) -> list[Vector]:
    """Read and parse one of the vector files in this directory. Raises FormatError if malformed or if
    it holds a section type other than the file's own."""
    path = VECTOR_DIR / filename
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise FormatError(f"cannot read test vectors {path}: {exc}") from None
    vectors = parse(text, str(path))
    expected = FILES.get(filename)
    if expected is not None and any(v.section != expected for v in vectors):
        raise FormatError(f"{path}: every section must be [{expected}]")
    return vectors


def render(section: str, header: str, vectors: list[dict[str, str | int | bytes]]) -> str:
    """Format vectors as a file: `header` as # comments, then one [section] per vector. bytes values are
    written as lowercase hex, ints in decimal, str as they are."""
    lines = [f"# {line}".rstrip() for line in header.strip("\n").split("\n")]
    for vector in vectors:
        lines += ["", f"[{section}]"]
        for key, value in vector.items():
            text = value.hex() if isinstance(value, bytes) else str(value)
            if not re.fullmatch(r"[a-z0-9_]+", key) or "\n" in text:
                raise FormatError(f"cannot write field {key!r}")
            lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"
