"""python -m parcels: create, inspect, verify and unpack parcels in a local parcel store.

Only `main()` turns errors into a one-line message on stderr and exit status 1.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from parcels import crypto, envelope, parcel, secretsource
from parcels.chunk import DEFAULT_CHUNK_SIZE
from parcels.errors import ParcelError
from parcels.store import DirStore

PROG = "python -m parcels"

DESCRIPTION = """\
Create, inspect, verify and unpack ISR parcels in a local parcel store: a directory laid out as
doc/parcel-format.md describes ("Parcel store layout"). A parcel is a VM's disk and memory images,
chunked, compressed and encrypted; its keys are protected by a passphrase or a key file.

Credentials: the passphrase is never taken on the command line (it would show in `ps`). Put it in an
environment variable and name that with --passphrase-env, or in a file (--passphrase-file), or use
--key-file FILE.

examples:
  PASS=secret python -m parcels create --store /srv/isr --name ws --disk disk.qcow2 --ram-mib 512 \\
      --passphrase-env PASS
  python -m parcels info --store /srv/isr
  PASS=secret python -m parcels info --store /srv/isr --parcel UUID --passphrase-env PASS
  PASS=secret python -m parcels verify --store /srv/isr --parcel UUID --all --passphrase-env PASS
  PASS=secret python -m parcels extract --store /srv/isr --parcel UUID --out disk.raw --passphrase-env PASS
"""


class CommandError(ParcelError):
    """A command-line argument that cannot be used (an unset variable, an unreadable key file)."""


class ProgressLine:
    """A one-line progress display on a terminal; silent when stderr is not a terminal."""

    def __init__(self, label: str, unit: str = "MiB", stream: TextIO = sys.stderr) -> None:
        self.label, self.unit, self.stream = label, unit, stream
        self.enabled = stream.isatty()
        self._last = 0.0
        self._shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.2 and done < total):
            return
        self._last = now
        scale = 1 << 20 if self.unit == "MiB" else 1
        percent = 100 * done // total if total else 100
        self.stream.write(f"\r{self.label}: {percent:3d}% ({done // scale}/{total // scale} {self.unit})")
        self.stream.flush()
        self._shown = True

    def finish(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False


def _add_store(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", required=True, type=Path, metavar="DIR", help="the parcel store directory")


def _add_credentials(p: argparse.ArgumentParser, required: bool, create: bool = False) -> None:
    group = p.add_argument_group("credentials (one of)")
    choice = group.add_mutually_exclusive_group(required=required)
    # The names and sources of isr and isr-admin (parcels.secretsource); --keyfile and --new-keyfile, the names
    # before issue 18, still work and are not shown.
    choice.add_argument("--passphrase-file", metavar="FILE|-",
                        help="read the passphrase from FILE ('-': the first line of standard input)")
    choice.add_argument("--passphrase-env", metavar="VAR",
                        help="read the passphrase from environment variable VAR")
    choice.add_argument("--key-file", type=Path, metavar="FILE", help="use the key file FILE (32 to 4096 bytes)")
    choice.add_argument("--keyfile", type=Path, dest="key_file", help=argparse.SUPPRESS)
    if create:
        choice.add_argument("--new-key-file", type=Path, metavar="FILE",
                            help="make a new random key file FILE (must not exist) and use it")
        choice.add_argument("--new-keyfile", type=Path, dest="new_key_file", help=argparse.SUPPRESS)


def _add_parcel(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--parcel", type=_uuid, required=required, metavar="UUID", help="the parcel's UUID")


def _uuid(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a UUID: {text!r}") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what is being done")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    create = commands.add_parser(
        "create", help="make a new parcel from a disk image",
        description="Make a new parcel whose version 1 holds a disk image (raw or qcow2) and a powered-off "
                    "VM with RAM_MIB MiB of memory. Prints the new parcel's UUID.")
    _add_store(create)
    create.add_argument("--name", required=True, help="a human name for the parcel, 1 to 64 characters")
    create.add_argument("--disk", required=True, type=Path, metavar="FILE", help="raw or qcow2 disk image")
    create.add_argument("--ram-mib", required=True, type=_positive, metavar="N", help="the VM's RAM in MiB")
    create.add_argument("--kernel", type=Path, metavar="FILE", help="kernel for direct boot (stored in the parcel)")
    create.add_argument("--initrd", type=Path, metavar="FILE", help="initrd for direct boot (needs --kernel)")
    create.add_argument("--cmdline", default="", help="kernel command line for direct boot")
    create.add_argument("--machine", default=parcel.DEFAULT_MACHINE,
                        help="versioned QEMU machine type (default: %(default)s)")
    create.add_argument("--cpu", default=parcel.DEFAULT_CPU, help="QEMU CPU model (default: %(default)s)")
    create.add_argument("--smp", type=_positive, default=parcel.DEFAULT_SMP, help="vCPUs (default: %(default)s)")
    create.add_argument("--chunk-size", type=_positive, default=DEFAULT_CHUNK_SIZE, metavar="BYTES",
                        help="the disk's chunks: a power of two from 4096 to 4194304 (default: %(default)s)")
    create.add_argument("--memory-chunk-size", type=_positive, metavar="BYTES",
                        help="the memory image's chunks, the same rule (default: the disk's)")
    create.add_argument("--convergence-secret-file", type=Path, metavar="FILE",
                        help="32-byte file with your convergence secret, shared by your parcels so they "
                             "dedup; made with random bytes if it does not exist (default: a new secret)")
    create.add_argument("--scrypt-log2n", type=int, default=envelope.DEFAULT_LOG2N, metavar="N",
                        help="scrypt cost log2(N) for a passphrase, 10 to 22 (default: %(default)s)")
    _add_credentials(create, required=True, create=True)

    extract = commands.add_parser(
        "extract", help="write a disk or memory image out as a sparse raw file",
        description="Verify and write one image of a version as a sparse raw file.")
    _add_store(extract)
    _add_parcel(extract)
    extract.add_argument("--version", type=_positive, metavar="N", help="version number (default: newest)")
    extract.add_argument("--image", choices=("disk", "memory"), default="disk", help="which image (default: disk)")
    extract.add_argument("--out", required=True, type=Path, metavar="FILE", help="where to write the raw image")
    _add_credentials(extract, required=True)

    info = commands.add_parser(
        "info", help="list parcels, or describe one parcel's versions",
        description="Without --parcel, list the parcels in the store and their version numbers. With "
                    "--parcel and credentials, describe each version (or only --version N); --json prints "
                    "the manifest of one version (default: newest) as JSON.")
    _add_store(info)
    _add_parcel(info, required=False)
    info.add_argument("--version", type=_positive, metavar="N", help="only this version")
    info.add_argument("--json", action="store_true", help="print the manifest as JSON")
    _add_credentials(info, required=False)

    verify = commands.add_parser(
        "verify", help="check every byte of a version",
        description="Open and fully decode the manifest, keyrings, blobs and every chunk object of a "
                    "version (default: newest). Exit status 1 if anything is wrong.")
    _add_store(verify)
    _add_parcel(verify)
    which = verify.add_mutually_exclusive_group()
    which.add_argument("--version", type=_positive, metavar="N", help="version number (default: newest)")
    which.add_argument("--all", action="store_true", help="verify every version")
    _add_credentials(verify, required=True)
    return parser


def _read_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CommandError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def _write_new_file(path: Path, data: bytes, what: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fsync(f.fileno())
    except FileExistsError:
        raise CommandError(f"{what} {path} already exists; use it with --key-file or pick another name") from None
    except OSError as exc:
        raise CommandError(f"cannot write {what} {path}: {exc.strerror or exc}") from None


def _credentials(args: argparse.Namespace) -> dict[str, Any]:
    passphrase = secretsource.read_secret(file=args.passphrase_file, env=args.passphrase_env, option="--passphrase")
    if passphrase is not None:
        return {"passphrase": passphrase}
    if getattr(args, "new_key_file", None):
        data = envelope.new_keyfile()
        _write_new_file(args.new_key_file, data, "key file")
        return {"keyfile": data}
    if args.key_file:
        return {"keyfile": secretsource.read_key_file(args.key_file)}
    return {}


def _convergence_secret(path: Path | None) -> bytes | None:
    if path is None:
        return None
    if not path.exists():
        secret = crypto.random_bytes(32)
        _write_new_file(path, secret, "convergence secret file")
        return secret
    secret = _read_file(path, "convergence secret file")
    if len(secret) != 32:
        raise CommandError(f"convergence secret file {path} holds {len(secret)} bytes, not 32")
    return secret


def _cmd_create(args: argparse.Namespace, out: TextIO) -> int:
    if args.initrd and not args.kernel:
        raise CommandError("--initrd needs --kernel")
    boot = None
    if args.kernel:
        boot = {"kernel": args.kernel, "initrd": args.initrd, "cmdline": args.cmdline}
    secret = _convergence_secret(args.convergence_secret_file)
    creds = _credentials(args)
    progress = ProgressLine("create")
    try:
        new = parcel.create_parcel(
            DirStore(args.store), name=args.name, disk=args.disk, ram_mib=args.ram_mib,
            vm={"machine": args.machine, "cpu": args.cpu, "smp": args.smp}, boot=boot,
            convergence_secret=secret, chunk_size=args.chunk_size, memory_chunk_size=args.memory_chunk_size,
            progress=progress, log2n=args.scrypt_log2n, **creds)
    finally:
        progress.finish()
    print(new, file=out)
    return 0


def _cmd_extract(args: argparse.Namespace, out: TextIO) -> int:
    progress = ProgressLine("extract")
    try:
        manifest = parcel.extract_image(DirStore(args.store), args.parcel, args.version, args.image, args.out,
                                        progress=progress, **_credentials(args))
    finally:
        progress.finish()
    print(f"wrote {args.image} image of version {manifest.version} ({manifest.images[args.image].size} bytes) "
          f"to {args.out}", file=out)
    return 0


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n % (1 << 20) else f"{n >> 20} MiB"


def _cmd_info(args: argparse.Namespace, out: TextIO) -> int:
    store = DirStore(args.store)
    if args.parcel is None:
        for p in store.parcels():
            versions = store.versions(p)
            print(f"{p}  versions: {', '.join(map(str, versions)) or 'none'}", file=out)
        return 0
    creds = _credentials(args)
    if not creds:
        versions = store.versions(args.parcel)
        print(f"{args.parcel}  versions: {', '.join(map(str, versions)) or 'none'}", file=out)
        return 0
    keys = parcel.unlock(store, args.parcel, **creds)
    if args.json:
        version = args.version or parcel.latest_version(store, args.parcel)
        manifest = parcel.open_version(store, args.parcel, version, keys).manifest
        print(json.dumps(manifest.to_dict(), indent=2, sort_keys=True, ensure_ascii=False), file=out)
        return 0
    versions = [args.version] if args.version else store.versions(args.parcel)
    for version in versions:
        m = parcel.open_version(store, args.parcel, version, keys).manifest
        disk, memory = m.images["disk"], m.images["memory"]
        state = f"suspended {m.timestamps.suspended}" if m.suspended else "powered off"
        print(f"{m.parcel}  {m.name!r}  version {m.version}  created {m.timestamps.created}  {state}", file=out)
        print(f"  disk {_mib(disk.size)}, {disk.chunks} chunks stored; memory {_mib(memory.size)}, "
              f"{memory.chunks} chunks stored; chunk size {m.chunk_size}"
              + (f" (memory {m.image_chunk_size('memory')})" if m.image_chunk_size("memory") != m.chunk_size else ""),
              file=out)
        print(f"  vm: {m.vm.machine}, cpu {m.vm.cpu}, {m.vm.smp} vCPU, {m.vm.ram_mib} MiB"
              + (f", kernel boot ({m.vm.boot.cmdline!r})" if m.vm.boot else ""), file=out)
        if m.blobs:
            print(f"  blobs: {', '.join(f'{n} ({b.size} bytes)' for n, b in sorted(m.blobs.items()))}", file=out)
    return 0


def _cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    store = DirStore(args.store)
    keys = parcel.unlock(store, args.parcel, **_credentials(args))
    if args.all:
        versions = store.versions(args.parcel)
    else:
        versions = [args.version or parcel.latest_version(store, args.parcel)]
    failed = False
    for version in versions:
        progress = ProgressLine(f"verify version {version}", unit="chunks")
        try:
            problems = parcel.verify_version(store, args.parcel, version, keys, progress=progress)
        finally:
            progress.finish()
        for problem in problems:
            print(f"version {version}: {problem}", file=out)
        print(f"version {version}: {'FAILED' if problems else 'ok'}", file=out)
        failed = failed or bool(problems)
    return 1 if failed else 0


COMMANDS = {"create": _cmd_create, "extract": _cmd_extract, "info": _cmd_info, "verify": _cmd_verify}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; return the exit status (0 ok, 1 error or failed verification, 2 usage)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="parcels: %(message)s")
    try:
        return COMMANDS[args.command](args, sys.stdout)
    except ParcelError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
