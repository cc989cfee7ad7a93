"""Generate the shared parcel-format test vectors: python -m parcels.testvectors.generate [--force]

Every secret, salt and plaintext is derived from a fixed label with SHAKE-256, so a rerun writes the same
bytes (with the same zstd version). Existing files whose content would change are left alone unless
--force is given, because a change to a vector is a change to the format.

Reject vectors come in three strengths: a damaged object under its original tag (the first check
catches it), a damaged object "retagged" (its tag recomputed, so the later checks run), and a
"resealed" object whose defect is encrypted and authenticated properly, so that only the one check
named by `why` can refuse it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from parcels import chunk, compress, crypto, envelope, keyring, manifest, seal
from parcels.testvectors import VECTOR_DIR, render

Vec = dict[str, Any]


# --- deterministic material -----------------------------------------------------------------------------

def det(label: str, n: int = 32) -> bytes:
    """n bytes that depend only on `label`."""
    return hashlib.shake_256(b"isr-testvectors/" + label.encode()).digest(n)


def text(label: str, n: int) -> bytes:
    """n bytes of compressible, text-like data that depend only on `label`."""
    words = [b"suspend", b"resume", b"parcel", b"chunk", b"keyring", b"manifest", b"vulpes", b"qemu"]
    seed = det(label, 64)
    out = bytearray()
    i = 0
    while len(out) < n:
        out += b"%d %s %s\n" % (i, words[seed[i % 64] % 8], words[(seed[i % 64] >> 3) % 8])
        i += 1
    return bytes(out[:n])


def flip(data: bytes, pos: int, mask: int = 0x01) -> bytes:
    out = bytearray(data)
    out[pos] ^= mask
    return bytes(out)


def frame(data: bytes, *, content_size: bool = True, checksum: bool = False) -> bytes:
    return compress.compress(data, content_size=content_size, checksum=checksum)


def patch_content_size(zframe: bytes, size: int) -> bytes:
    """Rewrite the frame-content-size field of a single-segment frame with a 2-byte field."""
    descriptor = zframe[4]
    assert descriptor >> 6 == 1 and descriptor & 0x20, "expected a single-segment frame, 2-byte size"
    assert 256 <= size < 65536 + 256
    return zframe[:5] + struct.pack("<H", size - 256) + zframe[7:]


SKIPPABLE = struct.pack("<II", 0x184D2A50, 4) + b"skip"


# --- chunks -------------------------------------------------------------------------------------------

CS = det("chunk/secret")
CS_OTHER = det("chunk/other-secret")


def chunk_object(header: bytes, body: bytes, secret: bytes = CS) -> tuple[bytes, bytes]:
    """Encrypt `body` with AAD `header` under the convergent key, whatever the header says."""
    return chunk._assemble(secret, header, body)


def chunk_header(n: int, *, magic: bytes = chunk.MAGIC, version: int = chunk.VERSION, compression: int = 1,
                 reserved: int = 0) -> bytes:
    return chunk.HEADER.pack(magic, version, compression, reserved, n)


def chunk_ok(name: str, plaintext: bytes) -> Vec:
    encoded = chunk.encode_chunk(plaintext, CS)
    return {"name": name, "result": "ok", "secret": CS, "length": len(plaintext), "plaintext": plaintext,
            "object": encoded.data, "tag": encoded.tag, "key": encoded.key, "flags": encoded.flags}


def chunk_handmade_ok(name: str, plaintext: bytes, body: bytes) -> Vec:
    """A valid compressed object whose zstd frame the reference encoder would not produce."""
    data, key = chunk_object(chunk_header(len(plaintext)), body)
    return {"name": name, "result": "ok", "secret": CS, "length": len(plaintext), "plaintext": plaintext,
            "object": data, "tag": crypto.sha256(data), "key": key, "flags": chunk.FLAG_COMPRESSED}


def chunk_reject(name: str, why: str, data: bytes, tag: bytes, key: bytes, length: int) -> Vec:
    return {"name": name, "result": "reject", "why": why, "secret": CS, "length": length, "object": data,
            "tag": tag, "key": key}


def chunk_resealed(name: str, why: str, header: bytes, body: bytes, length: int) -> Vec:
    data, key = chunk_object(header, body)
    return chunk_reject(name, why, data, crypto.sha256(data), key, length)


def chunk_vectors() -> list[Vec]:
    random_4096 = det("chunk/random-4096", 4096)
    text_4096 = text("chunk/text-4096", 4096)
    sparse = bytearray(4096)
    for i, pos in enumerate((0, 1000, 2049, 4095)):
        sparse[pos] = 0x11 * (i + 1)
    ok = [
        chunk_ok("random_4096", random_4096),
        chunk_ok("text_4096", text_4096),
        chunk_ok("random_131072", det("chunk/random-131072", 131072)),
        chunk_ok("text_131072", text("chunk/text-131072", 131072)),
        chunk_ok("short_last_random_1000", det("chunk/random-1000", 1000)),
        chunk_ok("short_last_text_3000", text("chunk/text-3000", 3000)),
        chunk_ok("one_byte", b"\x2a"),
        chunk_ok("sparse_4096", bytes(sparse)),
        chunk_ok("half_random_half_zero_8192", det("chunk/half", 4096) + bytes(4096)),
        chunk_handmade_ok("frame_without_content_size", text_4096, frame(text_4096, content_size=False)),
        chunk_handmade_ok("frame_with_checksum", text_4096, frame(text_4096, checksum=True)),
    ]
    assert [v["flags"] for v in ok] == [0, 1, 0, 1, 0, 1, 0, 1, 1, 1, 1]

    rejects = []
    bases = {"raw": chunk.encode_chunk(random_4096, CS), "zstd": chunk.encode_chunk(text_4096, CS)}
    n = 4096
    for label, base in bases.items():
        obj = base.data
        regions = {"header": 6, "body": chunk.HEADER_SIZE + 7, "gcmtag": len(obj) - 1}
        for region, pos in regions.items():
            damaged = flip(obj, pos)
            rejects.append(chunk_reject(f"{label}_flip_{region}", "tag", damaged, base.tag, base.key, n))
            rejects.append(chunk_reject(f"{label}_flip_{region}_retagged", "gcm" if region != "header" else
                                        "reserved", damaged, crypto.sha256(damaged), base.key, n))
        for size, why in ((0, "short"), (27, "short"), (len(obj) - 1, "gcm")):
            cut = obj[:size]
            rejects.append(chunk_reject(f"{label}_truncated_{size}_retagged", why, cut, crypto.sha256(cut),
                                        base.key, n))
        rejects.append(chunk_reject(f"{label}_truncated_one_short", "tag", obj[:-1], base.tag, base.key, n))
        longer = obj + b"\x00"
        rejects.append(chunk_reject(f"{label}_extended_one_byte_retagged", "gcm", longer, crypto.sha256(longer),
                                    base.key, n))
        rejects.append(chunk_reject(f"{label}_wrong_tag", "tag", obj, crypto.sha256(b"another object"),
                                    base.key, n))
        other = bases["zstd" if label == "raw" else "raw"]
        rejects.append(chunk_reject(f"{label}_key_of_another_chunk", "gcm", obj, base.tag, other.key, n))
        rejects.append(chunk_reject(f"{label}_key_under_another_secret", "gcm", obj, base.tag,
                                    chunk.encode_chunk(random_4096 if label == "raw" else text_4096,
                                                       CS_OTHER).key, n))
        for length in (n - 1, n + 1, 131072):
            rejects.append(chunk_reject(f"{label}_expected_length_{length}", "length", obj, base.tag, base.key,
                                        length))

    # Header damage of every kind: under the original tag (the tag check catches it), with the tag
    # recomputed (GCM would still catch these, the header being associated data), and resealed (only
    # the header check can catch these).
    obj = bases["zstd"].data
    for what, why, header in (
            ("magic", "magic", chunk_header(n, magic=b"ISRX")),
            ("version_0", "version", chunk_header(n, version=0)),
            ("version_2", "version", chunk_header(n, version=2)),
            ("compression_2", "compression", chunk_header(n, compression=2)),
            ("compression_255", "compression", chunk_header(n, compression=255)),
            ("reserved_1", "reserved", chunk_header(n, reserved=1)),
            ("reserved_256", "reserved", chunk_header(n, reserved=256)),
            ("length_4095", "length", chunk_header(4095))):
        damaged = header + obj[chunk.HEADER_SIZE:]
        rejects.append(chunk_reject(f"bad_{what}_original_tag", "tag", damaged, bases["zstd"].tag,
                                    bases["zstd"].key, n))
        rejects.append(chunk_reject(f"bad_{what}_retagged", why, damaged, crypto.sha256(damaged),
                                    bases["zstd"].key, n))
        rejects.append(chunk_resealed(f"bad_{what}_resealed", why, header, frame(text_4096), n))
    raw_header = chunk_header(n, compression=0)
    rejects += [
        chunk_resealed("raw_body_one_short", "body_length", raw_header, random_4096[:-1], n),
        chunk_resealed("raw_body_one_long", "body_length", raw_header, random_4096 + b"\x00", n),
        chunk_resealed("raw_body_empty", "body_length", raw_header, b"", n),
        chunk_resealed("zstd_frame_size_4095", "zstd_length", chunk_header(n), frame(text_4096[:-1]), n),
        chunk_resealed("zstd_frame_size_4097", "zstd_length", chunk_header(n), frame(text_4096 + b"x"), n),
        chunk_resealed("zstd_no_size_decodes_short", "zstd_length", chunk_header(n),
                       frame(text_4096[:-1], content_size=False), n),
        chunk_resealed("zstd_no_size_decodes_long", "zstd_length", chunk_header(n),
                       frame(text_4096 + b"x", content_size=False), n),
        chunk_resealed("zstd_size_field_lies", "zstd_length", chunk_header(n),
                       patch_content_size(frame(text_4096[:-1]), n), n),
        chunk_resealed("zstd_trailing_zero_byte", "zstd_trailing", chunk_header(n), frame(text_4096) + b"\x00", n),
        chunk_resealed("zstd_no_size_trailing_byte", "zstd_trailing", chunk_header(n),
                       frame(text_4096, content_size=False) + b"\x00", n),
        chunk_resealed("zstd_two_frames", "zstd_trailing", chunk_header(n),
                       frame(text_4096[:2048], content_size=False) + frame(text_4096[2048:], content_size=False), n),
        chunk_resealed("zstd_skippable_frame_first", "zstd_frame", chunk_header(n), SKIPPABLE + frame(text_4096), n),
        chunk_resealed("zstd_truncated_frame", "zstd_frame", chunk_header(n), frame(text_4096)[:-1], n),
        chunk_resealed("zstd_garbage", "zstd_frame", chunk_header(n), det("chunk/garbage", 100), n),
        chunk_resealed("zstd_empty_body", "zstd_frame", chunk_header(n), b"", n),
        chunk_resealed("zstd_flag_on_raw_body", "zstd_frame", chunk_header(n), random_4096, n),
    ]
    return ok + rejects


# --- sealed blobs -----------------------------------------------------------------------------------------

PK_BLOB = det("blob/parcel-key")
PK_OTHER = det("other-parcel-key")


def blob_raw(body: bytes, *, kind: int, length: int, compression: int, magic: bytes = seal.MAGIC,
             version: int = seal.VERSION, reserved: int = 0, salt_label: str = "blob/salt",
             parcel_key: bytes = PK_BLOB) -> bytes:
    """A sealed blob built from primitives, authenticated whatever its header says."""
    salt = det(salt_label)
    header = seal.HEADER.pack(magic, version, kind, compression, reserved, salt, length)
    blob_key = crypto.hmac_sha256(parcel_key, b"isr-blob-v1" + salt)
    return header + crypto.aes_gcm_encrypt(blob_key, body, header)


def blob_vec(name: str, result: str, blob: bytes, kind: int, max_length: int, payload: bytes | None = None,
             why: str | None = None, parcel_key: bytes = PK_BLOB) -> Vec:
    vec: Vec = {"name": name, "result": result}
    if why:
        vec["why"] = why
    vec.update({"parcel_key": parcel_key, "kind": kind, "max_length": max_length})
    if payload is not None:
        vec["payload"] = payload
    vec["blob"] = blob
    return vec


def blob_ok(name: str, kind: int, payload: bytes, max_length: int = 1 << 20, compress: bool = True) -> Vec:
    blob = seal.seal(PK_BLOB, kind, payload, compress, _salt=det(f"blob/salt/{name}"))
    return blob_vec(name, "ok", blob, kind, max_length, payload)


def blob_vectors() -> list[Vec]:
    manifest_like = json.dumps({"name": "workstation", "words": text("blob/manifest", 1500).decode()},
                               sort_keys=True).encode()
    stream = keyring.encode_stream(131072, 1 << 30, [
        keyring.KeyringRecord(i, i & 1, det(f"blob/tag/{i}"), det(f"blob/wkey/{i}", 40)) for i in (0, 3, 9)])
    devstate = det("blob/devstate", 3000)
    boot = text("blob/boot", 10000)
    ok = [
        blob_ok("manifest_compressed", seal.KIND_MANIFEST, manifest_like),
        blob_ok("keyring_stream", seal.KIND_KEYRING, stream),
        blob_ok("devstate_incompressible", seal.KIND_DEVSTATE, devstate),
        blob_ok("boot_file_compressed", seal.KIND_BOOT, boot),
        blob_ok("empty_payload", seal.KIND_DEVSTATE, b""),
        blob_ok("one_byte_payload", seal.KIND_BOOT, b"\x00"),
        blob_ok("payload_at_limit", seal.KIND_BOOT, boot, max_length=len(boot)),
        blob_ok("compressible_but_stored_raw", seal.KIND_MANIFEST, manifest_like, compress=False),
        blob_vec("frame_without_content_size", "ok",
                 blob_raw(frame(boot, content_size=False), kind=seal.KIND_BOOT, length=len(boot), compression=1),
                 seal.KIND_BOOT, 1 << 20, boot),
        blob_vec("frame_with_checksum", "ok",
                 blob_raw(frame(boot, checksum=True), kind=seal.KIND_BOOT, length=len(boot), compression=1),
                 seal.KIND_BOOT, 1 << 20, boot),
    ]
    rejects = []
    for label, base_vec in (("zstd", ok[3]), ("raw", ok[2])):
        base, kind = base_vec["blob"], base_vec["kind"]
        regions = {"magic": (0, "magic"), "version": (4, "version"), "kind": (5, "kind"),
                   "compression": (6, "compression"), "reserved": (7, "reserved"), "salt_first": (8, "gcm"),
                   "salt_last": (39, "gcm"), "length_high": (40, "length"), "length_low": (47, "length"),
                   "ciphertext": (48, "gcm"), "gcmtag": (len(base) - 1, "gcm")}
        for region, (pos, why) in regions.items():
            rejects.append(blob_vec(f"{label}_flip_{region}", "reject", flip(base, pos), kind, 1 << 20, why=why))
        for size, why in ((0, "short"), (63, "short"), (len(base) - 1, "gcm")):
            rejects.append(blob_vec(f"{label}_truncated_{size}", "reject", base[:size], kind, 1 << 20, why=why))
        rejects.append(blob_vec(f"{label}_extended_one_byte", "reject", base + b"\x00", kind, 1 << 20, why="gcm"))
        rejects.append(blob_vec(f"{label}_other_parcel_key", "reject", base, kind, 1 << 20, why="gcm",
                                parcel_key=PK_OTHER))
        rejects.append(blob_vec(f"{label}_expected_other_kind", "reject", base, seal.KIND_MANIFEST, 1 << 20,
                                why="kind"))
        rejects.append(blob_vec(f"{label}_payload_over_limit", "reject", base, kind,
                                len(base_vec["payload"]) - 1, why="limit"))
    boot_frame = frame(boot)
    resealed: list[tuple[str, str, dict[str, Any], bytes, int, int]] = [
        ("bad_magic", "magic", dict(magic=b"ISRX"), boot_frame, len(boot), 1),
        ("bad_version_0", "version", dict(version=0), boot_frame, len(boot), 1),
        ("bad_version_2", "version", dict(version=2), boot_frame, len(boot), 1),
        ("bad_compression_2", "compression", {}, boot, len(boot), 2),
        ("bad_reserved", "reserved", dict(reserved=1), boot_frame, len(boot), 1),
        ("raw_length_field_one_more", "length", {}, boot, len(boot) + 1, 0),
        ("raw_length_field_one_less", "length", {}, boot, len(boot) - 1, 0),
        ("zstd_length_field_one_more", "length", {}, boot_frame, len(boot) + 1, 1),
        ("zstd_length_field_one_less", "length", {}, boot_frame, len(boot) - 1, 1),
        ("zstd_no_size_length_field_one_less", "length", {}, frame(boot, content_size=False), len(boot) - 1, 1),
        ("zstd_no_size_length_field_one_more", "length", {}, frame(boot, content_size=False), len(boot) + 1, 1),
        ("zstd_length_field_huge", "limit", {}, boot_frame, (1 << 64) - 1, 1),
        ("zstd_trailing_byte", "zstd_trailing", {}, boot_frame + b"\x00", len(boot), 1),
        ("zstd_two_frames", "zstd_trailing", {},
         frame(boot[:5000], content_size=False) + frame(boot[5000:], content_size=False), len(boot), 1),
        ("zstd_skippable_frame_first", "zstd_frame", {}, SKIPPABLE + boot_frame, len(boot), 1),
        ("zstd_truncated_frame", "zstd_frame", {}, boot_frame[:-1], len(boot), 1),
        ("zstd_garbage", "zstd_frame", {}, det("blob/garbage", 200), len(boot), 1),
        ("zstd_empty_frame_for_empty_payload_trailing", "zstd_trailing", {}, frame(b"") + b"\x00", 0, 1),
    ]
    for name, why, fields, body, length, compression in resealed:
        blob = blob_raw(body, kind=seal.KIND_BOOT, length=length, compression=compression,
                        salt_label=f"blob/salt/{name}", **fields)
        rejects.append(blob_vec(f"{name}_resealed", "reject", blob, seal.KIND_BOOT, 1 << 20, why=why))
    ok.append(blob_vec("zstd_empty_frame_for_empty_payload", "ok",
                       blob_raw(frame(b""), kind=seal.KIND_DEVSTATE, length=0, compression=1,
                                salt_label="blob/salt/empty-frame"), seal.KIND_DEVSTATE, 1 << 20, b""))
    return ok + rejects


# --- key envelopes ------------------------------------------------------------------------------------------

ENV_UUID = uuid.UUID(bytes=det("envelope/uuid", 16), version=4)
ENV_PK = det("envelope/parcel-key")
ENV_CS = det("envelope/convergence-secret")
PASSPHRASE = "correct horse battery staple"
KEYFILE = det("envelope/keyfile")


def envelope_raw(*, kdf: int, kek: bytes, log2n: int, r: int, p: int, salt: bytes, magic: bytes = envelope.MAGIC,
                 version: int = envelope.VERSION, reserved: int = 0, reserved2: bytes = bytes(3),
                 parcel: uuid.UUID = ENV_UUID) -> bytes:
    """An envelope built from primitives, authenticated under `kek` whatever its header says."""
    header = envelope.HEADER.pack(magic, version, kdf, reserved, parcel.bytes, salt, log2n, reserved2, r, p)
    return header + crypto.aes_gcm_encrypt(kek, ENV_PK + ENV_CS, header)


def scrypt_kek(passphrase: str, salt: bytes, log2n: int, r: int, p: int) -> bytes:
    return crypto.scrypt(passphrase.encode(), salt, log2n, r, p)


def keyfile_kek(keyfile: bytes, salt: bytes) -> bytes:
    return crypto.hmac_sha256(keyfile, b"isr-keyfile-v1" + salt)


def env_vec(name: str, result: str, data: bytes, *, passphrase: str | None = None, keyfile: bytes | None = None,
            why: str | None = None, parcel: uuid.UUID = ENV_UUID) -> Vec:
    vec: Vec = {"name": name, "result": result}
    if why:
        vec["why"] = why
    if passphrase is not None:
        vec.update({"kdf": "scrypt", "passphrase": passphrase.encode()})
    else:
        vec.update({"kdf": "keyfile", "keyfile": keyfile})
    vec.update({"uuid": parcel.bytes, "envelope": data})
    if result == "ok":
        vec.update({"parcel_key": ENV_PK, "convergence_secret": ENV_CS})
    return vec


def env_scrypt(name: str, passphrase: str, log2n: int = 10, r: int = 8, p: int = 1) -> Vec:
    data = envelope.wrap_envelope(ENV_UUID, ENV_PK, ENV_CS, passphrase=passphrase, log2n=log2n, r=r, p=p,
                                  _salt=det(f"envelope/salt/{name}"))
    return env_vec(name, "ok", data, passphrase=passphrase)


def env_keyfile(name: str, keyfile: bytes) -> Vec:
    data = envelope.wrap_envelope(ENV_UUID, ENV_PK, ENV_CS, keyfile=keyfile, _salt=det(f"envelope/salt/{name}"))
    return env_vec(name, "ok", data, keyfile=keyfile)


def envelope_vectors() -> list[Vec]:
    ok = [
        env_scrypt("scrypt_ascii", PASSPHRASE),
        env_scrypt("scrypt_unicode", "pässwörd ✓ 🔑"),
        env_scrypt("scrypt_empty_passphrase", ""),
        env_scrypt("scrypt_r1_p2", PASSPHRASE, r=1, p=2),
        env_scrypt("scrypt_default_parameters", PASSPHRASE, log2n=15),
        env_keyfile("keyfile_32", KEYFILE),
        env_keyfile("keyfile_100", det("envelope/keyfile-100", 100)),
        env_keyfile("keyfile_4096", det("envelope/keyfile-4096", 4096)),
    ]
    rejects = []
    scrypt_base, keyfile_base = ok[0]["envelope"], ok[5]["envelope"]
    rejects += [
        env_vec("wrong_passphrase", "reject", scrypt_base, passphrase=PASSPHRASE + "!", why="gcm"),
        env_vec("wrong_passphrase_case", "reject", scrypt_base, passphrase=PASSPHRASE.upper(), why="gcm"),
        env_vec("wrong_keyfile", "reject", keyfile_base, keyfile=det("envelope/other-keyfile"), why="gcm"),
        env_vec("keyfile_envelope_given_passphrase", "reject", keyfile_base, passphrase=PASSPHRASE, why="kdf"),
        env_vec("scrypt_envelope_given_keyfile", "reject", scrypt_base, keyfile=KEYFILE, why="kdf"),
        env_vec("expected_other_uuid", "reject", scrypt_base, passphrase=PASSPHRASE, why="uuid",
                parcel=uuid.UUID(bytes=det("envelope/other-uuid", 16), version=4)),
    ]
    scrypt_regions = {"magic": (0, "magic"), "version": (4, "version"), "kdf": (5, "kdf"),
                      "reserved_6": (6, "reserved"), "reserved_7": (7, "reserved"), "uuid": (8, "uuid"),
                      "salt": (24, "gcm"), "log2n": (56, "gcm"), "reserved_57": (57, "reserved"),
                      "reserved_59": (59, "reserved"), "r": (63, "gcm"), "r_high": (60, "scrypt_params"),
                      "p": (67, "scrypt_params"), "ciphertext_first": (68, "gcm"),
                      "ciphertext_last": (131, "gcm"), "gcmtag_first": (132, "gcm"), "gcmtag_last": (147, "gcm")}
    for region, (pos, why) in scrypt_regions.items():
        rejects.append(env_vec(f"scrypt_flip_{region}", "reject", flip(scrypt_base, pos), passphrase=PASSPHRASE,
                               why=why))
    keyfile_regions = {"kdf": (5, "kdf"), "uuid": (23, "uuid"), "salt": (55, "gcm"), "log2n": (56, "scrypt_params"),
                       "r": (63, "scrypt_params"), "p": (67, "scrypt_params"), "ciphertext": (100, "gcm"),
                       "gcmtag": (140, "gcm")}
    for region, (pos, why) in keyfile_regions.items():
        rejects.append(env_vec(f"keyfile_flip_{region}", "reject", flip(keyfile_base, pos), keyfile=KEYFILE,
                               why=why))
    for size in (0, 68, 147):
        rejects.append(env_vec(f"truncated_{size}", "reject", scrypt_base[:size], passphrase=PASSPHRASE,
                               why="size"))
    rejects.append(env_vec("extended_one_byte", "reject", scrypt_base + b"\x00", passphrase=PASSPHRASE, why="size"))

    # Out-of-range scrypt parameters. Where scrypt is affordable the envelope is genuinely encrypted with
    # them, so a reader that forgot the range check would open it; the others carry a dummy ciphertext.
    def scrypt_envelope(name: str, log2n: int, r: int, p: int, genuine: bool) -> bytes:
        salt = det(f"envelope/salt/{name}")
        kek = scrypt_kek(PASSPHRASE, salt, log2n, r, p) if genuine else det(f"envelope/dummy-kek/{name}")
        return envelope_raw(kdf=envelope.KDF_SCRYPT, kek=kek, log2n=log2n, r=r, p=p, salt=salt)

    for name, log2n, r, p, genuine in (("log2n_9", 9, 8, 1, True), ("log2n_23", 23, 8, 1, False),
                                       ("log2n_255", 255, 8, 1, False), ("r_0", 10, 0, 1, False),
                                       ("r_33", 10, 33, 1, True), ("p_0", 10, 8, 0, False),
                                       ("p_17", 10, 1, 17, True), ("memory_over_1gib", 16, 16, 9, True),
                                       ("r_huge", 10, 0xFFFFFFFF, 1, False), ("p_huge", 10, 8, 0xFFFFFFFF, False)):
        rejects.append(env_vec(f"scrypt_{name}", "reject", scrypt_envelope(name, log2n, r, p, genuine),
                               passphrase=PASSPHRASE, why="scrypt_params"))

    # Header defects sealed properly, so only the header check can refuse them.
    salt = det("envelope/salt/resealed")
    kek = keyfile_kek(KEYFILE, salt)
    for name, why, fields in (("bad_magic", "magic", dict(magic=b"ISRX")), ("bad_version", "version", dict(version=2)),
                              ("reserved_6_nonzero", "reserved", dict(reserved=1)),
                              ("reserved_57_nonzero", "reserved", dict(reserved2=b"\x00\x00\x01")),
                              ("kdf_3", "kdf", dict(kdf=3)), ("kdf_0", "kdf", dict(kdf=0)),
                              ("keyfile_with_scrypt_fields", "scrypt_params", dict(log2n=10, r=8, p=1))):
        params: dict[str, Any] = dict(kdf=envelope.KDF_KEYFILE, log2n=0, r=0, p=0)
        params.update(fields)
        rejects.append(env_vec(f"{name}_resealed", "reject", envelope_raw(kek=kek, salt=salt, **params),
                               keyfile=KEYFILE, why=why))
    for size in (31, 4097):
        keyfile = det(f"envelope/keyfile-{size}", size)
        salt = det(f"envelope/salt/keyfile-{size}")
        data = envelope_raw(kdf=envelope.KDF_KEYFILE, kek=keyfile_kek(keyfile, salt), log2n=0, r=0, p=0, salt=salt)
        rejects.append(env_vec(f"keyfile_{size}_bytes", "reject", data, keyfile=keyfile, why="keyfile_size"))
    return ok + rejects


# --- keyrings ----------------------------------------------------------------------------------------------

PK_KEYRING = det("keyring/parcel-key")
KEYRING_HEADER = keyring.HEADER


def plain_records(label: str, indices: list[int], flags: Callable[[int], int] = lambda i: i % 2
                  ) -> list[tuple[int, int, bytes, bytes]]:
    return [(i, flags(i), det(f"keyring/{label}/tag/{i}"), det(f"keyring/{label}/key/{i}")) for i in indices]


def records_text(records: list[tuple[int, int, bytes, bytes]]) -> str:
    return ",".join(f"{i}:{f}:{tag.hex()}:{key.hex()}" for i, f, tag, key in records)


def wrapped(records: list[tuple[int, int, bytes, bytes]], parcel_key: bytes = PK_KEYRING) -> list[keyring.KeyringRecord]:
    return [keyring.KeyringRecord(i, f, tag, keyring.wrap_chunk_key(parcel_key, key)) for i, f, tag, key in records]


def raw_stream(chunk_size: int, image_size: int, records: list[keyring.KeyringRecord], *, magic: bytes = keyring.MAGIC,
               version: int = keyring.VERSION, reserved: bytes = bytes(3), count: int | None = None) -> bytes:
    """A keyring stream packed without any validation."""
    body = b"".join(keyring.RECORD.pack(*r) for r in records)
    return KEYRING_HEADER.pack(magic, version, reserved, chunk_size, image_size,
                               len(records) if count is None else count) + body


def keyring_vec(name: str, result: str, chunk_size: int, image_size: int, stream: bytes,
                records: list[tuple[int, int, bytes, bytes]] | None = None, why: str | None = None) -> Vec:
    vec: Vec = {"name": name, "result": result}
    if why:
        vec["why"] = why
    vec.update({"parcel_key": PK_KEYRING, "chunk_size": chunk_size, "image_size": image_size})
    if records is not None:
        vec["records"] = records_text(records)
    vec.update({"stream": stream, "digest": crypto.sha256(stream)})
    return vec


def keyring_ok(name: str, chunk_size: int, image_size: int, indices: list[int]) -> Vec:
    records = plain_records(name, indices)
    stream = keyring.encode_stream(chunk_size, image_size, wrapped(records))
    return keyring_vec(name, "ok", chunk_size, image_size, stream, records)


def keyring_vectors() -> list[Vec]:
    ok = [
        keyring_ok("empty", 131072, 268435456, []),
        keyring_ok("three_records", 131072, 268435456, [0, 5, 2047]),
        keyring_ok("short_last_chunk", 4096, 10000, [0, 2]),
        keyring_ok("chunk_size_4m", 4194304, 1 << 30, [0, 255]),
        keyring_ok("empty_image", 4096, 0, []),
        keyring_ok("many_records", 4096, 1 << 20, list(range(0, 256, 3))),
        keyring_ok("large_index", 4096, 1 << 50, [7, (1 << 32) + 5, (1 << 38) - 1]),
        keyring_ok("unaligned_image_size", 131072, 131072 * 3 + 512, [3]),
    ]
    base_records = wrapped(plain_records("base", [1, 4, 7]))
    cs, size = 131072, 1 << 20          # 8 chunks
    good = raw_stream(cs, size, base_records)

    def rec(i: int, flags: int = 0) -> keyring.KeyringRecord:
        return wrapped(plain_records("reject", [i], flags=lambda _: flags))[0]

    rejects = []
    for name, why, stream in (
            ("bad_magic", "magic", raw_stream(cs, size, base_records, magic=b"ISRX")),
            ("bad_version_0", "version", raw_stream(cs, size, base_records, version=0)),
            ("bad_version_2", "version", raw_stream(cs, size, base_records, version=2)),
            ("reserved_5", "reserved", raw_stream(cs, size, base_records, reserved=b"\x01\x00\x00")),
            ("reserved_7", "reserved", raw_stream(cs, size, base_records, reserved=b"\x00\x00\x80")),
            ("chunk_size_0", "chunk_size", raw_stream(0, size, base_records)),
            ("chunk_size_2048", "chunk_size", raw_stream(2048, size, base_records)),
            ("chunk_size_8m", "chunk_size", raw_stream(8388608, size, base_records)),
            ("chunk_size_not_power_of_two", "chunk_size", raw_stream(131072 + 4096, size, base_records)),
            ("empty_stream", "length", b""),
            ("header_only_27_bytes", "length", good[:27]),
            ("one_byte_short", "length", good[:-1]),
            ("one_byte_extra", "length", good + b"\x00"),
            ("count_one_more", "length", raw_stream(cs, size, base_records, count=4)),
            ("count_one_less", "length", raw_stream(cs, size, base_records, count=2)),
            ("count_huge", "length", raw_stream(cs, size, base_records, count=(1 << 64) - 1)),
            ("unsorted", "order", raw_stream(cs, size, [rec(5), rec(2)])),
            ("duplicate_index", "order", raw_stream(cs, size, [rec(2), rec(5), rec(5)])),
            ("index_equals_chunk_count", "range", raw_stream(cs, size, [rec(1), rec(8)])),
            ("index_max_u64", "range", raw_stream(cs, size, [rec((1 << 64) - 1)])),
            ("index_past_short_last_chunk", "range", raw_stream(4096, 10000, [rec(3)])),
            ("index_in_empty_image", "range", raw_stream(4096, 0, [rec(0)])),
            ("flags_2", "flags", raw_stream(cs, size, [rec(1, 2)])),
            ("flags_128", "flags", raw_stream(cs, size, [rec(1, 128)])),
            ("flags_255", "flags", raw_stream(cs, size, [rec(1, 255)]))):
        rejects.append(keyring_vec(name, "reject", cs, size, stream, why=why))
    altered = list(base_records)
    altered[1] = altered[1]._replace(wkey=flip(altered[1].wkey, 20))
    rejects.append(keyring_vec("wrapped_key_altered", "reject", cs, size, raw_stream(cs, size, altered), why="unwrap"))
    foreign = wrapped(plain_records("base", [1, 4, 7]), parcel_key=det("other-parcel-key"))
    rejects.append(keyring_vec("wrapped_under_other_parcel_key", "reject", cs, size, raw_stream(cs, size, foreign),
                               why="unwrap"))
    return ok + rejects


# --- manifests -------------------------------------------------------------------------------------------

PK_MANIFEST = det("manifest/parcel-key")
MANIFEST_UUID = uuid.UUID(bytes=det("manifest/uuid", 16), version=4)


def base_manifest() -> dict[str, Any]:
    """A suspended version 3 with every optional part present, as a JSON object."""
    def image(size: int, chunks: int, label: str) -> dict[str, Any]:
        return {"size": size, "chunks": chunks,
                "keyring": {"sha256": det(f"manifest/{label}").hex(), "size": 28 + 81 * chunks}}
    return {
        "format": 1,
        "parcel": str(MANIFEST_UUID),
        "name": "workstation",
        "version": 3,
        "parent": 2,
        "created": "2026-11-22T04:40:32Z",
        "chunk_size": 131072,
        "images": {"disk": image(1073741824, 2116, "disk"), "memory": image(268435456, 611, "memory")},
        "blobs": {
            "devstate": {"kind": 3, "sha256": det("manifest/devstate").hex(), "size": 126011},
            "kernel": {"kind": 4, "sha256": det("manifest/kernel").hex(), "size": 7012345},
            "initrd": {"kind": 4, "sha256": det("manifest/initrd").hex(), "size": 1234567},
        },
        "vm": {
            "machine": "pc-q35-7.2", "cpu": "qemu64", "ram_mib": 256, "smp": 1, "qemu_version": "7.2.19",
            "boot": {"kernel": "kernel", "initrd": "initrd", "cmdline": "console=ttyS0 quiet"},
            "devices": {"disk": "virtio-blk", "net": "none", "display": "vnc"},
        },
        "suspended": True,
        "working_set": {"disk": [0, 1, 2, 17], "memory": [5, 3, 4]},
        "timestamps": {"created": "2026-11-22T05:01:02Z", "suspended": "2026-11-22T05:02:11Z"},
    }


def cold_manifest() -> dict[str, Any]:
    obj = base_manifest()
    obj.update(version=1, parent=None, suspended=False, blobs={}, working_set={"disk": [], "memory": []},
               timestamps={"created": "2026-11-22T04:40:32Z", "suspended": None})
    obj["images"]["memory"].update(chunks=0, keyring={"sha256": det("manifest/empty").hex(), "size": 28})
    obj["vm"].update(qemu_version=None)
    del obj["vm"]["boot"]
    return obj


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def manifest_vec(name: str, result: str, blob: bytes, version: int, *, json_bytes: bytes | None = None,
                 why: str | None = None, layer: str | None = None, parcel: uuid.UUID = MANIFEST_UUID,
                 parcel_key: bytes = PK_MANIFEST) -> Vec:
    vec: Vec = {"name": name, "result": result}
    if why:
        vec.update({"why": why, "layer": layer})
    vec.update({"parcel_key": parcel_key, "uuid": str(parcel), "version": version})
    if json_bytes is not None:
        vec["json"] = json_bytes
    vec["blob"] = blob
    return vec


def sealed(name: str, payload: bytes, kind: int = seal.KIND_MANIFEST) -> bytes:
    return seal.seal(PK_MANIFEST, kind, payload, _salt=det(f"manifest/salt/{name}"))


def manifest_ok(name: str, obj: dict[str, Any]) -> Vec:
    payload = canonical(obj)
    manifest.Manifest.from_json(payload)        # the generator must not emit an ok vector it rejects itself
    return manifest_vec(name, "ok", sealed(name, payload), obj["version"], json_bytes=payload)


def manifest_reject(name: str, why: str, layer: str, payload: bytes | dict[str, Any], version: int = 3,
                    parcel: uuid.UUID = MANIFEST_UUID) -> Vec:
    data = payload if isinstance(payload, bytes) else canonical(payload)
    return manifest_vec(name, "reject", sealed(name, data), version, why=why, layer=layer, parcel=parcel)


def edited(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    obj = base_manifest()
    change(obj)
    return obj


def manifest_vectors() -> list[Vec]:
    future = base_manifest()
    future["future_field"] = {"anything": [1, 2, 3]}
    future["images"]["disk"]["future"] = "ignored"
    future["vm"]["future"] = True
    future["blobs"]["devstate"]["note"] = None
    future["timestamps"]["future"] = "2030-01-01T00:00:00Z"
    unicode_name = cold_manifest()
    unicode_name["name"] = "Schreibtisch ✓ 仕事"
    long_name = cold_manifest()
    long_name["name"] = "n" * 64
    fractional = cold_manifest()
    fractional["created"] = "2026-11-22T04:40:32.123456Z"
    fractional["timestamps"]["created"] = "2026-11-22T04:40:32+00:00"
    # The memory image's own chunk size: 8192 chunks of 32 KiB, so index 8191 is in range (not at 128 KiB).
    memory_chunks = base_manifest()
    memory_chunks["images"]["memory"]["chunk_size"] = 32768
    memory_chunks["working_set"]["memory"] = [8191, 0]
    ok = [
        manifest_ok("suspended_version_3", base_manifest()),
        manifest_ok("cold_version_1", cold_manifest()),
        manifest_ok("unknown_keys_ignored", future),
        manifest_ok("unicode_name", unicode_name),
        manifest_ok("name_64_characters", long_name),
        manifest_ok("fractional_seconds_and_offset", fractional),
        manifest_ok("memory_chunk_size_of_its_own", memory_chunks),
    ]
    base_blob = ok[0]["blob"]
    rejects = []
    for region, pos, why in (("magic", 0, "magic"), ("version", 4, "version"), ("kind", 5, "kind"),
                             ("compression", 6, "compression"), ("reserved", 7, "reserved"), ("salt", 20, "gcm"),
                             ("length", 47, "length"), ("ciphertext", 60, "gcm"),
                             ("gcmtag", len(base_blob) - 1, "gcm")):
        rejects.append(manifest_vec(f"flip_{region}", "reject", flip(base_blob, pos), 3, why=why, layer="seal"))
    rejects += [
        manifest_vec("truncated", "reject", base_blob[:-1], 3, why="gcm", layer="seal"),
        manifest_vec("other_parcel_key", "reject", base_blob, 3, why="gcm", layer="seal",
                     parcel_key=det("other-parcel-key")),
        manifest_vec("sealed_as_keyring", "reject", sealed("as-keyring", canonical(base_manifest()),
                                                           seal.KIND_KEYRING), 3, why="kind", layer="seal"),
        manifest_vec("sealed_as_devstate", "reject", sealed("as-devstate", canonical(base_manifest()),
                                                            seal.KIND_DEVSTATE), 3, why="kind", layer="seal"),
        manifest_reject("other_parcel", "parcel", "identity", base_manifest(),
                        parcel=uuid.UUID(bytes=det("manifest/other-uuid", 16), version=4)),
        manifest_reject("other_version", "version", "identity", base_manifest(), version=4),
        manifest_reject("older_version", "version", "identity", base_manifest(), version=2),
        manifest_reject("not_json", "json", "identity", b"this is not json"),
        manifest_reject("not_utf8", "json", "identity", canonical(base_manifest()).replace(b"workstation",
                                                                                            b"work\xffstation")),
        manifest_reject("json_array", "json", "identity", b"[1]"),
        manifest_reject("empty_payload", "json", "identity", b""),
        manifest_reject("missing_parcel", "missing", "identity", edited(lambda o: o.pop("parcel"))),
        manifest_reject("missing_version", "missing", "identity", edited(lambda o: o.pop("version"))),
        manifest_reject("parcel_uppercase", "parcel", "rules",
                        edited(lambda o: o.update(parcel=o["parcel"].upper()))),
        manifest_reject("parcel_not_uuid", "parcel", "identity", edited(lambda o: o.update(parcel="workstation"))),
        manifest_reject("version_as_string", "version", "identity", edited(lambda o: o.update(version="3"))),
    ]
    required = ["format", "name", "parent", "created", "chunk_size", "images", "blobs", "vm", "suspended",
                "working_set", "timestamps"]
    def without(key: str) -> Callable[[dict[str, Any]], None]:
        return lambda o: o.pop(key)

    for key in required:
        rejects.append(manifest_reject(f"missing_{key}", "missing", "rules", edited(without(key))))

    def vm(**changes: Any) -> Callable[[dict[str, Any]], None]:
        return lambda o: o["vm"].update(changes)

    def memory_index_beyond_64k(o: dict[str, Any]) -> None:
        o["images"]["memory"].update(chunk_size=65536)      # 4096 chunks of 64 KiB: 4095 is the last
        o["working_set"].update(memory=[4096])

    rules: list[tuple[str, str, Callable[[dict[str, Any]], None]]] = [
        ("format_2", "format", lambda o: o.update(format=2)),
        ("format_0", "format", lambda o: o.update(format=0)),
        ("format_as_string", "format", lambda o: o.update(format="1")),
        ("format_as_float", "format", lambda o: o.update(format=1.0)),
        ("format_as_bool", "format", lambda o: o.update(format=True)),
        ("name_empty", "name", lambda o: o.update(name="")),
        ("name_65_characters", "name", lambda o: o.update(name="n" * 65)),
        ("version_0", "version", lambda o: o.update(version=0, parent=None)),
        ("parent_not_previous", "parent", lambda o: o.update(parent=1)),
        ("parent_null_after_first", "parent", lambda o: o.update(parent=None)),
        ("parent_as_string", "parent", lambda o: o.update(parent="2")),
        ("created_not_utc", "time", lambda o: o.update(created="2026-11-22T06:40:32+02:00")),
        ("created_no_zone", "time", lambda o: o.update(created="2026-11-22T04:40:32")),
        ("created_bad_month", "time", lambda o: o.update(created="2026-13-22T04:40:32Z")),
        ("created_date_only", "time", lambda o: o.update(created="2026-11-22")),
        ("created_year_0", "time", lambda o: o.update(created="0000-01-01T00:00:00Z")),
        ("chunk_size_not_power_of_two", "chunk_size", lambda o: o.update(chunk_size=100000)),
        ("chunk_size_too_large", "chunk_size", lambda o: o.update(chunk_size=8388608)),
        ("images_missing_memory", "images", lambda o: o["images"].pop("memory")),
        ("images_extra_swap", "images", lambda o: o["images"].update(swap=o["images"]["disk"])),
        ("disk_size_not_multiple_of_512", "images", lambda o: o["images"]["disk"].update(size=1073741824 + 100)),
        ("disk_size_negative", "images", lambda o: o["images"]["disk"].update(size=-512)),
        ("memory_size_not_ram_mib", "memory", lambda o: o["images"]["memory"].update(size=268435456 + 512)),
        ("keyring_sha256_uppercase", "digest",
         lambda o: o["images"]["disk"]["keyring"].update(sha256=o["images"]["disk"]["keyring"]["sha256"].upper())),
        ("keyring_sha256_short", "digest", lambda o: o["images"]["disk"]["keyring"].update(sha256="ab" * 31)),
        ("keyring_size_not_record_count", "keyring_size",
         lambda o: o["images"]["disk"]["keyring"].update(size=28 + 81 * 2115)),
        ("chunks_more_than_image", "chunks",
         lambda o: o["images"]["disk"].update(chunks=8193, keyring={"sha256": "00" * 32, "size": 28 + 81 * 8193})),
        ("blob_name_uppercase", "blob_name", lambda o: o["blobs"].update(Kernel=o["blobs"]["kernel"])),
        ("blob_name_leading_dot", "blob_name", lambda o: o["blobs"].update({".hidden": o["blobs"]["kernel"]})),
        ("blob_name_slash", "blob_name", lambda o: o["blobs"].update({"a/b": o["blobs"]["kernel"]})),
        ("blob_name_65_characters", "blob_name", lambda o: o["blobs"].update({"b" * 65: o["blobs"]["kernel"]})),
        ("blob_name_reserved_manifest", "blob_name", lambda o: o["blobs"].update(manifest=o["blobs"]["kernel"])),
        ("blob_name_reserved_keyring", "blob_name",
         lambda o: o["blobs"].update({"keyring.disk": o["blobs"]["kernel"]})),
        ("blob_kind_1", "blob_kind", lambda o: o["blobs"]["kernel"].update(kind=1)),
        ("blob_kind_5", "blob_kind", lambda o: o["blobs"]["kernel"].update(kind=5)),
        ("blob_sha256_not_hex", "digest", lambda o: o["blobs"]["kernel"].update(sha256="zz" * 32)),
        ("blob_size_negative", "blob_size", lambda o: o["blobs"]["kernel"].update(size=-1)),
        ("machine_alias_q35", "machine", vm(machine="q35")),
        ("machine_alias_pc", "machine", vm(machine="pc")),
        ("cpu_empty", "cpu", vm(cpu="")),
        ("ram_mib_zero", "memory", vm(ram_mib=0)),
        ("ram_mib_mismatch", "memory", vm(ram_mib=512)),
        ("smp_zero", "smp", vm(smp=0)),
        ("vm_missing_machine", "missing", lambda o: o["vm"].pop("machine")),
        ("vm_missing_devices", "missing", lambda o: o["vm"].pop("devices")),
        ("boot_kernel_not_a_blob", "boot", lambda o: o["vm"]["boot"].update(kernel="vmlinuz")),
        ("boot_kernel_is_devstate", "boot", lambda o: o["vm"]["boot"].update(kernel="devstate")),
        ("suspended_without_devstate", "suspended", lambda o: o["blobs"].pop("devstate")),
        ("suspended_without_time", "suspended", lambda o: o["timestamps"].update(suspended=None)),
        ("suspended_as_string", "suspended", lambda o: o.update(suspended="true")),
        ("working_set_out_of_range", "working_set", lambda o: o["working_set"].update(disk=[0, 8192])),
        ("memory_working_set_beyond_chunk_count", "working_set", lambda o: o["working_set"].update(memory=[2048])),
        ("memory_working_set_beyond_own_chunk_count", "working_set", memory_index_beyond_64k),
        ("memory_chunk_size_not_power_of_two", "chunk_size",
         lambda o: o["images"]["memory"].update(chunk_size=30000)),
        ("memory_chunk_size_too_small", "chunk_size", lambda o: o["images"]["memory"].update(chunk_size=2048)),
        ("memory_chunk_size_as_string", "chunk_size", lambda o: o["images"]["memory"].update(chunk_size="32768")),
        ("memory_chunks_more_than_own_chunk_count", "chunks",
         lambda o: o["images"]["memory"].update(chunk_size=4194304, chunks=65,
                                                keyring={"sha256": "00" * 32, "size": 28 + 81 * 65})),
        ("working_set_negative", "working_set", lambda o: o["working_set"].update(disk=[-1])),
        ("working_set_duplicate", "working_set", lambda o: o["working_set"].update(memory=[5, 3, 5])),
        ("working_set_missing_memory", "working_set", lambda o: o["working_set"].pop("memory")),
        ("timestamps_created_missing", "missing", lambda o: o["timestamps"].pop("created")),
        ("timestamps_suspended_bad", "time", lambda o: o["timestamps"].update(suspended="yesterday")),
    ]
    for name, why, change in rules:
        rejects.append(manifest_reject(name, why, "rules", edited(change)))
    duplicate = canonical(base_manifest()).replace(b'"name":"workstation"', b'"name":"workstation","name":"other"')
    assert duplicate.count(b'"name":') == 2
    rejects.append(manifest_reject("duplicate_key", "json", "rules", duplicate))
    nan = canonical(base_manifest()).replace(b'"smp":1', b'"smp":NaN')
    rejects.append(manifest_reject("nan_number", "json", "rules", nan))
    # JSON one reader took and the other did not, found by fuzzing the two against each other (doc/fuzzing.md):
    # refused by both, also under a key that no reader knows.
    for name, member in (("integer_2_63", b'"future":9223372036854775808'), ("number_overflow", b'"future":1e400'),
                         ("nul_in_string", b'"future":"a\\u0000b"'), ("nul_in_key", b'"a\\u0000b":1'),
                         ("lone_surrogate", b'"future":"\\ud800"')):
        text = canonical(base_manifest()).replace(b"{", b"{" + member + b",", 1)
        rejects.append(manifest_reject(f"unknown_key_{name}", "json", "rules", text))
    return ok + rejects


# --- files -------------------------------------------------------------------------------------------------

HEADER = """\
{title}
Generated by `python -m parcels.testvectors.generate`; do not edit by hand. The file syntax and the
meaning of each key are in README.md next to this file; the byte layouts in doc/parcel-format.md.
"""

LAYER_NOTE = """\
Reject vectors carry `layer`: `seal` (the sealed blob itself must be refused), `identity` (the blob
opens, but the JSON is not an object with the asked-for `parcel` and `version`), or `rules` (any other
rule of the manifest table). The C side must reject `seal` and `identity` vectors; Python rejects all.
"""

SPECS: dict[str, tuple[str, str, Callable[[], list[Vec]]]] = {
    "chunks.txt": ("chunk", "Chunk objects: doc/parcel-format.md, \"Chunk objects\".", chunk_vectors),
    "blobs.txt": ("blob", "Sealed blobs: doc/parcel-format.md, \"Sealed blobs\".", blob_vectors),
    "keyenvelopes.txt": ("envelope", "Key envelopes: doc/parcel-format.md, \"Key envelope\".", envelope_vectors),
    "keyrings.txt": ("keyring", "Keyring streams: doc/parcel-format.md, \"Keyrings\".", keyring_vectors),
    "manifests.txt": ("manifest", "Sealed manifests: doc/parcel-format.md, \"Manifest\".\n" + LAYER_NOTE,
                      manifest_vectors),
}


def generate() -> dict[str, str]:
    """The content of every vector file, by file name."""
    return {filename: render(section, HEADER.format(title=title), build())
            for filename, (section, title, build) in SPECS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parcels.testvectors.generate",
                                     description="Write the parcel-format test vectors into "
                                                 f"{VECTOR_DIR}. Refuses to change existing files without --force.")
    parser.add_argument("--force", action="store_true", help="overwrite files whose content would change")
    parser.add_argument("--dir", type=Path, default=VECTOR_DIR, help="write here instead (default: %(default)s)")
    args = parser.parse_args(argv)
    contents = generate()
    changed = [name for name, content in contents.items()
               if (args.dir / name).exists() and (args.dir / name).read_text(encoding="ascii") != content]
    if changed and not args.force:
        print(f"generate: refusing to change {', '.join(changed)} (a change here is a format change); "
              "rerun with --force if that is intended", file=sys.stderr)
        return 1
    for name, content in contents.items():
        path = args.dir / name
        if path.exists() and path.read_text(encoding="ascii") == content:
            print(f"{name}: unchanged")
            continue
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(content, encoding="ascii")
        os.replace(tmp, path)
        count = content.count("\n[")
        print(f"{name}: wrote {count} vectors, {len(content)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
