"""The client's names for the project's progress layer, `isrprogress` (rich bars on a terminal, plain lines
elsewhere, JSON lines between processes). cli.py and session.py import them from here; other modules
import `isrprogress` itself."""
from __future__ import annotations

from isrprogress import (
                         JsonReporter,
                         LogReporter,
                         NullReporter,
                         Progress,
                         Replayer,
                         Reporter,
                         TerminalReporter,
                         human_bytes,
)

__all__ = ["JsonReporter", "LogReporter", "NullReporter", "Progress", "Replayer", "Reporter", "TerminalReporter",
           "human_bytes"]
