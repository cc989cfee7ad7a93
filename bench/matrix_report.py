"""The BENCHMARKS.md sections of bench/matrix.py, made from its raw results (the --json it writes), and the
chunk-size study of the traces. Every number here comes from the results, except the seed papers' figures,
which come from bench/seed_figures.py and are labeled as transcribed.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from seed_figures import CHUNK_SIZE_STUDIES, FIGURES, SEED_001, SEED_003, SETUPS
from vulpes_common import table, update_section

from tools.chunksim.cache import DEFAULT_SIZES, sweep  # noqa: E402
from tools.chunksim.trace import Trace, read_trace  # noqa: E402
from tools.chunksim.units import format_size  # noqa: E402

MIB = 1 << 20
TRACES = Path(__file__).resolve().parent.parent / "tools" / "chunksim" / "traces"
DASH = "–"

TIMELINE = "isr: the ISR timeline per policy"
RAM = "isr: resume latency and RAM size"
THROUGHPUT = "isr: hoard and checkin throughput"
PEERS = "isr: peers on the same links"
MODEL = "isr: the policy model against the measurements"
CHUNKS = "chunk size from the traces"
SEEDS = "the seeds' figures beside ours"
SPREAD = "isr: run-to-run spread"
TOUCHED = "isr: what the resumed guest touches"
COMPARE = "isr: before and after"
DISKBOOT = "isr: a disk-booted guest (a PC disk with its own bootloader)"


# --- numbers to text ----------------------------------------------------------------------------------------

def num(value: Any, digits: int = 1) -> str:
    return DASH if value is None else f"{value:.{digits}f}"


def mib(value: Any) -> str:
    return DASH if value is None else f"{value / MIB:.1f}"


def rate_text(value: float) -> str:
    """Mbit/s with two decimals below 10, else one."""
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def ratio(measured: Any, predicted: Any) -> str:
    if measured is None or predicted is None:
        return DASH
    text = f"{measured:.1f} / {predicted:.1f}"
    return f"{text} ({measured / predicted:.2f})" if predicted > 0 else text


def mbit(nbytes: Any, seconds: Any) -> float | None:
    return nbytes * 8 / seconds / 1e6 if nbytes is not None and seconds else None


def slowdown(workload: Any, local: Any) -> str:
    if workload is None or not local:
        return DASH
    return f"{workload / local:.2f}× ({(workload - local) / local * 100:+.0f} %)"


def ok(cell: dict[str, Any]) -> bool:
    return cell.get("status") == "ok"


def link_name(rate: Any, rtt: Any) -> str:
    return f"{rate} Mbit/s, RTT +{rtt} ms"


def local_workload(results: dict[str, Any], ram: Any, key: str = "workload_s") -> float | None:
    entry = results["local"].get(str(ram)) or {}
    return entry.get(key) if entry.get("status") == "ok" else None


def goodput(results: dict[str, Any], rate: Any) -> float | None:
    entry = results["links"].get(str(rate)) or {}
    return entry.get("goodput_mbit")


def combos(cells: Iterable[dict[str, Any]], *fields: str) -> list[tuple[Any, ...]]:
    seen: list[tuple[Any, ...]] = []
    for cell in cells:
        key = tuple(cell[f] for f in fields)
        if key not in seen:
            seen.append(key)
    return seen


def header(results: dict[str, Any]) -> str:
    meta = results["meta"]
    return (f"Machine: {meta['machine']}. Date: {meta['date']}. Command: `{meta['command']}` ({meta['mode']}, "
            f"{meta.get('seconds', 0) / 60:.0f} min).")


# --- the sections -------------------------------------------------------------------------------------------

def sections(results: dict[str, Any]) -> dict[str, str]:
    out = {TIMELINE: timeline(results)}
    if len(results["meta"]["ram"]) > 1:
        out[RAM] = ram_sizes(results)
    out[THROUGHPUT] = throughput(results)
    if results["peers"] or results["meta"]["peers"]:
        out[PEERS] = peers(results)
    if any(cell.get("touched") for cell in results["cells"]):
        out[TOUCHED] = touched(results)
    out[MODEL] = model(results)
    out[CHUNKS] = chunk_table(results.get("chunk_sizes") or {})
    out[SEEDS] = seeds(results)
    return out


def write(made: dict[str, str]) -> None:
    for title, body in made.items():
        update_section(title, body)


def timeline(results: dict[str, Any]) -> str:
    local = ", ".join(
        f"{ram} MiB RAM: boot {num(v.get('boot_s'))} s, workload {num(v.get('workload_first_s'))} s the first "
        f"time and {num(v.get('workload_s'))} s the second"
        + (f", {num(v['workload_resumed_s'])} s after a local resume (saved to a file, all RAM loaded)"
           if v.get("workload_resumed_s") else "")
        if v.get("status") == "ok" else f"{ram} MiB: {v['status']}"
        for ram, v in results["local"].items())
    links = ", ".join(f"{rate} Mbit/s: {rate_text(v['goodput_mbit'])}" if v.get("status") == "ok"
                      else f"{rate} Mbit/s: {v['status']}" for rate, v in results["links"].items())
    parts = [
        "The ISR timeline (doc/isrctl.md) with the real `isr` command, measured by `bench/matrix.py`: one "
        "isr-server, two sites in network namespaces behind veth links shaped with tbf to the link rate both "
        "ways, and between each site and the server a toxiproxy proxy that adds the round-trip time (RTT +N ms; "
        "the kernel here has no netem, so the delay is added to the data in user space and TCP's own round trip "
        "stays short). The test guest (`tools.guest` small: TCG, one vCPU, RAM in vulpes's memory image) runs "
        "`run.sh`. Site A resumes a fresh parcel (a cold boot with demand fetch), runs the workload, suspends and "
        "checks in (t2: `isr suspend` until the version is committed; in parentheses when the state was safe at "
        "A). For each policy a fresh site B with an empty cache hoards if the policy wants it (t3: `isr hoard`), "
        "resumes (t4: what `isr resume` reports, with its boot-file and hoard phases; then until the guest first "
        "answers on its console), and runs the workload again (t5). Every B resumes the same version, so the "
        "policies share one t2, except eager writeback, whose site A trickled its writes during t1. Slowdown is "
        "the workload at B against the same workload's second run on a local copy of the disk (no network, no "
        "vulpes) in the same run. MiB to B: what crossed B's link (headers included) during t3 / t4 / t5; vulpes: "
        "the chunk objects it fetched by the end of t5.",
        header(results),
        f"Local baseline: {local or DASH}. Link goodput (one bulk TCP connection, no proxy, Mbit/s): "
        f"{links or DASH}.",
    ]
    for note in results.get("notes", []):
        parts.append(f"Note: {note}.")
    head = ["policy", "RAM (MiB)", "t2 (s) (safe at A)", "t3: hoard (s)", "t4: isr resume (s) (boot files + hoard)",
            "t4 until the guest answers (s)", "t5: workload at B (s)", "slowdown vs local", "MiB to B: t3 / t4 / t5",
            "vulpes fetched (MiB)", "chunks fetched until the guest answered: memory / disk"]
    for rate, rtt in combos(results["cells"], "rate", "rtt"):
        rows = []
        for cell in results["cells"]:
            if (cell["rate"], cell["rtt"]) != (rate, rtt):
                continue
            a = cell.get("site_a") or {}
            if not ok(cell):
                rows.append([cell["policy"], str(cell["ram"]), cell["status"]] + [DASH] * (len(head) - 3))
                continue
            phases = cell.get("t4_phases") or {}
            t2 = f"{num(a.get('t2'))} ({num(a.get('t2_safe'))})"
            if cell["policy"] == "eager-writeback":
                t2 += " own A"
            rows.append([
                cell["policy"], str(cell["ram"]), t2, num(cell.get("t3")),
                f"{num(cell.get('t4'))} ({num(phases.get('boot files'))} + {num(phases.get('hoard'))})",
                num(cell.get("t4_responsive")), num(cell.get("workload_b_s")),
                slowdown(cell.get("workload_b_s"), local_workload(results, cell["ram"])),
                " / ".join(mib(cell.get(f"{t}_link_bytes")) for t in ("t3", "t4", "t5")),
                mib(cell.get("vulpes_fetched_bytes")), fetched_before(cell)])
        parts.append(f"Link {link_name(rate, rtt)}:\n\n" + table(head, rows))
    if not results["cells"]:
        parts.append("No ISR cells were run.")
    return "\n\n".join(parts)


def diskboot(results: dict[str, Any]) -> str:
    """The timeline of a run with the disk-booted guest (`bench/matrix.py --guest diskboot`)."""
    return ("A parcel made from a real PC disk rather than a kernel handed to QEMU: the disk-booted test guest "
            "(`tools.guest` diskboot: a 512 MiB disk with syslinux in its MBR, a FAT boot partition with the "
            "kernel and initramfs, and a Debian 12 root holding the same workload), imported with `isr-admin "
            "parcel create` without boot files, so site A's cold boot goes through SeaBIOS and syslinux and "
            "fetches the bootloader's, kernel's and root's blocks on demand. Everything else as in the section "
            "above; the paragraph below describes the test guest's matrix, of which this is one row.\n\n"
            + timeline(results))


def fetched_before(cell: dict[str, Any]) -> str:
    chunks = cell.get("server_chunks")
    if chunks is None:
        return DASH
    return " / ".join(str(chunks.get(image, {}).get("before", 0)) for image in ("memory", "disk"))


def touched(results: dict[str, Any]) -> str:
    """The memory pages the resumed guest touched (vulpes's page-level traces) against the chunks fetched for
    them: the physical limit of a resume, and what smaller memory chunks would have moved."""
    sizes = ["4096", "16384", "32768", "65536", "131072"]
    parts = [
        "What the guest at site B touched of its memory image, from vulpes's traces (version 2: the bytes of "
        "each access; with the kernel's readahead off every page fault is one 4 KiB access): the distinct pages "
        "until it first answered and the new ones during the workload, and how many chunks those pages fall in "
        "at smaller chunk sizes (MiB: their plaintext). The pages alone are the physical limit of the resume: "
        "compressed at the memory image's mean ratio (its stored chunk objects over their plaintext), and "
        "their time at the link's goodput plus a round trip, the fastest any transfer of them could be. The floors "
        "come from site F, which resumed the same version after every B with vulpes's warmer off (so that its "
        "trace sees every page the guest reads; the warmer hides the touches of pages it put into the page "
        "cache) and was not timed: the pages of both images the guest read until it answered (a page it wrote "
        "first needs nothing), taken from the version in the order it read them and compressed as one stream "
        "at the resume pack's level, and their time at the link's goodput plus a round trip; then the same of "
        "the pages it read first during the workload, against the local run's workload.",
        header(results),
    ]
    head = ["link", "policy", "RAM (MiB)", "guest answered (s)", "pages until it answered (MiB)",
            "memory chunks fetched from the server until then", "limit: those pages compressed (MiB; s at goodput)",
            "new pages in the workload (MiB)", "floor until it answers: MB read; s at goodput",
            "workload floor: MB read; s at goodput (local workload, s)"] + \
        [f"chunks of {int(s) >> 10} KiB (MiB)" for s in sizes]
    rows = []
    for cell in results["cells"]:
        mem = (cell.get("touched") or {}).get("memory")
        if not ok(cell) or not mem:
            continue
        compression = mem.get("compression")
        limit = mem["before_pages"] * 4096 * compression if compression else None
        good = goodput(results, cell["rate"])
        seconds = limit * 8 / (good * 1e6) + cell["rtt"] / 1000 if good and limit else None
        before = (cell.get("server_chunks") or {}).get("memory", {}).get("before", 0)
        floors = []
        floor = [image for image in (cell.get("floor") or {}).values() if isinstance(image, dict)]
        for phase, rtt in (("before", cell["rtt"] / 1000), ("workload", 0.0)):
            nbytes = [image.get(f"{phase}_bytes") for image in floor]
            if not good or not nbytes or None in nbytes:
                floors.append(DASH)
                continue
            total = sum(int(n or 0) for n in nbytes)
            floors.append(f"{total / 1e6:.2f}; {total * 8 / (good * 1e6) + rtt:.1f}")
        local = local_workload(results, cell["ram"])
        floors[1] += f" ({num(local)})" if floors[1] != DASH else ""
        rows.append([link_name(cell["rate"], cell["rtt"]), cell["policy"], str(cell["ram"]),
                     num(cell.get("t4_responsive")),
                     f"{mem['before_pages']} ({mib(mem['before_pages'] * 4096)})", str(before),
                     f"{mib(limit)}; {num(seconds)}" if limit else DASH,
                     f"{mem['workload_pages']} ({mib(mem['workload_pages'] * 4096)})"] + floors
                    + [f"{mem['before_chunks'].get(s, 0)} ({mib(mem['before_chunks'].get(s, 0) * int(s))})"
                       for s in sizes])
    parts.append(table(head, rows))
    return "\n\n".join(parts)


def ram_sizes(results: dict[str, Any]) -> str:
    rams = results["meta"]["ram"]
    head = ["link", "policy"] + [f"t4 (s), {r} MiB: isr / guest answers" for r in rams] + \
        [f"memory / disk chunks fetched until the guest answered, {r} MiB" for r in rams] + \
        [f"t2 (s), {r} MiB" for r in rams] + [f"vulpes fetched at B (MiB), {r} MiB" for r in rams]
    rows = []
    for rate, rtt, policy in combos(results["cells"], "rate", "rtt", "policy"):
        by_ram = {c["ram"]: c for c in results["cells"] if (c["rate"], c["rtt"], c["policy"]) == (rate, rtt, policy)}
        row = [link_name(rate, rtt), policy]
        for key in ("t4", "before", "t2", "fetched"):
            for r in rams:
                cell = by_ram.get(r)
                if cell is None or not ok(cell):
                    row.append(DASH if cell is None else "failed")
                elif key == "t4":
                    row.append(f"{num(cell.get('t4'))} / {num(cell.get('t4_responsive'))}")
                elif key == "before":
                    row.append(fetched_before(cell))
                elif key == "t2":
                    row.append(num((cell.get("site_a") or {}).get("t2")))
                else:
                    row.append(mib(cell.get("vulpes_fetched_bytes")))
        rows.append(row)
    return ("Resume latency against the guest's RAM size (issue 5), from the same cells as the timeline above: "
            "the guest's RAM lives in vulpes's memory image and is faulted in chunk by chunk after the resume, "
            "so t4 should not grow with it; what does grow is what the guest dirtied in RAM (uploaded in t2, "
            "fetched at B when touched, and everything a baseline or proactive hoard moves).\n\n"
            f"{header(results)}\n\n" + table(head, rows))


def throughput(results: dict[str, Any]) -> str:
    head = ["link", "RAM (MiB)", "bulk TCP goodput (Mbit/s) (÷ rate)", "site A run",
            "checkin: MiB up in s", "checkin Mbit/s (÷ rate, ÷ goodput)",
            "checkin by the session's clock: s, Mbit/s (÷ rate, ÷ goodput)",
            "hoard (proactive, `isr hoard`): MiB in s", "hoard Mbit/s (÷ rate, ÷ goodput)",
            "baseline hoard in t4: MiB in s", "baseline Mbit/s (÷ rate, ÷ goodput)"]
    rows = []

    def fractions(rate_mbit: float | None, rate: float, good: float | None) -> str:
        if rate_mbit is None:
            return DASH
        text = f"{rate_text(rate_mbit)} ({rate_mbit / rate:.2f}"
        return f"{text}, {rate_mbit / good:.2f})" if good else f"{text})"

    for rate, rtt, ram in combos(results["cells"], "rate", "rtt", "ram"):
        cells = [c for c in results["cells"] if (c["rate"], c["rtt"], c["ram"]) == (rate, rtt, ram)]
        good = goodput(results, rate)
        good_text = f"{rate_text(good)} ({good / rate:.2f})" if good else DASH
        hoard = next((c for c in cells if c["policy"] == "proactive" and ok(c)), None)
        base = next((c for c in cells if c["policy"] == "baseline" and ok(c)), None)
        hoard_rate = mbit(hoard.get("t3_link_bytes"), hoard.get("t3")) if hoard else None
        base_s = None
        if base:
            phases = base.get("t4_phases") or {}
            base_s = (phases.get("boot files") or 0) + (phases.get("hoard") or 0)
        base_rate = mbit(base.get("t4_link_bytes"), base_s) if base else None
        site_as: dict[str, dict[str, Any]] = {}
        for c in cells:
            a = c.get("site_a") or {}
            if a.get("status") == "ok":
                site_as.setdefault(a["policy_a"], a)
        for policy_a, a in site_as.items() or {"-": {}}.items():
            up = mbit(a.get("checkin_link_bytes"), a.get("checkin_s"))
            session = a.get("checkin_session_s")
            up_session = mbit(a.get("checkin_link_bytes"), session)
            rows.append([link_name(rate, rtt), str(ram), good_text, policy_a,
                         f"{mib(a.get('checkin_link_bytes'))} in {num(a.get('checkin_s'))}", fractions(up, rate, good),
                         f"{num(session)}: {fractions(up_session, rate, good)}" if session else DASH,
                         f"{mib(hoard.get('t3_link_bytes'))} in {num(hoard.get('t3'))}" if hoard else DASH,
                         fractions(hoard_rate, rate, good),
                         f"{mib(base.get('t4_link_bytes'))} in {num(base_s)}" if base else DASH,
                         fractions(base_rate, rate, good)])
    return ("Hoard and checkin throughput as fractions of the link, from the same cells as the timeline: bytes are "
            "what crossed the site's veth (the kernel's counters on the host side, so TCP/IP, TLS and HTTP "
            "overhead included) over the wall time of the step, divided by the tbf rate and by the goodput of "
            "one bulk TCP connection over the same link measured at the start of the run (payload only, no proxy, "
            "no added RTT). Checkin: site A's `isr suspend` from the moment the state was safe locally to the "
            "commit (vulpes uploads the new chunk objects while the keyrings, device state and manifest are "
            "staged), taken as the command's wall time less its time to the safe state (counted from the command's "
            "start since the session learns its age; before that, from the request's arrival, so that the "
            "command's own start fell into the checkin), so with the command's exit; by the session's clock: "
            "from the safe state to the commit and the lock's release, as `isr suspend` prints it (trees before "
            "issue 15's staging do not). Hoard: `isr hoard` at B for the proactive policy (every chunk, and the boot files beside them; before "
            "issue 15 the boot files came first); baseline: the boot "
            "files and hoard phases of its resume.\n\n" + header(results) + "\n\n" + table(head, rows))


def peers(results: dict[str, Any]) -> str:
    head = ["link", "system", "boot or resume until the guest answers (s)", "workload (s)", "slowdown vs local",
            "MiB to the site", "note"]
    rows = []
    for rate, rtt in combos(results["peers"] + results["cells"], "rate", "rtt"):
        first = local_workload(results, results["meta"]["ram"][0], "workload_first_s")
        second = local_workload(results, results["meta"]["ram"][0])
        ram = results["meta"]["ram"][0]
        cells = [c for c in results["cells"] if (c["rate"], c["rtt"], c["ram"]) == (rate, rtt, ram)]
        a = next((c["site_a"] for c in cells if c["policy"] != "eager-writeback" and c.get("site_a")
                  and c["site_a"].get("status") == "ok"), None)
        if a:
            rows.append([link_name(rate, rtt), "isr (vulpes), site A: cold boot, demand fetch",
                         num(a.get("boot_s")), num(a.get("workload_a_s")), slowdown(a.get("workload_a_s"), first),
                         mib(a.get("t1_link_down_bytes")), "boot files fetched from the server (once per site)"])
        for cell in cells:
            if cell["policy"] in ("demand", "proactive") and ok(cell):
                rows.append([link_name(rate, rtt), f"isr (vulpes), site B: resume, {cell['policy']}",
                             num(cell.get("t4_responsive")), num(cell.get("workload_b_s")),
                             slowdown(cell.get("workload_b_s"), second),
                             mib((cell.get("t3_link_bytes") or 0) + cell.get("t4_link_bytes", 0)
                                 + cell.get("t5_link_bytes", 0)), "the guest's second run, after a resume"])
        for peer in results["peers"]:
            if (peer["rate"], peer["rtt"]) != (rate, rtt):
                continue
            if not ok(peer):
                rows.append([link_name(rate, rtt), peer["peer"], peer["status"], DASH, DASH, DASH, DASH])
                continue
            fetch = f" ({num(peer['fetch_s'])} of it downloads)" if peer.get("fetch_s") is not None else ""
            rows.append([link_name(rate, rtt), peer["peer"], num(peer.get("resume_s")) + fetch,
                         num(peer.get("workload_s")), slowdown(peer.get("workload_s"), first),
                         mib(peer.get("link_bytes")), str(peer.get("note") or "")])
    notes = "" if results["peers"] else "\n\nThe peers were not run in this run" + (
        f": {'; '.join(results['notes'])}" if results.get("notes") else "") + "."
    return ("The peers of issue 7 on site B's link in the same run (bench/peers.py: QEMU's curl block driver with "
            "a qcow2 overlay; nbdkit's curl plugin with its cache and retry filters, served to QEMU over NBD; a "
            "copy-in of the whole compressed image before boot, ISR-1 style), each through its own toxiproxy "
            "proxy with the same RTT to one nginx origin (HTTPS, HTTP/1.1), next to isr's own cold boot at site A "
            "and resumes at site B. Every system fetches the kernel and initramfs over the link too (the peers "
            "zstd-compressed, isr as sealed boot files). A peer boots the guest cold and runs the workload once, "
            "so its slowdown is against the local baseline's first run; isr's resumes at B are the guest's second "
            "run, against the second. MiB to the site: what crossed the site's veth towards it (headers "
            "included), for every row.\n\n"
            + header(results) + "\n\n" + table(head, rows) + notes)


def model(results: dict[str, Any]) -> str:
    head = ["link", "RAM (MiB)", "policy", "t4 (s): measured / predicted (ratio)",
            "t5 workload (s): measured / predicted (ratio)", "t3 (s)", "t2 (s)", "model inputs"]
    rows = []
    for cell in results["cells"]:
        pred = cell.get("prediction")
        if not ok(cell) or not pred:
            continue
        if "error" in pred:
            rows.append([link_name(cell["rate"], cell["rtt"]), str(cell["ram"]), cell["policy"],
                         f"model failed: {pred['error']}", DASH, DASH, DASH, DASH])
            continue
        a = cell.get("site_a") or {}
        p = pred["params"]
        rows.append([link_name(cell["rate"], cell["rtt"]), str(cell["ram"]), cell["policy"],
                     ratio(cell.get("t4"), pred["t4"]), ratio(cell.get("workload_b_s"), pred["workload_b_s"]),
                     ratio(cell.get("t3"), pred["t3"]) if cell.get("t3") is not None else DASH,
                     ratio(a.get("t2"), pred["t2"]),
                     f"{rate_text(p['bandwidth_bytes_s'] * 8 / 1e6)} Mbit/s, {p['rtt_s'] * 1000:g} ms, state "
                     f"{p['disk_size'] / MIB:.1f} + {p['memory_size'] / MIB:.1f} MiB"])
    body = ("The chunksim policy model (`tools/chunksim/policy.py`, `predict`; doc/chunksim.md) for each measured "
            "cell, with the bandwidth the link measured (bulk TCP goodput), the added RTT, 128 KiB chunks, launch "
            "1 s, a site B with nothing cached, and the trace of the same workload from the local baseline of this "
            "run (the second run, block-traced). State sizes as this ISR stores them: 'disk' is what the server "
            "holds for the version (disk and memory chunk objects, compressed and encrypted), 'memory' (what every "
            "policy needs before the VM starts) is the boot files plus the sealed device state. Predicted t5 = "
            "the local workload time + the model's demand-fetch stalls. What the model leaves out, so where a "
            "ratio far from 1 comes from: it moves a demand miss as a raw 128 KiB chunk (vulpes moves the "
            "compressed object), fetches one chunk at a time (vulpes overlaps them), and has no RAM faults after "
            "the resume (here the guest's RAM is demand-paged through vulpes; the model only knows a memory image "
            "moved before the VM starts). Its working set is the disk chunks of the local trace; the one `isr` "
            "records at site A spans the cold boot and the workload and holds the RAM chunks too, so eager-ws's t3 "
            "is far above the prediction. Its t2 moves the trace's dirty chunks (raw) plus the 'memory' above, "
            "where `isr suspend` uploads the dirty disk and RAM chunks: agreement there is partly a coincidence "
            "of sizes.")
    if not rows:
        return body + "\n\n" + header(results) + "\n\nNo cell had both a measurement and a prediction."
    return body + "\n\n" + header(results) + "\n\n" + table(head, rows)


# --- chunk size --------------------------------------------------------------------------------------------

def chunk_sizes(local_traces: dict[int, Trace]) -> dict[str, Any]:
    """Miss ratio and MiB fetched at 4 KiB..1 MiB for the stored traces and this run's local trace(s), under
    the papers' model (every chunk stored, fetch on write) and this ISR's (zero chunks not stored, whole-chunk
    writes not fetched)."""
    traces = [read_trace(path) for path in sorted(TRACES.glob("*.csv.zst"))] + list(local_traces.values())
    out: dict[str, Any] = {}
    for trace in traces:
        out[trace.name] = {
            model: [{"chunk": r.chunk_size, "miss_ratio": r.miss_ratio, "fetched": r.bytes_fetched,
                     "never_used": r.bytes_never_used, "upload": r.upload_bytes}
                    for r in sweep(trace, DEFAULT_SIZES, write_policy=policy, zero_chunks=zero)]
            for model, policy, zero in (("papers", "fetch", False), ("isr", "whole-no-fetch", True))}
        out[trace.name]["requests"] = len(trace.accesses)
    return {"status": "ok", "traces": out}


def chunk_table(data: dict[str, Any]) -> str:
    traces = data.get("traces") or {}
    intro = ("Demand fetch of block traces into a cold, infinite cache with chunks of 4 KiB to 1 MiB "
             "(`tools.chunksim.cache.sweep`, as `python -m tools.chunksim sizes` prints it; doc/chunksim.md), for "
             "the stored traces (`tools/chunksim/traces/`, whose README says how each was captured) and for this "
             "run's own block trace of the workload on the small guest (testwork-local-*, from the local "
             "baseline). Each cell: miss ratio / MiB fetched. The papers' model stores every chunk and fetches a "
             "chunk before writing to it (Dinero IV as in seed 001 §5.3 and seed 003 §5.4.1); this ISR's stores no "
             "all-zero chunk and writes whole chunks without fetching them.")
    if not traces:
        return intro + f"\n\nNot computed: {data.get('status', 'no traces')}."
    names = list(traces)
    parts = [intro]
    for model, label in (("papers", "The papers' model"), ("isr", "This ISR's model")):
        rows = []
        for i, size in enumerate(DEFAULT_SIZES):
            row = [format_size(size)]
            for name in names:
                r = traces[name][model][i]
                row.append(f"{r['miss_ratio']:.3f} / {r['fetched'] / MIB:.2f}")
            rows.append(row)
        head = ["chunk"] + [f"{n} ({traces[n]['requests']} requests)" for n in names]
        parts.append(f"{label}:\n\n" + table(head, rows))
    parts.append("What the papers concluded from the same kind of study (their curves are not in our copies):\n\n"
                 + "\n".join(f"- {s}" for s in CHUNK_SIZE_STUDIES))
    return "\n\n".join(parts)


# --- the seeds ----------------------------------------------------------------------------------------------

def ours(results: dict[str, Any], metric: str, policy: str, link_mbit: float | None) -> str:
    """This run's figure for a seed figure's metric, policy and link: the smallest RTT, the first RAM size."""
    cells = [c for c in results["cells"] if ok(c) and c["policy"] == policy and c["rate"] == link_mbit
             and c["ram"] == results["meta"]["ram"][0]]
    if not cells:
        return DASH
    cell = min(cells, key=lambda c: c["rtt"])
    local = local_workload(results, cell["ram"])
    where = f" (+{cell['rtt']} ms)" if cell["rtt"] else ""
    if metric == "resume":
        return f"{num(cell.get('t4'))} s; the guest answers after {num(cell.get('t4_responsive'))} s{where}"
    if metric == "benchmark":
        return f"{num(cell.get('workload_b_s'))} s, local {num(local)} s{where}"
    if metric == "slowdown" and local:
        return f"{(cell['workload_b_s'] - local) / local * 100:.1f} %{where}"
    return DASH


def seeds(results: dict[str, Any]) -> str:
    head = ["source", "what", "policy", "link", "the paper's figure", "ours (this run)", "note"]
    rows = []
    for f in FIGURES:
        what = {"resume": "resume latency", "benchmark": "benchmark running time", "slowdown": "slowdown"}[f.metric]
        rows.append([f"{f.seed} {f.where}", what, f.policy, f.link, f.value,
                     ours(results, f.metric, f.policy, f.link_mbit), f.note])
    times = [c["t4"] for c in results["cells"] if ok(c) and c.get("t4") is not None]
    spread = f" Our t4 ranged over {min(times):.1f}–{max(times):.1f} s (median {statistics.median(times):.1f})." \
        if times else ""
    return ("The seed papers' own figures, transcribed by hand from the OCR'd text (bench/seed_figures.py; "
            "numbers as printed, standard deviations in parentheses), next to this run's figure for the same "
            "policy and link rate (the smallest added RTT of the run, the first RAM size). Seed 003 ends a resume "
            "at 'the first instant that the user is able to interact with the VM', which is our 'the guest "
            "answers'; `isr resume` itself returns earlier. Not like for like: "
            "their guests were Windows XP desktops with 4 GB disks under VMware on 2003 hardware over Coda, "
            "their workloads ran for 10–20 minutes with think time, and their memory image was moved whole at "
            "resume; ours is a small Linux guest under TCG whose RAM is demand-paged, running a one-minute "
            f"workload without think time.{spread}\n\n"
            f"- {SEED_001}: {SETUPS['001']}\n- {SEED_003}: {SETUPS['003']}\n\n" + header(results) + "\n\n"
            + table(head, rows))


# --- several runs -------------------------------------------------------------------------------------------

def compare(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The cells both runs measured, before → after: resume, workload and what crossed the link, and the
    checkin and hoard throughput of the same cells."""
    def key(cell: dict[str, Any]) -> tuple[Any, ...]:
        return (cell["rate"], cell["rtt"], cell["ram"], cell["policy"])

    def pair(a: Any, b: Any, fmt: Any = num) -> str:
        return f"{fmt(a)} → {fmt(b)}"

    def fraction(run: dict[str, Any], nbytes: Any, seconds: Any, rate: float) -> str:
        value, good = mbit(nbytes, seconds), goodput(run, rate)
        return f"{value / good:.2f}" if value and good else DASH

    cells = [({key(c): c for c in run["cells"] if ok(c)}) for run in (before, after)]
    common = [k for k in cells[0] if k in cells[1]]
    head = ["link", "RAM (MiB)", "policy", "t4: isr resume (s)", "guest answers (s)", "t5 workload (s)",
            "slowdown vs local", "MiB to B in t4 + t5", "checkin ÷ goodput", "hoard ÷ goodput"]
    rows = []
    for k in common:
        b, a = cells[0][k], cells[1][k]
        slow = [c["workload_b_s"] / local if c.get("workload_b_s") and (local := local_workload(run, k[2])) else None
                for c, run in ((b, before), (a, after))]
        moved = [(c.get("t4_link_bytes") or 0) + (c.get("t5_link_bytes") or 0) for c in (b, a)]
        checkin = [fraction(run, (c.get("site_a") or {}).get("checkin_link_bytes"),
                            (c.get("site_a") or {}).get("checkin_s"), k[0]) for c, run in ((b, before), (a, after))]
        hoard = [fraction(run, c.get("t3_link_bytes"), c.get("t3"), k[0]) if c["policy"] == "proactive" else DASH
                 for c, run in ((b, before), (a, after))]
        rows.append([link_name(k[0], k[1]), str(k[2]), k[3], pair(b.get("t4"), a.get("t4")),
                     pair(b.get("t4_responsive"), a.get("t4_responsive")),
                     pair(b.get("workload_b_s"), a.get("workload_b_s")),
                     pair(slow[0], slow[1], lambda v: f"{v:.2f}×" if v else DASH), pair(moved[0], moved[1], mib),
                     f"{checkin[0]} → {checkin[1]}", f"{hoard[0]} → {hoard[1]}"])
    return ("Two runs of `bench/matrix.py` with the same options, one on the code before a change and one after, "
            "each with its own local baseline and link goodput, one after the other on the same machine: each "
            "cell's figure before → after. One trial each (see 'isr: run-to-run spread' for how far two trials "
            "of a cell can differ).\n\n"
            f"- before: {header(before)}\n- after: {header(after)}\n\n" + table(head, rows))


def spread(runs: list[dict[str, Any]]) -> str:
    """The cells that every run measured, side by side: how far one trial of a cell is from another."""
    def key(cell: dict[str, Any]) -> tuple[Any, ...]:
        return (cell["rate"], cell["rtt"], cell["ram"], cell["policy"])

    by_run = [{key(c): c for c in run["cells"] if ok(c)} for run in runs]
    common = [k for k in by_run[0] if all(k in other for other in by_run[1:])]
    intro = ("The cells that each of these runs of `bench/matrix.py` measured, side by side, each run with its own "
             "local baseline: one trial of a cell against another, on the same machine and code. The "
             "spread is the largest over the smallest.\n\n")
    runs_text = "\n".join(f"- run {i + 1}: " + header(run) for i, run in enumerate(runs))
    if not common:
        return intro + runs_text + "\n\nNo cell was measured by every run."

    def series(values: list[Any]) -> str:
        if any(v is None for v in values):
            return DASH
        text = " / ".join(f"{v:.1f}" for v in values)
        return f"{text} ({max(values) / min(values):.2f})" if min(values) > 0 else text

    head = ["link", "RAM (MiB)", "policy", "t4 until the guest answers (s): runs (spread)",
            "t5 workload (s): runs (spread)", "slowdown vs local: runs"]
    rows = []
    for k in common:
        cells = [run[k] for run in by_run]
        slow = " / ".join(
            f"{c['workload_b_s'] / local:.2f}×" if c.get("workload_b_s") and (local := local_workload(run, k[2]))
            else DASH for c, run in zip(cells, runs))
        rows.append([link_name(k[0], k[1]), str(k[2]), k[3], series([c.get("t4_responsive") for c in cells]),
                     series([c.get("workload_b_s") for c in cells]), slow])
    return intro + runs_text + "\n\n" + table(head, rows)
