"""Manifests: the sealed JSON description of a version and the root of trust for everything in it.

See "Manifest" in doc/parcel-format.md. `Manifest.from_json` enforces every rule of the spec's table
(and ignores unknown keys, so later versions can add fields); `Manifest.validate` applies the same rules
to a manifest built in Python, and `seal_manifest` never seals one that fails them.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

from parcels import seal
from parcels.compress import StreamReader
from parcels.chunk import chunk_count, valid_chunk_size
from parcels.errors import FormatError, IntegrityError
from parcels.crypto import sha256
from parcels.keyring import HEADER_SIZE as KEYRING_HEADER_SIZE
from parcels.keyring import RECORD_SIZE as KEYRING_RECORD_SIZE
from parcels.keyring import KeyringRecord, decode_stream

FORMAT = 1
IMAGES = ("disk", "memory")
#: The firmware a VM starts with (``vm.firmware``): legacy BIOS (SeaBIOS, QEMU's default) or UEFI (OVMF).
FIRMWARES = ("bios", "uefi")
MAX_NAME = 64
# A working set can list every chunk of a large disk; 64 MiB of JSON is far beyond any real manifest.
MAX_MANIFEST_SIZE = 64 << 20
BLOB_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
# These names are files of their own in a version directory (see "Parcel store layout").
RESERVED_BLOB_NAMES = frozenset({"manifest", "keyring.disk", "keyring.memory"})
BLOB_KINDS = (seal.KIND_DEVSTATE, seal.KIND_BOOT)
#: The device state, and the same payload sealed against the firmware files it carries (compression 2): a
#: reader that has those files fetches the second, a few KB instead of a few hundred.
DEVSTATE = "devstate"
DEVSTATE_FILES = "devstate.fw"
# A versioned QEMU machine type ends in -MAJOR.MINOR ("pc-q35-7.2"); aliases ("q35", "pc") do not.
MACHINE_TYPE = re.compile(r"[a-z0-9][a-z0-9_.-]*-[0-9]+\.[0-9]+")
_RFC3339_UTC = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})"
                          r"(\.[0-9]+)?([Zz]|\+00:00)")
_HEX256 = re.compile(r"[0-9a-f]{64}")
# jansson (vulpes) reads 64-bit signed integers only; the format says so for both readers.
_MIN_INT = -(1 << 63)
_MAX_INT = (1 << 63) - 1


@dataclass
class ImageInfo:
    """One image of a version: its size, the digest and size of its keyring stream, and its own chunk size
    (None: the manifest's ``chunk_size``; use `Manifest.image_chunk_size`)."""

    size: int
    keyring_sha256: bytes
    keyring_size: int
    chunks: int
    chunk_size: int | None = None


@dataclass
class BlobInfo:
    """A sealed blob named in the manifest: its kind and the SHA-256 and size of its payload."""

    kind: int
    sha256: bytes
    size: int


@dataclass
class BootConfig:
    """Direct kernel boot: blob names of the kernel and initrd, and the kernel command line."""

    kernel: str
    initrd: str | None = None
    cmdline: str = ""


@dataclass
class VMConfig:
    """The virtual hardware a version runs on."""

    machine: str
    cpu: str
    ram_mib: int
    smp: int
    devices: dict[str, str]
    qemu_version: str | None = None
    boot: BootConfig | None = None
    #: "bios" (SeaBIOS; the default, also for a manifest that names none) or "uefi" (OVMF).
    firmware: str = "bios"


@dataclass
class Timestamps:
    """RFC 3339 UTC times: when this version was created, and when its state was saved (or None)."""

    created: str
    suspended: str | None = None


@dataclass
class Manifest:
    """A decoded, validated manifest. Digests are raw bytes here and lowercase hex in JSON."""

    parcel: uuid.UUID
    name: str
    version: int
    parent: int | None
    created: str
    chunk_size: int
    images: dict[str, ImageInfo]
    blobs: dict[str, BlobInfo]
    vm: VMConfig
    suspended: bool
    working_set: dict[str, list[int]]
    timestamps: Timestamps
    format: int = FORMAT

    def image_chunk_size(self, image: str) -> int:
        """The chunk size of `image`: its own if the manifest gives one, else the parcel's ``chunk_size``."""
        own = self.images[image].chunk_size
        return self.chunk_size if own is None else own

    def image_chunk_count(self, image: str) -> int:
        """How many chunks `image` has: ceil(size / its chunk size)."""
        return chunk_count(self.image_chunk_size(image), self.images[image].size)

    def chunk_counts(self) -> dict[str, int]:
        """`image_chunk_count` of every image."""
        return {image: self.image_chunk_count(image) for image in IMAGES}

    def largest_chunk_size(self) -> int:
        """The largest chunk size of any image: the most one chunk object of this version can hold."""
        return max(self.image_chunk_size(image) for image in IMAGES)

    def to_dict(self) -> dict[str, Any]:
        """The manifest as the JSON object the spec describes."""
        vm: dict[str, Any] = {
            "machine": self.vm.machine, "cpu": self.vm.cpu, "ram_mib": self.vm.ram_mib, "smp": self.vm.smp,
            "qemu_version": self.vm.qemu_version, "devices": dict(self.vm.devices),
        }
        if self.vm.firmware != "bios":
            vm["firmware"] = self.vm.firmware
        if self.vm.boot is not None:
            vm["boot"] = {"kernel": self.vm.boot.kernel, "initrd": self.vm.boot.initrd,
                          "cmdline": self.vm.boot.cmdline}
        return {
            "format": self.format,
            "parcel": str(self.parcel),
            "name": self.name,
            "version": self.version,
            "parent": self.parent,
            "created": self.created,
            "chunk_size": self.chunk_size,
            "images": {name: _image_dict(info) for name, info in self.images.items()},
            "blobs": {name: {"kind": info.kind, "sha256": info.sha256.hex(), "size": info.size}
                      for name, info in self.blobs.items()},
            "vm": vm,
            "suspended": self.suspended,
            "working_set": {name: list(indices) for name, indices in self.working_set.items()},
            "timestamps": {"created": self.timestamps.created, "suspended": self.timestamps.suspended},
        }

    def to_json(self) -> bytes:
        """UTF-8 JSON with sorted keys and no whitespace. Does not validate (seal_manifest does)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse and validate a manifest.

        Guarantees: the result satisfies every rule of the spec's manifest table (see `validate`).
        Unknown keys are ignored, but not JSON that vulpes's reader refuses, anywhere: the two accept the same
        manifests. Raises FormatError for text that is not UTF-8 JSON, duplicate keys, NaN, infinities or a
        number that overflows to one, an integer outside -2^63..2^63-1, a string with U+0000 or a lone
        surrogate, `format` other than 1, a missing required field, a field of the wrong type, or a broken rule.
        """
        try:
            text = bytes(data).decode("utf-8")
            obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant,
                             parse_int=_int64, parse_float=_finite)
        except UnicodeDecodeError:
            raise FormatError("manifest is not UTF-8") from None
        except (ValueError, RecursionError) as exc:
            raise FormatError(f"manifest is not valid JSON: {exc}") from None
        _check_strings(obj)
        manifest = _from_object(obj)
        manifest.validate()
        return manifest

    def validate(self) -> None:
        """Raise FormatError unless this manifest follows every rule of the spec's manifest table.

        Beyond the table's literal rules this also checks what the table implies: `keyring.size` equals
        28 + 81·`chunks` and `chunks` fits the image; blob kinds are 3 (device state) or 4 (boot file);
        blob names do not collide with the version directory's own files; boot names refer to kind-4
        blobs; working-set indices are in range and unique; a suspended version has a kind-3 `devstate`
        blob, a QEMU version and a suspend time.
        """
        _check(self.format == FORMAT, f"unknown manifest format {self.format}")
        _check(isinstance(self.parcel, uuid.UUID), "parcel must be a UUID")
        _check(isinstance(self.name, str) and 1 <= len(self.name) <= MAX_NAME,
               f"name must be 1 to {MAX_NAME} characters")
        _check(_is_int(self.version) and self.version >= 1, "version must be an integer >= 1")
        if self.version == 1:
            _check(self.parent is None, "version 1 must have a null parent")
        else:
            _check(self.parent == self.version - 1, f"parent of version {self.version} must be "
                                                    f"{self.version - 1}, not {self.parent}")
        _check_time(self.created, "created")
        _check(valid_chunk_size(self.chunk_size), f"invalid chunk size {self.chunk_size}")
        _check(sorted(self.images) == sorted(IMAGES), "images must be exactly disk and memory")
        for name, image in self.images.items():
            where = f"images.{name}"
            _check(_is_int(image.size) and 0 <= image.size <= _MAX_INT and image.size % 512 == 0,
                   f"{where}.size must be a multiple of 512")
            _check(len(image.keyring_sha256) == 32, f"{where}.keyring.sha256 must be 32 bytes")
            _check(image.chunk_size is None or valid_chunk_size(image.chunk_size),
                   f"invalid {where}.chunk_size {image.chunk_size}")
            _check(_is_int(image.chunks) and 0 <= image.chunks <= self.image_chunk_count(name),
                   f"{where}.chunks out of range")
            _check(image.keyring_size == KEYRING_HEADER_SIZE + KEYRING_RECORD_SIZE * image.chunks,
                   f"{where}.keyring.size does not match {image.chunks} records")
        for name, blob in self.blobs.items():
            _check(BLOB_NAME.fullmatch(name) is not None, f"invalid blob name {name!r}")
            _check(name not in RESERVED_BLOB_NAMES, f"blob name {name!r} is reserved")
            _check(blob.kind in BLOB_KINDS, f"blob {name} has kind {blob.kind}, expected 3 or 4")
            _check(len(blob.sha256) == 32, f"blob {name} sha256 must be 32 bytes")
            _check(_is_int(blob.size) and 0 <= blob.size <= _MAX_INT, f"blob {name} has an invalid size")
        vm = self.vm
        _check(all(isinstance(x, str) for x in (vm.machine, vm.cpu, *vm.devices, *vm.devices.values())),
               "vm.machine, vm.cpu and vm.devices must be strings")
        _check(vm.qemu_version is None or isinstance(vm.qemu_version, str), "vm.qemu_version must be a string")
        _check(MACHINE_TYPE.fullmatch(vm.machine) is not None,
               f"vm.machine {vm.machine!r} is not a versioned QEMU machine type such as pc-q35-7.2")
        _check(len(vm.cpu) > 0, "vm.cpu must not be empty")
        _check(_is_int(vm.ram_mib) and vm.ram_mib >= 1, "vm.ram_mib must be >= 1")
        _check(self.images["memory"].size == vm.ram_mib << 20,
               f"images.memory.size must be vm.ram_mib * 2^20 = {vm.ram_mib << 20}")
        _check(_is_int(vm.smp) and vm.smp >= 1, "vm.smp must be >= 1")
        _check(vm.firmware in FIRMWARES, f"vm.firmware must be one of {', '.join(FIRMWARES)}")
        if vm.boot is not None:
            for role, blob_name in (("kernel", vm.boot.kernel), ("initrd", vm.boot.initrd)):
                if blob_name is None and role == "initrd":
                    continue
                blob_info = self.blobs.get(blob_name or "")
                _check(blob_info is not None and blob_info.kind == seal.KIND_BOOT,
                       f"vm.boot.{role} {blob_name!r} is not a boot blob of this version")
        if self.suspended:
            devstate = self.blobs.get(DEVSTATE)
            _check(devstate is not None and devstate.kind == seal.KIND_DEVSTATE,
                   "a suspended version needs a devstate blob of kind 3")
            _check(vm.qemu_version is not None, "a suspended version needs vm.qemu_version")
            _check(self.timestamps.suspended is not None, "a suspended version needs timestamps.suspended")
        for name in IMAGES:
            _check(name in self.working_set, f"working_set.{name} is missing")
            indices = self.working_set[name]
            limit = self.image_chunk_count(name)
            _check(all(_is_int(i) and 0 <= i < limit for i in indices), f"working_set.{name} index out of range")
            _check(len(set(indices)) == len(indices), f"working_set.{name} lists an index twice")
        _check_time(self.timestamps.created, "timestamps.created")
        if self.timestamps.suspended is not None:
            _check_time(self.timestamps.suspended, "timestamps.suspended")

    def replace(self, **changes: Any) -> Manifest:
        """A copy with some fields changed (not validated)."""
        return dataclasses.replace(self, **changes)


def _image_dict(info: ImageInfo) -> dict[str, Any]:
    image: dict[str, Any] = {"size": info.size, "chunks": info.chunks,
                             "keyring": {"sha256": info.keyring_sha256.hex(), "size": info.keyring_size}}
    if info.chunk_size is not None:
        image["chunk_size"] = info.chunk_size
    return image


def utc_now() -> str:
    """The current time in the RFC 3339 UTC form writers use, e.g. 2026-11-22T04:40:32Z."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def seal_manifest(parcel_key: bytes, manifest: Manifest, *, _salt: bytes | None = None) -> bytes:
    """Validate `manifest` and seal its JSON as a kind-1 blob under `parcel_key`.

    `_salt` is for the deterministic test-vector generator only. Raises FormatError if the manifest
    breaks a rule (checked by a full JSON round trip, so what is sealed is exactly what readers accept).
    """
    data = manifest.to_json()
    Manifest.from_json(data)
    if len(data) > MAX_MANIFEST_SIZE:
        raise FormatError(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_SIZE}")
    return seal.seal(parcel_key, seal.KIND_MANIFEST, data, _salt=_salt)


def open_manifest(parcel_key: bytes, blob: bytes, *, parcel: uuid.UUID, version: int) -> Manifest:
    """Open a sealed manifest and check that it describes `version` of `parcel`.

    Raises FormatError for a malformed blob or manifest, IntegrityError if authentication fails or the
    manifest belongs to another parcel or version (the store substituted it).
    """
    manifest = Manifest.from_json(seal.open_sealed(parcel_key, blob, seal.KIND_MANIFEST, MAX_MANIFEST_SIZE,
                                                   what=f"the manifest of version {version}"))
    if manifest.parcel != parcel:
        raise IntegrityError(f"manifest is for parcel {manifest.parcel}, not {parcel}")
    if manifest.version != version:
        raise IntegrityError(f"manifest is for version {manifest.version}, not {version}")
    return manifest


def open_keyring(parcel_key: bytes, blob: bytes, manifest: Manifest, image: str) -> list[KeyringRecord]:
    """Open the sealed keyring stream of `image` ("disk" or "memory") and check it against `manifest`.

    Guarantees: the stream's SHA-256 and size are those the manifest records, and its chunk size, image
    size and record count match the manifest. Returns the records (keys still wrapped). Raises
    IntegrityError for a digest or authentication mismatch, FormatError for a malformed blob or stream or
    one that disagrees with the manifest, or an unknown image name.
    """
    if image not in IMAGES:
        raise FormatError(f"unknown image {image!r}: expected disk or memory")
    info = manifest.images[image]
    stream = seal.open_sealed(parcel_key, blob, seal.KIND_KEYRING, info.keyring_size,
                              what=f"the {image} keyring of version {manifest.version}")
    if len(stream) != info.keyring_size or sha256(stream) != info.keyring_sha256:
        raise IntegrityError(f"{image} keyring does not match the digest in the manifest")
    chunk_size, image_size, records = decode_stream(stream)
    if chunk_size != manifest.image_chunk_size(image) or image_size != info.size or len(records) != info.chunks:
        raise FormatError(f"{image} keyring disagrees with the manifest about its sizes")
    return records


def open_blob(parcel_key: bytes, blob: bytes, manifest: Manifest, name: str, *,
              files: seal.FileLookup | None = None, stream: StreamReader | None = None) -> bytes:
    """Open the sealed blob `name` of this version and check it against the manifest's kind, size and
    SHA-256 (``files``, ``stream``: as `seal.open_sealed` takes them). Raises FormatError if the manifest names no such
    blob or the blob is malformed, IntegrityError for an authentication or digest mismatch,
    MissingFilesError for a blob compressed against files ``files`` does not give."""
    info = manifest.blobs.get(name)
    if info is None:
        raise FormatError(f"the manifest names no blob {name!r}")
    payload = seal.open_sealed(parcel_key, blob, info.kind, info.size,
                               what=f"blob {name} of version {manifest.version}", files=files, stream=stream)
    if len(payload) != info.size or sha256(payload) != info.sha256:
        raise IntegrityError(f"blob {name} does not match the digest in the manifest")
    return payload


# --- parsing helpers -------------------------------------------------------------------------------

def _check(ok: bool, message: str) -> None:
    if not ok:
        raise FormatError(f"manifest: {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_time(value: object, where: str) -> None:
    match = _RFC3339_UTC.fullmatch(value) if isinstance(value, str) else None
    _check(match is not None, f"{where} must be an RFC 3339 UTC time such as 2026-11-22T04:40:32Z")
    assert match is not None
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    try:
        # A leap second (60) is valid RFC 3339 but not a datetime.
        datetime.datetime(year, month, day, hour, minute, 59 if second == 60 else second)
        valid = True
    except ValueError:
        valid = False
    _check(valid, f"{where} is not a valid date and time")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            # Two parsers could pick different values for a duplicate key; refuse the ambiguity.
            raise FormatError(f"manifest: duplicate key {key!r}")
        obj[key] = value
    return obj


def _no_constant(name: str) -> Any:
    raise FormatError(f"manifest: {name} is not valid JSON")


def _int64(text: str) -> int:
    value = int(text)
    if not _MIN_INT <= value <= _MAX_INT:
        raise FormatError(f"manifest: the integer {text[:40]} is outside -2^63..2^63-1")
    return value


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise FormatError(f"manifest: the number {text[:40]} is too large")
    return value


def _check_strings(obj: Any) -> None:
    """Refuse U+0000 and lone surrogates (escaped as \\u0000, \\ud800) in every key and string: jansson does.
    Iterative, as deep as the parser went."""
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise FormatError("manifest: a string holds a lone surrogate") from None
            if "\0" in value:
                raise FormatError("manifest: a string holds U+0000")


def _field(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str,
           optional: bool = False) -> Any:
    """obj[key], checked for type; None if optional and absent or null."""
    if key not in obj or (optional and obj[key] is None):
        _check(optional, f"{where}{key} is missing")
        return None
    value = obj[key]
    if kind is int:
        _check(_is_int(value), f"{where}{key} must be an integer")
    else:
        _check(isinstance(value, kind), f"{where}{key} has the wrong type")
    return value


def _optional(value: Any, default: Any) -> Any:
    """``value``, or ``default`` if it is None (absent or null)."""
    return default if value is None else value


def _digest(obj: dict[str, Any], where: str) -> bytes:
    value = _field(obj, "sha256", str, where)
    _check(_HEX256.fullmatch(value) is not None, f"{where}sha256 must be 64 lowercase hex digits")
    return bytes.fromhex(value)


def _from_object(obj: Any) -> Manifest:
    _check(isinstance(obj, dict), "not a JSON object")
    # Check the format first, so a future manifest fails with the one message that matters.
    format_ = _field(obj, "format", int, "")
    _check(format_ == FORMAT, f"unknown manifest format {format_}")
    parcel_text = _field(obj, "parcel", str, "")
    try:
        parcel = uuid.UUID(parcel_text)
    except ValueError:
        raise FormatError(f"manifest: parcel {parcel_text!r} is not a UUID") from None
    _check(str(parcel) == parcel_text, "parcel must be a UUID in lowercase canonical form")

    images_obj = _field(obj, "images", dict, "")
    _check(sorted(images_obj) == sorted(IMAGES), "images must be exactly disk and memory")
    images = {}
    for name in IMAGES:
        where = f"images.{name}."
        image = _field(images_obj, name, dict, "images.")
        keyring = _field(image, "keyring", dict, where)
        images[name] = ImageInfo(size=_field(image, "size", int, where),
                                 keyring_sha256=_digest(keyring, where + "keyring."),
                                 keyring_size=_field(keyring, "size", int, where + "keyring."),
                                 chunks=_field(image, "chunks", int, where),
                                 chunk_size=_field(image, "chunk_size", int, where, optional=True))

    blobs = {}
    for name, blob in _field(obj, "blobs", dict, "").items():
        where = f"blobs.{name}."
        _check(isinstance(blob, dict), f"blobs.{name} must be an object")
        blobs[name] = BlobInfo(kind=_field(blob, "kind", int, where), sha256=_digest(blob, where),
                               size=_field(blob, "size", int, where))

    vm_obj = _field(obj, "vm", dict, "")
    boot_obj = _field(vm_obj, "boot", dict, "vm.", optional=True)
    boot = None
    if boot_obj is not None:
        boot = BootConfig(kernel=_field(boot_obj, "kernel", str, "vm.boot."),
                          initrd=_field(boot_obj, "initrd", str, "vm.boot.", optional=True),
                          cmdline=_field(boot_obj, "cmdline", str, "vm.boot.", optional=True) or "")
    devices = _field(vm_obj, "devices", dict, "vm.")
    _check(all(isinstance(v, str) for v in devices.values()), "vm.devices values must be strings")
    vm = VMConfig(machine=_field(vm_obj, "machine", str, "vm."), cpu=_field(vm_obj, "cpu", str, "vm."),
                  ram_mib=_field(vm_obj, "ram_mib", int, "vm."), smp=_field(vm_obj, "smp", int, "vm."),
                  devices=dict(devices),
                  qemu_version=_field(vm_obj, "qemu_version", str, "vm.", optional=True), boot=boot,
                  firmware=_optional(_field(vm_obj, "firmware", str, "vm.", optional=True), "bios"))

    working_set_obj = _field(obj, "working_set", dict, "")
    working_set = {}
    for name in IMAGES:
        indices = _field(working_set_obj, name, list, "working_set.")
        _check(all(_is_int(i) for i in indices), f"working_set.{name} must list integers")
        working_set[name] = list(indices)

    times = _field(obj, "timestamps", dict, "")
    _check("suspended" in times, "timestamps.suspended is missing")
    timestamps = Timestamps(created=_field(times, "created", str, "timestamps."),
                            suspended=_field(times, "suspended", str, "timestamps.", optional=True))

    _check("parent" in obj, "parent is missing")
    parent = obj["parent"]
    _check(parent is None or _is_int(parent), "parent must be an integer or null")
    return Manifest(
        format=format_, parcel=parcel, name=_field(obj, "name", str, ""),
        version=_field(obj, "version", int, ""), parent=parent,
        created=_field(obj, "created", str, ""), chunk_size=_field(obj, "chunk_size", int, ""),
        images=images, blobs=blobs, vm=vm, suspended=_field(obj, "suspended", bool, ""),
        working_set=working_set, timestamps=timestamps)
