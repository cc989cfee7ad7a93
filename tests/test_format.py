"""The Python parcel format (parcels/): codecs, keyrings, manifests, the directory store, whole parcels, CLI.

Randomized tests use a fixed seed so a failure reproduces. Key envelopes use scrypt with log2(N) = 10
except in one test of the default parameters.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from parcels import chunk, compress, crypto, envelope, keyring, manifest, parcel, resumepack, seal
from parcels.errors import (
    FormatError, ImageError, IntegrityError, MissingFilesError, NotFoundError, ParcelError, StoreError, WrongKeyError,
)
from parcels.image import read_chunks
from parcels.keyring import Keyring, KeyringRecord
from parcels.manifest import BlobInfo, BootConfig, ImageInfo, Manifest, Timestamps, VMConfig
from parcels.store import DirStore

pytestmark = pytest.mark.timeout(120)

SECRET = bytes(range(32))
PK = bytes(range(32, 64))
PASS = "a passphrase for tests"
FAST = 10           # scrypt log2(N) for tests
MIB = 1 << 20
CLI_TIMEOUT = 60


def text_bytes(n: int, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    words = [b"suspend", b"resume", b"parcel", b"chunk", b"keyring", b"manifest"]
    out = bytearray()
    while len(out) < n:
        out += rng.choice(words) + b" "
    return bytes(out[:n])


# --- compression ---------------------------------------------------------------------------------------------

def test_compress_writes_one_frame_with_content_size() -> None:
    data = text_bytes(10000)
    frame = compress.compress(data)
    assert frame[:4] == compress.ZSTD_MAGIC and len(frame) < len(data)
    assert compress.decompress(frame, len(data)) == data


@pytest.mark.parametrize("content_size", [True, False])
def test_decompress_refuses_frames_of_the_wrong_shape(content_size: bool) -> None:
    data = text_bytes(5000)
    frame = compress.compress(data, content_size=content_size)
    assert compress.decompress(frame, 5000) == data
    bad = {
        "fewer": (frame, 5001),
        "more": (frame, 4999),
        "trailing": (frame + b"\x00", 5000),
        "two frames": (compress.compress(data[:2500], content_size=content_size)
                       + compress.compress(data[2500:], content_size=content_size), 5000),
        "truncated": (frame[:-1], 5000),
        "skippable first": (b"\x50\x2a\x4d\x18\x00\x00\x00\x00" + frame, 5000),
        "not zstd": (data, 5000),
        "empty": (b"", 5000),
    }
    for what, (body, length) in bad.items():
        with pytest.raises(FormatError):
            compress.decompress(body, length)
            pytest.fail(f"accepted {what}")


def test_decompress_output_is_bounded_for_a_bomb() -> None:
    # 64 MiB of zeros compresses to a few KiB; without a stated size the reader must stop at its limit.
    bomb = compress.compress(bytes(64 * MIB), content_size=False)
    assert len(bomb) < 64 * 1024
    with pytest.raises(FormatError):
        compress.decompress(bomb, 4096)


def test_decompress_empty_payload() -> None:
    assert compress.decompress(compress.compress(b""), 0) == b""
    with pytest.raises(FormatError):
        compress.decompress(compress.compress(b"x"), 0)


# --- chunks -------------------------------------------------------------------------------------------------------

def test_chunk_round_trips_random_plaintexts() -> None:
    rng = random.Random(20261122)
    for _ in range(150):
        n = rng.choice([1, 2, 511, 4096, rng.randrange(1, 70000), 131072])
        kind = rng.randrange(3)
        if kind == 0:
            plaintext = rng.randbytes(n)
        elif kind == 1:
            plaintext = text_bytes(n, rng.randrange(1000))
        else:
            sparse = bytearray(n)
            for _ in range(rng.randrange(1, 20)):
                sparse[rng.randrange(n)] = rng.randrange(1, 256)
            plaintext = bytes(sparse)
        encoded = chunk.encode_chunk(plaintext, SECRET)
        assert encoded.tag == hashlib.sha256(encoded.data).digest()
        header = chunk.HEADER.unpack_from(encoded.data)
        assert header == (b"ISRC", 1, encoded.flags, 0, n)
        if encoded.flags == 0:
            assert len(encoded.data) == n + 28
        else:
            assert len(encoded.data) < n + 28
        assert chunk.decode_chunk(encoded.data, encoded.tag, encoded.key, n) == plaintext


def test_chunk_encoding_is_convergent() -> None:
    plaintext = text_bytes(8192)
    a, b = chunk.encode_chunk(plaintext, SECRET), chunk.encode_chunk(bytearray(plaintext), SECRET)
    assert a == b
    other = chunk.encode_chunk(plaintext, bytes(32))
    assert other.key != a.key and other.tag != a.tag
    assert chunk.encode_chunk(plaintext[:-1] + b"!", SECRET).key != a.key


@pytest.mark.parametrize("plaintext", [text_bytes(200), random.Random(7).randbytes(48)], ids=["zstd", "raw"])
def test_every_byte_flip_of_a_chunk_object_is_detected(plaintext: bytes) -> None:
    encoded = chunk.encode_chunk(plaintext, SECRET)
    assert encoded.flags == (1 if len(plaintext) == 200 else 0)
    for pos in range(len(encoded.data)):
        for mask in (0x01, 0x80):
            damaged = bytearray(encoded.data)
            damaged[pos] ^= mask
            with pytest.raises(IntegrityError):
                chunk.decode_chunk(damaged, encoded.tag, encoded.key, len(plaintext))
            # Even with a tag that matches the damage, a later check must catch it.
            with pytest.raises((FormatError, IntegrityError)):
                chunk.decode_chunk(damaged, hashlib.sha256(damaged).digest(), encoded.key, len(plaintext))


def test_decode_chunk_checks_arguments_and_length() -> None:
    encoded = chunk.encode_chunk(b"data" * 100, SECRET)
    with pytest.raises(FormatError):
        chunk.decode_chunk(encoded.data, encoded.tag, encoded.key, 399)
    with pytest.raises(FormatError):
        chunk.decode_chunk(encoded.data, encoded.tag[:31], encoded.key, 400)
    with pytest.raises(FormatError):
        chunk.decode_chunk(encoded.data, encoded.tag, encoded.key[:16], 400)
    for bad in (b"", bytes(chunk.MAX_CHUNK_SIZE + 1)):
        with pytest.raises(FormatError):
            chunk.encode_chunk(bad, SECRET)
    with pytest.raises(FormatError):
        chunk.encode_chunk(b"x", SECRET[:31])


def test_is_zero() -> None:
    assert chunk.is_zero(b"") and chunk.is_zero(bytes(4096)) and chunk.is_zero(bytearray(131072))
    assert chunk.is_zero(memoryview(bytes(100))) and chunk.is_zero(bytes(chunk.MAX_CHUNK_SIZE + 5))
    for size in (1, 4096, 131072, chunk.MAX_CHUNK_SIZE + 5):
        for pos in (0, size // 2, size - 1):
            buf = bytearray(size)
            buf[pos] = 1
            assert not chunk.is_zero(buf) and not chunk.is_zero(bytes(buf)) and not chunk.is_zero(memoryview(buf))


def test_chunk_sizes_and_lengths() -> None:
    assert [n for n in (2048, 4096, 6144, 131072, 4194304, 8388608, True) if chunk.valid_chunk_size(n)] == [
        4096, 131072, 4194304]
    assert chunk.chunk_length(0, 4096, 10000) == 4096
    assert chunk.chunk_length(2, 4096, 10000) == 10000 - 8192
    assert chunk.chunk_count(4096, 0) == 0 and chunk.chunk_count(4096, 4097) == 2
    for index in (-1, 3):
        with pytest.raises(FormatError):
            chunk.chunk_length(index, 4096, 10000)
    with pytest.raises(FormatError):
        chunk.chunk_length(0, 5000, 10000)


# --- sealed blobs -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", seal.KINDS)
def test_seal_round_trip(kind: int) -> None:
    for payload in (b"", b"x", text_bytes(50000), os.urandom(3000)):
        for compressed in (True, False):
            blob = seal.seal(PK, kind, payload, compressed)
            assert blob[:8] == b"ISRB\x01" + bytes([kind, int(compressed and len(blob) < len(payload) + 64), 0])
            assert seal.open_sealed(PK, blob, kind, len(payload)) == payload
            if payload:
                with pytest.raises(FormatError):
                    seal.open_sealed(PK, blob, kind, len(payload) - 1)


def test_seal_uses_a_fresh_salt_and_checks_kind_and_key() -> None:
    a, b = seal.seal(PK, seal.KIND_DEVSTATE, b"state"), seal.seal(PK, seal.KIND_DEVSTATE, b"state")
    assert a[8:40] != b[8:40] and a != b
    with pytest.raises(FormatError):
        seal.open_sealed(PK, a, seal.KIND_BOOT, 100)
    with pytest.raises(IntegrityError):
        seal.open_sealed(bytes(32), a, seal.KIND_DEVSTATE, 100)
    with pytest.raises(FormatError):
        seal.seal(PK, 5, b"x")


FIRMWARE = [("bios-256k.bin", os.urandom(70000)), ("efi-virtio.rom", os.urandom(30000))]


def _files(table: list[tuple[str, bytes]]) -> seal.FileLookup:
    return lambda name, size, digest: next((data for n, data in table if n == name and len(data) == size), None)


def test_device_state_sealed_against_files_needs_only_what_is_not_in_them() -> None:
    """Compression 2: the payload's bytes that are in the named files do not cross; a reader with the same
    files gets the payload back, one without them (or with other contents) is told which it lacks."""
    payload = FIRMWARE[1][1][5000:29000] + b"cpu state" * 100 + FIRMWARE[0][1][:65536]
    blob = seal.seal(PK, seal.KIND_DEVSTATE, payload, files=FIRMWARE)
    assert blob[6] == seal.COMPRESSION_ZSTD_FILES
    assert len(blob) < 2000 < len(seal.seal(PK, seal.KIND_DEVSTATE, payload)) - 80000
    assert seal.open_sealed(PK, blob, seal.KIND_DEVSTATE, len(payload), files=_files(FIRMWARE)) == payload
    assert seal.files_named(PK, blob, seal.KIND_DEVSTATE) == [
        (name, len(data), hashlib.sha256(data).digest()) for name, data in FIRMWARE]
    other = [FIRMWARE[0], ("efi-virtio.rom", os.urandom(30000))]
    for lookup, missing in ((None, ["bios-256k.bin", "efi-virtio.rom"]), (_files(other), ["efi-virtio.rom"]),
                            (_files(FIRMWARE[:1]), ["efi-virtio.rom"])):
        with pytest.raises(MissingFilesError, match="efi-virtio.rom") as caught:
            seal.open_sealed(PK, blob, seal.KIND_DEVSTATE, len(payload), files=lookup)
        assert caught.value.missing == missing
    with pytest.raises(FormatError):
        seal.open_sealed(PK, blob, seal.KIND_DEVSTATE, len(payload) - 1, files=_files(FIRMWARE))


@pytest.mark.parametrize("files, why", [
    ([], "1 to 8"), ([(f"f{i}", b"x") for i in range(9)], "1 to 8"), ([("../etc/passwd", b"x")], "file name"),
    ([("", b"x")], "file name")])
def test_files_a_sealed_blob_may_not_name(files: list[tuple[str, bytes]], why: str) -> None:
    with pytest.raises(FormatError, match=why):
        seal.seal(PK, seal.KIND_DEVSTATE, b"state", files=files)
    with pytest.raises(FormatError, match="only device state"):
        seal.seal(PK, seal.KIND_BOOT, b"kernel", files=FIRMWARE)


@pytest.mark.parametrize("body, why", [
    (b"", "1 to 8"), (b"\x00", "1 to 8"), (b"\x09", "1 to 8"), (b"\x01\x05bios", "truncated"),
    (b"\x01\x00" + bytes(40), "truncated"), (b"\x01\x03a/b" + bytes(40), "file name"),
    (b"\x01\x01a" + (1 << 40).to_bytes(8, "big") + bytes(32), "exceed")])
def test_a_malformed_file_list_is_refused(body: bytes, why: str) -> None:
    from parcels.testvectors.generate import PK_BLOB, blob_raw
    blob = blob_raw(body + compress.compress(b"state"), kind=seal.KIND_DEVSTATE, length=5,
                    compression=seal.COMPRESSION_ZSTD_FILES)
    with pytest.raises(FormatError, match=why):
        seal.open_sealed(PK_BLOB, blob, seal.KIND_DEVSTATE, 100, files=_files(FIRMWARE))
    boot = blob_raw(body, kind=seal.KIND_BOOT, length=5, compression=seal.COMPRESSION_ZSTD_FILES)
    with pytest.raises(FormatError, match="unknown compression 2"):
        seal.open_sealed(PK_BLOB, boot, seal.KIND_BOOT, 100)


def test_blobs_sealed_as_one_stream_open_in_their_order_only() -> None:
    """Compression 3: later pieces copy from the earlier ones (a pack's parts repeat one another's pages), so
    the chain is smaller than the blobs sealed alone; each opens with the reader that opened the ones before
    it, and not alone, out of order, twice or after a damaged one."""
    rng = random.Random(3)
    pages = [rng.randbytes(4096) for _ in range(16)]
    payloads = [b"".join(rng.choice(pages) for _ in range(24)) for _ in range(4)]
    chain = seal.seal_stream(PK, seal.KIND_DEVSTATE, payloads, level=9)
    assert [blob[6] for blob in chain] == [seal.COMPRESSION_ZSTD_STREAM] * 4
    alone = [seal.seal(PK, seal.KIND_DEVSTATE, payload, level=9) for payload in payloads]
    assert sum(map(len, chain[1:])) < sum(map(len, alone[1:])) // 4
    reader = compress.StreamReader()
    assert [seal.open_sealed(PK, blob, seal.KIND_DEVSTATE, len(p), stream=reader)
            for blob, p in zip(chain, payloads)] == payloads
    with pytest.raises(FormatError, match="after the end"):
        seal.open_sealed(PK, chain[3], seal.KIND_DEVSTATE, len(payloads[3]), stream=reader)
    with pytest.raises(FormatError, match="continues a zstd stream"):
        seal.open_sealed(PK, chain[0], seal.KIND_DEVSTATE, len(payloads[0]))
    with pytest.raises(FormatError, match="does not start a zstd frame"):
        seal.open_sealed(PK, chain[1], seal.KIND_DEVSTATE, len(payloads[1]), stream=compress.StreamReader())
    reader = compress.StreamReader()
    seal.open_sealed(PK, chain[0], seal.KIND_DEVSTATE, len(payloads[0]), stream=reader)
    with pytest.raises(FormatError):                                  # part 2 before part 1
        seal.open_sealed(PK, chain[2], seal.KIND_DEVSTATE, len(payloads[2]), stream=reader)
    with pytest.raises(FormatError, match="broke off"):
        seal.open_sealed(PK, chain[1], seal.KIND_DEVSTATE, len(payloads[1]), stream=reader)
    damaged = bytearray(chain[1])
    damaged[60] ^= 1
    reader = compress.StreamReader()
    seal.open_sealed(PK, chain[0], seal.KIND_DEVSTATE, len(payloads[0]), stream=reader)
    with pytest.raises(IntegrityError):
        seal.open_sealed(PK, bytes(damaged), seal.KIND_DEVSTATE, len(payloads[1]), stream=reader)
    with pytest.raises(FormatError, match="only device state"):
        seal.seal_stream(PK, seal.KIND_BOOT, payloads)
    from parcels.testvectors.generate import PK_BLOB, blob_raw
    boot = blob_raw(compress.compress(b"kernel"), kind=seal.KIND_BOOT, length=6,
                    compression=seal.COMPRESSION_ZSTD_STREAM)
    with pytest.raises(FormatError, match="unknown compression 3"):
        seal.open_sealed(PK_BLOB, boot, seal.KIND_BOOT, 100, stream=compress.StreamReader())


def sample_manifest(version: int = 1, **changes: Any) -> Manifest:
    disk_chunks = 3
    m = Manifest(
        parcel=uuid.UUID("6f1c2a4e-8d3b-4f0e-9a55-0c1d2e3f4a5b"), name="workstation", version=version,
        parent=None if version == 1 else version - 1, created="2026-11-22T04:40:32Z", chunk_size=131072,
        images={"disk": ImageInfo(size=64 * MIB, keyring_sha256=bytes(32), keyring_size=28 + 81 * disk_chunks,
                                  chunks=disk_chunks),
                "memory": ImageInfo(size=256 * MIB, keyring_sha256=bytes(range(32)), keyring_size=28, chunks=0)},
        blobs={"kernel": BlobInfo(kind=4, sha256=bytes(32), size=1000)},
        vm=VMConfig(machine="pc-q35-7.2", cpu="qemu64", ram_mib=256, smp=2, devices={"disk": "virtio-blk"},
                    boot=BootConfig(kernel="kernel", cmdline="console=ttyS0")),
        suspended=False, working_set={"disk": [2, 0], "memory": []},
        timestamps=Timestamps(created="2026-11-22T04:40:32Z"))
    return dataclasses.replace(m, **changes)


def test_every_byte_flip_of_a_sealed_manifest_is_detected() -> None:
    m = sample_manifest()
    blob = manifest.seal_manifest(PK, m)
    assert manifest.open_manifest(PK, blob, parcel=m.parcel, version=1) == m
    for pos in range(len(blob)):
        damaged = bytearray(blob)
        damaged[pos] ^= 0x04
        with pytest.raises((FormatError, IntegrityError)):
            manifest.open_manifest(PK, bytes(damaged), parcel=m.parcel, version=1)


# --- key envelopes ----------------------------------------------------------------------------------------------

def test_envelope_with_default_scrypt_parameters() -> None:
    parcel_id = uuid.uuid4()
    data = envelope.wrap_envelope(parcel_id, PK, SECRET, passphrase=PASS)
    assert len(data) == 148 and data[56] == 15 and data[60:68] == b"\x00\x00\x00\x08\x00\x00\x00\x01"
    assert envelope.unwrap_envelope(data, passphrase=PASS, expect_uuid=parcel_id) == (parcel_id, PK, SECRET)
    with pytest.raises(WrongKeyError):
        envelope.unwrap_envelope(data, passphrase=PASS + " ")


def test_envelope_with_key_file_and_rewrap() -> None:
    parcel_id = uuid.uuid4()
    keyfile = envelope.new_keyfile()
    assert len(keyfile) == 32 and keyfile != envelope.new_keyfile()
    data = envelope.wrap_envelope(parcel_id, PK, SECRET, keyfile=keyfile)
    assert data[5] == 2 and data[56:68] == bytes(12)
    assert envelope.unwrap_envelope(data, keyfile=keyfile) == (parcel_id, PK, SECRET)
    # Changing the credential rewraps the same secrets under a fresh salt.
    rewrapped = envelope.wrap_envelope(parcel_id, PK, SECRET, passphrase="new", log2n=FAST)
    assert rewrapped[24:56] != data[24:56]
    assert envelope.unwrap_envelope(rewrapped, passphrase="new") == (parcel_id, PK, SECRET)
    with pytest.raises(WrongKeyError):
        envelope.unwrap_envelope(data, keyfile=envelope.new_keyfile())
    with pytest.raises(WrongKeyError):
        envelope.unwrap_envelope(data, passphrase=PASS)
    with pytest.raises(IntegrityError):
        envelope.unwrap_envelope(data, keyfile=keyfile, expect_uuid=uuid.uuid4())
    with pytest.raises(FormatError):
        envelope.unwrap_envelope(data, keyfile=keyfile, passphrase=PASS)


def test_scrypt_parameters_are_checked_before_scrypt_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    good = envelope.wrap_envelope(uuid.uuid4(), PK, SECRET, passphrase=PASS, log2n=FAST)

    def scrypt_must_not_run(*args: object) -> bytes:
        raise AssertionError("scrypt ran with out-of-range parameters")

    monkeypatch.setattr(crypto, "scrypt", scrypt_must_not_run)
    for log2n, r, p in ((22, 32, 16), (9, 8, 1), (23, 8, 1), (10, 0, 1), (10, 33, 1), (10, 8, 0), (10, 8, 17),
                        (17, 8, 9)):
        data = bytearray(good)
        data[56] = log2n
        data[60:64] = r.to_bytes(4, "big")
        data[64:68] = p.to_bytes(4, "big")
        with pytest.raises(FormatError):
            envelope.unwrap_envelope(bytes(data), passphrase=PASS)
        with pytest.raises(FormatError):
            envelope.wrap_envelope(uuid.uuid4(), PK, SECRET, passphrase=PASS, log2n=log2n, r=r, p=p)
    envelope.check_scrypt_params(16, 8, 16)         # exactly 1 GiB is allowed


def test_every_byte_flip_of_an_envelope_is_detected() -> None:
    parcel_id = uuid.uuid4()
    keyfile = envelope.new_keyfile()
    data = envelope.wrap_envelope(parcel_id, PK, SECRET, keyfile=keyfile)
    for pos in range(len(data)):
        damaged = bytearray(data)
        damaged[pos] ^= 0x01
        with pytest.raises((FormatError, IntegrityError, WrongKeyError)):
            envelope.unwrap_envelope(bytes(damaged), keyfile=keyfile, expect_uuid=parcel_id)


# --- keyrings --------------------------------------------------------------------------------------------------

def random_records(rng: random.Random, count: int, n: int) -> list[KeyringRecord]:
    indices = sorted(rng.sample(range(count), n))
    return [KeyringRecord(i, rng.randrange(2), rng.randbytes(32),
                          keyring.wrap_chunk_key(PK, rng.randbytes(32))) for i in indices]


def test_keyring_stream_round_trips_random_keyrings() -> None:
    rng = random.Random(42)
    for _ in range(50):
        chunk_size = 1 << rng.randrange(12, 23)
        image_size = rng.randrange(0, 1 << 40)
        count = chunk.chunk_count(chunk_size, image_size)
        records = random_records(rng, count, min(count, rng.randrange(0, 40)))
        stream = keyring.encode_stream(chunk_size, image_size, records)
        assert len(stream) == 28 + 81 * len(records)
        assert keyring.decode_stream(stream) == (chunk_size, image_size, records)


def test_chunk_key_wrapping() -> None:
    key = os.urandom(32)
    wrapped = keyring.wrap_chunk_key(PK, key)
    assert len(wrapped) == 40 and wrapped == keyring.wrap_chunk_key(PK, key)
    assert keyring.unwrap_chunk_key(PK, wrapped) == key
    with pytest.raises(IntegrityError):
        keyring.unwrap_chunk_key(bytes(32), wrapped)
    with pytest.raises(IntegrityError):
        keyring.unwrap_chunk_key(PK, wrapped[:-1] + bytes([wrapped[-1] ^ 1]))


def test_encode_stream_refuses_invalid_records() -> None:
    tag, wkey = bytes(32), bytes(40)
    for records in ([KeyringRecord(2, 0, tag, wkey), KeyringRecord(1, 0, tag, wkey)],
                    [KeyringRecord(1, 0, tag, wkey), KeyringRecord(1, 0, tag, wkey)],
                    [KeyringRecord(8, 0, tag, wkey)], [KeyringRecord(0, 2, tag, wkey)],
                    [KeyringRecord(0, 0, tag[:31], wkey)], [KeyringRecord(-1, 0, tag, wkey)]):
        with pytest.raises(FormatError):
            keyring.encode_stream(4096, 8 * 4096, records)
    with pytest.raises(FormatError):
        keyring.encode_stream(1000, 4096, [])


def test_sqlite_keyring_has_the_spec_schema(tmp_path: Path) -> None:
    path = tmp_path / "disk.db"
    with Keyring.create(path, 131072, 64 * MIB):
        pass
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA application_id").fetchone() == (0x49535231,)
        assert db.execute("PRAGMA user_version").fetchone() == (1,)
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        tables = dict(db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'"))
        assert set(tables) == {"meta", "chunks"}
        assert "CHECK (length(tag) = 32)" in tables["chunks"] and "CHECK (flags BETWEEN 0 AND 255)" in tables["chunks"]
        assert dict(db.execute("SELECT name, value FROM meta")) == {"chunk_size": 131072, "image_size": 64 * MIB}
        with pytest.raises(sqlite3.IntegrityError):
            db.execute("INSERT INTO chunks VALUES (0, x'00', x'00', 0)")
    finally:
        db.close()


def test_sqlite_keyring_records_import_and_export(tmp_path: Path) -> None:
    rng = random.Random(5)
    records = random_records(rng, 500, 60)         # indices below 500 of 512 chunks
    stream = keyring.encode_stream(131072, 64 * MIB, records)
    path = tmp_path / "disk.db"
    with Keyring.create(path, 4096, 4096) as db:
        db.import_stream(stream)
        assert (db.chunk_size, db.image_size, db.chunk_count) == (131072, 64 * MIB, 512)
        assert list(db) == records and len(db) == 60
        assert db.export_stream() == stream and db.digest() == hashlib.sha256(stream).digest()
        new = KeyringRecord(511, 1, bytes(32), bytes(40))
        db.put(new)
        assert db.get(511) == new and db.get(510) is None and db.get(records[5].idx) == records[5]
        db.put(records[5]._replace(flags=1 - records[5].flags))
        assert db.get(records[5].idx) == records[5]._replace(flags=1 - records[5].flags)
        db.put(records[5])
        db.delete(records[0].idx)
        db.delete(99999)
        assert list(db) == [*records[1:], new]
        with pytest.raises(FormatError):
            db.put(KeyringRecord(512, 0, bytes(32), bytes(40)))
        with pytest.raises(FormatError):
            db.put(KeyringRecord(3, 4, bytes(32), bytes(40)))
        # A bad stream changes nothing.
        before = db.export_stream()
        with pytest.raises(FormatError):
            db.import_stream(stream[:-1])
        assert db.export_stream() == before
    with Keyring.open(path) as db:
        assert db.export_stream() == before
        db.import_stream(keyring.encode_stream(4096, 8192, []))
        assert len(db) == 0 and (db.chunk_size, db.image_size) == (4096, 8192)


def test_sqlite_keyring_put_many_is_atomic(tmp_path: Path) -> None:
    with Keyring.create(tmp_path / "k.db", 4096, 4096 * 4) as db:
        with pytest.raises(FormatError):
            db.put_many([KeyringRecord(0, 0, bytes(32), bytes(40)), KeyringRecord(9, 0, bytes(32), bytes(40))])
        assert len(db) == 0
        db.put_many([KeyringRecord(i, 0, bytes(32), bytes(40)) for i in range(4)])
        assert len(db) == 4


def test_sqlite_keyring_open_validates(tmp_path: Path) -> None:
    with pytest.raises(StoreError):
        Keyring.open(tmp_path / "missing.db")
    assert not (tmp_path / "missing.db").exists()
    (tmp_path / "text.db").write_text("not a database, just some text that is long enough" * 100)
    with pytest.raises(FormatError):
        Keyring.open(tmp_path / "text.db")
    other = sqlite3.connect(tmp_path / "other.db")
    other.execute("CREATE TABLE t (x)")
    other.commit()
    other.close()
    with pytest.raises(FormatError):
        Keyring.open(tmp_path / "other.db")
    path = tmp_path / "k.db"
    Keyring.create(path, 4096, 4096).close()
    with pytest.raises(StoreError):
        Keyring.create(path, 4096, 4096)
    # Other components may add tables of their own.
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE dirty (idx INTEGER PRIMARY KEY)")
    db.execute("UPDATE meta SET value = 5000 WHERE name = 'chunk_size'")
    db.commit()
    db.close()
    with pytest.raises(FormatError):
        Keyring.open(path)


# --- manifests -----------------------------------------------------------------------------------------------

def test_manifest_json_is_canonical_and_round_trips() -> None:
    m = sample_manifest()
    data = m.to_json()
    obj = json.loads(data)
    assert data == json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    assert obj["parcel"] == str(m.parcel) and obj["images"]["disk"]["keyring"]["size"] == 28 + 81 * 3
    assert Manifest.from_json(data) == m
    obj["a_future_field"] = {"x": 1}
    obj["vm"]["another"] = []
    assert Manifest.from_json(json.dumps(obj).encode()) == m


@pytest.mark.parametrize("change, message", [
    (dict(format=2), "format"), (dict(name=""), "name"), (dict(parent=0), "parent"),
    (dict(chunk_size=1000), "chunk size"), (dict(created="yesterday"), "created"),
    (dict(working_set={"disk": [600], "memory": []}), "working_set"),
    (dict(working_set={"disk": [1, 1], "memory": []}), "working_set"),
    (dict(suspended=True), "devstate"),
    (dict(blobs={}), "boot"),
])
def test_manifest_rules(change: dict[str, Any], message: str) -> None:
    m = sample_manifest(**change)
    with pytest.raises(FormatError, match=message):
        m.validate()
    with pytest.raises(FormatError):
        manifest.seal_manifest(PK, m)


def test_manifest_memory_size_must_match_ram() -> None:
    m = sample_manifest()
    m.vm.ram_mib = 512
    with pytest.raises(FormatError, match="ram_mib"):
        m.validate()


def test_open_manifest_checks_parcel_and_version() -> None:
    m = sample_manifest(version=3)
    blob = manifest.seal_manifest(PK, m)
    assert manifest.open_manifest(PK, blob, parcel=m.parcel, version=3).parent == 2
    with pytest.raises(IntegrityError):
        manifest.open_manifest(PK, blob, parcel=uuid.uuid4(), version=3)
    with pytest.raises(IntegrityError):
        manifest.open_manifest(PK, blob, parcel=m.parcel, version=4)
    with pytest.raises(FormatError):
        manifest.open_manifest(PK, seal.seal(PK, seal.KIND_DEVSTATE, m.to_json()), parcel=m.parcel, version=3)


# --- the directory store -------------------------------------------------------------------------------------

def test_store_layout_and_chunk_verification(tmp_path: Path) -> None:
    store = DirStore(tmp_path)
    encoded = chunk.encode_chunk(b"hello" * 1000, SECRET)
    hexname = encoded.tag.hex()
    assert store.put_chunk(encoded.tag, encoded.data) is True
    path = tmp_path / "chunks" / hexname[:2] / hexname[2:4] / hexname
    assert path.read_bytes() == encoded.data
    assert store.has_chunk(encoded.tag) and store.get_chunk(encoded.tag) == encoded.data
    with pytest.raises(IntegrityError):
        store.put_chunk(encoded.tag, encoded.data + b"x")
    with pytest.raises(NotFoundError):
        store.get_chunk(bytes(32))
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.rglob("*"))


def test_store_never_replaces_a_chunk_and_quarantines_corruption(tmp_path: Path) -> None:
    store = DirStore(tmp_path)
    encoded = chunk.encode_chunk(text_bytes(3000), SECRET)
    store.put_chunk(encoded.tag, encoded.data)
    path = store.chunk_path(encoded.tag)
    inode = path.stat().st_ino
    assert store.put_chunk(encoded.tag, encoded.data) is False
    assert path.stat().st_ino == inode
    # Rot one byte: a later writer still does not replace the file, a reader refuses and quarantines it.
    rotten = bytearray(encoded.data)
    rotten[40] ^= 1
    path.write_bytes(rotten)
    assert store.put_chunk(encoded.tag, encoded.data) is False and path.read_bytes() == rotten
    with pytest.raises(IntegrityError):
        store.get_chunk(encoded.tag)
    assert not path.exists()
    assert [p.read_bytes() for p in (tmp_path / "quarantine").iterdir()] == [bytes(rotten)]
    assert store.put_chunk(encoded.tag, encoded.data) is True
    assert store.get_chunk(encoded.tag) == encoded.data


def test_store_write_is_atomic_when_fsync_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = DirStore(tmp_path)
    parcel_id = uuid.uuid4()
    store.put_blob(parcel_id, 1, "keyring.disk", b"old")

    def failing_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(StoreError):
        store.put_blob(parcel_id, 1, "keyring.disk", b"new")
    encoded = chunk.encode_chunk(b"abc" * 999, SECRET)
    with pytest.raises(StoreError):
        store.put_chunk(encoded.tag, encoded.data)
    monkeypatch.undo()
    assert store.get_blob(parcel_id, 1, "keyring.disk") == b"old"
    assert not store.has_chunk(encoded.tag)
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.rglob("*"))


def test_store_lists_only_committed_versions_and_published_parcels(tmp_path: Path) -> None:
    store = DirStore(tmp_path)
    parcel_id = uuid.uuid4()
    assert store.parcels() == [] and store.versions(parcel_id) == []
    store.put_blob(parcel_id, 1, "keyring.disk", b"k")
    assert store.versions(parcel_id) == []
    store.put_blob(parcel_id, 1, "manifest", b"m")
    store.put_blob(parcel_id, 10, "manifest", b"m")
    (tmp_path / "parcels" / str(parcel_id) / "versions" / "07").mkdir()
    assert store.versions(parcel_id) == [1, 10]
    assert store.parcels() == []
    with pytest.raises(StoreError):
        store.put_blob(parcel_id, 1, "devstate", b"too late")
    for bad in ("../x", "Kernel", ".tmp-1", ""):
        with pytest.raises(FormatError):
            store.put_blob(parcel_id, 2, bad, b"x")
    env = envelope.wrap_envelope(parcel_id, PK, SECRET, keyfile=bytes(32))
    with pytest.raises(IntegrityError):
        store.put_envelope(uuid.uuid4(), env)
    store.put_envelope(parcel_id, env)
    assert store.parcels() == [parcel_id] and store.get_envelope(parcel_id) == env
    with pytest.raises(NotFoundError):
        store.get_envelope(uuid.uuid4())


# --- whole parcels -----------------------------------------------------------------------------------------------

def write_test_image(path: Path, size: int = 64 * MIB) -> set[int]:
    """A sparse image with random, compressible, duplicate and explicitly zero regions; returns the
    indices of its nonzero 128 KiB chunks."""
    rng = random.Random(99)
    with open(path, "wb") as f:
        f.truncate(size)
        regions = [(0, rng.randbytes(4096)), (1 * MIB + 100, rng.randbytes(3 * MIB)),
                   (10 * MIB, text_bytes(2 * MIB)), (20 * MIB, bytes(4 * MIB)),          # written zeros
                   (30 * MIB, rng.randbytes(131072)), (31 * MIB, b""), (size - 700, b"tail" * 100)]
        duplicate = rng.randbytes(131072)
        regions += [(40 * MIB, duplicate), (41 * MIB, duplicate)]
        for offset, data in regions:
            f.seek(offset)
            f.write(data)
    nonzero = set()
    with open(path, "rb") as f:
        index = 0
        while block := f.read(131072):
            if any(block):
                nonzero.add(index)
            index += 1
    return nonzero


def same_content(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(MIB), fb.read(MIB)
            if x != y:
                return False
            if not x:
                return True


@pytest.fixture(scope="module")
def image64(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[int]]:
    path = tmp_path_factory.mktemp("image") / "disk.raw"
    return path, write_test_image(path)


@pytest.fixture
def created(tmp_path: Path, image64: tuple[Path, set[int]]) -> Iterator[tuple[DirStore, uuid.UUID]]:
    store = DirStore(tmp_path / "store")
    yield store, parcel.create_parcel(store, name="test", disk=image64[0], ram_mib=32, passphrase=PASS, log2n=FAST)


def test_read_chunks_skips_holes_and_zero_chunks(image64: tuple[Path, set[int]]) -> None:
    path, nonzero = image64
    found = [index for index, data in read_chunks(path, path.stat().st_size, 131072)]
    assert found == sorted(nonzero)


def test_create_and_extract_a_sparse_64_mib_image(tmp_path: Path, image64: tuple[Path, set[int]],
                                                  created: tuple[DirStore, uuid.UUID]) -> None:
    path, nonzero = image64
    store, parcel_id = created
    assert store.parcels() == [parcel_id] and store.versions(parcel_id) == [1]
    keys = parcel.unlock(store, parcel_id, passphrase=PASS)
    contents = parcel.open_version(store, parcel_id, 1, keys)
    m = contents.manifest
    assert (m.name, m.version, m.parent, m.suspended, m.chunk_size) == ("test", 1, None, False, 131072)
    assert (m.vm.machine, m.vm.cpu, m.vm.smp, m.vm.ram_mib) == ("pc-q35-7.2", "qemu64", 1, 32)
    assert m.images["disk"].size == 64 * MIB and m.images["memory"].size == 32 * MIB
    assert [r.idx for r in contents.disk] == sorted(nonzero) and contents.memory == []
    # The two equal chunks share one object.
    objects = [p for p in (store.root / "chunks").rglob("*") if p.is_file()]
    assert len(objects) == len(nonzero) - 1
    assert store.missing_pieces(parcel_id, 1, keys.parcel_key) == []
    assert parcel.verify_version(store, parcel_id, 1, keys) == []

    out = tmp_path / "out.raw"
    progress: list[tuple[int, int]] = []
    parcel.extract_image(store, parcel_id, None, "disk", out, passphrase=PASS,
                         progress=lambda done, total: progress.append((done, total)))
    assert out.stat().st_size == path.stat().st_size and same_content(out, path)
    assert out.stat().st_blocks * 512 < 16 * MIB          # sparse: holes where the chunks were zero
    assert progress[-1] == (64 * MIB, 64 * MIB)
    memory = tmp_path / "memory.raw"
    parcel.extract_image(store, parcel_id, 1, "memory", memory, passphrase=PASS)
    assert memory.stat().st_size == 32 * MIB and memory.stat().st_blocks == 0


def test_create_with_short_last_chunk_boot_files_and_shared_secret(tmp_path: Path) -> None:
    disk = tmp_path / "odd.raw"
    disk.write_bytes(os.urandom(5000) + bytes(1 * MIB) + b"end" * 100 + bytes(332))
    assert disk.stat().st_size % 512 == 0
    kernel, initrd = tmp_path / "vmlinuz", tmp_path / "initrd"
    kernel.write_bytes(b"kernel image " * 1000)
    initrd.write_bytes(os.urandom(2000))
    store = DirStore(tmp_path / "store")
    keyfile = envelope.new_keyfile()
    first = parcel.create_parcel(store, name="boot", disk=disk, ram_mib=16, keyfile=keyfile, chunk_size=4096,
                                 convergence_secret=SECRET, vm={"smp": 2, "devices": {"net": "user"}},
                                 boot={"kernel": kernel, "initrd": initrd, "cmdline": "console=ttyS0"})
    keys = parcel.unlock(store, first, keyfile=keyfile)
    assert keys.convergence_secret == SECRET
    m = parcel.open_version(store, first, 1, keys).manifest
    assert m.vm.boot == BootConfig(kernel="kernel", initrd="initrd", cmdline="console=ttyS0")
    assert m.vm.smp == 2 and m.vm.devices == {"disk": "virtio-blk", "net": "user", "rng": "virtio", "balloon": "virtio",
                                             "display": "vnc"}
    assert parcel.read_blob(store, first, m, "kernel", keys) == kernel.read_bytes()
    assert parcel.read_blob(store, first, m, "initrd", keys) == initrd.read_bytes()
    # Without a memory chunk size of its own, the memory image has the disk's, and the manifest names none.
    assert m.image_chunk_size("memory") == 4096 and m.images["memory"].chunk_size is None
    out = tmp_path / "out.raw"
    parcel.extract_image(store, first, 1, "disk", out, keyfile=keyfile)
    assert out.read_bytes() == disk.read_bytes()
    # The same secret and content dedup across parcels: a second parcel adds no chunk objects.
    before = sorted(p.name for p in (store.root / "chunks").rglob("*") if p.is_file())
    copy = parcel.create_parcel(store, name="copy", disk=disk, ram_mib=16, keyfile=keyfile, chunk_size=4096,
                                convergence_secret=SECRET, memory_chunk_size=32768)
    assert sorted(p.name for p in (store.root / "chunks").rglob("*") if p.is_file()) == before
    # Given one, the memory image has its own chunk size, in the manifest and its keyring.
    contents = parcel.open_version(store, copy, 1, parcel.unlock(store, copy, keyfile=keyfile))
    assert contents.manifest.images["memory"].chunk_size == 32768 and contents.manifest.chunk_size == 4096


def test_create_from_qcow2(tmp_path: Path, image64: tuple[Path, set[int]]) -> None:
    qcow2 = tmp_path / "disk.qcow2"
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(image64[0]), str(qcow2)],
                   check=True, capture_output=True, timeout=60)
    assert qcow2.read_bytes()[:4] == b"QFI\xfb"
    store = DirStore(tmp_path / "store")
    parcel_id = parcel.create_parcel(store, name="q", disk=qcow2, ram_mib=8, passphrase=PASS, log2n=FAST,
                                     tmpdir=tmp_path)
    out = tmp_path / "out.raw"
    parcel.extract_image(store, parcel_id, None, "disk", out, passphrase=PASS)
    assert same_content(out, image64[0])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("isr-convert-")] == []
    broken = tmp_path / "broken.qcow2"
    broken.write_bytes(b"QFI\xfb" + bytes(100))
    with pytest.raises(ImageError):
        parcel.create_parcel(store, name="b", disk=broken, ram_mib=8, passphrase=PASS, log2n=FAST)


def test_wrong_credentials_are_refused(tmp_path: Path, created: tuple[DirStore, uuid.UUID]) -> None:
    store, parcel_id = created
    for creds in ({"passphrase": PASS + "x"}, {"keyfile": envelope.new_keyfile()}):
        with pytest.raises(WrongKeyError):
            parcel.extract_image(store, parcel_id, None, "disk", tmp_path / "out.raw", **creds)
    assert not (tmp_path / "out.raw").exists()
    with pytest.raises(NotFoundError):
        parcel.extract_image(store, uuid.uuid4(), None, "disk", tmp_path / "out.raw", passphrase=PASS)


def test_corruption_is_detected_and_leaves_no_output(tmp_path: Path, created: tuple[DirStore, uuid.UUID]) -> None:
    store, parcel_id = created
    keys = parcel.unlock(store, parcel_id, passphrase=PASS)
    victim = parcel.open_version(store, parcel_id, 1, keys).disk[3]
    path = store.chunk_path(victim.tag)
    data = bytearray(path.read_bytes())
    data[100] ^= 0x10
    path.write_bytes(data)
    out = tmp_path / "out.raw"
    with pytest.raises(IntegrityError):
        parcel.extract_image(store, parcel_id, 1, "disk", out, passphrase=PASS)
    assert list(tmp_path.glob("*out.raw*")) == []
    # The corrupt object went to quarantine, so the version is now incomplete.
    assert store.missing_pieces(parcel_id, 1, keys.parcel_key) == [f"chunk {victim.tag.hex()}"]
    problems = parcel.verify_version(store, parcel_id, 1, keys)
    assert len(problems) == 1 and f"disk chunk {victim.idx}" in problems[0]
    (store.version_dir(parcel_id, 1) / "keyring.memory").write_bytes(b"garbage")
    with pytest.raises(FormatError):
        parcel.open_version(store, parcel_id, 1, keys)


def test_create_refuses_bad_input_and_publishes_nothing(tmp_path: Path) -> None:
    store = DirStore(tmp_path / "store")
    odd = tmp_path / "odd.raw"
    odd.write_bytes(b"x" * 1000)
    with pytest.raises(ImageError):
        parcel.create_parcel(store, name="odd", disk=odd, ram_mib=8, passphrase=PASS, log2n=FAST)
    with pytest.raises(ImageError):
        parcel.create_parcel(store, name="none", disk=tmp_path / "missing", ram_mib=8, passphrase=PASS, log2n=FAST)
    for bad in (dict(name=""), dict(ram_mib=0), dict(chunk_size=1000), dict(passphrase=None),
                dict(keyfile=b"short"), dict(vm={"machine": "q35"}), dict(vm={"colour": "red"})):
        args: dict[str, Any] = {"name": "x", "disk": odd, "ram_mib": 8, "passphrase": PASS, "log2n": FAST, **bad}
        if "keyfile" in bad:
            args.pop("passphrase")
        with pytest.raises(FormatError):
            parcel.create_parcel(store, **args)
    assert store.parcels() == []


# --- the command line ----------------------------------------------------------------------------------------------

def run_cli(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "parcels", *map(str, args)], capture_output=True, text=True,
                          timeout=CLI_TIMEOUT, env={**os.environ, **(env or {})})


def test_cli_create_info_verify_extract(tmp_path: Path) -> None:
    disk = tmp_path / "disk.raw"
    write_test_image(disk, 8 * MIB)
    store = tmp_path / "store"
    env = {"ISR_TEST_PASS": PASS}
    creds = ["--passphrase-env", "ISR_TEST_PASS"]
    created = run_cli("create", "--store", store, "--name", "cli", "--disk", disk, "--ram-mib", 16,
                      "--scrypt-log2n", FAST, *creds, env=env)
    assert created.returncode == 0, created.stderr
    parcel_id = uuid.UUID(created.stdout.strip())

    listing = run_cli("info", "--store", store)
    assert listing.returncode == 0 and listing.stdout == f"{parcel_id}  versions: 1\n"
    info = run_cli("info", "--store", store, "--parcel", parcel_id, *creds, env=env)
    assert info.returncode == 0 and "'cli'" in info.stdout and "version 1" in info.stdout
    as_json = run_cli("info", "--store", store, "--parcel", parcel_id, "--json", *creds, env=env)
    assert json.loads(as_json.stdout)["parcel"] == str(parcel_id)

    verified = run_cli("verify", "--store", store, "--parcel", parcel_id, "--all", *creds, env=env)
    assert verified.returncode == 0 and verified.stdout == "version 1: ok\n"
    out = tmp_path / "out.raw"
    extracted = run_cli("extract", "--store", store, "--parcel", parcel_id, "--out", out, *creds, env=env)
    assert extracted.returncode == 0, extracted.stderr
    assert out.read_bytes() == disk.read_bytes()

    wrong = run_cli("extract", "--store", store, "--parcel", parcel_id, "--out", tmp_path / "x", *creds,
                    env={"ISR_TEST_PASS": "wrong"})
    assert wrong.returncode == 1 and wrong.stdout == ""
    assert wrong.stderr.startswith("python -m parcels: error: wrong passphrase") and wrong.stderr.count("\n") == 1
    unset = run_cli("verify", "--store", store, "--parcel", parcel_id, "--passphrase-env", "ISR_TEST_UNSET_VAR")
    assert unset.returncode == 1 and "ISR_TEST_UNSET_VAR" in unset.stderr

    victim = next(p for p in (store / "chunks").rglob("*") if p.is_file())
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(data)
    broken = run_cli("verify", "--store", store, "--parcel", parcel_id, *creds, env=env)
    assert broken.returncode == 1 and "version 1: FAILED" in broken.stdout


def test_cli_with_a_new_key_file_and_help(tmp_path: Path) -> None:
    disk = tmp_path / "disk.raw"
    disk.write_bytes(os.urandom(4096) + bytes(4096))
    keyfile, store = tmp_path / "key", tmp_path / "store"
    created = run_cli("create", "--store", store, "--name", "kf", "--disk", disk, "--ram-mib", 4,
                      "--new-keyfile", keyfile)
    assert created.returncode == 0, created.stderr
    assert len(keyfile.read_bytes()) == 32 and keyfile.stat().st_mode & 0o077 == 0
    again = run_cli("create", "--store", store, "--name", "kf", "--disk", disk, "--ram-mib", 4,
                    "--new-keyfile", keyfile)
    assert again.returncode == 1 and "already exists" in again.stderr
    out = tmp_path / "out.raw"
    extracted = run_cli("extract", "--store", store, "--parcel", created.stdout.strip(), "--out", out,
                        "--keyfile", keyfile)
    assert extracted.returncode == 0 and out.read_bytes() == disk.read_bytes()
    helped = run_cli("--help")
    assert helped.returncode == 0
    assert all(word in helped.stdout for word in ("create", "extract", "info", "verify", "--passphrase-env"))
    usage = run_cli("create", "--store", store)
    assert usage.returncode == 2


def test_public_errors_share_one_root() -> None:
    for error in (FormatError, IntegrityError, WrongKeyError, StoreError, NotFoundError, ImageError):
        assert issubclass(error, ParcelError)
    assert not issubclass(WrongKeyError, IntegrityError)       # callers must be able to tell these apart


# --- the resume pack ---------------------------------------------------------------------------------------

def test_resume_pack_round_trip_and_refusals() -> None:
    size = 1 << 20
    payload = resumepack.encode(size, [(4096, b"a" * 100), (8192, b"b" * 4096)])
    decoded = resumepack.decode(payload, size)
    assert [(e.offset, e.length, bytes(data)) for e, data in decoded] == [(4096, 100, b"a" * 100),
                                                                         (8192, 4096, b"b" * 4096)]
    assert resumepack.decode(resumepack.encode(size, []), size) == []
    with pytest.raises(FormatError, match="for an image of 1048576 bytes, not 2097152"):
        resumepack.decode(payload, 2 * size)
    with pytest.raises(FormatError, match="wrong magic"):
        resumepack.decode(b"ISRX" + payload[4:], size)
    with pytest.raises(FormatError, match="hold 4196 bytes, but 4195 follow them"):
        resumepack.decode(payload[:-1], size)
    with pytest.raises(FormatError, match="out of order, overlapping"):
        resumepack.encode(size, [(8192, b"x"), (4096, b"y")])
    with pytest.raises(FormatError, match="beyond the image"):
        resumepack.encode(size, [(size - 10, b"z" * 11)])
    overlapping = bytearray(payload)
    resumepack.EXTENT.pack_into(overlapping, resumepack.HEADER.size + resumepack.EXTENT.size, 4100, 4096)
    with pytest.raises(FormatError, match="extent 1 is empty, out of order, overlapping"):
        resumepack.decode(bytes(overlapping), size)


def test_resume_pack_version_2_carries_the_map_of_the_parts_to_come() -> None:
    size = 1 << 20
    entries = [resumepack.MapEntry(0, 8192, 1), resumepack.MapEntry(65536, 4096, 255)]
    payload = resumepack.encode(size, [(4096, b"a" * 100)], entries)
    assert payload[4] == 2 and resumepack.decode_map(payload, size) == entries
    assert [(e.offset, bytes(data)) for e, data in resumepack.decode(payload, size)] == [(4096, b"a" * 100)]
    # Without a map the payload stays version 1, which readers before the map take.
    assert resumepack.encode(size, [(4096, b"a")])[4] == 1
    for bad, why in (([resumepack.MapEntry(0, 4096, 0)], "names part 0"),
                     ([resumepack.MapEntry(0, 4096, resumepack.PARTS_MAX)], f"names part {resumepack.PARTS_MAX}"),
                     ([resumepack.MapEntry(8192, 4096, 1), resumepack.MapEntry(0, 4096, 2)], "map entry 1 is empty"),
                     ([resumepack.MapEntry(size - 4096, 8192, 1)], "beyond the image")):
        with pytest.raises(FormatError, match=why):
            resumepack.encode(size, [], bad)
    # A reader checks the map as strictly as the extents.
    damaged = bytearray(payload)
    resumepack.MAP_ENTRY.pack_into(damaged, resumepack.HEADER_V2.size + resumepack.EXTENT.size, 0, 8192, 0)
    with pytest.raises(FormatError, match="names part 0"):
        resumepack.decode(bytes(damaged), size)
    with pytest.raises(FormatError, match="do not fit"):
        resumepack.decode(payload[:resumepack.HEADER_V2.size + 20], size)
    assert resumepack.part_index("resumepack") == 0 and resumepack.part_index("resumepack.17") == 17
    for name in ("resumepack.0", "resumepack.017", "resumepack.x", f"resumepack.{resumepack.PARTS_MAX}", "devstate"):
        with pytest.raises(FormatError, match="does not name a resume pack part"):
            resumepack.part_index(name)


def test_resume_pack_parts_are_named_in_order() -> None:
    assert [resumepack.part_name(i) for i in range(3)] == ["resumepack", "resumepack.1", "resumepack.2"]
    assert resumepack.is_part("resumepack") and resumepack.is_part("resumepack.31")
    assert not resumepack.is_part("resumepack.x") and not resumepack.is_part("devstate")
    with pytest.raises(FormatError, match=f"at most {resumepack.PARTS_MAX} parts"):
        resumepack.part_name(resumepack.PARTS_MAX)
