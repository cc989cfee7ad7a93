#!/usr/bin/env python3
"""How long a guest read waits while vulpes hoards: the demand fetch goes ahead of the hoard's queue.

    .venv/bin/python bench/vulpes_overtake.py [--rounds 5] [--delay 0.3]

The scenario of tests/test_vulpes.py::test_demand_overtakes_hoard, timed: a local HTTPS chunk server that
answers every GET after `--delay` seconds, vulpes (`--max-transfers=8`) with a hoard of 64 chunks queued,
and a read of the chunk queued last. Prints, per round, the read's wait and the hoard's progress at that
moment, then the median and the maximum next to what hoard order would cost (63 requests ahead of it,
8 at a time). The test asserts the order of the requests; the wait, which depends on how busy the machine
is, is measured here. Needs root (FUSE).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.test_vulpes import CHUNK_SIZE, fault_vulpes  # noqa: E402
from tests.vulpes_fixtures import FaultServer, make_state, random_image  # noqa: E402

MIB = 1 << 20


def one_round(binary: Path, work: Path, delay: float, seed: int) -> tuple[float, int]:
    content = random_image(8 * MIB, seed=seed, data_fraction=1.0)
    state = make_state(work / "state", content, 1 * MIB)
    state.publish(work / "store")
    server = FaultServer(work / "store", work).start()
    server.delay = delay
    try:
        with fault_vulpes(binary, work, state, server, extra=["--max-transfers=8"]) as v:
            order = list(range(64))
            last = order.pop()
            assert v.control({"op": "hoard", "disk": order + [last]})["ok"]
            time.sleep(0.2)
            start = time.monotonic()
            with open(v.path("disk"), "rb", buffering=0) as f:
                f.seek(last * CHUNK_SIZE)
                assert f.read(4096) == content[last * CHUNK_SIZE:last * CHUNK_SIZE + 4096]
            waited = time.monotonic() - start
            done = int(v.status()["hoard"]["chunks_done"])
            v.control({"op": "hoard-stop"})
        return waited, done
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--delay", type=float, default=0.3, help="seconds the server takes for each GET")
    args = parser.parse_args()
    binary = REPO / "build" / "vulpes" / "vulpes"
    waits = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="vulpes-overtake-", dir="/var/tmp") as tmp:
            waited, done = one_round(binary, Path(tmp), args.delay, seed=151 + i)
        waits.append(waited)
        print(f"round {i + 1}: the read waited {waited:.2f} s; the hoard had {done} of 64 chunks", flush=True)
    in_order = (63 // 8 + 1) * args.delay
    print(f"median {statistics.median(waits):.2f} s, max {max(waits):.2f} s; behind the hoard's queue it would "
          f"wait about {in_order:.1f} s")


if __name__ == "__main__":
    main()
