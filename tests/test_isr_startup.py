"""What `isr` does before it does anything (issue 15): a command imports only its own module and what that
uses, because a command's start counts against its transfer (`isr hoard`, `isr suspend` at 100 Mbit/s), and
`isr resume` starts the session's process first, which a resume refused early ends again. Checked by the
modules a real `isr` process has loaded and the processes left, not by time."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import IsrEnv, Site, isr_env, one_line_error, sites  # noqa: F401  (isr_env: pytest fixture)

pytestmark = pytest.mark.timeout(120)

#: Libraries that no command below needs (each is a fifth to a third of the old start-up): QEMU's QMP (and
#: asyncio under it), calendars, the HTTP client, terminal drawing and httpx's command line (click, pygments).
HEAVY = ("qemu.qmp", "asyncio", "icalendar", "httpx", "rich", "click", "pygments")


def loaded_by(tmp_path: Path, *code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running ``code`` (lines; SystemExit is caught, and
    its output goes to the test's log), with its XDG directories empty below ``tmp_path``."""
    out = tmp_path / "modules.json"
    script = ["import json, sys", "try:", *[f"    {line}" for line in code], "except SystemExit:", "    pass",
              f"open({str(out)!r}, 'w').write(json.dumps(sorted(sys.modules)))"]
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_DATA_HOME=str(tmp_path / "data"),
               XDG_CACHE_HOME=str(tmp_path / "cache"), XDG_RUNTIME_DIR=str(tmp_path / "run"))
    result = subprocess.run([sys.executable, "-c", "\n".join(script)], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return set(json.loads(out.read_text()))


def top_level(modules: set[str]) -> set[str]:
    return {name for name in modules if name.split(".")[0] in {h.split(".")[0] for h in HEAVY}} & set(HEAVY)


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["suspend"], ["hoard", "--help"]])
def test_a_command_that_needs_none_of_them_loads_none(tmp_path: Path, argv: list[str]) -> None:
    # `isr suspend` with nothing running here fails at once (no session): it only asks the session when
    # there is one, so it never needs the session's own modules or the HTTP client either.
    modules = loaded_by(tmp_path, "from isrctl.cli import main", f"main({argv!r})")
    assert not top_level(modules), f"isr {' '.join(argv)} loaded {sorted(top_level(modules))}"
    assert not {"isrctl.session", "isrctl.checkin", "isrctl.qemu", "isrctl.schedule"} & modules


def test_a_hoard_with_the_key_loads_the_http_client_alone(tmp_path: Path) -> None:
    modules = loaded_by(tmp_path, "import isrctl.commands.hoard")
    assert top_level(modules) == {"httpx"}, sorted(top_level(modules))
    assert not {"isrctl.session", "isrctl.qemu", "isrctl.schedule", "isrctl.hoard"} & modules


def test_a_suspend_asks_the_session_without_its_modules(tmp_path: Path) -> None:
    modules = loaded_by(tmp_path, "import isrctl.commands.session")
    assert not top_level(modules), sorted(top_level(modules))
    assert not {"isrctl.session", "isrctl.checkin", "isrctl.checkout", "isrctl.remote"} & modules


def session_processes(site: Site) -> list[int]:
    """The session processes (``python -m isrctl.detach``) started for ``site`` (found by its data directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if b"isrctl.detach" not in (entry / "cmdline").read_bytes():
                continue
            if f"XDG_DATA_HOME={site.root / 'data'}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


def test_a_resume_that_fails_before_the_session_leaves_no_session_process(isr_env: IsrEnv, tmp_path: Path) -> None:
    # `isr resume` starts the session's process first thing (its start overlaps the command's work with the
    # server); a resume refused before it hands that process its options ends it, silently.
    parcel = isr_env.make_parcel("startup")
    wrong = tmp_path / "wrong.key"
    wrong.write_bytes(bytes(32))
    with sites(isr_env, tmp_path, ["A"]) as (a,):
        one_line_error(a.isr("resume", parcel.name, "--detach", "--vnc", "unix", "--keyfile", str(wrong),
                             check=False), "key")
        assert session_processes(a) == []
        assert a.session(parcel) is None
