#!/usr/bin/env python3
"""Hoard throughput of vulpes over a shaped link, as a fraction of the link's bandwidth.

    .venv/bin/python bench/vulpes_hoard.py [--rates 100,10] [--seconds 8] [--windows 64,1]

A real isr-server (2 workers, sqlite, directory store) runs in a network namespace behind a veth pair
shaped with tbf on both ends (10.231.0.0/24, nothing leaves the machine). For each rate, the link's bulk
TCP goodput is measured first (one connection, 4 s), then vulpes (in the host namespace, cache empty)
hoards a parcel of incompressible chunks sized for about `--seconds` of transfer, with `--hoard-window`
requests in flight (64 is the default; 1 is OpenISR's one-GET-at-a-time hoard). Hoard throughput counts
the chunk-object bytes fetched over the time from the hoard request to its completion (status of the
control socket). Needs root (namespaces, tc, FUSE).
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from vulpes_common import (REPO, NsServer, link_bandwidth, machine, netns, shape, start_server, table, today,
                           update_section)

from tests.vulpes_fixtures import ParcelState, Vulpes, make_state  # noqa: E402

MIB = 1 << 20


def hoard_once(binary: Path, work: Path, state: ParcelState, server: NsServer, window: int) -> dict[str, Any]:
    cache = work / f"cache-{window}-{os.urandom(4).hex()}"
    with Vulpes(binary, work / "mnt", state, cache, server=server.url, token_file=server.token_file,
                pin=server.pin, extra=[f"--hoard-window={window}"]) as v:
        response = v.control({"op": "hoard", "wait": True}, timeout=900)
        assert response["ok"], response
        hoard = response["status"]["hoard"]
        assert hoard["state"] == "done" and hoard["chunks_done"] == hoard["chunks_total"], hoard
        return hoard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="100,10", help="link rates in Mbit/s")
    parser.add_argument("--seconds", type=float, default=8.0, help="transfer time to size the parcel for")
    parser.add_argument("--windows", default="64,1", help="hoard windows (requests in flight) to compare")
    parser.add_argument("--no-update", action="store_true")
    args = parser.parse_args()
    binary = REPO / "build" / "vulpes" / "vulpes"
    rates = [float(r) for r in args.rates.split(",")]
    windows = [int(w) for w in args.windows.split(",")]
    rows = []

    with tempfile.TemporaryDirectory(prefix="vulpes-hoard-", dir="/var/tmp") as tmp, netns():
        work = Path(tmp)
        server = start_server(work)
        try:
            for rate in rates:
                size = max(8, int(rate * 1e6 / 8 * args.seconds / MIB)) * MIB
                print(f"{rate:g} Mbit/s: encoding a {size // MIB} MiB parcel ...", flush=True)
                state = make_state(work / f"state-{rate:g}", os.urandom(size), 1 * MIB)
                state.publish(server.store)
                object_bytes = sum(len(o) for o in state.objects.values())
                shape(rate)
                link = link_bandwidth()
                print(f"  link: {link:.1f} Mbit/s measured", flush=True)
                for window in windows:
                    hoard = hoard_once(binary, work, state, server, window)
                    mbit = hoard["bytes_fetched"] * 8 / hoard["seconds"] / 1e6
                    assert hoard["bytes_fetched"] == object_bytes
                    print(f"  window {window}: {hoard['chunks_done']} chunks, {hoard['bytes_fetched'] / MIB:.1f} MiB "
                          f"in {hoard['seconds']:.2f} s = {mbit:.1f} Mbit/s ({mbit / link:.2f} of the link)",
                          flush=True)
                    rows.append([f"{rate:g}", f"{link:.1f}", str(window), f"{hoard['bytes_fetched'] / MIB:.1f}",
                                 f"{hoard['seconds']:.2f}", f"{mbit:.1f}", f"{mbit / link:.2f}",
                                 f"{mbit / rate:.2f}"])
        finally:
            shape(None)
            server.stop()

    header = ["tbf rate (Mbit/s)", "link goodput, bulk TCP (Mbit/s)", "hoard window", "fetched (MiB)",
              "time (s)", "hoard (Mbit/s)", "hoard / link goodput", "hoard / tbf rate"]
    out = table(header, rows)
    print(out)
    body = f"""Hoard throughput over a shaped link, measured by `bench/vulpes_hoard.py`: a real isr-server (2 workers,
sqlite, directory store, `chunk_serving = auto` = sendfile, TLS with its self-signed certificate pinned by
vulpes) in a network namespace behind a veth pair with tbf on both ends (`latency 400ms`); vulpes in the
host namespace with an empty cache hoards a parcel of incompressible 128 KiB chunks (about
{args.seconds:g} s of transfer at each rate) through its curl multi handle (HTTP/2, one connection). "Link
goodput" is one bulk TCP connection over the same shaped link, measured just before. Window 1 is OpenISR's
one-GET-at-a-time hoard; 64 is vulpes's default. Time runs from the hoard request to completion (every
object verified and written to the cache). The veth link adds no delay (netem is not available on this
kernel), so with a round-trip time near zero even one request at a time keeps the link busy; the window is
what keeps it full once there is latency (at 50 ms RTT one 128 KiB GET at a time would reach about
128 KiB / (50 ms + transfer time), a fraction of the link, which is how OpenISR's hoard behaves).

Machine: {machine()}. Date: {today()}. Command: `.venv/bin/python bench/vulpes_hoard.py --rates {args.rates}
--seconds {args.seconds:g} --windows {args.windows}`.

{out}
"""
    if not args.no_update:
        update_section("vulpes: hoard throughput", body)


if __name__ == "__main__":
    main()
