"""The demo behind `./bootstrap demo`: what ISR does, shown on the real test guest, with the time of each phase.

Today it shows the foundation: the guest's disk and boot files packed into an encrypted parcel, a look at
what the store holds (ciphertext only), the image taken back out and verified, and the guest booted from it
running its workload. It grows into suspend-at-site-A, resume-at-site-B as the server, vulpes and the `isr`
command land.

Run: `python -m isrctl.demo [--keep DIR]`.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from isrctl.errors import IsrError
from parcels import parcel as parcel_ops
from parcels.envelope import new_keyfile
from parcels.errors import ParcelError
from parcels.guest import booted_guest, build
from parcels.guest.boot import KERNEL_CMDLINE
from parcels.store import DirStore


def _say(text: str) -> None:
    print(text, flush=True)


@contextmanager
def _phase(title: str) -> Iterator[None]:
    _say(f"\n\033[1m▶ {title}\033[0m")
    started = time.monotonic()
    yield
    _say(f"  ({time.monotonic() - started:.1f} s)")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def run(workdir: Path) -> None:
    _say("Internet Suspend/Resume — your whole PC as a virtual machine that follows you.")
    _say(f"Working in {workdir}")

    with _phase("Build the test guest (a Debian kernel, a busybox userland, an ext4 disk with real source files)"):
        guest = build("small")
        _say(f"  kernel {guest.kernel.name}, disk {_mib(guest.disk.stat().st_size)} "
             f"(cached in {guest.directory})")

    store = DirStore(workdir / "store")
    keyfile = new_keyfile()
    (workdir / "parcel.key").write_bytes(keyfile)
    with _phase("Pack it into a parcel: 128 KiB chunks, zstd, convergent AES-256-GCM, sealed manifest"):
        parcel = parcel_ops.create_parcel(
            store, name="demo", disk=guest.disk, ram_mib=256, keyfile=keyfile,
            boot={"kernel": guest.kernel, "initrd": guest.initrd, "cmdline": KERNEL_CMDLINE})
        keys = parcel_ops.unlock(store, parcel, keyfile=keyfile)
        contents = parcel_ops.open_version(store, parcel, 1, keys)
        disk = contents.manifest.images["disk"]
        chunks = list(Path(store.root, "chunks").rglob("*"))
        stored = sum(p.stat().st_size for p in chunks if p.is_file())
        total_chunks = -(-disk.size // contents.manifest.chunk_size)
        _say(f"  parcel {parcel}, version 1")
        _say(f"  disk image {_mib(disk.size)} = {total_chunks} chunks; {disk.chunks} stored "
             f"(the rest are all zero and cost nothing), {_mib(stored)} of ciphertext in the store")

    with _phase("Take the disk and boot files back out, verifying every tag, GCM tag and digest"):
        problems = parcel_ops.verify_version(store, parcel, 1, keys)
        if problems:
            raise IsrError(f"the new parcel is incomplete: {problems[0]}")
        site = workdir / "site"
        site.mkdir()
        parcel_ops.extract_image(store, parcel, None, "disk", site / "disk.img", keyfile=keyfile)
        (site / "kernel").write_bytes(parcel_ops.read_blob(store, parcel, contents.manifest, "kernel", keys))
        (site / "initrd").write_bytes(parcel_ops.read_blob(store, parcel, contents.manifest, "initrd", keys))
        _say("  verified: every chunk matches its tag; the manifest and keyrings are authentic")

    from_parcel = dataclasses.replace(guest, kernel=site / "kernel", initrd=site / "initrd")
    with _phase("Boot the guest from the parcel (QEMU, TCG) and run its workload"):
        with booted_guest(from_parcel, site / "disk.img", run_dir=site, name="demo") as vm:
            _say(f"  guest ready after {vm.boot_seconds:.1f} s")
            result = vm.console.run_workload(timeout=300)
            _say(f"  workload: {result['files']} files unpacked, searched and checksummed, "
                 f"digest {result['digest'][:16]}… in {result.get('seconds', '?')} s")
            ok = result["digest"] == guest.expected.digest
            _say(f"  digest {'matches' if ok else 'DOES NOT MATCH'} the one computed on the host")
            vm.console.request_poweroff()
            vm.vm.wait(60)
        if not ok:
            raise IsrError("the guest's workload result differs from the host's")

    _say("\nDone. Next to land: the server, vulpes (demand-fetch over HTTPS) and `isr resume`/`suspend`.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m isrctl.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="work in DIR and keep it afterwards (default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="isr-demo-"))
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        run(workdir)
        return 0
    except (IsrError, ParcelError, OSError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
