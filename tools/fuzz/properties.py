"""The Python fuzz targets: one hypothesis property per parser that takes outside bytes.

Each property feeds a parser inputs built the way an attacker or a damaged store could (random bytes, real
objects from the test vectors with a few bytes changed, objects sealed under the right key around a body
of the fuzzer's choosing, so that the checks after authentication see hostile bytes too) and asserts what
the package promises: it returns, or raises its documented error root (parcels: `ParcelError`; isrctl:
`IsrError`; isr-server: a 4xx answer, never a 500). Where a parser has an inverse, what it accepts must
round-trip.

tests/test_fuzz.py runs every property with a fixed example budget; ``python -m tools.fuzz python`` runs
them for a given time, driven by atheris's coverage feedback through hypothesis's ``fuzz_one_input``.
"""
from __future__ import annotations

import asyncio
import atexit
import datetime as dt
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any, TypeVar
from zoneinfo import ZoneInfo

from hypothesis import strategies as st
from hypothesis import assume, given

from parcels import chunk, compress, crypto, envelope, keyring, manifest, resumepack, seal
from parcels.errors import ParcelError
from parcels.testvectors import load

T = TypeVar("T")

#: The parcel key (and convergence secret) every property seals and opens with.
KEY = bytes(range(32))
#: The key file of the envelope property.
KEYFILE = b"fuzz key file, thirty-two bytes!"
PARCEL = uuid.UUID("4e653b57-acae-4766-9bfe-71f70decf1a5")


def refused_only(errors: type[BaseException] | tuple[type[BaseException], ...], fn: Callable[..., T],
                 *args: Any, **kwargs: Any) -> T | None:
    """fn(*args): its result, or None if it raised one of `errors`; any other exception is a finding and
    propagates to hypothesis."""
    try:
        return fn(*args, **kwargs)
    except errors:
        return None


# --- strategies -------------------------------------------------------------------------------------------


@st.composite
def mangled(draw: st.DrawFn, base: bytes) -> bytes:
    """`base` with a few edits: bytes flipped or set, a cut, an insertion, an extension."""
    data = bytearray(base)
    for _ in range(draw(st.integers(0, 4))):
        edit = draw(st.sampled_from(["flip", "set", "cut", "insert", "extend"]))
        position = draw(st.integers(0, max(len(data) - 1, 0)))
        if edit == "flip" and data:
            data[position] ^= 1 << draw(st.integers(0, 7))
        elif edit == "set" and data:
            data[position] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF]))
        elif edit == "cut":
            del data[position:position + draw(st.integers(1, 64))]
        elif edit == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=16))
        elif edit == "extend":
            data += draw(st.binary(min_size=1, max_size=64))
    return bytes(data)


def _vectors(filename: str, key: str) -> list[bytes]:
    return [bytes.fromhex(v.fields[key]) for v in load(filename) if v.fields.get(key)]


def from_vectors(filename: str, key: str) -> st.SearchStrategy[bytes]:
    """The `key` field of the vectors in `filename`, mangled, or plain random bytes."""
    samples = _vectors(filename, key)
    return st.one_of(st.binary(max_size=512), st.sampled_from(samples).flatmap(mangled))


def zstd_frames(max_size: int = 2048) -> st.SearchStrategy[bytes]:
    """zstd frames as writers make them (with and without the content size and checksum), mangled."""
    frames = st.builds(lambda data, size, check: compress.compress(data, content_size=size, checksum=check),
                       st.binary(max_size=max_size) | st.builds(bytes, st.integers(0, 300000)),
                       st.booleans(), st.booleans())
    return st.one_of(frames, frames.flatmap(mangled), st.binary(max_size=64).map(lambda b: compress.ZSTD_MAGIC + b))


JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                        st.text(max_size=20), st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, "",
                                                               "all", "disk", "memory"]))
#: Strings close to what the manifest's fields want (times, UUIDs, digests, machine types, blob names), so that
#: the rules behind the type checks are reached.
FIELD_STRINGS = st.one_of(
    st.from_regex(r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{0,3})?([Zz]|\+00:00)?", fullmatch=True),
    st.from_regex(r"[0-9a-fA-F]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", fullmatch=True),
    st.from_regex(r"[0-9a-fA-F]{63,65}", fullmatch=True),
    st.from_regex(r"[a-z0-9_.-]{0,8}-[0-9]{0,2}\.?[0-9]{0,2}", fullmatch=True),
    st.from_regex(r"[a-z0-9][a-z0-9._-]{0,66}", fullmatch=True))
#: RFC 3339 times at the edges of each field's range.
TIMES = st.builds("{}-{}-{}{}{}:{}:{}{}{}".format, st.sampled_from(["0000", "0001", "1969", "2024", "2026", "9999"]),
                  st.sampled_from(["00", "01", "02", "12", "13"]), st.sampled_from(["00", "01", "28", "29", "31", "32"]),
                  st.sampled_from(["T", "t", " "]), st.sampled_from(["00", "23", "24"]), st.sampled_from(["00", "59", "60"]),
                  st.sampled_from(["00", "59", "60", "61"]), st.sampled_from(["", ".5", ".", ".123456789"]),
                  st.sampled_from(["Z", "z", "+00:00", "+01:00", "-00:00", ""]))
JSON_LEAVES = JSON_LEAVES | FIELD_STRINGS | TIMES
JSON_VALUES = st.recursive(JSON_LEAVES, lambda children: st.lists(children, max_size=4)
                           | st.dictionaries(st.text(max_size=12), children, max_size=4), max_leaves=12)


# --- parcels ----------------------------------------------------------------------------------------------


@given(data=from_vectors("chunks.txt", "object"), length=st.integers(-1, 4194305))
def chunk_objects(data: bytes, length: int) -> None:
    """A chunk object as a server or cache file hands it over: decoded plaintext has the asked length."""
    plaintext = refused_only(ParcelError, chunk.decode_chunk, data, crypto.sha256(data), KEY, length)
    assert plaintext is None or len(plaintext) == length


@given(compression=st.sampled_from([0, 1, 1, 2, 255]), header_length=st.integers(0, 4194305),
       body=zstd_frames() | st.binary(max_size=1024), length=st.integers(1, 4194304))
def chunk_bodies(compression: int, header_length: int, body: bytes, length: int) -> None:
    """A chunk whose GCM checks (sealed here around any body): the body's length and zstd frame are checked."""
    if compression == 1 and body[:4] == compress.ZSTD_MAGIC and header_length % 3 == 0:
        length = header_length  # mostly agree, so that the frame is what decides
    header = chunk.HEADER.pack(chunk.MAGIC, chunk.VERSION, compression, 0, header_length & 0xFFFFFFFF)
    data = header + crypto.aes_gcm_encrypt(KEY, body, header)
    plaintext = refused_only(ParcelError, chunk.decode_chunk, data, crypto.sha256(data), KEY, length)
    assert plaintext is None or len(plaintext) == length


@given(plaintext=st.binary(min_size=1, max_size=8192), level=st.integers(1, 5))
def chunk_round_trip(plaintext: bytes, level: int) -> None:
    encoded = chunk.encode_chunk(plaintext, KEY, level)
    assert chunk.decode_chunk(encoded.data, encoded.tag, encoded.key, len(plaintext)) == plaintext


@given(frame=zstd_frames(), length=st.integers(-1, 1 << 22))
def zstd_frames_exact(frame: bytes, length: int) -> None:
    """compress.decompress gives exactly `length` bytes or FormatError."""
    out = refused_only(ParcelError, compress.decompress, frame, length)
    assert out is None or len(out) == length


@given(blob=from_vectors("blobs.txt", "blob"), kind=st.sampled_from([1, 2, 3, 4, 0, 5]),
       max_length=st.integers(0, 1 << 22))
def sealed_blobs(blob: bytes, kind: int, max_length: int) -> None:
    payload = refused_only(ParcelError, seal.open_sealed, KEY, blob, kind, max_length)
    assert payload is None or len(payload) <= max_length


@given(kind=st.sampled_from([1, 2, 3, 4]), compression=st.sampled_from([0, 1, 2, 3]),
       length=st.integers(0, 1 << 20), body=zstd_frames() | st.binary(max_size=1024))
def sealed_bodies(kind: int, compression: int, length: int, body: bytes) -> None:
    """A blob that authenticates (sealed here around any body): its length and zstd frame are checked."""
    if compression == 1 and body[:4] == compress.ZSTD_MAGIC and length % 2 == 0:
        try:
            length = compress.zstandard.get_frame_parameters(body).content_size % (1 << 21)
        except compress.zstandard.ZstdError:
            pass
    salt = bytes(32)
    header = seal.HEADER.pack(seal.MAGIC, seal.VERSION, kind, compression, 0, salt, length)
    blob = header + crypto.aes_gcm_encrypt(seal._blob_key(KEY, salt), body, header)
    payload = refused_only(ParcelError, seal.open_sealed, KEY, blob, kind, 1 << 21, stream=compress.StreamReader())
    assert payload is None or len(payload) == length


@given(stream=from_vectors("keyrings.txt", "stream"))
def keyring_streams(stream: bytes) -> None:
    """A keyring stream: what decodes is canonical (encodes to itself) and imports into a keyring database
    that exports it again."""
    decoded = refused_only(ParcelError, keyring.decode_stream, stream)
    if decoded is None:
        return
    assert keyring.encode_stream(*decoded) == stream
    database = _keyring_database()
    try:
        database.import_stream(stream)
    except ParcelError:
        assert decoded[1] >= 2**63, "only an image size sqlite cannot hold may be refused"
        return
    assert database.export_stream() == stream


_keyring: keyring.Keyring | None = None


def _keyring_database() -> keyring.Keyring:
    global _keyring
    if _keyring is None:
        directory = tempfile.mkdtemp(prefix="fuzz-keyring-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        _keyring = keyring.Keyring.create(Path(directory) / "keyring", 131072, 1 << 20)
    return _keyring


@given(data=from_vectors("keyenvelopes.txt", "envelope"), keyfile=st.booleans())
def key_envelopes(data: bytes, keyfile: bool) -> None:
    """An envelope from the server: unwrapped, or WrongKeyError/FormatError/IntegrityError. Expensive scrypt
    parameters (valid up to 1 GiB) are skipped: they would only measure scrypt."""
    if len(data) == envelope.SIZE and data[5] == envelope.KDF_SCRYPT:
        log2n, r, p = data[56], int.from_bytes(data[60:64], "big"), int.from_bytes(data[64:68], "big")
        assume(not (10 <= log2n <= 22 and 1 <= r <= 32 and 1 <= p <= 16 and 128 * r * p << log2n > 4 << 20))
    credential: dict[str, Any] = {"keyfile": KEYFILE} if keyfile else {"passphrase": "fuzz"}
    refused_only(ParcelError, envelope.unwrap_envelope, data, **credential)
    refused_only(ParcelError, envelope.envelope_uuid, data)


def _manifest_dicts() -> list[dict[str, Any]]:
    out = []
    for vector in load("manifests.txt"):
        if vector.ok:
            value = json.loads(bytes.fromhex(vector.fields["json"]))
            value["parcel"] = str(PARCEL)
            out.append(value)
    return out


@st.composite
def manifest_documents(draw: st.DrawFn) -> bytes:
    """A valid manifest with a few values replaced, added or removed anywhere in it, as JSON text."""
    document = json.loads(json.dumps(draw(st.sampled_from(_manifest_dicts()))))
    for _ in range(draw(st.integers(0, 3))):
        node: Any = document
        while isinstance(node, (dict, list)) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
            if not isinstance(node[key], (dict, list)):
                break
            node = node[key]
        if isinstance(node, dict):
            key = draw(st.sampled_from(sorted(node) + ["extra"]))
            if draw(st.booleans()) and key in node:
                del node[key]
            elif key in ("created", "suspended") and draw(st.booleans()):
                node[key] = draw(TIMES)
            else:
                node[key] = draw(JSON_VALUES)
        elif isinstance(node, list):
            node.append(draw(JSON_VALUES))
    return json.dumps(document, allow_nan=True).encode()


@given(text=manifest_documents() | st.binary(max_size=256) | JSON_VALUES.map(lambda v: json.dumps(v).encode()),
       version=st.sampled_from([1, 2, 3]))
def manifests(text: bytes, version: int) -> None:
    """A manifest's JSON: accepted manifests round-trip and reopen from their sealed form."""
    parsed = refused_only(ParcelError, manifest.Manifest.from_json, text)
    if parsed is None:
        return
    again = manifest.Manifest.from_json(parsed.to_json())
    assert again == parsed
    blob = seal.seal(KEY, seal.KIND_MANIFEST, text)
    opened = refused_only(ParcelError, manifest.open_manifest, KEY, blob, parcel=PARCEL, version=version)
    assert opened is None or opened == parsed


def _codec() -> Path:
    return Path(os.environ.get("ISR_BUILD_DIR", Path(__file__).resolve().parents[2] / "build")) / "vulpes" / \
        "vulpes-codec"


def _big_integer(value: Any) -> bool:
    """Whether a JSON value holds an integer above 2^63 - 1, which jansson (so vulpes) cannot read."""
    if isinstance(value, dict):
        return any(_big_integer(v) for v in value.values())
    if isinstance(value, list):
        return any(_big_integer(v) for v in value)
    return isinstance(value, int) and not isinstance(value, bool) and value >= 2**63


@given(text=manifest_documents(), version=st.sampled_from([1, 2, 3]))
def manifest_agreement(text: bytes, version: int) -> None:
    """Python and C accept the same manifests (doc/parcel-format.md; manifest.c says so too): sealed, then opened
    by parcels.manifest and by vulpes-codec. The one allowed difference: integers above 2^63 - 1, which C
    refuses (manifest.c)."""
    blob = seal.seal(KEY, seal.KIND_MANIFEST, text)
    python = refused_only(ParcelError, manifest.open_manifest, KEY, blob, parcel=PARCEL, version=version)
    with tempfile.NamedTemporaryFile() as f:
        f.write(blob)
        f.flush()
        result = subprocess.run([str(_codec()), "manifest-open", KEY.hex(), str(PARCEL), str(version), f.name],
                                capture_output=True, text=True, timeout=60, env={**os.environ, "VULPES_CODEC_DEBUG": "1"})
    assert result.returncode in (0, 1), result.stderr
    if (python is not None) != (result.returncode == 0):
        assert python is not None and _big_integer(json.loads(text)), (
            f"Python {'accepts' if python is not None else 'refuses'} this manifest, C "
            f"{'accepts' if result.returncode == 0 else 'refuses'} it: {result.stderr.strip()}")


@st.composite
def resume_packs(draw: st.DrawFn) -> tuple[bytes, int]:
    image = draw(st.sampled_from([0, 4096, 16 << 20, 2**64 - 1]))
    pieces = []
    offset = 0
    for _ in range(draw(st.integers(0, 4))):
        offset += draw(st.integers(0, 8192))
        data = draw(st.binary(min_size=1, max_size=64))
        pieces.append((offset, data))
        offset += len(data)
    entries = []
    offset = 0
    for _ in range(draw(st.integers(0, 3))):         # a map of the parts to come: a version-2 payload
        offset += draw(st.integers(0, 8192))
        length = draw(st.integers(0, 8192))
        entries.append(resumepack.MapEntry(offset, length, draw(st.integers(0, resumepack.PARTS_MAX))))
        offset += length
    payload = refused_only(ParcelError, resumepack.encode, image, pieces, entries)
    base = payload if payload is not None else resumepack.HEADER.pack(resumepack.MAGIC, 1, bytes(3), image, 0)
    return draw(mangled(base)), draw(st.sampled_from([image, image + 1, 0]))


@given(pack=resume_packs())
def resume_pack_payloads(pack: tuple[bytes, int]) -> None:
    payload, image = pack
    extents = refused_only(ParcelError, resumepack.decode, payload, image)
    if extents is None:
        return
    end = 0
    for extent, data in extents:
        assert extent.length == len(data) > 0 and extent.offset >= end and extent.offset + extent.length <= image
        end = extent.offset + extent.length
    end = 0
    for entry in resumepack.decode_map(payload, image):
        assert entry.length > 0 and entry.offset >= end and entry.offset + entry.length <= image
        assert 1 <= entry.part < resumepack.PARTS_MAX
        end = entry.offset + entry.length


# --- isrctl: calendars -----------------------------------------------------------------------------------

_ICS_LINES = [
    "BEGIN:VEVENT", "END:VEVENT", "BEGIN:VTIMEZONE", "END:VTIMEZONE", "BEGIN:STANDARD", "END:STANDARD",
    "BEGIN:DAYLIGHT", "END:DAYLIGHT", "BEGIN:VALARM", "END:VALARM", "BEGIN:VTODO", "END:VTODO", "END:VCALENDAR",
    "TZID:Europe/Berlin", "TZID:Mars/Olympus", "TZOFFSETFROM:+0100", "TZOFFSETTO:+0200", "TZOFFSETTO:+9999",
    "DTSTART:19700329T020000", "RRULE:FREQ=YEARLY;BYMONTH=3;BYDAY=-1SU",
    "UID:a", "UID:b", "SUMMARY:meeting", "SUMMARY:", "LOCATION:room", "CATEGORIES:travel,isr", "STATUS:CANCELLED",
    "DTSTART:20261124T090000Z", "DTSTART:20261124T090000", "DTSTART;VALUE=DATE:20261125",
    "DTSTART;TZID=Europe/Berlin:20261124T090000", "DTSTART;TZID=Nowhere/Else:20261124T090000",
    "DTSTART:20261324T250000Z", "DTSTART:", "DTSTART:yesterday", "DTSTART;VALUE=DATE:20261124T090000Z",
    "DTEND:20261124T100000Z", "DTEND;VALUE=DATE:20261126", "DTEND:20261124T080000Z", "DURATION:PT1H",
    "DURATION:-P1D", "DURATION:P", "DURATION:PT99999999H",
    "RRULE:FREQ=DAILY;COUNT=3", "RRULE:FREQ=WEEKLY;BYDAY=MO,WE", "RRULE:FREQ=HOURLY;INTERVAL=6",
    "RRULE:FREQ=MINUTELY;INTERVAL=30", "RRULE:FREQ=SECONDLY", "DTSTART:20250101T000000Z", "RRULE:FREQ=MINUTELY",
    "RRULE:FREQ=DAILY;BYHOUR=1,2,3;BYMINUTE=0,1,2,3,4,5,6,7,8,9;BYSECOND=0,1,2,3,4,5,6,7,8,9", "RRULE:FREQ=DAILY;UNTIL=20261201T000000Z",
    "RRULE:FREQ=DAILY;UNTIL=20261201", "RRULE:COUNT=2", "RRULE:FREQ=NEVER", "RRULE:FREQ=DAILY;BYSETPOS=0",
    "RRULE:FREQ=MONTHLY;BYMONTHDAY=31", "RRULE:FREQ=YEARLY;BYWEEKNO=53", "RRULE:FREQ=DAILY;INTERVAL=0",
    "EXDATE:20261125T090000Z", "EXDATE;VALUE=DATE:20261125", "RDATE:20261130T090000Z", "RDATE;VALUE=PERIOD:20261130T090000Z/PT1H",
    "RECURRENCE-ID:20261125T090000Z", "RECURRENCE-ID;RANGE=THISANDFUTURE:20261125T090000Z", "SEQUENCE:1",
    "X-WR-TIMEZONE:Europe/Berlin", "X-WR-TIMEZONE:Bad/Zone", "VERSION:2.0", "PRODID:-//fuzz//EN", ";:", ":", "\t",
]


_ICS_EVENT_LINES = [line for line in _ICS_LINES if not line.startswith(("BEGIN:", "END:"))]


@st.composite
def calendars(draw: st.DrawFn) -> bytes:
    """An iCalendar text: events made of plausible and broken property lines, stray lines between them (folded,
    with odd line ends), or raw bytes."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=256))
    lines = ["BEGIN:VCALENDAR"] if draw(st.integers(0, 9)) else []
    stray = st.sampled_from(_ICS_LINES) | st.text(max_size=30)
    for _ in range(draw(st.integers(0, 4))):
        lines += draw(st.lists(stray, max_size=3))
        lines += ["BEGIN:VEVENT", *draw(st.lists(st.sampled_from(_ICS_EVENT_LINES) | stray, max_size=8))]
        if draw(st.integers(0, 5)):
            lines.append("END:VEVENT")
    if draw(st.booleans()):
        lines.append("END:VCALENDAR")
    ending = draw(st.sampled_from(["\r\n", "\n", "\r\n "]))
    return ending.join(lines).encode("utf-8", "surrogatepass")


@given(data=calendars(), zone=st.sampled_from(["UTC", "Europe/Berlin", "America/St_Johns"]))
def ics_calendars(data: bytes, zone: str) -> None:
    """A calendar file or URL's body: occurrences in the window, in UTC, or problems; CalendarError only when
    the whole file is unreadable."""
    from isrctl import calendar
    from isrctl.errors import IsrError

    start = dt.datetime(2026, 11, 23, tzinfo=dt.timezone.utc)
    end = start + dt.timedelta(days=7)
    read = refused_only(IsrError, calendar.occurrences, data, "fuzz.ics", start, end, local=ZoneInfo(zone))
    if read is None:
        return
    assert len(read.occurrences) <= calendar.MAX_OCCURRENCES
    for occurrence in read.occurrences:
        assert occurrence.start.tzinfo is not None and occurrence.start.utcoffset() == dt.timedelta(0)
        assert start <= occurrence.start < end and occurrence.end >= occurrence.start


# --- isr-server: JSON bodies and headers --------------------------------------------------------------------


class ServerUnderTest:
    """An isr-server app in this process (sqlite and a directory store in a temporary directory), with one user,
    a token, a parcel and its lock: requests go to it as ASGI calls, without a socket."""

    def __init__(self) -> None:
        from server import auth, config
        from server.app import IsrApp
        from server.store import envelope_key

        self.directory = tempfile.mkdtemp(prefix="fuzz-server-")
        atexit.register(shutil.rmtree, self.directory, ignore_errors=True)
        self.app = IsrApp(config.build({"server.data_dir": self.directory, "server.token_cache_seconds": 0}))
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.app.service.open())
        meta, store = self.app.service.meta, self.app.service.store
        user = meta.add_user("alice", auth.hash_password("password", log2n=10))
        self.token = auth.new_token()
        meta.add_token(os.urandom(8).hex(), auth.secret_hash(self.token), user.id, "fuzz", 3600)
        self.parcel = str(uuid.uuid4())
        store.put_bytes(envelope_key(self.parcel), b"ISRE" + bytes(4) + uuid.UUID(self.parcel).bytes + bytes(124))
        meta.create_parcel(self.parcel, "alice", "fuzz")
        self.nonce = ""
        status, body = self.request("POST", f"/v1/parcels/{self.parcel}/lock", {"authorization": f"Bearer {self.token}"},
                                    b'{"host": "fuzz"}')
        assert status == 201, (status, body)
        self.nonce = json.loads(body)["nonce"]

    def request(self, method: str, path: str, headers: dict[str, str], body: bytes,
                query: bytes = b"") -> tuple[int, bytes]:
        return self.loop.run_until_complete(self._request(method, path, headers, body, query))

    async def _request(self, method: str, path: str, headers: dict[str, str], body: bytes,
                       query: bytes) -> tuple[int, bytes]:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "2", "method": method, "scheme": "https",
                 "path": path, "raw_path": path.encode("utf-8", "surrogateescape"), "root_path": "",
                 "query_string": query, "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8443),
                 "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
                 "extensions": {"http.response.pathsend": {}}}
        pieces = [body[i:i + 1000] for i in range(0, len(body), 1000)] or [b""]
        sent: list[MutableMapping[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if pieces:
                piece = pieces.pop(0)
                return {"type": "http.request", "body": piece, "more_body": bool(pieces)}
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        await self.app(scope, receive, send)
        if not sent:  # a client that went away gets no answer
            return 0, b""
        assert sent[0]["type"] == "http.response.start"
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


_server: ServerUnderTest | None = None


def _server_under_test() -> ServerUnderTest:
    global _server
    if _server is None:
        _server = ServerUnderTest()
    return _server


_HEX = "0123456789abcdef"
_SEGMENT = st.one_of(st.text(max_size=20), st.text(_HEX, min_size=64, max_size=64), st.sampled_from(
    ["", ".", "..", "%2e%2e", "manifest", "keyring.disk", "chunks", "1", "0", "-1", "99999999999999", "\x00"]))
_PATHS = ["/v1/chunks/missing", "/v1/chunks/{tag}", "/v1/health", "/v1/login", "/v1/logout", "/v1/whoami",
          "/v1/tokens", "/v1/tokens/{x}", "/v1/parcels", "/v1/parcels/{parcel}", "/v1/parcels/{parcel}/keyenvelope",
          "/v1/parcels/{parcel}/versions", "/v1/parcels/{parcel}/versions/{x}",
          "/v1/parcels/{parcel}/versions/{x}/chunks", "/v1/parcels/{parcel}/versions/{x}/{x}",
          "/v1/parcels/{parcel}/staging/{x}", "/v1/parcels/{parcel}/lock", "/v1/parcels/{parcel}/lock/renew",
          "/v1/parcels/{parcel}/lock/break", "/v2/x", "/", "/signin", "/signout", "/parcels/{parcel}",
          "/parcels/{parcel}/release", "/admin", "/admin/users", "/admin/audit", "/static/{x}"]
_BODY_KEYS = ["user", "password", "label", "host", "site", "force", "take_expired", "reason", "parent", "blobs",
              "inherit", "tags", "working_tags", "dirty_chunks", "dirty_bytes", "reported", "csrf", "lock"]


@st.composite
def http_requests(draw: st.DrawFn) -> tuple[str, str, dict[str, str], bytes, bytes]:
    """A request with ``{PARCEL}``, ``{TOKEN}`` and ``{NONCE}`` standing for the server's own (`ServerUnderTest`)."""
    template = draw(st.sampled_from(_PATHS) | st.text(max_size=40).map(lambda t: "/" + t))
    parcel = draw(st.sampled_from(["{PARCEL}", "4e653b57-acae-4766-9bfe-71f70decf1a5"]) | _SEGMENT)
    path = template.replace("{parcel}", parcel)
    while "{x}" in path or "{tag}" in path:
        start = path.index("{x}") if "{x}" in path else path.index("{tag}")
        path = path[:start] + draw(_SEGMENT).replace("/", "") + path[path.index("}", start) + 1:]
    method = draw(st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "get", "BREW"]))
    headers: dict[str, str] = {}
    latin1 = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=40)
    if draw(st.integers(0, 4)):
        headers["authorization"] = draw(st.sampled_from(["Bearer {TOKEN}", "bearer  {TOKEN} ", "Bearer", "Basic abc",
                                                         "Bearer isr_" + "x" * 200]) | latin1)
    if draw(st.booleans()):
        headers["isr-lock"] = draw(st.sampled_from(["{NONCE}", "x" * 16]) | latin1)
    for name in ("content-length", "content-type", "if-none-match", "cookie", "origin", "referer"):
        if draw(st.integers(0, 3)) == 0:
            headers[name] = draw(latin1 | st.sampled_from(["0", "-1", "18446744073709551616", "application/json",
                                                           "application/x-www-form-urlencoded", "*", "https://x"]))
    fields = st.dictionaries(st.sampled_from(_BODY_KEYS) | st.text(max_size=8), JSON_VALUES, max_size=5)
    body = draw(st.one_of(fields.map(lambda v: json.dumps(v).encode()),
                          JSON_VALUES.map(lambda v: json.dumps(v).encode()),
                          st.binary(max_size=200), st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),
                          st.dictionaries(st.sampled_from(_BODY_KEYS), st.text(max_size=10)).map(
                              lambda v: "&".join(f"{k}={x}" for k, x in v.items()).encode())))
    # granian answers 400 itself to a request line with a byte outside printable ASCII (doc/fuzzing.md).
    query = draw(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40).map(str.encode)
                 | st.sampled_from([b"set=working", b"offset=1&limit=2", b"limit=0",
                                                           b"offset=99999999999999999999"]))
    return method, path, headers, body, query


@given(request=http_requests())
def http_api(request: tuple[str, str, dict[str, str], bytes, bytes]) -> None:
    """Any request: a 4xx answers bad input (JSON with "error" on the API), never a 500."""
    server = _server_under_test()
    method, path, headers, body, query = request

    def own(text: str) -> str:
        return text.replace("{PARCEL}", server.parcel).replace("{TOKEN}", server.token).replace("{NONCE}", server.nonce)

    path = own(path)
    status, answer = server.request(method, path, {k: own(v) for k, v in headers.items()}, body, query)
    assert status < 500, (status, answer[:500])
    if 400 <= status and path.startswith("/v1/") and method.upper() != "HEAD":
        assert isinstance(json.loads(answer).get("error"), str), answer[:500]


#: Every property, by name (``python -m tools.fuzz python NAME``).
PROPERTIES: dict[str, Callable[..., None]] = {
    "chunk_objects": chunk_objects, "chunk_bodies": chunk_bodies, "chunk_round_trip": chunk_round_trip,
    "zstd_frames": zstd_frames_exact, "sealed_blobs": sealed_blobs, "sealed_bodies": sealed_bodies,
    "keyring_streams": keyring_streams, "key_envelopes": key_envelopes, "manifests": manifests,
    "manifest_agreement": manifest_agreement,
    "resume_packs": resume_pack_payloads, "ics_calendars": ics_calendars, "http_api": http_api,
}
