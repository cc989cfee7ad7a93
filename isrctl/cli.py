"""``isr``: suspend your PC at one machine and resume it at another.

This module only parses: each subcommand is a function ``cmd_<name>(args) -> int`` in `isrctl.commands`
(one module per family), which prints and leaves the work to the module that owns it. `main` imports the
one module the command line names and runs it (so that a command loads only what it uses: the start of
`isr hoard` and `isr suspend` counts against their throughput), and is the only place that turns an
exception into a one-line message and an exit code:

    0 success, 1 error, 2 usage, 3 the parcel is locked by someone else, 4 this site's lock was broken,
    130 interrupted.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Any

from parcels.errors import ParcelError

from . import config as configmod
from . import policy as policymod
from .console import DETACH_NAME
from .control import POWEROFF_WAIT
from .display import VIEWERS
from .errors import IsrError, LockBroken, LockRefused

log = logging.getLogger("isrctl")

EXIT_ERROR, EXIT_USAGE, EXIT_LOCKED, EXIT_LOCK_BROKEN, EXIT_INTERRUPTED = 1, 2, 3, 4, 130

DESCRIPTION = """\
Internet Suspend/Resume: your whole PC is a virtual machine (a "parcel") kept encrypted on an ISR server.
Resume it at any PC, work, suspend it, and resume it somewhere else exactly where you left off.

A typical day:
  isr login https://isr.example.org:8443 --user alice --fingerprint sha256:9a81...
  isr ls                       your parcels, their versions, who holds each lock
  isr resume laptop            take the lock, fetch what is needed, run the VM (Ctrl-C suspends)
  isr suspend laptop           (from another terminal) save it and check in a new version
  ...at home:
  isr hoard laptop             optional: fetch it ahead of time (t3), so the resume is instant
  isr resume laptop --policy proactive
  ...or let your calendar say when, without the key (`isr schedule --help`):
  isr site add --location "Lab 4"; isr schedule calendar add ~/work.ics; isr schedule run
"""


EPILOG = """\
Policies (isr resume --policy; the ISR timeline t1..t5 is in doc/isrctl.md):
  baseline         fetch everything before the VM starts (long resume, no slowdown)
  proactive        everything was hoarded earlier with `isr hoard`; resume just launches the VM
  demand           start at once, fetch chunks on first touch (short resume, some slowdown)
  lazy-ws          demand, plus hoard the last working set in the background
  eager-ws         the working set was hoarded earlier with `isr hoard --working-set`
  eager-writeback  demand, plus trickle dirty chunks to the server while you work

Files: ~/.config/isr/config.toml, ~/.local/share/isr/ (token, parcel state), ~/.cache/isr/chunks
(XDG_CONFIG_HOME, XDG_DATA_HOME, XDG_CACHE_HOME and XDG_RUNTIME_DIR are honored).

Exit status: 0 done, 1 failed (one line on stderr says why and what to do), 2 usage, 3 the parcel is locked
by someone else, 4 this site's lock was broken, 130 interrupted. --json results: doc/isrctl.md.
"""


class _Version(argparse.Action):
    """``--version``: the version is looked up only when asked (importlib.metadata and the lookup took 10-20 ms,
    more than building the whole parser)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, default: Any = argparse.SUPPRESS,
                 help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from importlib import metadata

        print(f"{parser.prog} {metadata.version('isr')}")
        parser.exit()


def command_function(name: str) -> Any:
    """The function a subcommand runs, from its ``"module.cmd_name"`` in the parser: only now is its module
    (`isrctl.commands.<module>`, and with it what that command uses) imported."""
    module, _, function = name.rpartition(".")
    return getattr(importlib.import_module(f"{__package__}.commands.{module}"), function)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="isr", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (to stderr)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    parser.add_argument("--version", action=_Version, help="print the version (the project's, in VERSION) and exit")
    parser.set_defaults(func=None)  # no command: `main` prints this help
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def cmd(name: str, func: str, help_text: str, description: str | None = None) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=description or help_text,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(func=func)
        return p

    def json_result(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout (shapes "
                                                            "in doc/isrctl.md); messages and progress go to stderr")

    def credentials(p: argparse.ArgumentParser, new: bool = False) -> None:
        """--passphrase-file, --passphrase-env, --key-file (and with ``new`` the --new-... ones); the same
        names and sources as isr-admin's. --keyfile and --new-keyfile, the names before issue 18, are hidden."""
        prefix, what = ("new-", "the new") if new else ("", "the parcel")
        group = p.add_argument_group(f"{what} credential (default: ask on the terminal)").add_mutually_exclusive_group()
        group.add_argument(f"--{prefix}passphrase-file", metavar="FILE|-",
                           help=f"take {what} passphrase from this file ('-': a line of stdin"
                                + (", after the old one's)" if new else ")"))
        group.add_argument(f"--{prefix}passphrase-env", metavar="VAR", help=f"take {what} passphrase from this variable")
        group.add_argument(f"--{prefix}key-file", metavar="FILE",
                           help="protect the parcel with a new key file written here" if new
                           else "the parcel is protected by this key file")
        group.add_argument(f"--{prefix}keyfile", dest=f"{prefix.replace('-', '_')}key_file", help=argparse.SUPPRESS)

    p = cmd("login", "account.cmd_login", "log in to an ISR server and remember it",
            "Log in to an ISR server. The server's certificate is pinned by the fingerprint isr-server printed\n"
            "at start-up (checked before the password is sent); the token is kept in ~/.local/share/isr/token.")
    p.add_argument("url", help="the server, https://HOST:PORT")
    p.add_argument("--user", required=True, help="your user name on the server")
    p.add_argument("--fingerprint", required=True, metavar="sha256:HEX", help="the server certificate's fingerprint")
    p.add_argument("--site", help="a name for this site, shown to others in lock information (default: host name)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--password-file", metavar="FILE|-",
                       help="take the password from this file ('-': the first line of stdin)")
    group.add_argument("--password-env", metavar="VAR", help="take the password from this variable")
    p.add_argument("--accel", choices=configmod.ACCELERATORS, default="tcg",
                   help="default accelerator for resumes here (kvm is used only where a probe boot works)")
    p.add_argument("--cache-limit", metavar="SIZE",
                   help="bound this PC's chunk cache, e.g. 20G (least recently used chunks are evicted; chunks not "
                        "yet uploaded never are); default: no limit")

    cmd("logout", "account.cmd_logout", "revoke and forget the token")

    p = cmd("ls", "parcels.cmd_ls", "list your parcels, their versions and locks")
    p.add_argument("-l", "--long", action="store_true", help="also list every version")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = cmd("checkout", "parcels.cmd_checkout", "take the lock and fetch the current version's metadata",
            "Take the parcel's lock and fetch the current version's manifest, keyrings and device state into\n"
            "this site's state (chunks come later, on demand or with `isr hoard`).")
    p.add_argument("parcel", help="parcel name or UUID")
    json_result(p)
    credentials(p)

    p = cmd("resume", "session.cmd_resume", "run the parcel's VM here (Ctrl-C suspends)",
            "Take the lock, fetch what the policy needs, and resume the VM exactly where it was suspended\n"
            "(or boot it if it was powered off). Runs until suspended: Ctrl-C, `isr suspend`, or the guest\n"
            "powering off. With --detach it returns once the guest runs. Of a VM that is running here and\n"
            "paused because the chunk cache was full: continue it (after space was freed).", )
    p.add_argument("parcel", help="parcel name or UUID")
    p.add_argument("--policy", default=policymod.DEFAULT, choices=list(policymod.POLICIES),
                   help=f"state-transfer policy (default {policymod.DEFAULT}; see `isr --help`)")
    p.add_argument("--writeback", action="store_true", help="trickle dirty chunks to the server while running")
    p.add_argument("--writeback-rate", default="4M", metavar="RATE",
                   help="trickle rate in bytes/s, e.g. 500K, 4M, 0 = unlimited (default 4M)")
    p.add_argument("--disconnected", action="store_true",
                   help="never contact the server (needs `isr checkout` and a full `isr hoard` first)")
    p.add_argument("--detach", action="store_true", help="return once the guest runs; the session keeps going")
    p.add_argument("--vnc", default="auto", metavar="WHERE",
                   help="VNC display: auto (first free 127.0.0.1:N), unix (a socket in the runtime dir), "
                        "none, or a QEMU -vnc argument such as 127.0.0.1:3 (one not on loopback gets a password)")
    p.add_argument("--accel", choices=configmod.ACCELERATORS, help="accelerator (default from config: tcg)")
    p.add_argument("--lookaside", action="append", default=[], metavar="DIR",
                   help="look for chunks in this directory (e.g. a USB disk) before the server; repeatable")
    p.add_argument("--no-checkin", action="store_true",
                   help="if the guest powers itself off, keep the result local instead of checking it in")
    json_result(p)
    credentials(p)

    p = cmd("suspend", "session.cmd_suspend", "suspend the running VM and check in a new version",
            "Stop the VM, save its device state, make its disk and RAM images durable, quit QEMU, and check\n"
            "in a new version (releasing the lock) unless --no-checkin.")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID (default: the only running one)")
    p.add_argument("--no-checkin", action="store_true", help="keep the new state here (and the lock)")
    json_result(p)

    p = cmd("checkin", "session.cmd_checkin", "upload local changes as a new version and release the lock")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID (default: the only one here)")
    json_result(p)
    credentials(p)

    p = cmd("sync", "session.cmd_sync", "upload local changes as a new version and keep the lock",
            "Upload local changes as a new version and keep the lock. Of a VM running here: upload the chunks\n"
            "it wrote, so that a full chunk cache may drop them (its suspend commits the version).")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID (default: the only one here)")
    json_result(p)
    credentials(p)

    p = cmd("discard", "parcels.cmd_discard", "drop local changes since the last checkout or sync")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID (default: the only one here)")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")

    p = cmd("hoard", "hoard.cmd_hoard", "fetch a parcel's chunks into this site's cache ahead of time",
            "Fetch the current version (everything, or with --working-set the chunks its last session touched\n"
            "first) into this site's cache, so that a later resume with --policy proactive or eager-ws is fast.\n"
            "Needs no lock: the parcel may be running elsewhere (t3 of the ISR timeline).\n"
            "\n"
            "With --no-key (or with no key given and no terminal to ask for one) it needs no key either: the\n"
            "server lists the version's chunks and working set, and the ciphertext is fetched and checked\n"
            "against its tags; the boot files are kept sealed and checked by the next resume.\n"
            "\n"
            "Hoard management: --list shows which parcels are hoarded here and how much of each current version;\n"
            "--check PARCEL verifies every cached chunk of the parcel against its tag (bad ones are quarantined and\n"
            "fetched again when needed; exit 1 if any); --drop PARCEL removes its chunks from the cache to free\n"
            "space, except those another parcel here needs and those not uploaded yet.")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID")
    manage = p.add_mutually_exclusive_group()
    manage.add_argument("--list", action="store_true", help="list the parcels hoarded here and how much of each")
    manage.add_argument("--check", action="store_true",
                        help="verify the parcel's cached chunks against their tags; quarantine bad ones")
    manage.add_argument("--drop", action="store_true",
                        help="remove the parcel's chunks from the cache (never shared or not-yet-uploaded ones)")
    p.add_argument("--working-set", action="store_true", help="only the working set recorded at the last suspend")
    p.add_argument("--no-key", action="store_true",
                   help="hoard without the parcel key (what `isr schedule run` does)")
    json_result(p)
    credentials(p)

    def rule_options(p: argparse.ArgumentParser, required: bool) -> None:
        group = p.add_mutually_exclusive_group(required=required)
        group.add_argument("--location", metavar="TEXT", help="events whose LOCATION contains TEXT (any case)")
        group.add_argument("--category", metavar="NAME", help="events with the CATEGORY NAME (any case)")
        group.add_argument("--summary", metavar="REGEX", help="events whose title (SUMMARY) matches REGEX (any case)")

    p = cmd("site", "schedule.cmd_site_ls", "which calendar events mean you will be at this PC (site rules)",
            "Site rules tell `isr schedule` which calendar events mean you will be at this PC: by the event's\n"
            "LOCATION, one of its CATEGORIES, or a pattern in its title. Any rule matching is enough.\n"
            "\n"
            "  isr site add --location \"Lab 4\"     meetings in Lab 4 happen at this PC\n"
            "  isr site add --summary '^Office day'\n"
            "  isr site ls\n"
            "  isr site rm 2")
    site_sub = p.add_subparsers(dest="site_command", metavar="ACTION")
    q = site_sub.add_parser("add", help="add a rule", description="Add a site rule (one of the options).")
    q.set_defaults(func="schedule.cmd_site_add")
    rule_options(q, required=True)
    q = site_sub.add_parser("rm", help="remove a rule", description="Remove a site rule by its number in "
                                                                    "`isr site ls`, or as it was added.")
    q.set_defaults(func="schedule.cmd_site_rm")
    q.add_argument("number", nargs="?", type=int, help="the rule's number in `isr site ls`")
    rule_options(q, required=False)
    q = site_sub.add_parser("ls", help="list the rules")
    q.set_defaults(func="schedule.cmd_site_ls")

    p = cmd("schedule", "schedule.cmd_schedule_show", "hoard before your calendar says you will be at this PC",
            "Plan hoards from calendars: for each upcoming event that a site rule (`isr site`) places at this\n"
            "PC, start hoarding the parcel's newest version early enough to finish before the event starts:\n"
            "bytes missing here / measured throughput x (1 + margin) + overhead, ending lead_s before it.\n"
            "Hoards need no key (see `isr hoard --no-key`).\n"
            "\n"
            "  isr schedule calendar add ~/work.ics     a file, or an https:// URL (e.g. a published calendar)\n"
            "  isr schedule show                        the plan for the next days\n"
            "  isr schedule run                         do it: in the foreground, or as a service\n"
            "                                           (contrib/systemd/isr-schedule.service, doc/isrctl.md)\n"
            "  isr schedule set mode working-set        settings: `isr schedule set` lists them")
    schedule_sub = p.add_subparsers(dest="schedule_command", metavar="ACTION")
    q = schedule_sub.add_parser("calendar", help="add, remove or list calendars",
                                description="The calendars (iCalendar files or https URLs) that `isr schedule` reads.")
    q.set_defaults(func="schedule.cmd_calendar_ls")
    calendar_sub = q.add_subparsers(dest="calendar_command", metavar="ACTION")
    r = calendar_sub.add_parser("add", help="add a calendar file or https URL",
                                description="Add an iCalendar file (stored as an absolute path) or https URL; it is "
                                            "read once now to check it.")
    r.set_defaults(func="schedule.cmd_calendar_add")
    r.add_argument("source", help="a .ics file or an https:// URL")
    r.add_argument("--no-check", action="store_true", help="add it without reading it now")
    r = calendar_sub.add_parser("rm", help="remove a calendar")
    r.set_defaults(func="schedule.cmd_calendar_rm")
    r.add_argument("source", help="as `isr schedule calendar ls` shows it")
    r = calendar_sub.add_parser("ls", help="list the calendars")
    r.set_defaults(func="schedule.cmd_calendar_ls")
    q = schedule_sub.add_parser("set", help="show or change a setting",
                                description="Without arguments, list the settings; with NAME VALUE, change one.\n"
                                            "mode (full or working-set), margin (0.5 = +50 %), overhead_s, lead_s,\n"
                                            "horizon_days, assumed_bytes_per_s (until a hoard is measured),\n"
                                            "allday_start (08:00), timezone (default: this machine's), parcels\n"
                                            "(comma-separated; empty: all of yours), site (a label).",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    q.set_defaults(func="schedule.cmd_schedule_set")
    q.add_argument("name", nargs="?", help="the setting")
    q.add_argument("value", nargs="?", help="its new value")
    q = schedule_sub.add_parser("show", help="print the plan: events here, bytes missing, when each hoard starts",
                                description="The plan for the next days: each event at this PC, where and when, the "
                                            "bytes still missing here, when the hoard starts and is expected to "
                                            "finish, and a warning where there is not enough time.")
    q.set_defaults(func="schedule.cmd_schedule_show")
    q.add_argument("--days", type=float, metavar="N", help="look N days ahead (default: horizon_days, 7)")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(days=None, json=False)
    q = schedule_sub.add_parser("run", help="hoard as planned until stopped (foreground or service)",
                                description="Sleep until the next planned hoard start, hoard without the key (progress "
                                            "in the log, on stderr), plan again when a calendar or the schedule "
                                            "changes, a new version is checked in, or every --replan seconds. What "
                                            "was hoarded and the measured throughput survive restarts. SIGTERM or "
                                            "Ctrl-C stops it cleanly.")
    q.set_defaults(func="schedule.cmd_schedule_run")
    q.add_argument("--once", action="store_true", help="plan, run the hoards due now, print the plan and exit")
    q.add_argument("--replan", type=float, default=300.0, metavar="SECONDS",
                   help="plan again at least this often (default 300)")
    q.add_argument("--watch", type=float, default=30.0, metavar="SECONDS",
                   help="look for changed calendars and new versions this often (default 30)")

    def watch_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                       help="with --watch: seconds between updates (default 1)")
        p.add_argument("--count", type=int, default=0, metavar="N", help="with --watch: stop after N updates "
                                                                          "(default: until Ctrl-C or the parcel stops)")

    p = cmd("stat", "parcels.cmd_stat", "show local state: version, lock, dirty chunks, cache, hoard, memory image")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID (default: all with local state)")
    p.add_argument("--json", action="store_true", help="machine-readable output (with --watch: a JSON line an update)")
    p.add_argument("--watch", action="store_true",
                   help="follow a parcel in use here live: dirty bytes, cache fill, fetch and upload rates, demand "
                        "misses, hoard (also `isr top`)")
    watch_options(p)

    p = cmd("top", "watch.cmd_top", "follow a running or mounted parcel live (isr stat --watch)",
            "Follow a parcel resumed or mounted here, refreshed every second on a terminal (one line per update\n"
            "otherwise): dirty bytes not yet in the cache and bytes not yet uploaded, the chunk cache's fill, the\n"
            "fetch and upload rates, demand misses per second (guest reads that waited for the server) and the\n"
            "hoard's progress. Ctrl-C stops watching (the parcel goes on).")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID (default: the only one running here)")
    p.add_argument("--json", action="store_true", help="one JSON object per update (shape in doc/isrctl.md)")
    p.set_defaults(watch=True)
    watch_options(p)

    p = cmd("mount", "mount.cmd_mount", "expose a parcel's disk image in a directory, without running its VM",
            "Serve the parcel's disk (and memory) image as files DIR/disk and DIR/memory through vulpes, without\n"
            "running its VM: to copy a file out (`mount -o loop,ro DIR/disk /mnt`), back it up or run fsck.\n"
            "Chunks not in the cache are fetched on demand. Read-only, from this site's local state if the parcel\n"
            "has one here, else the server's current version (no lock needed). With --rw: writable, only while\n"
            "this site holds the lock and the VM is powered off; it then counts as a session, and after\n"
            "`isr umount DIR` the changes are checked in like a resume's (`isr checkin`). `isr umount DIR` ends it.")
    p.add_argument("parcel", help="parcel name or UUID")
    p.add_argument("dir", help="the directory to mount on (made if missing)")
    p.add_argument("--rw", action="store_true",
                   help="writable (needs the lock and a powered-off VM; a session to check in afterwards)")
    json_result(p)
    credentials(p)

    p = cmd("umount", "mount.cmd_umount", "end an `isr mount` (its writes become local changes to check in)")
    p.add_argument("dir", help="the directory the parcel is mounted on")
    json_result(p)

    p = cmd("clean", "parcels.cmd_clean", "remove a parcel's local state (and release its lock)")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID")
    p.add_argument("-f", "--force", action="store_true", help="even with local changes or an unreachable server")
    p.add_argument("--cache", action="store_true", help="also remove the chunk cache shared by all parcels")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")

    p = cmd("rollback", "parcels.cmd_rollback", "make a new version with an older version's content")
    p.add_argument("parcel", help="parcel name or UUID")
    p.add_argument("version", type=int, help="the older version to go back to")
    json_result(p)
    credentials(p)

    p = cmd("lock", "parcels.cmd_lock", "show who holds the lock; --force breaks it")
    p.add_argument("parcel", help="parcel name or UUID")
    p.add_argument("--force", action="store_true", help="break the lock (asks first)")
    p.add_argument("--reason", default="", help="recorded in the server's audit log")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")

    p = cmd("poweroff", "session.cmd_poweroff", "shut the VM down (or forget the saved RAM): the next resume boots cold",
            "Power the VM off. A running one is asked to shut down (the ACPI power button) and given --timeout\n"
            "seconds to power itself off; then, or at once with --force, its plug is pulled. The version then\n"
            "checked in has no device state and an all-zero memory image, so the next resume boots it cold.")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID (default: the only one here)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help=f"how long a running guest may take to shut down (default {POWEROFF_WAIT:g})")
    p.add_argument("--force", action="store_true", help="pull the plug of a running VM at once, as if cut off")
    p.add_argument("--no-checkin", action="store_true", help="keep the result here; `isr checkin` later")
    json_result(p)
    credentials(p)

    p = cmd("console", "view.cmd_console", "attach this terminal to the serial console of a VM running here",
            "Attach to the serial console of the parcel's VM running at this site (also one resumed with\n"
            "--detach, and while other clients are attached: all see the output, all may type). What the guest\n"
            f"printed before is shown first. On a terminal every key goes to the guest; {DETACH_NAME} detaches.\n"
            "Without a terminal, input and output are relayed as they are, for scripts; it ends once the input\n"
            "has ended and the guest has been quiet for a second.")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID (default: the only one running here)")

    p = cmd("viewer", "view.cmd_viewer", "show the display of a VM running here in a VNC viewer",
            "Start a VNC viewer (" + ", ".join(VIEWERS) + ") on the display of the parcel's VM running\n"
            "at this site; without one, or without a graphical session, print how to connect (address, port,\n"
            "password). A display on a non-loopback address has a password (`isr resume --vnc HOST:N`).")
    p.add_argument("parcel", nargs="?", help="parcel name or UUID (default: the only one running here)")
    p.add_argument("--print", action="store_true", help="only print how to connect")

    p = cmd("passwd", "account.cmd_passwd", "change the parcel's passphrase (or switch to a key file)")
    p.add_argument("parcel", help="parcel name or UUID")
    credentials(p)
    credentials(p, new=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.func is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="isr: %(name)s: %(message)s")
    try:
        return int(command_function(args.func)(args) or 0)
    except LockRefused as exc:
        print(f"isr: {exc}", file=sys.stderr)
        return EXIT_LOCKED
    except LockBroken as exc:
        print(f"isr: {exc}", file=sys.stderr)
        return EXIT_LOCK_BROKEN
    except (IsrError, ParcelError) as exc:
        # Only a command that loaded the HTTP client (`remote`) can have failed to reach the server; the others
        # must not load it just to find that out.
        remote = sys.modules.get(f"{__package__}.remote")
        if remote is not None and isinstance(exc, remote.RemoteUnreachable):
            print(f"isr: the server is unreachable: {exc} (for work without it see `isr resume --disconnected`)",
                  file=sys.stderr)
        else:
            print(f"isr: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("isr: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:
        print(f"isr: {exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
