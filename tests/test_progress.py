"""isrprogress, the one progress layer of isr and isr-admin: human sizes, a rate and an ETA only once they
are measurable, live bars on a terminal and plain lines elsewhere, quiet, the JSON relay between processes,
and isr-admin's output through it (real server, real pipe, real pseudo-terminal)."""
from __future__ import annotations

import io
import json
import logging
import os
import pty
import re
import select
import subprocess
from pathlib import Path

import pytest

from isrprogress import (JsonReporter, LogReporter, Meter, NullReporter, PlainReporter, Replayer, TerminalReporter,
                         human_bytes, human_duration, human_rate)
from isrprogress.meter import ETA_MIN_SECONDS, RATE_MIN_SECONDS, WINDOW
from tests.server_fixtures import BIN, ServerEnv, image_with_data, server_env  # noqa: F401

pytestmark = pytest.mark.timeout(120)

CONTROL = re.compile(r"[\x1b\r]")
MIB = 1 << 20


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_human_sizes_rates_and_durations() -> None:
    assert [human_bytes(n) for n in (0, 812, 1023, 1024, 1536, 5 * MIB, 3 << 30, 2 << 40)] == \
        ["0 B", "812 B", "1023 B", "1.0 KiB", "1.5 KiB", "5.0 MiB", "3.0 GiB", "2.0 TiB"]
    assert human_bytes(None) == "-"
    assert human_rate(2.5 * MIB, "B") == "2.5 MiB/s" and human_rate(3.46, "chunks") == "3.5 chunks/s"
    assert [human_duration(s) for s in (0, 9.4, 65, 7380)] == ["0s", "9s", "1m05s", "2h03m"]


def test_no_rate_or_eta_until_measurable() -> None:
    clock = Clock()
    meter = Meter(clock)
    assert meter.rate() is None and meter.eta(100 * MIB) is None
    # Two updates a moment apart: no rate, no ETA, however fast they look.
    clock.now += 0.01
    meter.add(MIB)
    clock.now += 0.01
    meter.add(2 * MIB)
    assert meter.rate() is None and meter.eta(100 * MIB) is None
    # A second in: a rate, still no ETA.
    clock.now = 1000.0 + RATE_MIN_SECONDS
    meter.add(3 * MIB)
    assert meter.rate() == pytest.approx(3 * MIB / RATE_MIN_SECONDS) and meter.eta(100 * MIB) is None
    # Three seconds in, growing steadily: an ETA from the measured rate.
    clock.now = 1000.0 + ETA_MIN_SECONDS
    meter.add(3 * MIB * ETA_MIN_SECONDS)
    rate = meter.rate()
    assert rate == pytest.approx(3 * MIB)
    assert meter.eta(100 * MIB) == pytest.approx((100 - 9) * MIB / rate)
    assert meter.eta(0) is None                       # no total, no ETA
    assert meter.eta(9 * MIB) is None                 # done


def test_one_burst_is_no_eta_and_a_stall_ends_it() -> None:
    clock = Clock()
    meter = Meter(clock)
    clock.now += 5
    meter.add(50 * MIB)                  # everything found at once (the cache): one advance only
    assert meter.rate() is not None and meter.eta(100 * MIB) is None
    clock.now += 1
    meter.add(51 * MIB)
    assert meter.eta(100 * MIB) is not None
    # Nothing moves for longer than the rate's window: the rate falls to 0 and there is no ETA.
    clock.now += WINDOW + 1
    meter.add(51 * MIB)
    assert meter.rate() == 0 and meter.eta(100 * MIB) is None
    # Counted again from less (a restart): what was measured no longer counts.
    clock.now += 1
    meter.add(MIB)
    assert meter.rate() is None and meter.eta(100 * MIB) is None


def run_bar(reporter: PlainReporter | TerminalReporter, clock: Clock, steps: int = 10, step_seconds: float = 1.0
            ) -> None:
    bar = reporter.progress("hoarding", steps * MIB)
    for i in range(1, steps + 1):
        clock.now += step_seconds
        bar.update(i * MIB)
    bar.close("10 chunks")


def test_plain_lines_when_not_a_terminal() -> None:
    clock = Clock()
    out = io.StringIO()
    reporter = TerminalReporter(out, interactive=False, every=4, clock=clock)
    reporter.say("hoarding everything")
    run_bar(reporter, clock)
    lines = out.getvalue().splitlines()
    assert not CONTROL.search(out.getvalue()), out.getvalue()
    # A message, a line every 4 s of the 10 s step, the summary.
    assert lines[0] == "hoarding everything"
    assert lines[1] == "  hoarding: 40% 4.0 MiB of 10.0 MiB, 1.0 MiB/s, ETA 6s", lines
    assert lines[2] == "  hoarding: 80% 8.0 MiB of 10.0 MiB, 1.0 MiB/s, ETA 2s", lines
    assert lines[3] == "  hoarding: 10.0 MiB in 10.0 s (1.0 MiB/s), 10 chunks", lines
    assert len(lines) == 4


def test_a_short_step_is_one_line_without_a_made_up_rate() -> None:
    clock = Clock()
    out = io.StringIO()
    reporter = TerminalReporter(out, interactive=False, clock=clock)
    bar = reporter.progress("uploading new chunks", 3, unit="chunks")
    clock.now += 0.2
    bar.update(3)
    bar.close()
    assert out.getvalue() == "  uploading new chunks: 3 chunks in 0.2 s\n"


def test_live_bars_on_a_terminal() -> None:
    out = io.StringIO()
    reporter = TerminalReporter(out, interactive=True)
    reporter.say("hoarding everything")
    bar = reporter.progress("hoarding", 10 * MIB)
    bar.update(MIB)
    bar.update(2 * MIB)
    bar.close("2 chunks")
    reporter.say("done")
    text = out.getvalue()
    assert "\x1b[" in text                            # drawn and cleared with control codes
    assert "hoarding everything\n" in text and "done\n" in text
    assert "  hoarding: 2.0 MiB in " in text and ", 2 chunks\n" in text
    assert "ETA" not in text                          # a step this short has no ETA to show
    assert re.search(r"hoarding .*% [0-9.]+ (B|MiB) of 10\.0 MiB", text), text   # the bar, drawn


def test_quiet_shows_nothing() -> None:
    for interactive in (True, False):
        out = io.StringIO()
        reporter = TerminalReporter(out, quiet=True, interactive=interactive)
        reporter.say("hoarding everything")
        run_bar(reporter, Clock())
        assert out.getvalue() == ""


def test_log_reporter_writes_records(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("isrctl.hoard")
    with caplog.at_level(logging.INFO, logger="isrctl.hoard"):
        reporter = LogReporter(logger)
        reporter.say("  hoarding everything ")
        bar = reporter.progress("hoarding", 2 * MIB)
        bar.update(2 * MIB)
        bar.close()
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "hoarding everything" and messages[1].startswith("hoarding: 2.0 MiB in ")


def test_json_relay_shows_on_the_other_side_as_if_local() -> None:
    """A detached session's JsonReporter, its lines across a pipe, a Replayer into the local reporter."""
    lines: list[str] = []
    remote = JsonReporter(lines.append)
    remote.say("resuming")
    bar = remote.progress("uploading new chunks", 4, unit="chunks")
    for done in range(1, 5):
        bar.update(done)
    bar.close("4 sent")
    remote.progress("hoarding", 10 * MIB)         # never closed: the session went away
    messages = [json.loads(line) for line in lines]
    assert all(line.endswith("\n") for line in lines)
    assert messages[0] == {"say": "resuming"}
    assert messages[1]["progress"] == {"id": 1, "label": "uploading new chunks", "total": 4, "unit": "chunks",
                                       "done": 0}
    assert {"id": 1, "done": 4, "total": 4, "end": True, "note": "4 sent"} in [m["progress"] for m in messages[2:]]

    out = io.StringIO()
    replay = Replayer(TerminalReporter(out, interactive=False))
    assert all(replay.feed(m) for m in messages)
    assert not replay.feed({"ready": {"pid": 1}})      # not a report: the caller's
    replay.close()
    shown = out.getvalue().splitlines()
    assert shown[0] == "resuming"
    assert shown[1].startswith("  uploading new chunks: 4 chunks in ") and shown[1].endswith(", 4 sent")
    assert shown[2].startswith("  hoarding: 0 B in ") and shown[2].endswith(", interrupted")


def test_a_bar_left_by_an_error_says_so() -> None:
    out = io.StringIO()
    reporter = TerminalReporter(out, interactive=False)
    with pytest.raises(OSError):
        with reporter.progress("storing chunks", 0):
            raise OSError("the disk is full")
    assert out.getvalue().startswith("  storing chunks: 0 B in ") and out.getvalue().endswith(", failed\n")
    bar = NullReporter().progress("anything", 1)
    bar.update(1)
    bar.close()


# --- isr-admin through the layer -----------------------------------------------------------------------

def create_parcel(env: ServerEnv, tmp_path: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    disk = tmp_path / f"{name}.raw"
    image_with_data(disk, 3 * MIB, seed=7, data_ranges=[(0, 2 * MIB + 4096)])
    (tmp_path / "pass").write_text("progress passphrase\n")
    return env.admin(*extra, "parcel", "create", "--owner", "alice", "--name", name, "--disk", str(disk),
                     "--ram", "16", "--passphrase-file", str(tmp_path / "pass"), "--scrypt-log2n", "10", "--force")


@pytest.mark.parametrize("server_env", ["sqlite-directory"], indirect=True)
def test_admin_reports_steps_in_human_sizes(server_env: ServerEnv, tmp_path: Path) -> None:  # noqa: F811
    made = create_parcel(server_env, tmp_path, "progress-plain")
    assert not CONTROL.search(made.stdout), made.stdout
    lines = made.stdout.splitlines()
    assert re.fullmatch(r"  encrypting progress-plain\.raw: 3\.0 MiB in [0-9.]+ s.*", lines[0]), lines
    assert re.fullmatch(r"  storing chunks: [0-9.]+ (KiB|MiB) in [0-9.]+ s.*", lines[1]), lines
    assert lines[2].startswith("created parcel "), lines
    assert not re.search(r"\b[0-9]{5,}\b", made.stdout), made.stdout      # no raw byte counts
    # With --json, stdout is the JSON alone and the steps go to stderr.
    checked = server_env.admin("--json", "fsck")
    assert json.loads(checked.stdout)["ok"] is True
    assert re.search(r"^  re-hashing chunks: [0-9.]+ (B|KiB|MiB) in [0-9.]+ s", checked.stderr, re.M), checked.stderr
    usage = server_env.admin("usage").stdout
    assert re.search(r"stored: [0-9]+ chunks, [0-9.]+ (B|KiB|MiB|GiB);", usage), usage


@pytest.mark.parametrize("server_env", ["sqlite-directory"], indirect=True)
def test_admin_draws_bars_on_a_terminal(server_env: ServerEnv) -> None:  # noqa: F811
    """isr-admin fsck with its stdout on a pseudo-terminal: drawn with control codes, then the summary."""
    controller, terminal = pty.openpty()
    try:
        proc = subprocess.Popen([str(BIN / "isr-admin"), "-c", str(server_env.config), "fsck"], stdout=terminal,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env={**os.environ, "TERM": "xterm"})
        os.close(terminal)
        terminal = -1
        output = b""
        while True:
            ready, _, _ = select.select([controller], [], [], 60)
            assert ready, "isr-admin fsck wrote nothing for 60 s"
            try:
                chunk = os.read(controller, 65536)
            except OSError:      # EIO: the other side closed
                break
            if not chunk:
                break
            output += chunk
        assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)
    text = output.decode()
    assert "\x1b[" in text, text
    assert "re-hashing chunks: " in text and "\nok" in text.replace("\r\n", "\n"), text
