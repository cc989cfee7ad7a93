"""The manual pages and shell completions of `isr`, `isr-admin` and `isr-server`, made from their argparse
parsers, so that they can never disagree with `--help`.

``python -m tools.clidocs SHARE`` writes them laid out as a ``share/`` directory (``man/man1/isr.1``,
``bash-completion/completions/isr``, ``zsh/site-functions/_isr``, ...); `./bootstrap setup` installs them
from ``build/share`` into /usr/local/share, and a package build can write them into its own tree.
`manpage` renders roff from a parser, `completion` asks shtab for the bash and zsh scripts.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

from isrctl.cli import build_parser as isr_parser
from server.admin import build_parser as admin_parser
from server.main import build_parser as server_parser

#: Each program with its parser and the one-line summary of its manual page's NAME section.
PROGRAMS: dict[str, tuple[Callable[[], argparse.ArgumentParser], str]] = {
    "isr": (isr_parser, "suspend your PC at one machine and resume it at another"),
    "isr-admin": (admin_parser, "manage an ISR server's users, parcels, versions, locks and storage"),
    "isr-server": (server_parser, "serve ISR parcels over HTTPS"),
}
