#!/usr/bin/env python3
"""Cold boot of the test guest from vulpes next to QEMU's own curl block driver, over the same shaped link.

    .venv/bin/python bench/vulpes_boot.py [--rates 0,100,10] [--trials 1]

In a network namespace behind a tbf-shaped veth pair (see bench/vulpes_common.py) run a real isr-server
holding the guest disk's chunk objects, and nginx-light serving the same raw disk image over HTTPS (HTTP/1.1,
the isr-server's certificate, byte ranges). Then, for each rate (0: unshaped):

- vulpes: an empty cache, the disk image served by vulpes from isr-server on demand; QEMU opens
  MOUNT/disk like a local raw file;
- curl: QEMU's https block driver on nginx's URL (readahead 256 KiB, sslverify=off, snapshot=on so that
  the guest can write).

Measured: the time from starting QEMU to the guest's ready marker (`tools.guest.booted_guest`; the
kernel and initramfs are local files, so a boot reads little of the disk), then the guest's workload, which
reads every source file on its disk; and the bytes that crossed the link for the disk (vulpes: chunk objects
fetched; curl: nginx's access log).
Needs root.
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from nginx_origin import Nginx
from vulpes_common import (NETNS, NS_ADDR, REPO, machine, netns, shape, start_server, table, today,
                           update_section)

from tools.guest import BootedGuest, GuestArtifacts, booted_guest, build  # noqa: E402
from tests.vulpes_fixtures import Vulpes, make_state  # noqa: E402

MIB = 1 << 20
NGINX_PORT = 8444


def run_workload(guest: BootedGuest, artifacts: GuestArtifacts) -> float:
    """The guest's workload (reads every source file on its disk); checked against the expected result."""
    start = time.monotonic()
    result = guest.console.run_workload(timeout=120)
    assert result["digest"] == artifacts.expected.digest, result
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="0,100,10", help="link rates in Mbit/s, 0: unshaped")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--no-update", action="store_true")
    args = parser.parse_args()
    binary = REPO / "build" / "vulpes" / "vulpes"
    artifacts = build("small")
    rows = []
    failures: list[str] = []

    with tempfile.TemporaryDirectory(prefix="vulpes-boot-", dir="/var/tmp") as tmp, netns():
        work = Path(tmp)
        server = start_server(work)
        nginx = None
        try:
            state = make_state(work / "state", Path(artifacts.disk), 256 * MIB)
            state.publish(server.store)
            web = work / "web"
            web.mkdir()
            (web / "disk.img").symlink_to(artifacts.disk)
            nginx = Nginx(work, root=web, cert=server.cert, key=server.cert.with_suffix(".key"),
                          listen=f"{NS_ADDR}:{NGINX_PORT}", prefix=("ip", "netns", "exec", NETNS)).start()
            url = f"https://{NS_ADDR}:{NGINX_PORT}/disk.img"
            for rate in (float(r) for r in args.rates.split(",")):
                shape(rate or None)
                times: dict[str, list[float]] = {"vulpes": [], "curl": []}
                workload: dict[str, list[float]] = {"vulpes": [], "curl": []}
                volume: dict[str, int] = {}
                for trial in range(args.trials):
                    cache = work / f"cache-{rate:g}-{trial}"
                    # The guest writes: every run starts from the pristine keyrings (whose objects the
                    # server has), never from the previous run's.
                    fresh = dataclasses.replace(state, state_dir=work / f"state-{rate:g}-{trial}")
                    shutil.copytree(state.state_dir, fresh.state_dir)
                    with Vulpes(binary, work / "mnt", fresh, cache, server=server.url, token_file=server.token_file,
                                pin=server.pin) as v:
                        try:
                            with booted_guest(artifacts, v.path("disk"), run_dir=work, name="vulpes",
                                              ready_timeout=600) as guest:
                                times["vulpes"].append(guest.boot_seconds)
                                workload["vulpes"].append(run_workload(guest, artifacts))
                        except Exception:
                            print(f"vulpes output:\n{v.output()}", flush=True)
                            raise
                        volume["vulpes"] = v.status()["fetch"]["bytes"]
                    nginx.traffic(reset=True)
                    drive = (f"file.driver=https,file.url={url},file.sslverify=off,file.timeout=60,format=raw,"
                             "if=none,id=disk0,snapshot=on")
                    try:
                        with booted_guest(artifacts, None, run_dir=work, name="curl",
                                          ready_timeout=600,
                                          extra_args=("-drive", drive, "-device", "virtio-blk-pci,drive=disk0")
                                          ) as guest:
                            times["curl"].append(guest.boot_seconds)
                            workload["curl"].append(run_workload(guest, artifacts))
                    except Exception as exc:  # noqa: BLE001  (a failed baseline is a result, not a crash)
                        log = (work / "curl.log").read_text(errors="replace")[-400:] if (work / "curl.log").exists() else ""
                        failures.append(f"{rate:g} Mbit/s trial {trial + 1}: {str(exc).splitlines()[0]} "
                                        f"(QEMU log: {log.strip()!r})")
                        print(f"curl baseline failed: {failures[-1]}", flush=True)
                        times["curl"].append(float("nan"))
                        workload["curl"].append(float("nan"))
                    volume["curl"] = nginx.traffic(reset=True).body
                    print(f"{rate:g} Mbit/s trial {trial + 1}: vulpes boot {times['vulpes'][-1]:.1f} s + workload "
                          f"{workload['vulpes'][-1]:.1f} s ({volume['vulpes'] / MIB:.1f} MiB), curl boot "
                          f"{times['curl'][-1]:.1f} s + workload {workload['curl'][-1]:.1f} s "
                          f"({volume['curl'] / MIB:.1f} MiB)", flush=True)
                med = {k: statistics.median(v) for k, v in times.items()}
                wmed = {k: statistics.median(v) for k, v in workload.items()}
                total = {k: med[k] + wmed[k] for k in med}
                rows.append([f"{rate:g}" if rate else "unshaped",
                             f"{med['vulpes']:.1f} + {wmed['vulpes']:.1f} = {total['vulpes']:.1f}",
                             f"{volume['vulpes'] / MIB:.1f}",
                             f"{med['curl']:.1f} + {wmed['curl']:.1f} = {total['curl']:.1f}",
                             f"{volume['curl'] / MIB:.1f}", f"{total['vulpes'] / total['curl']:.2f}"])
        finally:
            shape(None)
            if nginx is not None:
                nginx.stop()
            server.stop()

    header = ["link (Mbit/s)", "vulpes: boot + workload (s)", "vulpes fetched (MiB)",
              "QEMU curl: boot + workload (s)", "curl fetched (MiB)", "vulpes / curl (total time)"]
    out = table(header, rows)
    if failures:
        out += "\n\nQEMU curl driver failures (counted as nan):\n\n" + "\n".join(f"- {f}" for f in failures)
    print(out)
    body = f"""Cold boot of the test guest (`tools.guest` "small": Debian cloud kernel, busybox initramfs, 256 MiB
ext4 data disk; TCG, 256 MiB RAM) until its ready marker, then its workload (reads every source file on
the disk and checks the digest), measured by `bench/vulpes_boot.py`. The disk comes
over a tbf-shaped veth link from a network namespace, either through vulpes (empty cache; chunks from a real
isr-server, HTTP/2, pinned certificate; QEMU opens MOUNT/disk as a raw file) or through QEMU's curl block
driver from nginx-light serving the same raw image (HTTP/1.1 over TLS, byte ranges, readahead 256 KiB,
`snapshot=on`, `timeout=60` instead of its default 5 s; a run whose workload does not finish within
120 s counts as a failure and is listed; over HTTP/2 the curl driver hung the guest's workload here, so the baseline uses HTTP/1.1,
as QEMU's driver is built for). Median of {args.trials} trial(s) per rate; "fetched" is what crossed the link for the disk.

Machine: {machine()}. Date: {today()}. Command: `.venv/bin/python bench/vulpes_boot.py --rates {args.rates}
--trials {args.trials}`.

{out}
"""
    if not args.no_update:
        update_section("vulpes: cold boot of the test guest", body)


if __name__ == "__main__":
    main()
