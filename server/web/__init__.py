"""The web pages of isr-server (sign-in, My parcels, releasing a lock, administration): the handlers in
`pages`, the templates and their filters in `render` and ``templates/``, cookies and CSRF in `sessions`."""
from __future__ import annotations

from .pages import WebPages

__all__ = ["WebPages"]
