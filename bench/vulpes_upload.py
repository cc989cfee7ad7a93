#!/usr/bin/env python3
"""Upload and hoard throughput of vulpes alone (no QEMU, no isr), over a shaped link with added RTT.

    .venv/bin/python bench/vulpes_upload.py [--rate 100] [--rtt 20] [--chunks 700] [--trials 2]
        [--what upload,hoard]

A real isr-server (2 workers, sqlite, directory store) runs in a network namespace behind a veth pair
shaped with tbf (bench/vulpes_common.py); vulpes in the host namespace reaches it through a toxiproxy
proxy that adds ``--rtt`` ms (half each way). ``--rate 0`` leaves the link unshaped, which measures how
many chunk PUTs the server takes. Each trial:

- upload: a fresh parcel; ``--chunks`` chunks are written through the FUSE mount (about 30 % random, the
  rest compressible: objects of about 50 KiB on average, like a checkin of the test guest), flushed, then
  the control socket's ``upload`` (what `isr suspend` runs before a checkin) is timed;
- hoard: a parcel of the same content is published to the store and hoarded into an empty cache.

Throughput counts chunk-object bytes (no headers) against the bulk TCP goodput of the link measured at
the start. Needs root (namespaces, tc, FUSE) and toxiproxy-server (./bootstrap bench installs it). Prints
its figures; it does not write BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

from vulpes_common import REPO, NS_ADDR, NsServer, link_bandwidth, netns, shape, start_server

from tests.toxiproxy_fixtures import Toxiproxy  # noqa: E402
from tests.vulpes_fixtures import CHUNK_SIZE, Vulpes, make_state  # noqa: E402

MIB = 1 << 20


def content(chunks: int, seed: int, random_fraction: float = 0.3) -> bytes:
    """Random (incompressible) chunks and compressible ones with an eighth of random bytes each."""
    rng = random.Random(seed)
    out = bytearray()
    for i in range(chunks):
        if rng.random() < random_fraction:
            out += rng.randbytes(CHUNK_SIZE)
        else:
            words = b"chunk %d of the upload benchmark %d\n" % (i, rng.randrange(1 << 30))
            out += (rng.randbytes(CHUNK_SIZE // 8) + words * (CHUNK_SIZE // len(words)))[:CHUNK_SIZE]
    return bytes(out)


def upload_once(binary: Path, work: Path, url: str, server: NsServer, data: bytes,
                trial: int) -> tuple[int, int, float]:
    """(chunks, object bytes, seconds) of one `upload` of freshly written data."""
    state = make_state(work / f"up-{trial}", bytes(len(data)), MIB, seed=trial)
    with Vulpes(binary, work / f"mnt-up-{trial}", state, work / f"cache-up-{trial}", server=url,
                token_file=server.token_file, pin=server.pin) as v:
        with open(v.path("disk"), "r+b") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        assert v.control({"op": "flush"})["ok"]
        started = time.monotonic()
        response = v.control({"op": "upload"}, timeout=1800)
        seconds = time.monotonic() - started
        assert response["ok"], response
        writeback = v.status()["writeback"]
        assert writeback["failed"] == 0, writeback
        return writeback["uploaded_chunks"], writeback["uploaded_bytes"], seconds


def hoard_once(binary: Path, work: Path, url: str, server: NsServer, data: bytes, trial: int) -> tuple[int, int, float]:
    """(chunks, object bytes, seconds) of a hoard of everything into an empty cache."""
    state = make_state(work / f"hoard-{trial}", data, MIB, seed=trial + 50)
    state.publish(server.store)
    with Vulpes(binary, work / f"mnt-hoard-{trial}", state, work / f"cache-hoard-{trial}", server=url,
                token_file=server.token_file, pin=server.pin) as v:
        response = v.control({"op": "hoard", "wait": True}, timeout=1800)
        hoard = response["status"]["hoard"]
        assert hoard["state"] == "done" and hoard["chunks_failed"] == 0, hoard
        return hoard["chunks_done"], hoard["bytes_fetched"], hoard["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=100, help="tbf rate in Mbit/s (0: unshaped)")
    parser.add_argument("--rtt", type=float, default=20, help="round-trip time added by toxiproxy, ms")
    parser.add_argument("--chunks", type=int, default=700, help="chunks per trial")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--what", default="upload,hoard", help="upload, hoard or both")
    args = parser.parse_args()
    binary = REPO / "build" / "vulpes" / "vulpes"
    what = args.what.split(",")
    with tempfile.TemporaryDirectory(prefix="vulpes-upload-", dir="/var/tmp") as tmp, netns():
        work = Path(tmp)
        server = start_server(work)
        try:
            shape(args.rate or None)
            link = link_bandwidth(3)
            print(f"link: {link:.1f} Mbit/s bulk TCP goodput (tbf {args.rate:g} Mbit/s), RTT +{args.rtt:g} ms",
                  flush=True)
            with Toxiproxy.start() as toxi:
                port = int(server.url.rpartition(":")[2])
                proxy = toxi.proxy("vulpes-upload", listen=("127.0.0.1", 0), upstream=(NS_ADDR, port))
                proxy.set_rtt(args.rtt)
                url = f"https://{proxy.address}"
                for trial in range(args.trials):
                    data = content(args.chunks, seed=trial + 100)
                    for kind, measure in (("upload", upload_once), ("hoard", hoard_once)):
                        if kind not in what:
                            continue
                        chunks, size, seconds = measure(binary, work, url, server, data, trial)
                        mbit = size * 8 / seconds / 1e6
                        print(f"{kind} trial {trial + 1}: {chunks} chunks, {size / MIB:.1f} MiB in {seconds:.2f} s "
                              f"= {mbit:.1f} Mbit/s ({mbit / link:.2f} of the goodput), {chunks / seconds:.0f} "
                              f"chunks/s", flush=True)
        finally:
            shape(None)
            server.stop()


if __name__ == "__main__":
    main()
