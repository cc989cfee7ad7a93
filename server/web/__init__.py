"""The web pages of isr-server (sign-in, My parcels, releasing a lock, administration); see `pages`."""
from __future__ import annotations

from .pages import WebPages

__all__ = ["WebPages"]
