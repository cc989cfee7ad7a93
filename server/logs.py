"""Where isr-server logs: lines on stderr for every worker, and the audit trail in a file of its own."""
from __future__ import annotations

import logging
import sys

from .config import Config


def setup_logging(config: Config | None = None, level: int = logging.INFO) -> None:
    """Log to stderr; audit lines also go to ``server.audit_log`` if set. Idempotent."""
    root = logging.getLogger("server")
    if not getattr(root, "_isr_configured", False):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
        root.addHandler(handler)
        root.setLevel(level)
        root.propagate = False
        root._isr_configured = True  # type: ignore[attr-defined]
    audit = logging.getLogger("server.audit")
    if config is not None and config["server.audit_log"] and not getattr(audit, "_isr_file", False):
        audit_file = logging.FileHandler(config["server.audit_log"])
        audit_file.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        audit.addHandler(audit_file)
        audit._isr_file = True  # type: ignore[attr-defined]
