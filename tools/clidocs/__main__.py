"""python -m tools.clidocs SHARE: write the manual pages and the bash and zsh completions of isr, isr-admin and
isr-server below SHARE (laid out as /usr/share or /usr/local/share is)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from importlib import metadata
from pathlib import Path

from . import PROGRAMS
from .completion import completion
from .manpage import manpage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.clidocs", description=__doc__)
    parser.add_argument("share", type=Path, help="where to write: man/man1/, bash-completion/completions/ and the "
                                                 "zsh directory below it (e.g. build/share or /usr/local/share)")
    parser.add_argument("--zsh-dir", default="zsh/site-functions", metavar="DIR",
                        help="the zsh functions directory below SHARE (default %(default)s; a Debian package's "
                             "is zsh/vendor-completions)")
    args = parser.parse_args(argv)
    version = metadata.version("isr")
    epoch = os.environ.get("SOURCE_DATE_EPOCH")  # reproducible builds: the date of the source, not of today
    date = time.strftime("%Y-%m-%d", time.gmtime(int(epoch))) if epoch else ""
    written = []
    for name, (build, summary) in PROGRAMS.items():
        program = build()
        others = tuple(other for other in PROGRAMS if other != name)
        files = {Path("man/man1") / f"{name}.1": manpage(program, summary, version, date, others),
                 Path("bash-completion/completions") / name: completion(program, "bash"),
                 Path(args.zsh_dir) / f"_{name}": completion(program, "zsh")}
        for relative, text in files.items():
            path = args.share / relative
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            except OSError as e:
                print(f"python -m tools.clidocs: cannot write {path}: {e.strerror}", file=sys.stderr)
                return 1
            written.append(path)
    print(f"wrote {len(written)} files below {args.share}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
