"""Amounts, rates and durations as people read them: the one place the project turns byte counts into text."""
from __future__ import annotations

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float | None) -> str:
    """A byte count for people: 812 -> '812 B', 1536 -> '1.5 KiB'; None (not known) -> '-'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in _BYTE_UNITS:
        if abs(value) < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_amount(n: float, unit: str) -> str:
    """An amount of ``unit``: bytes as `human_bytes`, anything else counted ('12 chunks')."""
    return human_bytes(n) if unit == "B" else f"{n:.0f} {unit}"


def human_rate(per_second: float, unit: str) -> str:
    """A rate of ``unit`` per second: '2.4 MiB/s', '3.5 chunks/s'."""
    if unit == "B":
        return f"{human_bytes(per_second)}/s"
    return f"{per_second:.1f} {unit}/s" if per_second < 10 else f"{per_second:.0f} {unit}/s"


def human_duration(seconds: float) -> str:
    """A duration to the second: '9s', '4m05s', '2h03m'."""
    seconds = max(0.0, round(seconds))
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"
