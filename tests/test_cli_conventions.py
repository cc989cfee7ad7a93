"""The conventions every program of ISR keeps (issue 18): one version everywhere, help for every option, help
for a bare command, the same credential options with the same sources in `isr` and `isr-admin` (the old names
still work, hidden), and `--json` results of the commands that report one. Each through the installed
entry points (.venv/bin/isr, isr-admin, isr-server) and the built vulpes binaries."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from isrctl.cli import build_parser as isr_parser
from parcels.__main__ import build_parser as parcels_parser
from server.admin import build_parser as admin_parser
from server.main import build_parser as server_parser
from tests.guest_fixtures import guest_artifacts  # noqa: F401  (pytest fixture)
from tests.isr_fixtures import IsrEnv, Site, isr_env, one_line_error, sites  # noqa: F401  (isr_env: pytest fixture)
from tests.server_fixtures import BIN, image_with_data

pytestmark = pytest.mark.timeout(300)

PARSERS = {"isr": isr_parser, "isr-admin": admin_parser, "isr-server": server_parser}
ALL_PARSERS = {**PARSERS, "python -m parcels": parcels_parser}


def run(*args: str, input_text: str | None = None, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=60, input=input_text,
                          env={**os.environ, **(env or {})})


def test_every_program_prints_the_one_version(source_dir: Path, build_dir: Path) -> None:
    version = (source_dir / "VERSION").read_text().strip()
    pyproject = (source_dir / "pyproject.toml").read_text()
    assert 'version = { file = "VERSION" }' in pyproject and not re.search(r"^version = \"", pyproject, re.M)
    for program in ("isr", "isr-admin", "isr-server"):
        out = run(str(BIN / program), "--version")
        assert out.returncode == 0 and out.stdout == f"{program} {version}\n", (program, out)
    for program in ("vulpes", "vulpes-fetch"):
        out = run(str(build_dir / "vulpes" / program), "--version")
        assert out.returncode == 0 and out.stdout.startswith(f"{program} {version}"), (program, out)


def options_without_help(parser: argparse.ArgumentParser, path: str) -> Iterator[str]:
    """Every argument and subcommand under ``parser`` that has no help text (a hidden one has SUPPRESS)."""
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        if isinstance(action, argparse._SubParsersAction):
            helped = {choice.dest for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if name not in helped:
                    yield f"{path} {name}"
                yield from options_without_help(sub, f"{path} {name}")
        elif not action.help:
            yield f"{path} {'/'.join(action.option_strings) or action.dest}"


def test_every_option_and_command_has_help() -> None:
    missing = [m for name, build in ALL_PARSERS.items() for m in options_without_help(build(), name)]
    assert missing == [], f"options or commands without help text: {missing}"
    # The check bites: an option added without help is found.
    parser = isr_parser()
    parser.add_argument("--undocumented")
    assert list(options_without_help(parser, "isr")) == ["isr --undocumented"]


def test_a_bare_command_prints_its_help() -> None:
    for args, shows in ((["isr"], ["resume", "suspend", "hoard"]),
                        (["isr-admin"], ["user", "parcel", "gc", "fsck"]),
                        (["isr-admin", "user"], ["add", "password", "list"]),
                        (["isr-admin", "version"], ["prune", "rollback"])):
        out = run(str(BIN / args[0]), *args[1:])
        assert out.returncode == 2, (args, out)
        assert out.stderr.startswith(f"usage: {' '.join(args)} ") and "required" not in out.stderr, out.stderr
        for word in shows:
            assert f"\n    {word} " in out.stderr, (args, word, out.stderr)


def subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


def shown_options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions if a.help != argparse.SUPPRESS for o in a.option_strings}


def test_every_tool_spells_the_credential_options_alike() -> None:
    """The same names in isr, isr-admin and python -m parcels; the old names parse as the new ones, unshown."""
    for build, path in ((isr_parser, ["checkout"]), (admin_parser, ["version", "rollback"]),
                        (parcels_parser, ["verify"])):
        shown = shown_options(subparser(build(), *path))
        assert {"--passphrase-file", "--passphrase-env", "--key-file"} <= shown, (path, shown)
        assert not shown & {"--keyfile", "--new-keyfile"}, (path, shown)
    assert {"--new-passphrase-file", "--new-passphrase-env", "--new-key-file"} <= \
        shown_options(subparser(isr_parser(), "passwd")) & shown_options(subparser(admin_parser(), "parcel", "copy"))
    assert {"--password-file", "--password-env"} <= \
        shown_options(subparser(isr_parser(), "login")) & shown_options(subparser(admin_parser(), "user", "add"))
    parcel = "00000000-0000-4000-8000-000000000000"
    for build, args, old, new in ((isr_parser, ["checkout", "p"], "--keyfile", "--key-file"),
                                  (isr_parser, ["passwd", "p"], "--new-keyfile", "--new-key-file"),
                                  (parcels_parser, ["verify", "--store", "s", "--parcel", parcel], "--keyfile",
                                   "--key-file")):
        assert build().parse_args([*args, old, "k"]) == build().parse_args([*args, new, "k"]), (args, old)


def test_admin_takes_secrets_from_a_file_stdin_or_the_environment(tmp_path: Path) -> None:
    data = tmp_path / "srv"

    def admin(*args: str, input_text: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
        return run(str(BIN / "isr-admin"), "--data-dir", str(data), "--json", *args, input_text=input_text, env=env)

    assert admin("user", "add", "alice", "--password-env", "ALICE_PW", ALICE_PW="from-env").returncode == 0
    unset = admin("user", "password", "alice", "--password-env", "ISR_NOT_SET")
    assert unset.returncode == 1 and unset.stderr == \
        "isr-admin: environment variable ISR_NOT_SET (--password-env) is not set\n"
    assert admin("user", "password", "alice", "--password-file", "-", input_text="from-stdin\n").returncode == 0
    disk = tmp_path / "disk.raw"
    image_with_data(disk, 1 << 20, seed=3, data_ranges=[(0, 64 << 10)])
    kernel = tmp_path / "kernel"   # a blank disk boots nothing: a stand-in kernel for direct boot
    kernel.write_bytes(os.urandom(4096))
    made = admin("parcel", "create", "--owner", "alice", "--name", "p", "--disk", str(disk), "--ram", "16",
                 "--kernel", str(kernel),
                 "--scrypt-log2n", "10", "--passphrase-env", "PARCEL_PW", PARCEL_PW="parcel secret")
    assert made.returncode == 0, made.stderr
    parcel = json.loads(made.stdout)["id"]
    key = tmp_path / "new.key"
    key.write_bytes(os.urandom(32))
    wrong = admin("parcel", "copy", parcel, "--owner", "alice", "--name", "q", "--passphrase-file", "-",
                  "--new-key-file", str(key), input_text="not the secret\n")
    assert wrong.returncode == 1 and wrong.stderr.count("\n") == 1, wrong.stderr
    copied = admin("parcel", "copy", parcel, "--owner", "alice", "--name", "q", "--passphrase-file", "-",
                   "--new-key-file", str(key), input_text="parcel secret\n")
    assert copied.returncode == 0, copied.stderr
    again = admin("parcel", "copy", json.loads(copied.stdout)["id"], "--owner", "alice", "--name", "r",
                  "--key-file", str(key), "--new-passphrase-env", "NEW_PW", NEW_PW="third")
    assert again.returncode == 0, again.stderr
    both = admin("parcel", "copy", parcel, "--owner", "alice", "--name", "s", "--passphrase-env", "PARCEL_PW",
                 "--key-file", str(key))
    assert both.returncode == 2 and "not allowed with" in both.stderr, both.stderr


def test_isr_credential_options_and_their_old_names(isr_env: IsrEnv, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    parcel = isr_env.make_parcel()
    site = Site("A", tmp_path / "A", isr_env)
    try:
        site.isr("login", site.server_url, "--user", "alice", "--fingerprint", isr_env.fingerprint,
                 "--password-file", "-", input_text=site.environ()["ISR_TEST_PASSWORD"] + "\n")
        site.isr("checkout", parcel.name, "--key-file", str(parcel.keyfile))
        site.isr("checkout", parcel.name, "--keyfile", str(parcel.keyfile))      # the old name, hidden
        assert "--keyfile" not in site.isr("checkout", "--help").stdout
        # passwd: the old credential from a file, the new passphrase from the second line of stdin.
        site.isr("passwd", parcel.name, "--key-file", str(parcel.keyfile), "--new-passphrase-file", "-",
                 input_text="new passphrase\n")
        one_line_error(site.isr("checkout", parcel.name, "--key-file", str(parcel.keyfile), check=False), "try again")
        site.isr("checkout", parcel.name, "--passphrase-file", "-", input_text="new passphrase\n")
        monkeypatch.setenv("PARCEL_PW", "new passphrase")
        new_key = tmp_path / "new.key"
        site.isr("passwd", parcel.name, "--passphrase-env", "PARCEL_PW", "--new-keyfile", str(new_key))
        assert new_key.stat().st_size >= 32
        site.isr("checkout", parcel.name, "--key-file", str(new_key))
        empty = tmp_path / "empty"
        empty.write_text("\n")
        one_line_error(site.isr("checkout", parcel.name, "--passphrase-file", str(empty), check=False),
                       str(empty), "--passphrase-file")
        site.isr("clean", parcel.name)
    finally:
        site.cleanup()


#: The keys every `--json` result of a command on one parcel has (doc/isrctl.md "JSON results").
RESULT_KEYS = {"parcel", "name", "version", "lock_held", "local", "running"}


def json_result(site: Site, *args: str) -> dict[str, Any]:
    """Run ``isr ARGS --json``: stdout must be one JSON object, and the messages go to stderr."""
    out = site.isr(*args, "--json")
    data = json.loads(out.stdout)
    assert RESULT_KEYS <= set(data), (args, data)
    return dict(data)


def test_commands_report_their_result_as_json(isr_env: IsrEnv, tmp_path: Path) -> None:
    parcel = isr_env.make_parcel()
    key = ("--key-file", str(parcel.keyfile))
    with sites(isr_env, tmp_path, ["A"]) as (a,):
        # A keyless hoard at a site that never had the parcel: boot files with a bar, then the chunks.
        out = a.isr("hoard", parcel.name, "--no-key", "--json")
        hoard = json.loads(out.stdout)
        assert hoard["name"] == parcel.name and hoard["version"] is None and hoard["lock_held"] is False
        assert hoard["hoard"]["keyless"] is True and hoard["hoard"]["version"] == 1, hoard
        assert hoard["hoard"]["bytes_fetched"] > 0 and hoard["hoard"]["mode"] == "full", hoard
        assert re.search(r"^  fetching boot files? [^:]+: [0-9.]+ (KiB|MiB) in ", out.stderr, re.M), out.stderr

        checkout = json_result(a, "checkout", parcel.name, *key)
        assert checkout["version"] == 1 and checkout["lock_held"] is True and checkout["local"] == "clean", checkout
        nothing = json_result(a, "checkin", parcel.name, *key)
        assert nothing["checked_in"] is False and nothing["lock_held"] is False, nothing

        resumed = json_result(a, "resume", parcel.name, "--detach", "--vnc", "none", *key)
        assert resumed["running"] is True and resumed["local"] == "running", resumed
        assert resumed["session"]["pid"] > 0 and resumed["session"]["version"] == 1, resumed
        suspended = json_result(a, "suspend", parcel.name)
        assert suspended["checked_in"] is True and suspended["version"] == 2, suspended
        assert suspended["lock_held"] is False and suspended["running"] is False, suspended

        rolled = json_result(a, "rollback", parcel.name, "1", *key)
        assert rolled["committed"] == 3 and rolled["content_of"] == 1, rolled
        hoarded = json_result(a, "hoard", parcel.name, "--working-set", *key)
        assert hoarded["hoard"]["keyless"] is False and hoarded["hoard"]["version"] == 3, hoarded
        assert hoarded["hoard"]["mode"] == "working-set", hoarded
        a.isr("clean", parcel.name)


def complete(script: Path, function: str, words: list[str]) -> list[str]:
    """What bash offers after ``words`` (the last one being typed), through the generated completion script."""
    line = " ".join(words)
    array = " ".join(f"'{w}'" for w in words)
    out = subprocess.run(["bash", "-c", f'source "$0"; COMP_WORDS=({array}); COMP_CWORD={len(words) - 1}; '
                                        f'COMP_LINE="{line}"; COMP_POINT={len(line)}; '
                                        f'{function} {words[0]} "{words[-1]}" {words[-2]}; '
                                        f'printf "%s\\n" "${{COMPREPLY[@]}}"', str(script)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_manual_pages_and_completions_come_from_the_parsers(tmp_path: Path) -> None:
    share = tmp_path / "share"
    made = run(str(BIN / "python"), "-m", "tools.clidocs", str(share))
    assert made.returncode == 0, made.stderr
    for name, build in PARSERS.items():
        page = share / "man" / "man1" / f"{name}.1"
        checked = run("groff", "-man", "-Tutf8", "-ww", "-z", str(page))   # -ww: every warning
        assert checked.returncode == 0 and checked.stderr == "", checked.stderr
        shown = run("man", "-l", str(page), env={"MANWIDTH": "100", "MANPAGER": "cat", "LC_ALL": "C.UTF-8"})
        assert shown.returncode == 0 and f"{name} - " in shown.stdout, shown.stderr
        assert "--version" in shown.stdout and "--keyfile" not in shown.stdout
        commands = [c for a in build()._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices]
        for command in commands:
            assert f"{name} {command}" in shown.stdout, (name, command)
        zsh = (share / "zsh" / "site-functions" / f"_{name}").read_text()
        assert zsh.startswith(f"#compdef {name}") and all(c in zsh for c in commands)
    isr = share / "bash-completion" / "completions" / "isr"
    assert {"resume", "suspend", "hoard", "checkin", "passwd"} <= set(complete(isr, "_shtab_isr", ["isr", ""]))
    assert complete(isr, "_shtab_isr", ["isr", "resume", "--k"]) == ["--key-file"]   # not the hidden --keyfile
    admin = share / "bash-completion" / "completions" / "isr-admin"
    assert complete(admin, "_shtab_isr_admin", ["isr-admin", "user", ""]) == ["add", "remove", "password", "list"]
    assert (isr.parent / "isr-server").exists()
    isr_page = run("man", "-l", str(share / "man" / "man1" / "isr.1"), env={"MANPAGER": "cat"}).stdout
    assert re.search(r"Exit\s+status:\s+0\s+done,\s+1\s+failed", isr_page) and "130" in isr_page  # from the epilog
