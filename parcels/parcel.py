"""Whole parcels: create one from a disk image, open and verify its versions, extract images from it.

This is where the format's pieces meet a store: `create_parcel` writes chunk objects, keyrings, boot
blobs, then the manifest, then the key envelope, so a store never shows a parcel or version that is not
complete. Readers check everything against the manifest before using it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from parcels import crypto, envelope, resumepack, seal
from parcels import firmware as firmware_files
from parcels import devices as devices_mod
from parcels.compress import StreamReader
from parcels.chunk import DEFAULT_CHUNK_SIZE, chunk_length, decode_chunk, encode_chunk, is_zero, valid_chunk_size
from parcels.errors import FormatError, ImageError, MissingFilesError, NotFoundError, ParcelError
from parcels.image import SparseImageWriter, check_disk, image_size, raw_image, read_chunks
from parcels.keyring import HEADER_SIZE as KEYRING_HEADER_SIZE
from parcels.keyring import RECORD_SIZE as KEYRING_RECORD_SIZE
from parcels.keyring import KeyringRecord, encode_stream, unwrap_chunk_key, wrap_chunk_key
from parcels.manifest import (
    DEVSTATE, DEVSTATE_FILES, FIRMWARES, IMAGES, MAX_NAME, BlobInfo, BootConfig, ImageInfo, Manifest, Timestamps,
    VMConfig, open_blob, open_keyring, open_manifest, seal_manifest, utc_now,
)
from parcels.store import KEYRING_FILES, MANIFEST, DirStore

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
"""Called as progress(done, total) while a long operation runs: bytes of the image for create and
extract, chunk objects for verify."""

DEFAULT_MACHINE = "pc-q35-7.2"
DEFAULT_CPU = "qemu64"
DEFAULT_SMP = 1
_VM_KEYS = {"machine", "cpu", "smp", "qemu_version", "devices"}
_BOOT_BLOBS = ("kernel", "initrd")


class ParcelKeys(NamedTuple):
    """The secrets a key envelope holds."""

    parcel_key: bytes
    convergence_secret: bytes


class VersionContents(NamedTuple):
    """An opened version: its manifest and both keyrings (keys still wrapped), all checked."""

    manifest: Manifest
    disk: list[KeyringRecord]
    memory: list[KeyringRecord]

    def records(self, name: str) -> list[KeyringRecord]:
        """The records of image `name` ("disk" or "memory")."""
        if name not in IMAGES:
            raise FormatError(f"unknown image {name!r}: expected disk or memory")
        return self.disk if name == "disk" else self.memory


def unlock(store: DirStore, parcel: uuid.UUID, *, passphrase: str | None = None,
           keyfile: bytes | None = None) -> ParcelKeys:
    """Open the key envelope of `parcel` with a passphrase or key file.

    Raises NotFoundError if the store has no such parcel, WrongKeyError for a wrong credential or a
    damaged envelope, IntegrityError if the envelope belongs to another parcel, FormatError if malformed.
    """
    data = store.get_envelope(parcel)
    _, parcel_key, secret = envelope.unwrap_envelope(data, passphrase=passphrase, keyfile=keyfile,
                                                     expect_uuid=parcel)
    return ParcelKeys(parcel_key, secret)


def latest_version(store: DirStore, parcel: uuid.UUID) -> int:
    """The newest committed version of `parcel`. Raises NotFoundError if it has none."""
    versions = store.versions(parcel)
    if not versions:
        raise NotFoundError(f"parcel {parcel} has no versions in {store.root}")
    return versions[-1]


def open_version(store: DirStore, parcel: uuid.UUID, version: int, keys: ParcelKeys) -> VersionContents:
    """Open the manifest and both keyrings of a version and check them against each other.

    Raises NotFoundError for a missing file, IntegrityError for an authentication or digest failure,
    FormatError for malformed contents.
    """
    manifest = open_manifest(keys.parcel_key, store.get_blob(parcel, version, MANIFEST),
                             parcel=parcel, version=version)
    records = {name: open_keyring(keys.parcel_key, store.get_blob(parcel, version, filename), manifest, name)
               for name, filename in KEYRING_FILES.items()}
    return VersionContents(manifest, records["disk"], records["memory"])


def read_blob(store: DirStore, parcel: uuid.UUID, manifest: Manifest, name: str, keys: ParcelKeys, *,
              stream: StreamReader | None = None) -> bytes:
    """Return the payload of blob `name` of the version `manifest` describes, checked against it (``stream``:
    as `open_blob` takes it).

    Raises NotFoundError if the file is missing, FormatError if the manifest names no such blob,
    IntegrityError for an authentication or digest failure.
    """
    data = store.get_blob(parcel, manifest.version, name)
    return open_blob(keys.parcel_key, data, manifest, name, stream=stream)


def read_chunk(store: DirStore, keys: ParcelKeys, record: KeyringRecord, length: int) -> bytes:
    """Fetch, verify and decode the chunk a keyring record names. Raises as `DirStore.get_chunk`,
    `unwrap_chunk_key` and `decode_chunk`."""
    key = unwrap_chunk_key(keys.parcel_key, record.wkey)
    return decode_chunk(store.get_chunk(record.tag), record.tag, key, length)


def _check_credentials(passphrase: str | None, keyfile: bytes | None, log2n: int) -> None:
    if (passphrase is None) == (keyfile is None):
        raise FormatError("give exactly one of a passphrase or a key file")
    if passphrase is not None:
        envelope.check_scrypt_params(log2n, envelope.DEFAULT_R, envelope.DEFAULT_P)
    elif not envelope.MIN_KEYFILE <= len(keyfile or b"") <= envelope.MAX_KEYFILE:
        raise FormatError(f"a key file must hold {envelope.MIN_KEYFILE} to {envelope.MAX_KEYFILE} bytes")


def _vm_config(vm: dict[str, Any] | None, ram_mib: int, boot: BootConfig | None) -> VMConfig:
    vm = dict(vm or {})
    unknown = set(vm) - _VM_KEYS
    if unknown:
        raise FormatError(f"unknown vm settings {sorted(unknown)}: allowed are {sorted(_VM_KEYS)}")
    if not isinstance(vm.get("devices", {}), dict):
        raise FormatError("vm devices must be a mapping of device role to model")
    devices = {**devices_mod.DEFAULT, **vm.get("devices", {})}
    if devices_mod.FORWARD in devices:
        devices[devices_mod.FORWARD] = devices_mod.format_forwards(devices_mod.forwards(devices))
    devices_mod.check(devices)
    return VMConfig(machine=vm.get("machine", DEFAULT_MACHINE), cpu=vm.get("cpu", DEFAULT_CPU), ram_mib=ram_mib,
                    smp=vm.get("smp", DEFAULT_SMP), devices=devices, qemu_version=vm.get("qemu_version"),
                    boot=boot)


def _read_boot_file(path: str | os.PathLike[str]) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(seal.MAX_PAYLOAD + 1)
    except OSError as exc:
        raise ImageError(f"failed to read boot file {path}: {exc.strerror or exc}") from None
    if len(data) > seal.MAX_PAYLOAD:
        raise ImageError(f"boot file {path} is larger than {seal.MAX_PAYLOAD} bytes")
    return data


def _store_chunks(store: DirStore, raw: Path, size: int, chunk_size: int, keys: ParcelKeys,
                  progress: Progress | None) -> Iterator[KeyringRecord]:
    """Encode and store every nonzero chunk of a raw image, yielding its keyring record."""
    for index, data in read_chunks(raw, size, chunk_size):
        encoded = encode_chunk(data, keys.convergence_secret)
        store.put_chunk(encoded.tag, encoded.data)
        yield KeyringRecord(index, encoded.flags, encoded.tag, wrap_chunk_key(keys.parcel_key, encoded.key))
        if progress is not None:
            progress(min(size, (index + 1) * chunk_size), size)
    if progress is not None:
        progress(size, size)


def create_parcel(store: DirStore, *, name: str, disk: str | os.PathLike[str], ram_mib: int,
                  vm: dict[str, Any] | None = None, boot: dict[str, Any] | None = None,
                  passphrase: str | None = None, keyfile: bytes | None = None,
                  convergence_secret: bytes | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                  progress: Progress | None = None, log2n: int = envelope.DEFAULT_LOG2N,
                  tmpdir: str | os.PathLike[str] | None = None, disk_format: str | None = None,
                  firmware: str = "bios", check_boot: bool = False,
                  memory_chunk_size: int | None = None) -> uuid.UUID:
    """Create a new parcel whose version 1 holds the disk image `disk` and a powered-off VM.

    `disk` is a raw, qcow2, vmdk, vdi or vhdx file (`disk_format`, else as qemu-img identifies it), read
    through a raw view of it (`parcels.image.raw_image`, which first checks it is whole); the disk's size
    (its virtual size) must be a nonzero multiple of 512. `firmware` is "bios" or "uefi". Without `boot`,
    the VM boots from the disk through its own bootloader: with `check_boot`, a disk that shows no way to
    do so under `firmware` (`parcels.image.boot_problem`) is refused with ImageError. A UEFI parcel gets
    OVMF's empty variable store as its `firmware.NVRAM_BLOB` blob. The disk is cut into chunks of
    `chunk_size`. The memory image is all zero, `ram_mib` MiB large, and cut into chunks of
    `memory_chunk_size` (None: `chunk_size`). `vm` may set machine, cpu, smp, qemu_version and devices
    (merged into the defaults). `boot` holds "kernel" and
    optionally "initrd" (file paths, stored as kind-4 blobs of those names) and "cmdline". The parcel is
    protected by exactly one of `passphrase` (scrypt with log2(N) = `log2n`) or `keyfile`. A random
    convergence secret is made unless one is given (give the user's own to dedup across their parcels).

    Guarantees: the image is streamed (one chunk in memory at a time) and holes are not read; all-zero
    chunks are not stored; the parcel appears in `store.parcels()` only once it is complete. Returns the
    new parcel's UUID. Raises FormatError for invalid arguments, ImageError if an input file cannot be
    read or converted, StoreError if the store cannot be written.
    """
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME:
        raise FormatError(f"a parcel name must be 1 to {MAX_NAME} characters")
    if not isinstance(ram_mib, int) or ram_mib < 1:
        raise FormatError("ram_mib must be a positive integer")
    if memory_chunk_size is None:
        memory_chunk_size = chunk_size
    for what, size in (("chunk size", chunk_size), ("memory chunk size", memory_chunk_size)):
        if not valid_chunk_size(size):
            raise FormatError(f"invalid {what} {size}: must be a power of two in 4096..4194304")
    _check_credentials(passphrase, keyfile, log2n)
    secret = crypto.random_bytes(crypto.KEY_SIZE) if convergence_secret is None else bytes(convergence_secret)
    if len(secret) != crypto.KEY_SIZE:
        raise FormatError("a convergence secret must be 32 bytes")
    boot = dict(boot or {})
    if boot and "kernel" not in boot:
        raise FormatError("direct kernel boot needs a kernel")
    unknown_boot = set(boot) - {"kernel", "initrd", "cmdline"}
    if unknown_boot:
        raise FormatError(f"unknown boot settings {sorted(unknown_boot)}")
    for blob_name in _BOOT_BLOBS:
        if boot.get(blob_name) and not Path(boot[blob_name]).is_file():
            raise ImageError(f"boot file {boot[blob_name]} ({blob_name}) does not exist")
    boot_config = None
    if boot:
        boot_config = BootConfig(kernel="kernel", initrd="initrd" if boot.get("initrd") else None,
                                 cmdline=str(boot.get("cmdline") or ""))
    if firmware not in FIRMWARES:
        raise FormatError(f"unknown firmware {firmware!r}: use one of {', '.join(FIRMWARES)}")
    vm_config = dataclasses.replace(_vm_config(vm, ram_mib, boot_config), firmware=firmware)
    # A UEFI parcel keeps its variable store as a blob of its own; refused here if OVMF is not installed.
    nvram = firmware_files.empty_variable_store() if firmware == "uefi" else None
    parcel = uuid.uuid4()
    now = utc_now()

    def version_1(images: dict[str, ImageInfo], blobs: dict[str, BlobInfo]) -> Manifest:
        return Manifest(parcel=parcel, name=name, version=1, parent=None, created=now, chunk_size=chunk_size,
                        images=images, blobs=blobs, vm=vm_config, suspended=False,
                        working_set={"disk": [], "memory": []}, timestamps=Timestamps(created=now))

    # Check the settings against the manifest rules now, not after the whole disk has been stored.
    # The memory image's own chunk size is written only where it differs from the parcel's.
    own_size = {"disk": None, "memory": memory_chunk_size if memory_chunk_size != chunk_size else None}
    placeholder = {image_name: ImageInfo(size=size, keyring_sha256=bytes(32), keyring_size=KEYRING_HEADER_SIZE,
                                         chunks=0, chunk_size=own_size[image_name])
                   for image_name, size in (("disk", 0), ("memory", ram_mib << 20))}
    version_1(placeholder, {blob_name: BlobInfo(kind=seal.KIND_BOOT, sha256=bytes(32), size=0)
                            for blob_name in _BOOT_BLOBS if boot.get(blob_name)}).validate()

    keys = ParcelKeys(crypto.random_bytes(crypto.KEY_SIZE), secret)
    if check_boot and boot_config is None:
        check_disk(disk, disk_format, firmware, bootable=True, tmpdir=tmpdir)
    with raw_image(disk, tmpdir, disk_format) as raw:
        disk_size = image_size(raw)
        if disk_size == 0 or disk_size % 512:
            raise ImageError(f"disk image {disk} is {disk_size} bytes: the size must be a nonzero multiple of 512")
        disk_stream = encode_stream(chunk_size, disk_size, _store_chunks(store, raw, disk_size, chunk_size, keys,
                                                                          progress))
    memory_size = ram_mib << 20
    memory_stream = encode_stream(memory_chunk_size, memory_size, [])
    images = {}
    for image_name, size, stream in (("disk", disk_size, disk_stream), ("memory", memory_size, memory_stream)):
        store.put_blob(parcel, 1, KEYRING_FILES[image_name], seal.seal(keys.parcel_key, seal.KIND_KEYRING, stream))
        images[image_name] = ImageInfo(size=size, keyring_sha256=crypto.sha256(stream), keyring_size=len(stream),
                                       chunks=(len(stream) - KEYRING_HEADER_SIZE) // KEYRING_RECORD_SIZE,
                                       chunk_size=own_size[image_name])
    blobs = {}
    for blob_name in _BOOT_BLOBS:
        if boot.get(blob_name):
            payload = _read_boot_file(boot[blob_name])
            store.put_blob(parcel, 1, blob_name, seal.seal(keys.parcel_key, seal.KIND_BOOT, payload))
            blobs[blob_name] = BlobInfo(kind=seal.KIND_BOOT, sha256=crypto.sha256(payload), size=len(payload))
    if nvram is not None:
        store.put_blob(parcel, 1, firmware_files.NVRAM_BLOB, seal.seal(keys.parcel_key, seal.KIND_BOOT, nvram))
        blobs[firmware_files.NVRAM_BLOB] = BlobInfo(kind=seal.KIND_BOOT, sha256=crypto.sha256(nvram), size=len(nvram))
    manifest = version_1(images, blobs)
    # Chunks and blobs are in place; the manifest commits the version, the envelope publishes the parcel.
    store.put_blob(parcel, 1, MANIFEST, seal_manifest(keys.parcel_key, manifest))
    store.put_envelope(parcel, envelope.wrap_envelope(parcel, keys.parcel_key, keys.convergence_secret,
                                                      passphrase=passphrase, keyfile=keyfile, log2n=log2n))
    log.info("created parcel %s (%s): %d of %d disk chunks stored", parcel, name, images["disk"].chunks,
             -(-disk_size // chunk_size))
    return parcel


def extract_image(store: DirStore, parcel: uuid.UUID, version: int | None, image: str,
                  out: str | os.PathLike[str], *, passphrase: str | None = None, keyfile: bytes | None = None,
                  progress: Progress | None = None) -> Manifest:
    """Write image `image` ("disk" or "memory") of a version (None: the newest) to `out` as a sparse
    raw file, and return the version's manifest.

    Guarantees: every chunk is verified (tag, header, GCM, length) before it is written; absent chunks
    become holes; `out` appears only when the whole image has been written (a failure leaves no file).
    Raises WrongKeyError for a wrong credential, NotFoundError for a missing parcel, version, file or
    chunk, IntegrityError for a corrupt byte, FormatError for malformed contents, ImageError if `out`
    cannot be written.
    """
    if image not in IMAGES:
        raise FormatError(f"unknown image {image!r}: expected disk or memory")
    keys = unlock(store, parcel, passphrase=passphrase, keyfile=keyfile)
    if version is None:
        version = latest_version(store, parcel)
    contents = open_version(store, parcel, version, keys)
    manifest = contents.manifest
    size = manifest.images[image].size
    chunk_size = manifest.image_chunk_size(image)
    with SparseImageWriter(out, size) as writer:
        for record in contents.records(image):
            length = chunk_length(record.idx, chunk_size, size)
            writer.write(record.idx * chunk_size, read_chunk(store, keys, record, length))
            if progress is not None:
                progress(record.idx * chunk_size + length, size)
        writer.commit()
    if progress is not None:
        progress(size, size)
    return manifest


def _blob_order(name: str) -> tuple[int, int, str]:
    """Blobs by name, a resume pack's parts last and in their order (a stream across them is read in order)."""
    if resumepack.is_part(name):
        return 1, 0 if name == resumepack.BLOB_NAME else int(name.rsplit(".", 1)[1]), name
    return 0, 0, name


def verify_version(store: DirStore, parcel: uuid.UUID, version: int, keys: ParcelKeys,
                   progress: Progress | None = None) -> list[str]:
    """Check every byte of a version: manifest, keyrings, blobs and every chunk object fully decoded.

    Returns a list of problems, one line each (empty: the version is intact). Problems with single
    chunks or blobs are collected; if the manifest or a keyring cannot be opened, that error is raised
    (NotFoundError, IntegrityError or FormatError), since nothing else can be checked without it. A blob
    compressed against files (`DEVSTATE_FILES`, against QEMU's firmware) is decoded only where those files
    are; elsewhere its tag and file list are checked, and that its manifest entry is the one of the blob it
    stands in for.
    """
    contents = open_version(store, parcel, version, keys)
    manifest = contents.manifest
    problems = []
    stream = StreamReader()                      # a resume pack's parts sealed as one stream, read in order
    for name in sorted(manifest.blobs, key=_blob_order):
        try:
            read_blob(store, parcel, manifest, name, keys, stream=stream)
        except MissingFilesError:
            if name != DEVSTATE_FILES or manifest.blobs[name] != manifest.blobs.get(DEVSTATE):
                problems.append(f"blob {name}: compressed against files, but it does not stand in for "
                                f"{DEVSTATE} (the manifest gives them other digests or sizes)")
        except ParcelError as exc:
            problems.append(f"blob {name}: {exc}")
    total = sum(len(contents.records(name)) for name in IMAGES)
    done = 0
    for name in IMAGES:
        size = manifest.images[name].size
        for record in contents.records(name):
            try:
                plaintext = read_chunk(store, keys, record,
                                       chunk_length(record.idx, manifest.image_chunk_size(name), size))
                if is_zero(plaintext):
                    problems.append(f"{name} chunk {record.idx}: all zero but stored (writers must omit it)")
            except ParcelError as exc:
                problems.append(f"{name} chunk {record.idx}: {exc}")
            done += 1
            if progress is not None:
                progress(done, total)
    return problems
