"""The C codecs (vulpes-codec, built from vulpes/src) and the Python codecs (parcels/) against each other.

Every object crosses in both directions: written by Python and read by C, written by C and read by
Python. Covers chunks (compressible, incompressible, short last chunk), sealed blobs, key envelopes
(scrypt with log2N = 10 and the defaults, key file), keyring streams and sqlite keyrings (import and
export in C, digests equal, a database written by one opened by the other), and manifests.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import uuid
from pathlib import Path

import pytest

from parcels import resumepack
from parcels import seal as pseal
from parcels.chunk import decode_chunk, encode_chunk
from parcels.envelope import unwrap_envelope, wrap_envelope
from parcels.errors import FormatError, IntegrityError, ParcelError
from parcels.keyring import (Keyring, KeyringRecord, decode_stream, encode_stream, unwrap_chunk_key,
                             wrap_chunk_key)
from parcels.manifest import (BlobInfo, ImageInfo, Manifest, Timestamps, VMConfig, open_manifest,
                              seal_manifest)

pytestmark = pytest.mark.timeout(120)

CODEC_TIMEOUT = 60


@pytest.fixture(scope="session")
def codec(build_dir: Path) -> Path:
    path = build_dir / "vulpes" / "vulpes-codec"
    if not path.is_file():
        pytest.fail(f"{path} is not built: run ninja -C {build_dir}")
    return path


def run_codec(codec: Path, *args: object, env: dict[str, str] | None = None) -> dict[str, str]:
    """Run vulpes-codec; return its key=value lines. Fails the test if it does not succeed."""
    cmd = [str(codec), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CODEC_TIMEOUT,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}"
    assert proc.stderr == "", f"{' '.join(cmd)} wrote to stderr: {proc.stderr}"
    return dict(line.split("=", 1) for line in proc.stdout.splitlines())


def codec_refuses(codec: Path, *args: object, env: dict[str, str] | None = None, reason: str | None = None) -> str:
    """Run vulpes-codec expecting it to reject its input: exit 1 and exactly one line on stderr. With
    ``reason``, run it again with its debug log on (VULPES_CODEC_DEBUG) and check that the library refused
    for that reason, not for another one that happens to give the same one-line error."""
    cmd = [str(codec), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CODEC_TIMEOUT,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 1, f"{' '.join(cmd)} exited {proc.returncode}, expected 1: {proc.stderr}"
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    if reason is not None:
        debug = subprocess.run(cmd, capture_output=True, text=True, timeout=CODEC_TIMEOUT,
                               env={**os.environ, **(env or {}), "VULPES_CODEC_DEBUG": "1"})
        assert debug.returncode == 1 and reason in debug.stderr, (reason, debug.stderr)
    return proc.stderr


def text_bytes(n: int) -> bytes:
    words = b"suspend resume parcel chunk keyring manifest envelope "
    return (words * (n // len(words) + 1))[:n]


# --- chunks -----------------------------------------------------------------------------------------

CHUNK_CASES = {
    "compressible": text_bytes(131072),
    "incompressible": secrets.token_bytes(131072),
    "short-last-compressible": text_bytes(131072)[:5000],
    "short-last-incompressible": secrets.token_bytes(777),
    "one-byte": b"\x01",
    "largest": text_bytes(4194304),
}


@pytest.mark.parametrize("case", CHUNK_CASES)
def test_chunk_python_to_c(codec: Path, tmp_path: Path, case: str) -> None:
    plaintext = CHUNK_CASES[case]
    secret = secrets.token_bytes(32)
    enc = encode_chunk(plaintext, secret, level=3)
    (tmp_path / "obj").write_bytes(enc.data)
    run_codec(codec, "chunk-decode", enc.tag.hex(), enc.key.hex(), len(plaintext), tmp_path / "obj", tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == plaintext

    # C encodes the same plaintext: same flags; byte-identical when uncompressed (no zstd involved).
    (tmp_path / "pt").write_bytes(plaintext)
    out = run_codec(codec, "chunk-encode", secret.hex(), tmp_path / "pt", tmp_path / "cobj")
    assert int(out["flags"]) == enc.flags
    if enc.flags == 0:
        assert (tmp_path / "cobj").read_bytes() == enc.data
        assert out["tag"] == enc.tag.hex() and out["key"] == enc.key.hex()


@pytest.mark.parametrize("case", CHUNK_CASES)
def test_chunk_c_to_python(codec: Path, tmp_path: Path, case: str) -> None:
    plaintext = CHUNK_CASES[case]
    secret = secrets.token_bytes(32)
    (tmp_path / "pt").write_bytes(plaintext)
    out = run_codec(codec, "chunk-encode", secret.hex(), tmp_path / "pt", tmp_path / "obj")
    data = (tmp_path / "obj").read_bytes()
    assert int(out["length"]) == len(data)
    assert hashlib.sha256(data).hexdigest() == out["tag"]
    assert decode_chunk(data, bytes.fromhex(out["tag"]), bytes.fromhex(out["key"]), len(plaintext)) == plaintext


def test_chunk_damage_rejected_by_both(codec: Path, tmp_path: Path) -> None:
    plaintext = text_bytes(10000)
    enc = encode_chunk(plaintext, secrets.token_bytes(32))
    for pos in (0, 5, 11, 12, len(enc.data) // 2, len(enc.data) - 1):
        damaged = bytearray(enc.data)
        damaged[pos] ^= 0x40
        tag = hashlib.sha256(damaged).digest()     # a consistent name, so the later checks must catch it
        (tmp_path / "obj").write_bytes(damaged)
        codec_refuses(codec, "chunk-decode", tag.hex(), enc.key.hex(), len(plaintext), tmp_path / "obj", tmp_path / "out")
        with pytest.raises(ParcelError):
            decode_chunk(bytes(damaged), tag, enc.key, len(plaintext))
    assert not (tmp_path / "out").exists()
    (tmp_path / "obj").write_bytes(enc.data)
    codec_refuses(codec, "chunk-decode", enc.tag.hex(), enc.key.hex(), len(plaintext) - 1, tmp_path / "obj", tmp_path / "out")


# --- sealed blobs -----------------------------------------------------------------------------------

BLOB_CASES = {
    "manifest-text": (pseal.KIND_MANIFEST, text_bytes(20000)),
    "keyring-random": (pseal.KIND_KEYRING, secrets.token_bytes(5000)),
    "devstate-empty": (pseal.KIND_DEVSTATE, b""),
    "boot-large": (pseal.KIND_BOOT, text_bytes(3 << 20)),
}


@pytest.mark.parametrize("case", BLOB_CASES)
def test_blob_both_ways(codec: Path, tmp_path: Path, case: str) -> None:
    kind, payload = BLOB_CASES[case]
    pk = secrets.token_bytes(32)
    (tmp_path / "pblob").write_bytes(pseal.seal(pk, kind, payload))
    run_codec(codec, "open", pk.hex(), kind, len(payload), tmp_path / "pblob", tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == payload

    (tmp_path / "payload").write_bytes(payload)
    run_codec(codec, "seal", pk.hex(), kind, tmp_path / "payload", tmp_path / "cblob")
    cblob = (tmp_path / "cblob").read_bytes()
    assert pseal.open_sealed(pk, cblob, kind, len(payload)) == payload
    # Both compress when it helps and store raw otherwise.
    assert cblob[6] == (tmp_path / "pblob").read_bytes()[6]


def test_blob_refusals(codec: Path, tmp_path: Path) -> None:
    pk = secrets.token_bytes(32)
    payload = text_bytes(1000)
    blob = pseal.seal(pk, pseal.KIND_DEVSTATE, payload)
    (tmp_path / "blob").write_bytes(blob)
    wrong_key = secrets.token_bytes(32)
    # (key, kind, limit, why vulpes refuses, what Python raises and says): each refusal for its own reason.
    for key, kind, limit, c_reason, py_error, py_words in (
            (pk, pseal.KIND_BOOT, 1000, f"kind {pseal.KIND_DEVSTATE}, expected {pseal.KIND_BOOT}", FormatError,
             f"kind {pseal.KIND_DEVSTATE}, expected {pseal.KIND_BOOT}"),
            (pk, pseal.KIND_DEVSTATE, 999, "above the limit of 999", FormatError, "exceeds the limit of 999"),
            (wrong_key, pseal.KIND_DEVSTATE, 1000, "GCM authentication failed", IntegrityError,
             "AES-GCM authentication failed")):
        message = codec_refuses(codec, "open", key.hex(), kind, limit, tmp_path / "blob", tmp_path / "out",
                                reason=c_reason)
        assert message.startswith("vulpes-codec: failed to open sealed blob") and str(tmp_path / "blob") in message
        assert not (tmp_path / "out").exists()
        with pytest.raises(py_error, match=py_words):
            pseal.open_sealed(key, blob, kind, limit)


# --- key envelopes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("log2n", [10, 15])
def test_envelope_scrypt_both_ways(codec: Path, tmp_path: Path, log2n: int) -> None:
    parcel, pk, cs = uuid.uuid4(), secrets.token_bytes(32), secrets.token_bytes(32)
    passphrase = "pässwörd with ünïcode"
    env = {"ISR_TEST_PASSPHRASE": passphrase}
    (tmp_path / "penv").write_bytes(wrap_envelope(parcel, pk, cs, passphrase=passphrase, log2n=log2n, r=8, p=1))
    out = run_codec(codec, "envelope-unwrap", "--passphrase-env", "ISR_TEST_PASSPHRASE", tmp_path / "penv", env=env)
    assert out == {"uuid": parcel.hex, "parcel_key": pk.hex(), "convergence_secret": cs.hex()}

    run_codec(codec, "envelope-wrap", parcel.hex, pk.hex(), cs.hex(), "--passphrase-env", "ISR_TEST_PASSPHRASE",
              "--log2n", log2n, "--r", 8, "--p", 1, tmp_path / "cenv", env=env)
    cenv = (tmp_path / "cenv").read_bytes()
    assert len(cenv) == 148 and cenv[56] == log2n
    assert unwrap_envelope(cenv, passphrase=passphrase, expect_uuid=parcel) == (parcel, pk, cs)

    codec_refuses(codec, "envelope-unwrap", "--passphrase-env", "ISR_TEST_PASSPHRASE", tmp_path / "cenv",
                  env={"ISR_TEST_PASSPHRASE": passphrase + "x"})
    with pytest.raises(ParcelError):
        unwrap_envelope(cenv, passphrase=passphrase + "x")


def test_envelope_keyfile_both_ways(codec: Path, tmp_path: Path) -> None:
    parcel, pk, cs = uuid.uuid4(), secrets.token_bytes(32), secrets.token_bytes(32)
    keyfile = secrets.token_bytes(100)
    (tmp_path / "key").write_bytes(keyfile)
    (tmp_path / "penv").write_bytes(wrap_envelope(parcel, pk, cs, keyfile=keyfile))
    out = run_codec(codec, "envelope-unwrap", "--keyfile", tmp_path / "key", tmp_path / "penv")
    assert out == {"uuid": parcel.hex, "parcel_key": pk.hex(), "convergence_secret": cs.hex()}

    run_codec(codec, "envelope-wrap", parcel.hex, pk.hex(), cs.hex(), "--keyfile", tmp_path / "key", tmp_path / "cenv")
    cenv = (tmp_path / "cenv").read_bytes()
    assert cenv[5] == 2
    assert unwrap_envelope(cenv, keyfile=keyfile, expect_uuid=parcel) == (parcel, pk, cs)

    (tmp_path / "other").write_bytes(secrets.token_bytes(32))
    codec_refuses(codec, "envelope-unwrap", "--keyfile", tmp_path / "other", tmp_path / "penv")
    damaged = bytearray(cenv)
    damaged[30] ^= 1
    (tmp_path / "damaged").write_bytes(damaged)
    codec_refuses(codec, "envelope-unwrap", "--keyfile", tmp_path / "key", tmp_path / "damaged")


# --- keyrings ---------------------------------------------------------------------------------------

def make_records(pk: bytes, indices: list[int]) -> tuple[list[KeyringRecord], list[bytes]]:
    keys = [secrets.token_bytes(32) for _ in indices]
    records = [KeyringRecord(idx, idx % 2, secrets.token_bytes(32), wrap_chunk_key(pk, key))
               for idx, key in zip(indices, keys)]
    return records, keys


def test_chunk_key_wrap_both_ways(codec: Path) -> None:
    pk, key = secrets.token_bytes(32), secrets.token_bytes(32)
    out = run_codec(codec, "keyring-wrap", pk.hex(), key.hex())
    assert out["wkey"] == wrap_chunk_key(pk, key).hex()
    assert unwrap_chunk_key(pk, bytes.fromhex(out["wkey"])) == key
    assert run_codec(codec, "keyring-unwrap", pk.hex(), out["wkey"])["key"] == key.hex()
    codec_refuses(codec, "keyring-unwrap", secrets.token_hex(32), out["wkey"])


@pytest.mark.parametrize("indices", [[], [0], [0, 1, 5, 1000, 2047]], ids=["empty", "one", "several"])
def test_keyring_stream_import_export_in_c(codec: Path, tmp_path: Path, indices: list[int]) -> None:
    pk = secrets.token_bytes(32)
    chunk_size, image_size = 131072, 2048 * 131072 - 4096
    records, keys = make_records(pk, indices)
    stream = encode_stream(chunk_size, image_size, records)
    (tmp_path / "stream").write_bytes(stream)

    out = run_codec(codec, "keyring-import", tmp_path / "stream", tmp_path / "c.db")
    assert out == {"chunk_size": str(chunk_size), "image_size": str(image_size), "records": str(len(records))}
    out = run_codec(codec, "keyring-export", tmp_path / "c.db", tmp_path / "exported")
    assert (tmp_path / "exported").read_bytes() == stream
    assert out["digest"] == hashlib.sha256(stream).hexdigest()
    out = run_codec(codec, "keyring-digest", tmp_path / "c.db")
    assert out == {"digest": hashlib.sha256(stream).hexdigest(), "size": str(len(stream))}

    # The database C wrote, opened by Python.
    with Keyring.open(tmp_path / "c.db") as keyring:
        assert keyring.chunk_size == chunk_size and keyring.image_size == image_size
        assert keyring.export_stream() == stream
        assert keyring.digest() == hashlib.sha256(stream).digest()
        assert [unwrap_chunk_key(pk, r.wkey) for r in keyring] == keys


def test_keyring_database_python_to_c(codec: Path, tmp_path: Path) -> None:
    pk = secrets.token_bytes(32)
    records, _ = make_records(pk, [3, 4, 9, 63])
    with Keyring.create(tmp_path / "py.db", 65536, 64 * 65536) as keyring:
        for record in records:
            keyring.put(record)
        keyring.delete(9)
        stream = keyring.export_stream()
    assert decode_stream(stream)[2] == [r for r in records if r.idx != 9]
    out = run_codec(codec, "keyring-digest", tmp_path / "py.db")
    assert out == {"digest": hashlib.sha256(stream).hexdigest(), "size": str(len(stream))}
    run_codec(codec, "keyring-export", tmp_path / "py.db", tmp_path / "exported")
    assert (tmp_path / "exported").read_bytes() == stream

    # C imports into the database Python created, replacing its contents.
    other, _ = make_records(pk, [0, 1])
    new_stream = encode_stream(4096, 8192, other)
    (tmp_path / "new").write_bytes(new_stream)
    run_codec(codec, "keyring-import", tmp_path / "new", tmp_path / "py.db")
    with Keyring.open(tmp_path / "py.db") as keyring:
        assert keyring.export_stream() == new_stream


def test_keyring_bad_streams_refused_by_c(codec: Path, tmp_path: Path) -> None:
    pk = secrets.token_bytes(32)
    records, _ = make_records(pk, [1, 2, 3])
    good = encode_stream(4096, 4 * 4096, records)
    unsorted = good[:28] + good[28 + 81:28 + 162] + good[28:28 + 81] + good[28 + 162:]
    for name, bad in {"unsorted": unsorted, "truncated": good[:-1], "magic": b"X" + good[1:],
                      "flags": good[:28 + 8] + b"\x02" + good[28 + 9:]}.items():
        (tmp_path / name).write_bytes(bad)
        codec_refuses(codec, "keyring-import", tmp_path / name, tmp_path / f"{name}.db")
        assert not (tmp_path / f"{name}.db").exists()
        with pytest.raises(ParcelError):
            decode_stream(bad)


# --- manifests --------------------------------------------------------------------------------------

def make_manifest(parcel: uuid.UUID, version: int) -> Manifest:
    disk_stream = encode_stream(131072, 1 << 28, make_records(secrets.token_bytes(32), [0, 7, 2047])[0])
    # The memory image has chunks of its own size (a working-set index only that size allows shows both readers
    # apply it).
    memory_stream = encode_stream(32768, 256 << 20, [])
    devstate = secrets.token_bytes(1234)
    return Manifest(
        parcel=parcel, name="cross-language", version=version, parent=version - 1 if version > 1 else None,
        created="2026-11-22T04:40:32Z", chunk_size=131072,
        images={"disk": ImageInfo(size=1 << 28, keyring_sha256=hashlib.sha256(disk_stream).digest(),
                                  keyring_size=len(disk_stream), chunks=3),
                "memory": ImageInfo(size=256 << 20, keyring_sha256=hashlib.sha256(memory_stream).digest(),
                                    keyring_size=len(memory_stream), chunks=0, chunk_size=32768)},
        blobs={"devstate": BlobInfo(kind=3, sha256=hashlib.sha256(devstate).digest(), size=len(devstate))},
        vm=VMConfig(machine="pc-q35-7.2", cpu="qemu64", ram_mib=256, smp=1,
                    devices={"disk": "virtio-blk", "net": "none", "display": "vnc"}, qemu_version="7.2.19"),
        suspended=True, working_set={"disk": [0, 7], "memory": [8191]},
        timestamps=Timestamps(created="2026-11-22T04:40:32Z", suspended="2026-11-22T05:02:11Z"))


def test_manifest_python_to_c(codec: Path, tmp_path: Path) -> None:
    parcel, pk = uuid.uuid4(), secrets.token_bytes(32)
    manifest = make_manifest(parcel, 3)
    (tmp_path / "manifest").write_bytes(seal_manifest(pk, manifest))
    out = run_codec(codec, "manifest-open", pk.hex(), parcel, 3, tmp_path / "manifest")
    disk, memory = manifest.images["disk"], manifest.images["memory"]
    assert out == {
        "format": "1", "parcel": str(parcel), "version": "3", "name": "cross-language", "chunk_size": "131072",
        "disk_size": str(disk.size), "disk_keyring_sha256": disk.keyring_sha256.hex(),
        "disk_keyring_size": str(disk.keyring_size), "disk_chunks": "3", "disk_chunk_size": "131072",
        "memory_size": str(memory.size), "memory_keyring_sha256": memory.keyring_sha256.hex(),
        "memory_keyring_size": "28", "memory_chunks": "0", "memory_chunk_size": "32768",
        "disk_working_set": "0,7", "memory_working_set": "8191",
        "machine": "pc-q35-7.2", "smp": "1", "qemu_version": "7.2.19", "ram_mib": "256", "suspended": "true",
        "devstate_sha256": manifest.blobs["devstate"].sha256.hex(), "devstate_size": "1234",
    }
    # The reader must check parcel and version: another version, another parcel, another key all fail.
    codec_refuses(codec, "manifest-open", pk.hex(), parcel, 2, tmp_path / "manifest")
    codec_refuses(codec, "manifest-open", pk.hex(), uuid.uuid4(), 3, tmp_path / "manifest")
    codec_refuses(codec, "manifest-open", secrets.token_hex(32), parcel, 3, tmp_path / "manifest")


def test_manifest_sealed_by_c_opened_by_python(codec: Path, tmp_path: Path) -> None:
    parcel, pk = uuid.uuid4(), secrets.token_bytes(32)
    manifest = make_manifest(parcel, 1)
    (tmp_path / "json").write_bytes(manifest.to_json())
    run_codec(codec, "seal", pk.hex(), 1, tmp_path / "json", tmp_path / "manifest")
    blob = (tmp_path / "manifest").read_bytes()
    assert open_manifest(pk, blob, parcel=parcel, version=1) == manifest
    assert run_codec(codec, "manifest-open", pk.hex(), parcel, 1, tmp_path / "manifest")["suspended"] == "true"


@pytest.mark.parametrize("firmware, accepted", [("uefi", True), ("bios", True), (None, True), ("floppy", False),
                                                ("", False), (3, False)])
def test_manifest_firmware_same_in_both(codec: Path, tmp_path: Path, firmware: object, accepted: bool) -> None:
    """vm.firmware (doc/parcel-format.md): bios or uefi, absent or null meaning bios; anything else is refused
    by both readers."""
    parcel, pk = uuid.uuid4(), secrets.token_bytes(32)
    obj = json.loads(make_manifest(parcel, 1).to_json())
    obj["vm"]["firmware"] = firmware
    (tmp_path / "json").write_text(json.dumps(obj))
    run_codec(codec, "seal", pk.hex(), 1, tmp_path / "json", tmp_path / "manifest")
    blob = (tmp_path / "manifest").read_bytes()
    if accepted:
        assert open_manifest(pk, blob, parcel=parcel, version=1).vm.firmware == (firmware or "bios")
        run_codec(codec, "manifest-open", pk.hex(), parcel, 1, tmp_path / "manifest")
    else:
        with pytest.raises(FormatError):
            open_manifest(pk, blob, parcel=parcel, version=1)
        codec_refuses(codec, "manifest-open", pk.hex(), parcel, 1, tmp_path / "manifest")


@pytest.mark.parametrize("chunk_size, memory_index, accepted", [
    (32768, 8191, True), (None, 2047, True), (None, 8191, False), (131072, 2048, False), (32768, 8192, False),
    (3000, 0, False), (8 << 20, 0, False), ("32768", 0, False)])
def test_manifest_image_chunk_size_same_in_both(codec: Path, tmp_path: Path, chunk_size: object, memory_index: int,
                                                accepted: bool) -> None:
    """images.memory.chunk_size (doc/parcel-format.md): a valid chunk size of the memory image's own, absent
    or null meaning the parcel's; both readers take the memory image's chunk count from it (a working-set
    index is checked against it) and refuse anything else."""
    parcel, pk = uuid.uuid4(), secrets.token_bytes(32)
    obj = json.loads(make_manifest(parcel, 1).to_json())
    obj["images"]["memory"]["chunk_size"] = chunk_size
    obj["working_set"]["memory"] = [memory_index]
    (tmp_path / "json").write_text(json.dumps(obj))
    run_codec(codec, "seal", pk.hex(), 1, tmp_path / "json", tmp_path / "manifest")
    blob = (tmp_path / "manifest").read_bytes()
    if accepted:
        opened = open_manifest(pk, blob, parcel=parcel, version=1)
        assert opened.image_chunk_size("memory") == (chunk_size or 131072)
        out = run_codec(codec, "manifest-open", pk.hex(), parcel, 1, tmp_path / "manifest")
        assert out["memory_chunk_size"] == str(chunk_size or 131072) and out["disk_chunk_size"] == "131072"
    else:
        with pytest.raises(FormatError):
            open_manifest(pk, blob, parcel=parcel, version=1)
        codec_refuses(codec, "manifest-open", pk.hex(), parcel, 1, tmp_path / "manifest")


# --- the resume pack ----------------------------------------------------------------------------------------

def _pack_cases() -> dict[str, tuple[bytes, bool]]:
    """Resume pack payloads for an image of 1 MiB, each with whether the format accepts it."""
    size = 1 << 20
    entries = [resumepack.MapEntry(0, 8192, 1), resumepack.MapEntry(65536, 4096, resumepack.PARTS_MAX - 1)]
    v1 = resumepack.encode(size, [(4096, b"a" * 100), (8192, b"b" * 4096)])
    v2 = resumepack.encode(size, [(16384, b"c" * 4096)], entries)
    at = resumepack.HEADER_V2.size + resumepack.EXTENT.size
    part_zero, overlap, beyond = bytearray(v2), bytearray(v2), bytearray(v2)
    resumepack.MAP_ENTRY.pack_into(part_zero, at, 0, 8192, 0)
    resumepack.MAP_ENTRY.pack_into(overlap, at + resumepack.MAP_ENTRY.size, 4096, 4096, 2)
    resumepack.MAP_ENTRY.pack_into(beyond, at + resumepack.MAP_ENTRY.size, size - 4096, 8192, 2)
    version_3 = bytearray(v2)
    version_3[4] = 3
    return {"v1": (v1, True), "v2": (v2, True), "empty": (resumepack.encode(size, []), True),
            "map part 0": (bytes(part_zero), False), "map overlapping": (bytes(overlap), False),
            "map beyond the image": (bytes(beyond), False), "version 3": (bytes(version_3), False),
            "v2 truncated": (v2[:-1], False), "v2 header only": (v2[:resumepack.HEADER_V2.size - 1], False)}


@pytest.mark.parametrize("case", _pack_cases())
def test_resume_pack_same_in_both(codec: Path, tmp_path: Path, case: str) -> None:
    """A resume pack payload (doc/parcel-format.md, "Resume pack"), with or without the map of the parts to
    come: both readers take the same extents and map, and refuse the same damage; both allow the same most
    parts."""
    payload, accepted = _pack_cases()[case]
    size = 1 << 20
    (tmp_path / "pack").write_bytes(payload)
    if accepted:
        extents, parts_map = resumepack.decode(payload, size), resumepack.decode_map(payload, size)
        out = run_codec(codec, "pack-parse", size, tmp_path / "pack")
        assert out == {"extents": str(len(extents)), "bytes": str(sum(e.length for e, _ in extents)),
                       "map": str(len(parts_map)), "map_parts": str(max((e.part for e in parts_map), default=0)),
                       "parts_max": str(resumepack.PARTS_MAX)}
        codec_refuses(codec, "pack-parse", 2 * size, tmp_path / "pack", reason="for an image of")
    else:
        with pytest.raises(FormatError):
            resumepack.decode(payload, size)
        codec_refuses(codec, "pack-parse", size, tmp_path / "pack", reason="resume pack rejected")
