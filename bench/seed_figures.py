"""The seed papers' own figures, transcribed by hand for bench/matrix.py to print beside this ISR's.

Nothing here is measured: every number is copied from the OCR'd text in ../shared/seeds/ and says where it
comes from. Standard deviations are in parentheses as the papers print them. The papers' hardware, links and
workloads differ from ours (see SETUPS), so compare the shape (which policy wins by how much, how things
scale with bandwidth), not absolute seconds.
"""
from __future__ import annotations

from dataclasses import dataclass

SEED_001 = "seed 001 (Satyanarayanan, Kozuch et al., Towards Seamless Mobility on Pervasive Hardware: ISR-3)"
SEED_003 = "seed 003 (Kozuch, Satyanarayanan et al., Efficient State Transfer for Internet Suspend/Resume)"

SETUPS = {
    "001": ("ISR-3 on Coda. Clients: 2.0 GHz Pentium 4, 1 GB RAM, RedHat 7.3, VMware Workstation 3.1, 8 GB Coda "
            "cache; server: 1.2 GHz Pentium III Xeon; 100 Mb/s Ethernet through the NISTNet emulator (no added "
            "latency at 100 and 10 Mb/s, 10 ms at 1 Mb/s, 100 ms at 100 Kb/s). Guest: Windows XP, 256 MB RAM, "
            "4 GB disk. Workload: CDA, 113 timed Microsoft Office operations with ~10 s of think time between "
            "them; 1071 s (10) with think time, 93 s (6) without, on a local disk without ISR (Table 2). Chunks "
            "of 128 KB. The memory image moved at a demand-fetch resume is compressed, about 41 MB (§6.7.2). "
            "Mean of three trials."),
    "003": ("Coda 5.3.19 on RedHat 7.2 / Linux 2.4.18: 2.0 GHz Pentium 4 clients with 1 GB, VMware Workstation "
            "3.1, 8 GB Coda cache; 1.2 GHz Pentium III Xeon servers; 100 Mb/s Ethernet, no emulated limit "
            "(§5.4). Guest: 4 GB disk, 256 MB RAM whose image is stored gzip-compressed (62-142 MB, Figure 9). "
            "Resumed from snapshot s1, half way through each benchmark: SOP and SICC (Sysmark 2002 office and "
            "internet content creation), RSD (a developer unpacking, configuring, building and grepping Sphinx "
            "under Cygwin, 10 s think time, 640 s). Chunks of 256 KB. Mean of three trials."),
}


@dataclass(frozen=True)
class SeedFigure:
    """One number from a seed paper."""

    seed: str            # "001" or "003"
    where: str           # table or figure, as the paper numbers it
    metric: str          # "resume" (seconds), "benchmark" (seconds), "slowdown" (percent)
    policy: str          # this ISR's policy name for it
    link: str            # as the paper says it
    link_mbit: float | None
    value: str           # as printed, with the standard deviation
    note: str = ""


#: seed 001's four emulated links (§6.3).
LINKS_001 = (("100 Mb/s", 100.0), ("10 Mb/s", 10.0), ("1 Mb/s", 1.0), ("100 Kb/s", 0.1))


def _by_link(where: str, metric: str, policy: str, values: tuple[str | None, ...],
             notes: dict[int, str] | None = None) -> tuple[SeedFigure, ...]:
    """One seed 001 table or paragraph: a value per link of LINKS_001, in order (None: not given)."""
    return tuple(SeedFigure("001", where, metric, policy, link, mbit, value, (notes or {}).get(i, ""))
                 for i, ((link, mbit), value) in enumerate(zip(LINKS_001, values)) if value is not None)


FIGURES: tuple[SeedFigure, ...] = (
    # seed 001, Table 3: resume latency, baseline (100 and 10 Mb/s measured; 1 Mb/s and 100 Kb/s estimated
    # by dividing the total VM state by the nominal bandwidth).
    *_by_link("Table 3", "resume", "baseline", ("2504 (18) s", "5158 (34) s", "> 9 h", "> 90 h"),
              {2: "estimated, not measured", 3: "estimated, not measured"}),
    # Table 4: CDA running time under baseline (applies to fully proactive too, §6.6.2); slowdowns in §6.5.2.
    *_by_link("Table 4", "benchmark", "baseline", (
        "1105 (9) s; no think 113 (2) s", "1170 (47) s; no think 168 (47) s", "1272 (65) s; no think 204 (56) s",
        "1409 (38) s; no think 251 (24) s")),
    *_by_link("§6.5.2", "slowdown", "baseline", ("3.2 %", "9.2 %", "18.8 %", "31.6 %")),
    # Table 5: resume latency, fully proactive.
    *_by_link("Table 5", "resume", "proactive", ("10.3 (0.1) s", "10.2 (0.0) s", "10.2 (0.0) s", "11.4 (0.0) s")),
    # Table 6: resume latency, pure demand-fetch (the ~41 MB compressed memory image is moved at resume).
    *_by_link("Table 6", "resume", "demand", ("14 (0.5) s", "39 (0.4) s", "317 (0.3) s", "4301 (0.6) s"),
              {0: "OCR'd as '14 Q0.5)'", 1: "OCR'd as '390.4)'"}),
    # Table 7: CDA running time under pure demand-fetch; slowdowns in §6.7.2.
    *_by_link("Table 7", "benchmark", "demand", (
        "1160 (5.6) s; no think 173 (9.5) s", "1393 (20.1) s; no think 370 (14) s",
        "4722 (69) s; no think 2688 (39) s", "4600 (918) s; no think 30531 (1490) s"),
        {3: "as OCR'd; the first number cannot be right (it is below its own no-think time) and the text calls "
            "the slowdown 'well over an order of magnitude'"}),
    *_by_link("§6.7.2", "slowdown", "demand", ("8.3 %", "30.1 %", "340.9 %", None)),
    # seed 003, Figure 8: resume latency from snapshot s1 over 100 Mb/s Ethernet (SOP / SICC / RSD).
    SeedFigure("003", "Figure 8", "resume", "baseline", "100 Mb/s LAN", 100,
               "SOP 2060 (29), SICC 2020 (82), RSD 2034 (23) s"),
    SeedFigure("003", "Figure 8", "resume", "proactive", "100 Mb/s LAN", 100,
               "SOP 2.5 (0.15), SICC 2.5 (0.14), RSD 3 (0.02) s", "warm cache: only the VMM launch"),
    SeedFigure("003", "Figure 8", "resume", "demand", "100 Mb/s LAN", 100,
               "SOP 27 (1.9), SICC 33 (5.1), RSD 18 (1.0) s", "the compressed memory image (62-142 MB) + launch"),
    # Figure 10: RSD's total running time (SOP and SICC report average operation response times instead).
    SeedFigure("003", "Figure 10", "benchmark", "baseline", "100 Mb/s LAN", 100, "RSD 640 (56) s",
               "same for fully proactive"),
    SeedFigure("003", "Figure 10", "benchmark", "demand", "100 Mb/s LAN", 100, "RSD 660 (18) s",
               "3 % over baseline"),
)

#: The chunk-size studies, whose curves did not survive in our copies of the papers.
CHUNK_SIZE_STUDIES = (
    "seed 001 §5.3 and Fig. 3: a Sysmark trace of the disk blocks VMware fetched, replayed in an adapted "
    "Dinero IV cache simulator for several chunk sizes (miss ratio and bandwidth): '128 KB strikes a reasonable "
    "balance between bandwidth wastage and miss ratio'.",
    "seed 003 §5.4.1 and Figure 7: the same method on the two Sysmark benchmarks, demand fetch into a cache "
    "large enough for every chunk: 256 KB chosen 'to strike a balance between the miss rate and wasted "
    "bandwidth'.",
)
