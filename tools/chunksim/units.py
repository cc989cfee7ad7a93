"""Parse and print the quantities the command line deals in: sizes, bandwidths, durations.

Sizes are binary (``4K`` = 4096 bytes, ``1M`` = 1 MiB), like chunk sizes and images. Bandwidths are decimal
bits per second unless they say bytes (``10M`` = ``10Mbit`` = 10,000,000 bit/s, ``1.25MB/s`` = 1,250,000
bytes/s), like the papers' "10 Mb/s". Durations take ``us``, ``ms``, ``s``, ``min`` (plain numbers are
seconds).
"""
from __future__ import annotations

import re

from .errors import ModelError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)\s*(bit/s|bits/s|bit|bps|b/s|b|B/s|B|Bps)?\s*$")
_TIME = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|µs|ms|s|sec|min)?\s*$", re.IGNORECASE)
_BINARY = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SECONDS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "min": 60.0}


def parse_size(text: str) -> int:
    """``"128K"`` -> 131072. Binary multiples; a trailing ``B`` or ``iB`` is allowed."""
    match = _SIZE.match(text)
    if match is None:
        raise ModelError(f"size {text!r} is not a number of bytes such as 4096, 128K, 1M or 4G")
    value = float(match.group(1)) * _BINARY[match.group(2).lower()]
    if value != int(value):
        raise ModelError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def parse_bandwidth(text: str) -> float:
    """``"10M"`` -> 1,250,000.0 bytes/s (10 Mbit/s). Returns bytes per second."""
    match = _RATE.match(text)
    if match is None:
        raise ModelError(f"bandwidth {text!r} is not a rate such as 100M, 10Mbit, 1M or 1.25MB/s")
    value = float(match.group(1)) * _DECIMAL[match.group(2).lower()]
    unit = match.group(3) or "bit"
    per_second = value if unit in ("B", "B/s", "Bps") else value / 8
    if per_second <= 0:
        raise ModelError(f"bandwidth {text!r} must be more than zero")
    return per_second


def parse_duration(text: str) -> float:
    """``"50ms"`` -> 0.05 (seconds)."""
    match = _TIME.match(text)
    if match is None:
        raise ModelError(f"duration {text!r} is not a time such as 50ms, 2s or 1.5 (seconds)")
    return float(match.group(1)) * _SECONDS[(match.group(2) or "s").lower()]


def format_size(n: float) -> str:
    """4096 -> '4K', 1048576 -> '1M' (chunk sizes); other values with one decimal."""
    for suffix, factor in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= factor:
            q = n / factor
            return f"{q:.0f}{suffix}" if q == int(q) else f"{q:.1f}{suffix}"
    return f"{n:.0f}"


def format_bandwidth(bytes_per_second: float) -> str:
    bits = bytes_per_second * 8
    for suffix, factor in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= factor:
            return f"{bits / factor:g} {suffix}"
    return f"{bits:g} bit/s"
