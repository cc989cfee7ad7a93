"""isrctl.pack without a VM: which bytes of the memory image a trace says the guest touched first, and how
they become the extents of a resume pack (the whole path, suspend to a fresh site's resume, is in
tests/test_isr_policies.py)."""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from isrctl import pack
from isrctl.remote import Remote
from parcels import resumepack, seal
from parcels.compress import StreamReader
from parcels.crypto import sha256
from parcels.manifest import BlobInfo, ImageInfo, Manifest
from tests.server_fixtures import ServerEnv, server_env  # noqa: F401
from tests.test_format import sample_manifest

LINES = """# vulpes-trace 2 chunk_size=131072
100.0 memory 3 r server 397312 32768
100.1 disk 0 r cache 0 4096
100.2 memory 3 r ram 397312 4096
100.3 memory 3 w ram 401408 4096
100.4 memory 0 r server 8192 4096
100.5 memory 9 r zero 1179648 65536
"""


def test_first_touches_take_new_memory_reads_in_order_up_to_the_limit(tmp_path: Path) -> None:
    trace = tmp_path / "t.trace"
    trace.write_text(LINES)
    assert pack.first_touches(trace, "memory", 1 << 20) == [(397312, 32768), (8192, 4096), (1179648, 65536)]
    # A version-3 trace (a chunk size per image) has the same lines.
    v3 = tmp_path / "v3.trace"
    v3.write_text(LINES.replace("# vulpes-trace 2 chunk_size=131072",
                                "# vulpes-trace 3 disk.chunk_size=131072 memory.chunk_size=32768"))
    assert pack.first_touches(v3, "memory", 1 << 20) == [(397312, 32768), (8192, 4096), (1179648, 65536)]
    # The limit counts new pages: the first read is 8 pages, so a limit of 8 pages stops after it.
    assert pack.first_touches(trace, "memory", 8 * 4096) == [(397312, 32768)]
    assert pack.first_touches(tmp_path / "none", "memory", 1 << 20) == []
    old = tmp_path / "v1.trace"
    old.write_text("# vulpes-trace 1 chunk_size=131072\n100.0 memory 3 r server\n")
    assert pack.first_touches(old, "memory", 1 << 20) == []


def test_extents_are_sorted_page_aligned_joined_and_inside_the_image() -> None:
    # Whole pages, sorted; only pages the reads touched (a page apart stays apart: the next resume reads one
    # page per fault through the memory mount, so no neighbour is worth its bytes).
    assert pack.extents([(9000, 100), (100, 10), (20000, 5000), (60000, 10)], 61440) == \
        [(0, 4096), (8192, 4096), (16384, 12288), (57344, 4096)]
    # Touching or overlapping pages become one extent; the image's end clips the last page.
    assert pack.extents([(4096, 4096), (0, 4096), (6000, 100)], 14000) == [(0, 8192)]
    assert pack.extents([(0, 4096), (12288, 4096)], 14000) == [(0, 4096), (12288, 1712)]


def test_build_reads_the_chosen_bytes_back_from_the_memory_image(tmp_path: Path) -> None:
    trace = tmp_path / "t.trace"
    trace.write_text(LINES)
    memory = tmp_path / "memory"
    image = bytes(range(256)) * (2 << 20 >> 8)
    memory.write_bytes(image)
    [payload] = pack.build(trace, memory, len(image))
    got = [(e.offset, bytes(data)) for e, data in resumepack.decode(payload, len(image))]
    assert [offset for offset, _ in got] == [8192, 397312, 1179648]
    assert all(data == image[offset:offset + len(data)] for offset, data in got)
    # A first part of 32 KiB: the first touch alone fills it; the next ones go to the second...
    def part_offsets(first: int, part: int) -> list[list[int]]:
        return [[e.offset for e, _ in resumepack.decode(p, len(image))]
                for p in pack.build(trace, memory, len(image), first=first, part=part)]

    assert part_offsets(32768, 1 << 20) == [[397312], [8192, 1179648]]
    # ... and later parts of 4 KiB: one each.
    assert part_offsets(32768, 4096) == [[397312], [8192], [1179648]]
    empty = tmp_path / "empty.trace"
    empty.write_text("# vulpes-trace 2 chunk_size=131072\n")
    assert pack.build(empty, memory, len(image)) == []


def test_each_page_is_in_one_part_and_the_first_part_maps_the_others(tmp_path: Path) -> None:
    trace = tmp_path / "t.trace"
    # The guest reads page 2 twice (the second time inside a longer read) and pages 0-1 and 5 once.
    trace.write_text("# vulpes-trace 3 disk.chunk_size=131072 memory.chunk_size=131072\n"
                     "1.0 memory 0 r server 8192 4096\n"
                     "1.1 memory 0 r server 0 12288\n"
                     "1.2 memory 0 r server 20480 4096\n")
    memory = tmp_path / "memory"
    image = os.urandom(64 << 10)
    memory.write_bytes(image)
    payloads = pack.build(trace, memory, len(image), first=4096, part=4096)
    layouts = [[(e.offset, e.length) for e, _ in resumepack.decode(p, len(image))] for p in payloads]
    assert layouts == [[(8192, 4096)], [(0, 8192)], [(20480, 4096)]]       # page 2 only in the first part
    assert resumepack.decode_map(payloads[0], len(image)) == [resumepack.MapEntry(0, 8192, 1),
                                                               resumepack.MapEntry(20480, 4096, 2)]
    assert all(p[4] == 1 for p in payloads[1:])                   # later parts carry no map
    for p in payloads:
        for e, data in resumepack.decode(p, len(image)):
            assert bytes(data) == image[e.offset:e.offset + e.length]


def _packed_offsets(trace: Path, memory: Path, image: bytes, **kwargs: Any) -> list[int]:
    """The offsets of the extents pack.build() puts in its parts, in order, with parts of one page."""
    return [e.offset for p in pack.build(trace, memory, len(image), first=4096, part=4096, **kwargs)
            for e, _ in resumepack.decode(p, len(image))]


def test_recent_pages_join_the_first_touches_early_and_alone_make_a_cold_boots_pack(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pages read from ``recent_since`` on (after the suspend dropped the guest's mapped pages) that the
    guest had not read before the window, within RECENT_BYTES, take turns with the first touches after the first part; a
    session that booted cold packs only those."""
    trace = tmp_path / "t.trace"
    trace.write_text("# vulpes-trace 3 disk.chunk_size=131072 memory.chunk_size=131072\n"
                     "1.0 memory 0 r server 8192 4096\n"             # after the resume
                     "1.5 memory 0 r server 0 4096\n"
                     "2.0 memory 0 w new 40960 4096\n"
                     "9.0 memory 0 r ram 8192 4096\n"                # the recent window: a page read before,
                     "9.1 memory 1 r server 36864 4096\n"            # new ones,
                     "9.2 disk 0 r server 65536 4096\n"              # another image, a write: not reads of memory
                     "9.3 memory 0 w ram 45056 4096\n"
                     "9.4 memory 1 r server 24576 8192\n")
    memory = tmp_path / "memory"
    image = os.urandom(64 << 10)
    memory.write_bytes(image)

    def offsets(**kwargs: Any) -> list[int]:
        return _packed_offsets(trace, memory, image, **kwargs)
    assert offsets() == [8192, 0, 36864, 24576]                   # no window: the first touches
    assert offsets(resumed=False) == []                            # a cold boot without a window: none
    assert offsets(recent_since=9.0) == [8192, 36864, 0, 24576]                # read first in the window: early
    assert offsets(recent_since=9.0, limit=4096) == [8192, 36864, 24576]
    assert offsets(recent_since=9.0, limit=8192) == [8192, 36864, 0, 24576]   # after the first part, in turn
    assert offsets(recent_since=9.0, resumed=False) == [8192, 36864, 24576]
    monkeypatch.setattr(pack, "RECENT_BYTES", 8192)
    assert offsets(recent_since=9.0, resumed=False) == [8192, 36864]
    assert offsets(recent_since=9.5, resumed=False) == []


class PreloadRecorder:
    """Stands in for `isrctl.vulpes.Vulpes` where `pack.hand_over` hands it the parts: records what it was given."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def preload(self, image: str, payload: bytes, *args: Any, **kwargs: Any) -> None:
        assert image == "memory"
        self.payloads.append(payload)


def pack_manifest(parcel: str, version: int, image_size: int, parts: dict[str, bytes]) -> Manifest:
    """A manifest of ``version`` whose memory image has ``image_size`` bytes and whose blobs are the pack
    ``parts`` (name: payload)."""
    base = sample_manifest(version)
    return dataclasses.replace(
        base, parcel=uuid.UUID(parcel),
        images={**base.images, "memory": ImageInfo(size=image_size, keyring_sha256=bytes(32), keyring_size=28,
                                                   chunks=0)},
        blobs={name: BlobInfo(kind=seal.KIND_DEVSTATE, sha256=sha256(payload), size=len(payload))
               for name, payload in parts.items()})


def load_recorded(remote: Remote, parcel: str, manifest: Manifest, key: bytes, names: list[str],
                  caplog: pytest.LogCaptureFixture, **kwargs: Any) -> tuple[int, PreloadRecorder, list[str]]:
    """`pack.Fetching` of ``names``, handed over (`pack.hand_over`) to a `PreloadRecorder`, with its log
    captured afresh: what it returned, the recorder, and the paths of the requests it made."""
    vulpes = PreloadRecorder()
    requests: list[str] = []
    remote.client.event_hooks["request"] = [lambda request: requests.append(request.url.path)]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="isrctl.pack"):
        fetching = pack.Fetching(remote, SimpleNamespace(parcel=parcel), manifest,  # type: ignore[arg-type]
                                 SimpleNamespace(parcel_key=key), names, **kwargs)  # type: ignore[arg-type]
        used = pack.hand_over(iter(fetching), vulpes)  # type: ignore[arg-type]
    return used, vulpes, requests


def test_mapped_pages_come_after_the_exact_first_touches_and_do_not_hide_recent_ones(tmp_path: Path) -> None:
    """Pages vulpes traced as mapped at the suspend (its warmer had them in the page cache, so the guest touched
    them without a read) are first touches after the exact ones, in the order the guest first reached their
    chunks (those of chunks it never reached by a read last); a recent page among them still takes its turn
    early, once (a page is in one part only)."""
    trace = tmp_path / "t.trace"
    trace.write_text("# vulpes-trace 3 disk.chunk_size=131072 memory.chunk_size=131072\n"
                     "1.0 memory 0 r server 8192 4096\n"             # exact first touches after the resume
                     "1.5 memory 0 r cache 0 4096\n"
                     "2.0 memory 5 r server 655360 4096\n"           # chunk 5 reached before chunk 3
                     "3.0 memory 3 r server 393216 4096\n"
                     "8.0 memory 3 r mapped 409600 4096\n"           # at the suspend: mapped, in address order
                     "8.0 memory 4 r mapped 536576 4096\n"
                     "8.0 memory 5 r mapped 659456 4096\n"
                     "9.0 memory 5 r ram 659456 4096\n")             # the recent window: one of them
    memory = tmp_path / "memory"
    image = os.urandom(1 << 20)
    memory.write_bytes(image)

    def offsets(**kwargs: Any) -> list[int]:
        return _packed_offsets(trace, memory, image, **kwargs)
    assert pack.first_touches(trace, "memory", 1 << 20, mapped=False) == [(8192, 4096), (0, 4096), (655360, 4096),
                                                                         (393216, 4096), (659456, 4096)]
    assert pack.first_touches(trace, "memory", 1 << 20, until=9.0, mapped=False) == [
        (8192, 4096), (0, 4096), (655360, 4096), (393216, 4096)]
    assert offsets() == [8192, 0, 655360, 393216, 659456, 409600, 536576]
    assert offsets(recent_since=9.0) == [8192, 659456, 0, 655360, 393216, 409600, 536576]
    # A pack too small for every mapped page leaves out those of the chunks reached last, then never.
    assert offsets(limit=6 * 4096) == [8192, 0, 655360, 393216, 659456, 409600]


@pytest.mark.parametrize("server_env", ["sqlite-directory"], indirect=True)
def test_load_takes_the_parts_from_one_bundle_until_one_is_damaged(server_env: ServerEnv,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """`pack.Fetching` fetches its parts from a real server in one bundle, handed to vulpes in order; a
    damaged part ends the loading with one warning, and the parts before it stay loaded."""
    parcel = server_env.new_parcel("alice")
    key = os.urandom(32)
    image_size = 1 << 20
    payloads = [resumepack.encode(image_size, [(index * 8192, os.urandom(4096))]) for index in range(3)]
    names = [resumepack.part_name(index) for index in range(3)]
    sealed = [seal.seal(key, seal.KIND_DEVSTATE, payload) for payload in payloads]
    damaged = bytearray(sealed[1])
    damaged[-1] ^= 1
    with server_env.client("alice") as remote:
        nonce = remote.acquire(parcel, host="laptop")["nonce"]
        for version, part1 in ((1, sealed[1]), (2, bytes(damaged))):
            blobs = {"manifest": b"m", "keyring.disk": b"k", "keyring.memory": b"k", names[0]: sealed[0],
                     names[1]: part1, names[2]: sealed[2]}
            for name, data in blobs.items():
                remote.put_blob(parcel, name, data, nonce)
            remote.commit(parcel, nonce, version - 1, list(blobs), [])
        remote.release(parcel, nonce)
        for version, loaded in ((1, 3), (2, 1)):
            manifest = pack_manifest(parcel, version, image_size, dict(zip(names, payloads)))
            used, vulpes, requests = load_recorded(remote, parcel, manifest, key, names, caplog)
            assert used == loaded * 4096 and vulpes.payloads == payloads[:loaded]
            assert requests == [f"/v1/parcels/{parcel}/versions/{version}/_bundle"]
            warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            if loaded == 3:
                assert warnings == []
            else:
                assert len(warnings) == 1 and "version 2 is not used from resumepack.1 on" in warnings[0]


def published_pack(server_env: ServerEnv, count: int, pages: int = 1) -> tuple[str, bytes, list[str], list[bytes],
                                                                               dict[str, bytes], Manifest]:
    """A new parcel of alice's whose version 1 has a pack of ``count`` parts of ``pages`` random pages, each
    sealed alone: the parcel, its key, the part names, their payloads, every blob stored, and the version's
    manifest."""
    parcel = server_env.new_parcel("alice")
    key = os.urandom(32)
    image_size = max(1 << 20, count * pages * 8192)
    payloads = [resumepack.encode(image_size, [((index * pages + page) * 8192, os.urandom(4096))
                                               for page in range(pages)]) for index in range(count)]
    names = [resumepack.part_name(index) for index in range(count)]
    blobs = {"manifest": b"m", "keyring.disk": b"k", "keyring.memory": b"k",
             **{name: seal.seal(key, seal.KIND_DEVSTATE, payload) for name, payload in zip(names, payloads)}}
    with server_env.client("alice") as remote:
        nonce = remote.acquire(parcel, host="laptop")["nonce"]
        for name, data in blobs.items():
            remote.put_blob(parcel, name, data, nonce)
        remote.commit(parcel, nonce, 0, list(blobs), [])
        remote.release(parcel, nonce)
    return parcel, key, names, payloads, blobs, pack_manifest(parcel, 1, image_size, dict(zip(names, payloads)))


@pytest.mark.parametrize("server_env", ["sqlite-directory"], indirect=True)
def test_the_parts_pace_is_measured_once_a_megabyte_came(server_env: ServerEnv,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """`pack.Fetching.rate`: the bytes per second the parts crossed at, once a megabyte has come in a request
    (isr hands it to vulpes, whose own first GETs cannot tell the link's rate: on a fast link the pack's
    chunks then come at once); 0 when less came."""
    for count, pages, measured in ((2, 160, True), (1, 1, False)):
        parcel, key, names, payloads, blobs, manifest = published_pack(server_env, count, pages)
        with server_env.client("alice") as remote:
            started = time.monotonic()
            fetching = pack.Fetching(remote, SimpleNamespace(parcel=parcel), manifest,  # type: ignore[arg-type]
                                     SimpleNamespace(parcel_key=key), names)  # type: ignore[arg-type]
            assert pack.hand_over(iter(fetching), PreloadRecorder()) == count * pages * 4096  # type: ignore[arg-type]
            took = time.monotonic() - started
        crossed = sum(len(blobs[name]) for name in names)
        if measured:
            assert crossed >= pack.RATE_BYTES_MIN and crossed / took <= fetching.rate, (crossed, took, fetching.rate)
        else:
            assert fetching.rate == 0


@pytest.mark.parametrize("server_env", ["sqlite-directory"], indirect=True)
def test_load_with_keep_stops_where_the_rest_would_take_too_long(server_env: ServerEnv,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Past ``keep`` bytes of plaintext, `pack.Fetching` stops where the parts still to come would take longer than
    ``seconds`` at the pace the others came (none here: it stops at once); with time to spare it takes all.
    It asks for them in one streamed answer."""
    parcel, key, names, payloads, blobs, manifest = published_pack(server_env, 4)
    with server_env.client("alice") as remote:
        for keep, seconds, loaded in ((8192, 0.0, 2), (0, 0.0, 1), (8192, 1e9, 4), (None, 0.0, 4)):
            used, vulpes, requests = load_recorded(remote, parcel, manifest, key, names, caplog, keep=keep,
                                                   seconds=seconds)
            assert (used, vulpes.payloads) == (loaded * 4096, payloads[:loaded]), (keep, seconds)
            assert requests == [f"/v1/parcels/{parcel}/versions/1/_bundle"]
            stopped = [r.getMessage() for r in caplog.records if "are not fetched" in r.getMessage()]
            assert len(stopped) == (loaded < 4) and not [r for r in caplog.records if r.levelno >= logging.WARNING]
        # The connection the stopped bundle left is not needed again: the next request goes through.
        assert remote.get_blob(parcel, 1, names[3]) == blobs[names[3]]


@pytest.mark.parametrize("server_env", ["sqlite-directory"], indirect=True)
def test_a_held_fetch_stops_after_the_first_part_until_told_to_go(server_env: ServerEnv) -> None:
    """With ``hold`` the first part comes alone and the others are not asked for until `go`; then they all
    come, in order, in a second request on the same connection."""
    parcel, key, names, payloads, _, manifest = published_pack(server_env, 4)
    with server_env.client("alice") as remote:
        requests: list[str] = []
        remote.client.event_hooks["request"] = [lambda request: requests.append(request.url.path)]
        fetching = pack.Fetching(remote, SimpleNamespace(parcel=parcel), manifest,  # type: ignore[arg-type]
                                 SimpleNamespace(parcel_key=key), names, hold=True)  # type: ignore[arg-type]
        parts = iter(fetching)
        assert next(parts)[1] == payloads[0]
        time.sleep(0.5)                              # nothing more comes while held, however long it is
        assert fetching._queue.empty() and len(requests) == 1
        fetching.go()
        assert [part[1] for part in parts] == payloads[1:]
        assert requests == [f"/v1/parcels/{parcel}/versions/1/_bundle"] * 2


def test_limit_follows_the_link_within_bounds() -> None:
    assert pack.limit(0) == pack.PACK_BYTES                          # nothing measured
    assert pack.limit(1.2e6) == pack.PACK_BYTES                      # 10 Mbit/s: the least
    assert pack.limit(20e6) == pack.PACK_BYTES_MAX                   # faster than 100 Mbit/s: the most
    middle = pack.limit(12e6)                                        # 100 Mbit/s
    assert pack.PACK_BYTES < middle < pack.PACK_BYTES_MAX and middle % 4096 == 0


def test_the_parts_a_resume_loads_first_cross_the_link_as_one_stream() -> None:
    """`pack.for_transfer`: the parts holding the first PACK_BYTES are sealed again as one zstd stream at
    TRANSFER_LEVEL (same payloads, fewer bytes: each part compresses against those before it), which a reader
    opens in order; the later ones are left as the suspend sealed them, and so are all when the stream would
    not be smaller."""
    key = os.urandom(32)
    rng = random.Random(7)
    pages = [rng.randbytes(4096) for _ in range(64)]

    def memory(size: int) -> bytes:           # pages like those of a guest: the same ones with a few changes
        out = bytearray()
        while len(out) < size:
            page = bytearray(rng.choice(pages))
            for _ in range(8):
                page[rng.randrange(4096)] = rng.randrange(256)
            out += page
        return bytes(out[:size])
    payloads = [memory(size) for size in [pack.FIRST_PART_BYTES] + [pack.PART_BYTES] * 40]
    sealed = [pack.seal_pack(SimpleNamespace(parcel_key=key), p) for p in payloads]     # type: ignore[arg-type]
    out = pack.for_transfer(key, sealed, [len(p) for p in payloads])
    first = 1 + (pack.PACK_BYTES - pack.FIRST_PART_BYTES) // pack.PART_BYTES
    assert out[first:] == sealed[first:]
    assert [blob[6] for blob in out[:first]] == [seal.COMPRESSION_ZSTD_STREAM] * first
    stream = StreamReader()
    for blob, payload in zip(out[:first], payloads):
        assert seal.open_sealed(key, blob, seal.KIND_DEVSTATE, len(payload), stream=stream) == payload
    assert sum(map(len, out[:first])) < 0.95 * sum(map(len, sealed[:first]))
    noise = [os.urandom(4096) for _ in range(3)]
    plain = [seal.seal(key, seal.KIND_DEVSTATE, p, compress=False) for p in noise]
    assert pack.for_transfer(key, plain, [4096] * 3) == plain
    print(f"first {first} parts: {sum(map(len, sealed[:first]))} -> {sum(map(len, out[:first]))} bytes")
