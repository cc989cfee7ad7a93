"""The benchmark matrix's own logic that needs no links or guests: which cells --full runs, the run-to-run
spread report, and the physical floors from the pages a guest read (bench/matrix.py, bench/matrix_report.py)."""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import matrix  # noqa: E402
import matrix_report  # noqa: E402
from parcels.compress import compress  # noqa: E402
from parcels.parcel import create_parcel  # noqa: E402
from parcels.store import DirStore  # noqa: E402
from tests.isr_fixtures import Parcel  # noqa: E402


def _args(mode: str) -> argparse.Namespace:
    return argparse.Namespace(mode=mode, policies=list(matrix.POLICIES), ram=[256, 1024], rtts=[0, 50],
                              explicit_rtts=False)


def test_full_mode_runs_the_second_ram_size_at_1_mbit_for_demand_only() -> None:
    results: dict[str, Any] = {"notes": []}
    full = _args("full")
    assert matrix.policies_for(full, 100, 1024, results) == matrix.POLICIES
    assert matrix.policies_for(full, 1, 256, results) == matrix.POLICIES
    assert results["notes"] == []
    assert matrix.policies_for(full, 1, 1024, results) == ["demand"]
    assert len(results["notes"]) == 1 and "1024 MiB" in results["notes"][0]
    assert matrix.policies_for(_args("quick"), 1, 1024, {"notes": []}) == matrix.POLICIES


def _run(command: str, cells: list[dict[str, Any]], local_s: float) -> dict[str, Any]:
    return {"meta": {"machine": "m", "date": "d", "command": command, "mode": "quick", "seconds": 60},
            "local": {"256": {"status": "ok", "workload_s": local_s}}, "cells": cells}


def _cell(policy: str, answered: float, workload: float, status: str = "ok") -> dict[str, Any]:
    return {"rate": 10, "rtt": 20, "ram": 256, "policy": policy, "status": status,
            "t4_responsive": answered, "workload_b_s": workload}


def test_spread_sets_the_cells_every_run_measured_side_by_side() -> None:
    first = _run("one", [_cell("demand", 20.0, 12.0), _cell("proactive", 2.0, 3.0)], 3.0)
    second = _run("two", [_cell("demand", 22.0, 15.0), _cell("proactive", 2.0, 3.0, status="failed: x"),
                          _cell("baseline", 37.0, 3.3)], 2.5)
    text = matrix_report.spread([first, second])
    assert "`one`" in text and "`two`" in text
    rows = [line for line in text.splitlines() if line.startswith("| 10 Mbit/s")]
    # Only demand was measured (and ok) in both runs; each run's slowdown is against its own local run.
    assert rows == ["| 10 Mbit/s, RTT +20 ms | 256 | demand | 20.0 / 22.0 (1.10) | 12.0 / 15.0 (1.25) "
                    "| 4.00× / 6.00× |"]
    assert "No cell was measured by every run" in matrix_report.spread([first, _run("three", [], 3.0)])


def test_a_disk_booted_run_has_a_section_of_its_own(monkeypatch: Any) -> None:
    """`--guest diskboot` writes its own section, never the test guest's matrix (bench/matrix.py report)."""
    written: dict[str, str] = {}
    monkeypatch.setattr(matrix_report, "write", written.update)
    run = {**_run("bench/matrix.py --quick --guest diskboot", [_cell("demand", 20.0, 12.0)], 3.0),
           "links": {}, "peers": [], "notes": []}
    run["meta"].update({"guest": "diskboot", "ram": [256], "peers": []})
    matrix.report(run, update=True)
    assert list(written) == [matrix_report.DISKBOOT]
    assert "syslinux" in written[matrix_report.DISKBOOT] and "demand" in written[matrix_report.DISKBOOT]
    assert matrix.parse_args(["--quick", "--guest", "diskboot"]).guest == "diskboot"


def test_throughput_shows_the_checkin_by_the_sessions_clock_where_the_suspend_said_it() -> None:
    """The checkin as the command's wall time (with the start and exit of `isr suspend`) and, where the suspend
    printed it, from the safe state to the commit by the session's clock; older trees print no such line."""
    def cell(session: float | None) -> dict[str, Any]:
        return {**_cell("proactive", 2.0, 3.0), "rate": 100, "t3": 4.0, "t3_link_bytes": 40 * 2**20,
                "site_a": {"status": "ok", "policy_a": "demand", "checkin_s": 3.0, "checkin_session_s": session,
                           "checkin_link_bytes": 30 * 2**20}}

    def rows(session: float | None) -> list[str]:
        run = {**_run("one", [cell(session)], 3.0), "links": {"100": {"goodput_mbit": 100.0}}}
        return [line for line in matrix_report.throughput(run).splitlines() if line.startswith("| 100 Mbit/s")]

    # 30 MiB is 251.7 Mbit: 83.9 Mbit/s in the command's 3.0 s, 100.7 in the session's 2.5 s.
    assert "| 30.0 in 3.0 | 83.9 (0.84, 0.84) | 2.5: 100.7 (1.01, 1.01) | 40.0 in 4.0 |" in rows(2.5)[0], rows(2.5)
    assert "| 30.0 in 3.0 | 83.9 (0.84, 0.84) | – | 40.0 in 4.0 |" in rows(None)[0], rows(None)


def test_the_floors_are_the_pages_read_first_compressed_in_read_order(tmp_path: Path) -> None:
    """touched() keeps, per image and phase, the pages the guest read before writing, in read order;
    touched_bytes() compresses exactly those pages of the newest version as one stream."""
    rng = random.Random(7)
    disk = bytearray(1 << 20)
    for page in (3, 40, 41, 200):                       # incompressible pages; the rest stay zero
        disk[page * 4096:(page + 1) * 4096] = rng.randbytes(4096)
    image = tmp_path / "disk.img"
    image.write_bytes(bytes(disk))
    keyfile = tmp_path / "key"
    keyfile.write_bytes(b"k" * 32)
    store = tmp_path / "store"
    uid = create_parcel(DirStore(store), name="p", disk=image, ram_mib=1, keyfile=keyfile.read_bytes(), log2n=10)
    trace = tmp_path / "traces"
    trace.mkdir()
    (trace / "t.trace").write_text("\n".join([
        "# vulpes-trace 3 disk.chunk_size=131072 memory.chunk_size=131072",
        "10.0 disk 0 r server 163840 8192",      # pages 40 and 41, before the answer
        "10.5 disk 0 w new 12288 4096",          # page 3 written first: nothing to fetch
        "11.0 disk 0 r ram 12288 4096",
        "12.0 disk 1 r server 819200 4096",      # page 200, in the workload
        "12.5 disk 0 r ram 163840 4096",         # page 40 again: not new
        "13.0 memory 0 r server 0 4096",         # a page of zeros
        "30.0 disk 0 r server 0 4096",           # after the workload
    ]) + "\n")
    counts, pages = matrix.touched(trace, answered=11.5, finished=20.0)
    assert counts["disk"]["before_pages"] == 3 and counts["disk"]["workload_pages"] == 1
    assert pages == {"disk": {"before": [40, 41], "workload": [200]}, "memory": {"before": [], "workload": [0]}}
    floors = matrix.touched_bytes(store, Parcel("p", str(uid), keyfile), pages)
    level = matrix.pack.TRANSFER_LEVEL
    assert floors["disk"]["before"] == len(compress(bytes(disk[40 * 4096:42 * 4096]), level))
    assert floors["disk"]["workload"] == len(compress(bytes(disk[200 * 4096:201 * 4096]), level))
    assert floors["memory"]["workload"] == len(compress(bytes(4096), level))
