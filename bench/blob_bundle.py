#!/usr/bin/env python3
"""A version's blobs one GET each against one bundle (GET …/versions/{n}/_bundle), and a checkin's staging
PUTs one after another against on parallel connections (`isrctl.checkin.on_connections`), through added RTT.

    .venv/bin/python bench/blob_bundle.py [--rates 100,10] [--rtt 20] [--blobs 28] [--size 100000] [--trials 3]

What a fresh-site resume fetches after its first pack part: `--blobs` sealed blobs of about `--size` bytes
(the resume pack's later parts), from a real isr-server (sqlite, directory store, TLS, HTTP/2) through a
toxiproxy proxy that adds `--rtt` ms (half each way) and limits the rate (toxiproxy's bandwidth toxic, KB/s;
coarser than the tbf of the other benchmarks, which needs a network namespace). Per trial, on one warm
connection: the blobs with `Remote.get_blob` one after another, then all of them with `Remote.get_blobs`,
next to the time the bytes alone take at that rate; then the same blobs staged for a commit (PUT, the rate
limited upstream too), one after another on one connection and as `checkin.stage` sends them. Prints its
figures; it does not write BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from isrctl.checkin import on_connections  # noqa: E402
from isrctl.remote import Remote  # noqa: E402
from tests.server_fixtures import ServerEnv, start_env  # noqa: E402
from tests.toxiproxy_fixtures import Toxiproxy  # noqa: E402


def make_version(env: ServerEnv, parts: dict[str, bytes]) -> str:
    """A parcel whose version 1 holds the placeholder required blobs and ``parts``; its id."""
    parcel = env.new_parcel("alice")
    with env.client("alice") as client:
        nonce = client.acquire(parcel, host="bench")["nonce"]
        blobs = {"manifest": b"m", "keyring.disk": b"k", "keyring.memory": b"k", **parts}
        for name, data in blobs.items():
            client.put_blob(parcel, name, data, nonce)
        client.commit(parcel, nonce, 0, list(blobs), [])
        client.release(parcel, nonce)
    return parcel


def stage_times(env: ServerEnv, parcel: str, address: str, parts: dict[str, bytes]) -> tuple[float, float]:
    """Seconds to stage ``parts`` one PUT after another on one warm connection, and as `checkin.stage` does
    (each connection warmed by a first request before the clock starts, as a checkin's are by then)."""
    def remote() -> Remote:
        return Remote(f"https://{address}", fingerprint=env.server.fingerprint, token=env.tokens["alice"])

    with remote() as control:
        nonce = control.acquire(parcel, host="bench")["nonce"]
        try:
            with remote() as one:
                one.whoami()
                started = time.monotonic()
                for name, data in parts.items():
                    one.put_blob(parcel, name, data, nonce)
                serial = time.monotonic() - started
            started = time.monotonic()
            on_connections(SimpleNamespace(new_remote=remote), "stage",  # type: ignore[arg-type]
                           list(parts.items()), lambda r, blob: r.put_blob(parcel, blob[0], blob[1], nonce))
            parallel = time.monotonic() - started
        finally:
            control.release(parcel, nonce)
    return serial, parallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="100,10", help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--rtt", type=float, default=20, help="round-trip time added by toxiproxy, ms")
    parser.add_argument("--blobs", type=int, default=28)
    parser.add_argument("--size", type=int, default=100_000, help="bytes per blob")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    parts = {("resumepack" if i == 0 else f"resumepack.{i}"): os.urandom(args.size) for i in range(args.blobs)}
    with tempfile.TemporaryDirectory(prefix="blob-bundle-", dir="/var/tmp") as tmp:
        env = start_env("sqlite-directory", Path(tmp), None)
        try:
            parcel = make_version(env, parts)
            host, _, port = env.server.url.removeprefix("https://").rpartition(":")
            with Toxiproxy.start() as toxi:
                proxy = toxi.proxy("blob-bundle", listen=("127.0.0.1", 0), upstream=(host, int(port)))
                proxy.set_rtt(args.rtt)
                for mbit in (float(rate) for rate in args.rates.split(",")):
                    bytes_alone = args.blobs * args.size * 8 / (mbit * 1e6)
                    with proxy.toxic("bandwidth", rate=int(mbit * 1000 / 8)):
                        for trial in range(args.trials):
                            with Remote(f"https://{proxy.address}", fingerprint=env.server.fingerprint,
                                        token=env.tokens["alice"]) as remote:
                                remote.whoami()     # the connection is up before the clock starts
                                started = time.monotonic()
                                for name, data in parts.items():
                                    assert remote.get_blob(parcel, 1, name) == data
                                serial = time.monotonic() - started
                                started = time.monotonic()
                                assert dict(remote.get_blobs(parcel, 1, list(parts))) == parts
                                bundle = time.monotonic() - started
                            print(f"{mbit:g} Mbit/s +{args.rtt:g} ms, {args.blobs} blobs of {args.size} bytes, trial "
                                  f"{trial + 1}: one GET each {serial:.2f} s, one bundle {bundle:.2f} s (the bytes "
                                  f"alone {bytes_alone:.2f} s)", flush=True)
                    with proxy.toxic("bandwidth", stream="upstream", rate=int(mbit * 1000 / 8)):
                        for trial in range(args.trials):
                            serial, parallel = stage_times(env, parcel, proxy.address, parts)
                            print(f"{mbit:g} Mbit/s +{args.rtt:g} ms, staging {args.blobs} blobs, trial {trial + 1}: "
                                  f"one PUT after another {serial:.2f} s, on parallel connections {parallel:.2f} s "
                                  f"(the bytes alone {bytes_alone:.2f} s)", flush=True)
        finally:
            env.server.stop()


if __name__ == "__main__":
    main()
