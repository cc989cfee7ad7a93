"""Where isr-server logs: lines on stderr for every worker, and the audit trail in a file of its own."""
from __future__ import annotations

import logging
import sys

from .config import Config

# The names of the handlers setup_logging adds: seeing one on its logger means that part is already done.
_STDERR_HANDLER = "isr-stderr"
_AUDIT_HANDLER = "isr-audit-file"


def setup_logging(config: Config | None = None, level: int = logging.INFO) -> None:
    """Log to stderr; audit lines also go to ``server.audit_log`` if set. Idempotent."""
    root = logging.getLogger("server")
    if not any(h.name == _STDERR_HANDLER for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.name = _STDERR_HANDLER
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
        root.addHandler(handler)
        root.setLevel(level)
        root.propagate = False
    audit = logging.getLogger("server.audit")
    if config is not None and config["server.audit_log"] and not any(h.name == _AUDIT_HANDLER for h in audit.handlers):
        audit_file = logging.FileHandler(config["server.audit_log"])
        audit_file.name = _AUDIT_HANDLER
        audit_file.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        audit.addHandler(audit_file)
