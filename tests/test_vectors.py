"""Run every shared test vector in parcels/testvectors/ through the Python implementation.

Each vector is one test, named after the vector. Reject vectors must be refused; beyond the README's
requirement, the exception class is checked where the vector pins down which check fires (a resealed
vector can only be refused by a format check, a bad tag only by the integrity check), so a missing check
shows up as a failure here rather than being covered up by a later one.
"""
from __future__ import annotations

import functools
import uuid
from pathlib import Path
from typing import Any

import pytest

from parcels import chunk, crypto, envelope, keyring, manifest, seal
from parcels.errors import FormatError, IntegrityError, ParcelError, WrongKeyError
from parcels.testvectors import FILES, VECTOR_DIR, Vector, load, parse
from parcels.testvectors import generate as generator


def _vectors(filename: str) -> list[Any]:
    return [pytest.param(v, id=v.name) for v in load(filename)]


def _expect(vector: Vector, by_why: dict[str, tuple[type[ParcelError], ...]],
            default: tuple[type[ParcelError], ...]) -> tuple[type[ParcelError], ...]:
    if vector.name.endswith("_resealed"):
        # Authenticated properly: only a format check can refuse it.
        return (FormatError,)
    return by_why.get(vector.fields["why"], default)


# --- chunks ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("vector", _vectors("chunks.txt"))
def test_chunk_vector(vector: Vector) -> None:
    data, tag, key, length = vector.hex("object"), vector.hex("tag"), vector.hex("key"), vector.int("length")
    if not vector.ok:
        expected = _expect(vector, {"tag": (IntegrityError,), "gcm": (IntegrityError,)}, (FormatError,))
        with pytest.raises(expected):
            chunk.decode_chunk(data, tag, key, length)
        return
    plaintext = vector.hex("plaintext")
    assert len(plaintext) == length
    assert chunk.decode_chunk(data, tag, key, length) == plaintext
    assert crypto.sha256(data) == tag
    encoded = chunk.encode_chunk(plaintext, vector.hex("secret"))
    if vector.int("flags") == 0:
        assert encoded == chunk.EncodedChunk(tag, key, 0, data)
    else:
        # zstd output may differ between versions: the object only has to decode.
        assert encoded.flags == vector.int("flags")
        assert chunk.decode_chunk(encoded.data, encoded.tag, encoded.key, length) == plaintext


# --- sealed blobs --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("vector", _vectors("blobs.txt"))
def test_blob_vector(vector: Vector) -> None:
    parcel_key, kind, limit, blob = (vector.hex("parcel_key"), vector.int("kind"), vector.int("max_length"),
                                     vector.hex("blob"))
    if not vector.ok:
        expected = _expect(vector, {"gcm": (IntegrityError,)}, (FormatError, IntegrityError))
        with pytest.raises(expected):
            seal.open_sealed(parcel_key, blob, kind, limit)
        return
    payload = vector.hex("payload")
    assert seal.open_sealed(parcel_key, blob, kind, limit) == payload
    resealed = seal.seal(parcel_key, kind, payload)
    assert seal.open_sealed(parcel_key, resealed, kind, limit) == payload


# --- key envelopes -------------------------------------------------------------------------------------------

def _credential(vector: Vector) -> dict[str, Any]:
    if vector.fields["kdf"] == "scrypt":
        return {"passphrase": vector.hex("passphrase").decode("utf-8")}
    assert vector.fields["kdf"] == "keyfile"
    return {"keyfile": vector.hex("keyfile")}


@pytest.mark.parametrize("vector", _vectors("keyenvelopes.txt"))
def test_envelope_vector(vector: Vector) -> None:
    data, parcel = vector.hex("envelope"), uuid.UUID(bytes=vector.hex("uuid"))
    if not vector.ok:
        expected = _expect(vector, {"gcm": (WrongKeyError,), "uuid": (IntegrityError, WrongKeyError),
                                    "kdf": (FormatError, WrongKeyError)}, (FormatError,))
        with pytest.raises(expected):
            envelope.unwrap_envelope(data, expect_uuid=parcel, **_credential(vector))
        return
    assert len(data) == envelope.SIZE
    opened = envelope.unwrap_envelope(data, expect_uuid=parcel, **_credential(vector))
    assert opened == (parcel, vector.hex("parcel_key"), vector.hex("convergence_secret"))


# --- keyrings --------------------------------------------------------------------------------------------------

def _records(text: str) -> list[tuple[int, int, bytes, bytes]]:
    records = []
    for item in filter(None, text.split(",")):
        idx, flags, tag, key = item.split(":")
        records.append((int(idx), int(flags), bytes.fromhex(tag), bytes.fromhex(key)))
    return records


@pytest.mark.parametrize("vector", _vectors("keyrings.txt"))
def test_keyring_vector(vector: Vector, tmp_path: Path) -> None:
    parcel_key, stream = vector.hex("parcel_key"), vector.hex("stream")
    assert crypto.sha256(stream) == vector.hex("digest")
    if not vector.ok:
        if vector.fields["why"] == "unwrap":
            _, _, records = keyring.decode_stream(stream)        # the stream itself is well formed
            with pytest.raises(IntegrityError):
                for record in records:
                    keyring.unwrap_chunk_key(parcel_key, record.wkey)
        else:
            with pytest.raises(FormatError):
                keyring.decode_stream(stream)
            with keyring.Keyring.create(tmp_path / "k.db", 4096, 0) as db, pytest.raises(FormatError):
                db.import_stream(stream)
        return
    chunk_size, image_size = vector.int("chunk_size"), vector.int("image_size")
    plain = _records(vector.fields["records"])
    wrapped = [keyring.KeyringRecord(i, f, tag, keyring.wrap_chunk_key(parcel_key, key)) for i, f, tag, key in plain]
    assert keyring.encode_stream(chunk_size, image_size, wrapped) == stream
    decoded_cs, decoded_size, decoded = keyring.decode_stream(stream)
    assert (decoded_cs, decoded_size) == (chunk_size, image_size)
    assert [(r.idx, r.flags, r.tag, keyring.unwrap_chunk_key(parcel_key, r.wkey)) for r in decoded] == plain
    with keyring.Keyring.create(tmp_path / "k.db", 4096, 0) as db:
        db.import_stream(stream)
        assert (db.chunk_size, db.image_size, len(db)) == (chunk_size, image_size, len(plain))
        assert db.export_stream() == stream
        assert db.digest() == vector.hex("digest")


# --- manifests -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("vector", _vectors("manifests.txt"))
def test_manifest_vector(vector: Vector) -> None:
    parcel_key, blob = vector.hex("parcel_key"), vector.hex("blob")
    parcel, version = uuid.UUID(vector.fields["uuid"]), vector.int("version")
    if not vector.ok:
        layer = vector.fields["layer"]
        if layer == "seal":
            with pytest.raises((FormatError, IntegrityError)):
                seal.open_sealed(parcel_key, blob, seal.KIND_MANIFEST, manifest.MAX_MANIFEST_SIZE)
        else:
            # The defect must be in the JSON, not in the sealed layer around it.
            seal.open_sealed(parcel_key, blob, seal.KIND_MANIFEST, manifest.MAX_MANIFEST_SIZE)
        expected = (FormatError,) if layer == "rules" else (FormatError, IntegrityError)
        with pytest.raises(expected):
            manifest.open_manifest(parcel_key, blob, parcel=parcel, version=version)
        return
    payload = vector.hex("json")
    assert seal.open_sealed(parcel_key, blob, seal.KIND_MANIFEST, manifest.MAX_MANIFEST_SIZE) == payload
    opened = manifest.open_manifest(parcel_key, blob, parcel=parcel, version=version)
    assert (opened.parcel, opened.version) == (parcel, version)
    # Unknown keys are dropped, everything the spec defines survives a round trip.
    assert manifest.Manifest.from_json(opened.to_json()) == opened


# --- the files themselves --------------------------------------------------------------------------------------

def test_vector_files_hold_both_results_and_fit_the_budget() -> None:
    total = 0
    for filename in FILES:
        vectors = load(filename)
        assert {v.fields["result"] for v in vectors} == {"ok", "reject"}, filename
        assert all("why" in v.fields for v in vectors if not v.ok), filename
        total += (VECTOR_DIR / filename).stat().st_size
    assert total < 3_000_000


@functools.cache
def _generated() -> dict[str, str]:
    # Generation runs real scrypt (one vector needs 1.1 GiB of work), so do it once per session.
    return generator.generate()


def test_generator_reproduces_the_committed_files() -> None:
    """The files are what the generator makes; a difference is a format change (or a zstd upgrade)."""
    for filename, content in _generated().items():
        assert (VECTOR_DIR / filename).read_text(encoding="ascii") == content, filename


def test_generator_refuses_to_change_files_without_force(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generator, "generate", _generated)
    (tmp_path / "keyrings.txt").write_text("# an older version\n", encoding="ascii")
    assert generator.main(["--dir", str(tmp_path)]) == 1
    assert (tmp_path / "keyrings.txt").read_text(encoding="ascii") == "# an older version\n"
    assert not (tmp_path / "chunks.txt").exists()
    assert generator.main(["--dir", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "keyrings.txt").read_text(encoding="ascii") == (VECTOR_DIR / "keyrings.txt").read_text(
        encoding="ascii")


@pytest.mark.parametrize("text", ["name = x\n", "[chunk]\nname = a\nresult = ok\nname = b\n",
                                  "[chunk]\nName = a\n", "[chunk]\nname=a\n", "[chunk]\nresult = ok\n",
                                  "[chunk]\nname = a\nresult = maybe\n",
                                  "[chunk]\nname = a\nresult = ok\n[chunk]\nname = a\nresult = ok\n"])
def test_vector_parser_rejects_malformed_files(text: str) -> None:
    with pytest.raises(FormatError):
        parse(text)


def test_vector_parser_reads_empty_values_and_comments() -> None:
    vectors = parse("# comment\n\n[chunk]\nname = a\nresult = ok\nplaintext = \nother =\n")
    assert vectors[0].fields == {"name": "a", "result": "ok", "plaintext": "", "other": ""}
    assert vectors[0].hex("plaintext") == b""
