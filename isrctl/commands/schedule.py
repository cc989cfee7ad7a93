"""`isr site`, `isr schedule calendar`, `isr schedule`: where you will be, and hoards planned from it."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from isrprogress import LogReporter

from .. import calendar as ical
from .. import hoard as hoardmod
from .. import paths
from .. import schedule as schedulemod
from ..checkout import Client
from ..remote import RemoteUnreachable
from . import common

log = logging.getLogger("isrctl")


def _schedule_config() -> schedulemod.ScheduleConfig:
    return schedulemod.ScheduleConfig.load(paths.schedule_file())


def _save_schedule(config: schedulemod.ScheduleConfig, done: str) -> None:
    config.save(paths.schedule_file())
    print(done)


def _rule_from_args(args: argparse.Namespace) -> schedulemod.SiteRule | None:
    for kind in schedulemod.RULE_KINDS:
        value = getattr(args, kind, None)
        if value is not None:
            return schedulemod.SiteRule(kind, value)
    return None


def cmd_site_add(args: argparse.Namespace) -> int:
    config = _schedule_config()
    rule = _rule_from_args(args)
    assert rule is not None  # argparse requires one
    if rule in config.rules:
        print(f"this PC already has the rule {rule}")
        return 0
    config.rules.append(rule)
    _save_schedule(config, f"added rule {len(config.rules)}: events with {rule} mean you will be at this PC")
    if not config.calendars:
        print("no calendars yet: add one with `isr schedule calendar add FILE|URL`")
    return 0


def cmd_site_rm(args: argparse.Namespace) -> int:
    config = _schedule_config()
    rule = _rule_from_args(args)
    if rule is None:
        if args.number is None or not 1 <= args.number <= len(config.rules):
            raise schedulemod.ScheduleError(f"name the rule to remove by its number (1 to {len(config.rules)}, see "
                                            f"`isr site ls`) or as it was added (--location, --category, --summary)")
        rule = config.rules[args.number - 1]
    elif rule not in config.rules:
        raise schedulemod.ScheduleError(f"there is no rule {rule} (`isr site ls` lists them)")
    config.rules.remove(rule)
    _save_schedule(config, f"removed the rule {rule}")
    return 0


def cmd_site_ls(args: argparse.Namespace) -> int:
    config = _schedule_config()
    if not config.rules:
        print("no site rules: `isr site add --location TEXT` (or --category NAME, --summary REGEX) tells isr which "
              "calendar events mean you will be at this PC")
        return 0
    for number, rule in enumerate(config.rules, start=1):
        print(f"{number}  {rule.kind:<9} {rule.pattern}")
    return 0


def cmd_calendar_add(args: argparse.Namespace) -> int:
    config = _schedule_config()
    source = args.source if "://" in args.source else str(Path(args.source).absolute())
    if source in config.calendars:
        print(f"{source} is already a calendar of this PC")
        return 0
    if not args.no_check:
        read = schedulemod.read_calendar(config, source, schedulemod.utc_now())
        for problem in read.problems:
            print(f"warning: {problem}", file=sys.stderr)
        print(f"{source}: {len(read.occurrences)} events in the next {config.horizon_days:g} days, "
              f"{sum(1 for o in read.occurrences if config.matches(o))} of them at this PC")
    config.calendars.append(source)
    _save_schedule(config, f"added calendar {source}")
    return 0


def cmd_calendar_rm(args: argparse.Namespace) -> int:
    config = _schedule_config()
    source = args.source
    if source not in config.calendars:
        source = str(Path(args.source).absolute())
    if source not in config.calendars:
        raise schedulemod.ScheduleError(f"{args.source} is not a calendar of this PC (`isr schedule calendar ls`)")
    config.calendars.remove(source)
    _save_schedule(config, f"removed calendar {source}")
    return 0


def cmd_calendar_ls(args: argparse.Namespace) -> int:
    config = _schedule_config()
    if not config.calendars:
        print("no calendars: `isr schedule calendar add FILE|https://URL`")
    for source in config.calendars:
        print(source)
    return 0


def cmd_schedule_set(args: argparse.Namespace) -> int:
    config = _schedule_config()
    if args.name is None:
        for name, value in dataclasses.asdict(config).items():
            if name not in ("rules", "calendars"):
                print(f"{name} = {value!r}")
        return 0
    if args.value is None:
        raise schedulemod.ScheduleError(f"give a value: `isr schedule set {args.name} VALUE`")
    config.set(args.name, args.value)
    _save_schedule(config, f"{args.name} = {getattr(config, args.name)!r}")
    return 0


def _schedule_parcels(config: schedulemod.ScheduleConfig, inventory: hoardmod.ServerInventory) -> list[str]:
    return list(config.parcels) or [p["name"] for p in inventory.parcels() if p.get("current_version")]


def _plan_offline(config: schedulemod.ScheduleConfig, read: ical.CalendarRead, state: schedulemod.RunnerState,
                  now: dt.datetime, why: RemoteUnreachable) -> tuple[list[schedulemod.PlannedHoard], str]:
    """The plan from the last known state while the server is away, and the line that says so. Raises the
    server's error if this site never planned with it."""
    known = state.known
    if not known.get("missing"):
        raise why
    inventory = hoardmod.KnownInventory(known)
    plans = schedulemod.plan(read.occurrences, list(config.parcels) or inventory.parcels(), inventory, config,
                             state.throughput(), now)
    at = dt.datetime.fromtimestamp(float(known.get("at", 0)), dt.timezone.utc)
    return plans, (f"the server is unreachable ({why}): planned from the last known state, of "
                   f"{schedulemod.local_time(at, config.zone())}")


def cmd_schedule_show(args: argparse.Namespace) -> int:
    config = _schedule_config()
    if args.days is not None:
        config.horizon_days = args.days
        config.validate()
    state = schedulemod.RunnerState.load(paths.schedule_state_file())
    now = schedulemod.utc_now()
    read = schedulemod.read_calendars(config, now)
    offline = ""
    try:
        with common.quick_client() as client:
            inventory = hoardmod.ServerInventory(client, known_path=paths.schedule_state_file())
            plans = schedulemod.plan(read.occurrences, _schedule_parcels(config, inventory), inventory, config,
                                     state.throughput(), now)
    except RemoteUnreachable as exc:
        plans, offline = _plan_offline(config, read, state, now, exc)
    if args.json:
        print(json.dumps({"plans": [schedulemod.plan_json(p) for p in plans],
                          "problems": [str(p) for p in read.problems], "history": state.history,
                          "zone": str(config.zone()), "offline": offline or None}, indent=1))
        return 0
    if offline:
        print(offline)
    if not config.rules:
        print("no site rules yet: `isr site add --location TEXT` says which events mean you will be here")
    if not config.calendars:
        print("no calendars yet: `isr schedule calendar add FILE|https://URL`")
    print(schedulemod.format_plan(plans, config.zone(), read.problems))
    for done in state.history[-3:]:
        print(schedulemod.format_history(done, config.zone()))
    return 0


def cmd_schedule_run(args: argparse.Namespace) -> int:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.getLogger().handlers[:] = [handler]
    logging.getLogger("isrctl").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    schedulemod.ScheduleConfig.load(paths.schedule_file())  # a broken file is reported before anything starts
    with contextlib.ExitStack() as stack:
        stack.enter_context(schedulemod.single_runner(paths.schedule_state_file()))
        client = stack.enter_context(Client())
        inventory = hoardmod.ServerInventory(client, known_path=paths.schedule_state_file())
        hoarder = hoardmod.KeylessHoarder(client, inventory, LogReporter(logging.getLogger("isrctl.hoard")))
        runner = schedulemod.Runner(
            paths.schedule_file(), paths.schedule_state_file(),
            parcels=lambda config: _schedule_parcels(config, inventory), inventory=inventory, hoarder=hoarder,
            replan_s=args.replan, watch_s=args.watch,
            watch=lambda config: inventory.versions(_schedule_parcels(config, inventory)))
        if args.once:
            config = _schedule_config()
            plans, _ = runner.step()
            print(schedulemod.format_plan(plans, config.zone()))
            return 0

        def stop(signum: int, frame: Any) -> None:
            log.info("got signal %d: stopping", signum)
            runner.stop()

        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, stop)
        log.info("isr schedule run: site %s, schedule %s, state %s", client.config.site, paths.schedule_file(),
                 paths.schedule_state_file())
        runner.run()
        log.info("stopped")
    return 0
