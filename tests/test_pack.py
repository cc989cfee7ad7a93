"""isrctl.pack without a VM: which bytes of the memory image a trace says the guest touched first, and how
they become the extents of a resume pack (the whole path, suspend to a fresh site's resume, is in
tests/test_isr_policies.py)."""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from isrctl import pack
from isrctl.remote import Remote
from parcels import resumepack, seal
from parcels.crypto import sha256
from parcels.manifest import BlobInfo, ImageInfo, Manifest
from tests.conftest import wait_until
from tests.server_fixtures import ServerEnv, server_env  # noqa: F401
from tests.test_format import sample_manifest
from tests.vulpes_fixtures import CHUNK_SIZE, IsrServer, Vulpes, isr_server, make_state  # noqa: F401
from tests.vulpes_fixtures import vulpes_binary  # noqa: F401  (pytest fixture)

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


class PreloadRecorder:
    """Stands in for `isrctl.vulpes.Vulpes` where `pack.load` hands it the parts: records what it was given."""

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
    """`pack.load` of ``names`` into a `PreloadRecorder`, with its log captured afresh: what it returned, the
    recorder, and the paths of the requests it made."""
    vulpes = PreloadRecorder()
    requests: list[str] = []
    remote.client.event_hooks["request"] = [lambda request: requests.append(request.url.path)]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="isrctl.pack"):
        used = pack.load(remote, SimpleNamespace(parcel=parcel), manifest,  # type: ignore[arg-type]
                         SimpleNamespace(parcel_key=key), vulpes, names, **kwargs)  # type: ignore[arg-type]
    return used, vulpes, requests


@pytest.mark.parametrize("server_env", ["sqlite-directory"], indirect=True)
def test_load_takes_the_parts_from_one_bundle_until_one_is_damaged(server_env: ServerEnv,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """`pack.load` fetches its parts from a real server in one bundle and hands each to vulpes in order; a
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


class PackForwarder:
    """Stands in for `isrctl.vulpes.Vulpes` where `pack.load_rest` asks vulpes to fetch the parts: sends the
    request to the test's vulpes, as `Vulpes.pack` does."""

    def __init__(self, vulpes: Vulpes) -> None:
        self.vulpes = vulpes

    def pack(self, image: str, parts: list[dict[str, Any]], *, keep: int | None = None, seconds: float = 0.0) -> None:
        request: dict[str, Any] = {"op": "pack", "image": image, "parts": parts}
        if keep is not None:
            request.update(keep=keep, seconds=seconds)
        response = self.vulpes.control(request)
        assert response["ok"], response


def test_vulpes_fetches_the_later_parts_checks_each_and_stops_where_told(vulpes_binary: Path, isr_server: IsrServer,
                                                                        tmp_path: Path) -> None:
    """`pack.load_rest` has vulpes fetch the later parts from a real server itself: each is opened with the
    parcel key and checked against the manifest before vulpes serves its bytes. A damaged part, or one that does
    not match the manifest, ends the loading with one warning and is never served (the chunk's own bytes are);
    with ``keep``, vulpes stops where the rest would take longer than ``seconds``. Bad requests get one line."""
    rng = random.Random(15)
    image_size = 16 * CHUNK_SIZE
    memory = rng.randbytes(image_size)
    state = make_state(tmp_path / "state", bytes(CHUNK_SIZE), image_size, memory=memory)
    state.publish(isr_server.store)
    # Made-up bytes, one page per part in chunks 1, 3, 5: where a read is served from shows.
    offsets = {index: (2 * index - 1) * CHUNK_SIZE + 4096 for index in (1, 2, 3)}
    payloads = {index: resumepack.encode(image_size, [(offsets[index], bytes([index]) * 4096)]) for index in (1, 2, 3)}
    names = [resumepack.part_name(index) for index in (1, 2, 3)]
    sealed = {name: seal.seal(state.parcel_key, seal.KIND_DEVSTATE, payloads[index])
              for index, name in zip((1, 2, 3), names)}
    damaged = bytearray(sealed[names[1]])
    damaged[-1] ^= 1
    env = isr_server.env
    parcel = env.new_parcel("alice")
    with env.client("alice") as remote:
        nonce = remote.acquire(parcel, host="laptop")["nonce"]
        for version, part2 in ((1, sealed[names[1]]), (2, bytes(damaged))):
            blobs = {"manifest": b"m", "keyring.disk": b"k", "keyring.memory": b"k", **sealed, names[1]: part2}
            for name, data in blobs.items():
                remote.put_blob(parcel, name, data, nonce)
            remote.commit(parcel, nonce, version - 1, list(blobs), [])
        remote.release(parcel, nonce)
    manifests = {version: pack_manifest(parcel, version, image_size, {n: payloads[i] for i, n in zip((1, 2, 3), names)})
                 for version in (1, 2)}
    expected = [r"memory: resume pack part \d of 1 extents, 4096 bytes", r"memory: resume pack: .*"]

    def run(n: int, manifest: Manifest, **kwargs: Any) -> tuple[dict[str, Any], dict[int, bytes], str]:
        with Vulpes(vulpes_binary, tmp_path / f"mnt{n}", state, tmp_path / f"cache{n}",
                    server=isr_server.url, token_file=isr_server.token_file, ca=isr_server.ca,
                    expected_output=[*expected, r"memory: the resume pack is not used from part 2 on: .*"]) as v:
            pack.load_rest(SimpleNamespace(parcel=parcel), manifest, PackForwarder(v),  # type: ignore[arg-type]
                           names, **kwargs)
            wait_until(lambda: v.status()["resume_pack"]["ended"], 30, "the pack loading ends")
            status = v.status()
            assert status["images"]["memory"]["pack_parts"] == status["resume_pack"]["loaded"]
            with open(v.path("memory"), "rb", buffering=0) as f:
                served = {index: os.pread(f.fileno(), 4096, offsets[index]) for index in offsets}
            again = v.control({"op": "pack", "image": "memory", "parts": []})
            assert again == {"ok": False, "error": "the resume pack is loading already"}, again
            return status["resume_pack"], served, v.output()

    def real(index: int) -> bytes:
        return memory[offsets[index]:offsets[index] + 4096]

    # Version 1: every part comes, checked, and its bytes are what vulpes serves.
    loading, served, log = run(1, manifests[1])
    assert loading["loaded"] == loading["parts"] == 3 and not loading["failed"] and not loading["stopped"]
    assert served == {index: bytes([index]) * 4096 for index in (1, 2, 3)}
    assert "resume pack: 3 of 3 later parts loaded (12288 bytes)" in log, log
    # Version 2: part 2 is damaged. It is never served; part 1 was, and part 3 may have come before it.
    loading, served, log = run(2, manifests[2])
    assert loading["failed"] and loading["loaded"] in (1, 2), loading
    assert served[1] == bytes([1]) * 4096 and served[2] == real(2)
    assert log.count("the resume pack is not used from part 2 on: it does not open with the parcel key") == 1, log
    # A manifest whose digest for part 2 is another's: the same (no part is taken on the server's word).
    other = dataclasses.replace(manifests[1], blobs={**manifests[1].blobs, names[1]: manifests[1].blobs[names[0]]})
    loading, served, log = run(3, other)
    assert loading["failed"] and served[2] == real(2), loading
    assert "does not match the manifest" in log, log
    # Past keep (nothing), the rest would take longer than no time at all: vulpes stops after the first.
    loading, served, log = run(4, manifests[1], keep=0, seconds=0.0)
    assert loading["stopped"] and not loading["failed"] and loading["loaded"] < 3, loading
    assert "are not fetched: at the pace of the others" in log, log


def test_vulpes_refuses_a_bad_pack_request_in_one_line(vulpes_binary: Path, isr_server: IsrServer,
                                                       tmp_path: Path) -> None:
    state = make_state(tmp_path / "state", bytes(CHUNK_SIZE), CHUNK_SIZE)
    with Vulpes(vulpes_binary, tmp_path / "mnt", state, tmp_path / "cache", server=isr_server.url,
                token_file=isr_server.token_file, ca=isr_server.ca) as v:
        part = {"path": "/v1/parcels/x/versions/1/resumepack.1", "part": 1, "size": 10, "sha256": "00" * 32}
        for request in ({"op": "pack", "parts": [part]},
                        {"op": "pack", "image": "memory", "parts": [{**part, "path": "resumepack.1"}]},
                        {"op": "pack", "image": "memory", "parts": [{**part, "part": 0}]},
                        {"op": "pack", "image": "memory", "parts": [{**part, "sha256": "zz"}]},
                        {"op": "pack", "image": "memory", "parts": [part, part]},
                        {"op": "pack", "image": "memory", "parts": [part], "keep": 5}):
            response = v.control(request)
            assert response["ok"] is False and "\n" not in response["error"], (request, response)
        assert "resume_pack" not in v.status()


def test_limit_follows_the_link_within_bounds() -> None:
    assert pack.limit(0) == pack.PACK_BYTES                          # nothing measured
    assert pack.limit(1.2e6) == pack.PACK_BYTES                      # 10 Mbit/s: the least
    assert pack.limit(12e6) == pack.PACK_BYTES_MAX                   # 100 Mbit/s: the most
    middle = pack.limit(5e6)
    assert pack.PACK_BYTES < middle < pack.PACK_BYTES_MAX and middle % 4096 == 0


def test_later_parts_are_short_unless_the_pack_needs_more_room() -> None:
    assert pack.part_bytes(pack.PACK_BYTES) == pack.PART_BYTES
    longest = pack.part_bytes(pack.PACK_BYTES_MAX)
    assert longest > pack.PART_BYTES and longest % 4096 == 0
    assert pack.FIRST_PART_BYTES + (resumepack.PARTS_MAX - 1) * longest >= pack.PACK_BYTES_MAX
