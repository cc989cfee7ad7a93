"""Shell completion scripts (bash and zsh) from a parser, by shtab (the only importer of shtab).

Hidden options (the old names kept as aliases, help=SUPPRESS) are not offered.
"""
from __future__ import annotations

import argparse

import shtab

SHELLS = ("bash", "zsh")


def completion(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script of ``parser`` for ``shell`` (one of `SHELLS`)."""
    return str(shtab.complete(parser, shell=shell))
