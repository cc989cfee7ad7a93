"""``python -m tools.guest``: build the test guest, say where it is, or boot it.

    python -m tools.guest build [--variant small|big|diskboot|diskboot-uefi] [--force]
    python -m tools.guest path  [--variant V]          # JSON: kernel, initrd, disk, expected, ...
    python -m tools.guest boot  [--variant V] [--disk IMG] [--workload] [-c CMD]... [--accel tcg|kvm]

``boot`` boots a throwaway copy of the variant's disk (or ``--disk IMG`` itself), runs the workload and/or
the commands given with ``-c``, or else reads command lines from stdin, and powers the guest off.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from isrctl.errors import IsrError

from .boot import booted_guest
from .build import DEFAULT_VARIANT, VARIANTS, build
from .disk import copy_disk
from .errors import GuestError

log = logging.getLogger("tools.guest")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.guest", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    for action, text in (("build", "build the guest (unless cached)"),
                         ("path", "print the artifacts' paths as JSON (building if needed)"),
                         ("boot", "boot the guest and run commands in it")):
        p = sub.add_parser(action, help=text)
        p.add_argument("--variant", choices=sorted(VARIANTS), default=DEFAULT_VARIANT)
        if action == "build":
            p.add_argument("--force", action="store_true", help="rebuild even if cached")
        if action == "boot":
            p.add_argument("--disk", type=Path, help="boot this image (it is written to!) instead of a copy")
            p.add_argument("--workload", action="store_true", help="run /data/workload/run.sh")
            p.add_argument("-c", "--command", action="append", default=[], help="run this shell command")
            p.add_argument("--accel", choices=("tcg", "kvm"), default="tcg")
            p.add_argument("--timeout", type=float, default=600.0, help="per-command limit in seconds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="guest: %(message)s", stream=sys.stderr)
    # qemu.qmp reports the monitor hanging up after "quit" at INFO level; that is expected, not news.
    logging.getLogger("qemu.qmp").setLevel(logging.WARNING)

    try:
        if args.action == "build":
            artifacts = build(args.variant, force=args.force)
            print(artifacts.directory)
        elif args.action == "path":
            artifacts = build(args.variant)
            print(json.dumps(artifacts.to_json(), indent=2))
        else:
            return _boot(args)
    except (GuestError, IsrError) as exc:
        print(f"python -m tools.guest: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _boot(args: argparse.Namespace) -> int:
    artifacts = build(args.variant)
    with tempfile.TemporaryDirectory(prefix="isr-guest-") as tmp:
        run_dir = Path(tmp)
        disk = args.disk if args.disk else copy_disk(artifacts.disk, run_dir / "disk.img")
        failed = 0
        with booted_guest(artifacts, disk, run_dir=run_dir, accel=args.accel) as guest:
            if args.workload:
                started = time.monotonic()
                fields = guest.console.run_workload(args.timeout)
                print(" ".join(f"{k}={v}" for k, v in fields.items()))
                expected = artifacts.expected
                good = (int(fields["files"]) == expected.files and int(fields["matches"]) == expected.matches
                        and fields["digest"] == expected.digest)
                print(f"workload {'matches' if good else 'DOES NOT MATCH'} the host's expectation "
                      f"({time.monotonic() - started:.1f} s)", file=sys.stderr)
                failed |= not good
            commands = args.command or ([] if args.workload else _stdin_commands())
            for command in commands:
                status, output = guest.console.run(command, args.timeout)
                sys.stdout.write(output)
                if status:
                    print(f"[exit status {status}]", file=sys.stderr)
                    failed = 1
                sys.stdout.flush()
            guest.console.request_poweroff()
            guest.vm.wait(60)
        return 1 if failed else 0


def _stdin_commands() -> Iterator[str]:
    """Command lines from stdin, with a prompt when it is a terminal."""
    while True:
        if sys.stdin.isatty():
            print("guest# ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


if __name__ == "__main__":
    sys.exit(main())
