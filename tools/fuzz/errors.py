"""The one exception root of tools.fuzz."""
from __future__ import annotations


class FuzzError(Exception):
    """A harness cannot be built or run (not a finding: findings are reported, not raised)."""
