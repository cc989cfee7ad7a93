"""Only `human_size` is left here, for server/web/templates.py until it imports the project's one byte-count
formatter, `isrprogress.human_bytes`, itself; the progress bars are `isrprogress`'s."""
from __future__ import annotations

from isrprogress import human_bytes as human_size

__all__ = ["human_size"]
