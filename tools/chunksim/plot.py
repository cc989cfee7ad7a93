"""The chunk-size figure, in the manner of seed 003 Figure 7 / seed 001 Fig. 3: a PNG with two panels.

Left, the miss ratio against chunk size; right, the megabytes fetched (solid) and fetched but never used
(dashed) against chunk size; one line per trace, chunk size on a log-2 axis from 4 KB to 1 MB. Only this
module knows matplotlib (and uses its file-only Agg back end, so no display is needed).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from .cache import SizeResult
from .units import format_size

MB = 1 << 20


def plot_sizes(results: Mapping[str, Sequence[SizeResult]], dest: Path, *, title: str | None = None) -> Path:
    """Draw ``results`` (trace name -> one `SizeResult` per chunk size) to the PNG file ``dest``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_miss, ax_bytes) = plt.subplots(1, 2, figsize=(11, 4.8), constrained_layout=True)
    sizes: set[int] = set()
    for index, (name, rows) in enumerate(results.items()):
        color = f"C{index % 10}"
        xs = [r.chunk_size for r in rows]
        sizes.update(xs)
        ax_miss.plot(xs, [r.miss_ratio for r in rows], marker="o", color=color, label=name)
        ax_bytes.plot(xs, [r.bytes_fetched / MB for r in rows], marker="o", color=color)
        ax_bytes.plot(xs, [r.bytes_never_used / MB for r in rows], marker="x", linestyle="--", color=color)
    ticks = sorted(sizes)
    for ax in (ax_miss, ax_bytes):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks)
        ax.set_xticklabels([format_size(t) for t in ticks])
        ax.set_xlabel("chunk size")
        ax.grid(True, which="major", alpha=0.3)
    ax_miss.set_ylabel("miss ratio (misses / chunk references)")
    ax_miss.set_ylim(bottom=0)
    ax_miss.set_title("miss ratio")
    ax_bytes.set_ylabel("MB")
    ax_bytes.set_ylim(bottom=0)
    ax_bytes.set_title("MB fetched (solid, o) and fetched but never used (dashed, x)")
    # One legend for both panels, under them: a colour per trace.
    handles, labels = ax_miss.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 4), fontsize="small")
    if title:
        fig.suptitle(title)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dest, format="png", dpi=110)
    plt.close(fig)
    return dest
