#!/usr/bin/env python3
"""The ISR timeline measured with the real `isr` command, for every state-transfer policy.

    .venv/bin/python bench/isr_policies.py [--rates 100,10]

Two sites, each in its own network namespace behind a veth link shaped with tbf to the given rate in both
directions, and one real isr-server (tests/isr_fixtures.py). For each rate and policy, on a fresh parcel made
from the test guest: site A boots it, runs the guest's workload, leaves a RAM token and suspends (t2: the
`isr suspend` command until the version is committed); site B hoards ahead of time if the policy says so
(t3: `isr hoard`), resumes (t4: the session's own resume latency, printed by `isr resume`), and runs the
workload again (t5: its wall time, which includes demand fetches; "fetched" is what vulpes fetched at B
by then). Needs root.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

from vulpes_common import machine, table, today, update_section

from parcels.guest import build  # noqa: E402
from tests.isr_fixtures import shaped_namespaces, sites, start_isr_env  # noqa: E402

POLICIES = ["baseline", "proactive", "demand", "lazy-ws", "eager-ws", "eager-writeback"]
MIB = 1 << 20


def measure(env, root: Path, nets, policy: str) -> list[str]:  # noqa: ANN001 - bench script
    parcel = env.make_parcel(f"bench-{policy}-{int(time.time() * 1000) % 100000}")
    with sites(env, root / policy, ["A", "B"], nets) as (a, b):
        a.resume(parcel, "--policy", "eager-writeback" if policy == "eager-writeback" else "demand")
        with a.console(parcel) as console:
            console.wait_ready(120)
            started = time.monotonic()
            console.run_workload(timeout=600)
            workload_a = time.monotonic() - started
            console.set_token()
        started = time.monotonic()
        out = a.isr("suspend", parcel.name).stdout
        a.wait_session_end(parcel)
        t2 = time.monotonic() - started
        local = re.search(r"safe at this site after ([0-9.]+) s", out)
        t3 = "-"
        if policy in ("proactive", "eager-ws"):
            started = time.monotonic()
            b.isr("hoard", parcel.name, "--keyfile", str(parcel.keyfile),
                  *(["--working-set"] if policy == "eager-ws" else []))
            t3 = f"{time.monotonic() - started:.1f}"
        out = b.resume(parcel, "--policy", policy).stdout
        t4 = re.search(r"resumed in ([0-9.]+) s", out)
        boot_files = sum(float(x) for x in re.findall(r"fetched boot file \S+: .* in ([0-9.]+) s", out))
        with b.console(parcel) as console:
            started = time.monotonic()
            console.run_workload(timeout=600)
            workload_b = time.monotonic() - started
        fetched = int(b.stat(parcel)["session_status"]["vulpes"]["fetch"]["bytes"])
        b.isr("suspend", parcel.name, "--no-checkin")
        b.wait_session_end(parcel)
    return [policy, f"{t2:.1f} ({local.group(1) if local else '?'})", t3,
            f"{t4.group(1) if t4 else '?'} ({boot_files:.1f})", f"{workload_b:.1f} (A: {workload_a:.1f})",
            f"{fetched / MIB:.1f}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100,10", help="link rates in Mbit/s, comma-separated")
    args = parser.parse_args()
    guest = build("small")
    sections = []
    root = Path(tempfile.mkdtemp(prefix="isr-bench-"))
    env = start_isr_env(None, root, guest)  # type: ignore[arg-type]
    try:
        for rate in [int(r) for r in args.rates.split(",")]:
            rows = []
            with shaped_namespaces(2, rate=f"{rate}mbit") as nets:
                for policy in POLICIES:
                    row = measure(env, root / f"r{rate}", nets, policy)
                    print(f"{rate} Mbit/s: {row}", flush=True)
                    rows.append(row)
            sections.append(f"Link {rate} Mbit/s each way:\n\n" + table(
                ["policy", "t2: suspend + upload + commit (s) (state safe locally)", "t3: hoard (s)",
                 "t4: resume (s) (of which boot files)", "t5: workload at B (s)", "fetched at B by then (MiB)"],
                rows))
    finally:
        env.server.server.stop()
    body = (
        "The ISR timeline with the real `isr` command (`doc/isrctl.md`), measured by `bench/isr_policies.py`: two "
        "sites in network namespaces behind tbf-shaped veth links, one isr-server, the test guest (TCG, 256 MiB "
        "RAM, RAM in vulpes's memory image). Site A boots a fresh parcel, runs the workload, suspends; site B "
        "hoards if the policy says so, resumes, runs the workload. t4 is the session's own resume latency (lock, "
        "metadata, boot files the first time at a site, vulpes, hoard, QEMU with the device state); the workload "
        "at A ran right after a cold boot with demand fetch.\n\n"
        f"Machine: {machine()}. Date: {today()}. Command: `.venv/bin/python bench/isr_policies.py --rates "
        f"{args.rates}`.\n\n" + "\n\n".join(sections))
    update_section("isr: the ISR timeline per policy", body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
