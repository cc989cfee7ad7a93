"""A manual page (roff, man(7) macros) from an argparse parser: NAME, SYNOPSIS, DESCRIPTION, OPTIONS, then every
subcommand with its synopsis, description and options, and the parser's epilog.

Text is taken as the help shows it: a paragraph with an indented line (examples, tables) stays as it is
written (``.nf``), any other flows. Usage lines are formatted 80 columns wide whatever the terminal, so the
page is the same on every machine.
"""
from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from typing import cast

WIDTH = 80


def escape(text: str) -> str:
    """Text safe in roff: backslashes, hyphens (as minus signs, so that options copy as typed), and a line
    that would start with a control character."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line for line in text.split("\n"))


def paragraphs(text: str | None) -> list[str]:
    """``text`` as roff paragraphs."""
    out: list[str] = []
    for block in re.split(r"\n\s*\n", (text or "").strip("\n")):
        lines = block.rstrip().split("\n")
        if not block.strip():
            continue
        if any(line.startswith((" ", "\t")) for line in lines):
            out.append(".nf\n" + escape("\n".join(lines)) + "\n.fi")
        else:
            out.append(escape(" ".join(line.strip() for line in lines)))
    return out


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    # typeshed types formatter_class as a callable of prog alone; every HelpFormatter takes width too.
    return cast(type[argparse.HelpFormatter], parser.formatter_class)(prog=parser.prog, width=WIDTH)


def synopsis(parser: argparse.ArgumentParser) -> str:
    formatter = _formatter(parser)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return ".nf\n" + escape(formatter.format_help().strip("\n")) + "\n.fi"


def _shown(action: argparse.Action) -> bool:
    return action.help != argparse.SUPPRESS and not isinstance(action, (argparse._SubParsersAction,
                                                                         argparse._HelpAction))


def options(parser: argparse.ArgumentParser) -> Iterator[str]:
    """A tagged paragraph (``.TP``) for each argument of ``parser`` that its help shows (but --help)."""
    formatter = _formatter(parser)
    for action in parser._actions:
        if not _shown(action):
            continue
        invocation = formatter._format_action_invocation(action)
        text = formatter._expand_help(action) if action.help else ""
        yield f".TP\n\\fB{escape(invocation)}\\fR\n{escape(' '.join(text.split()))}"


def subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[argparse.ArgumentParser, str]]:
    """Every subcommand parser below ``parser`` (depth first, in the order of the help) with its help line."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield sub, helps.get(name, "")
                yield from subcommands(sub)


def manpage(parser: argparse.ArgumentParser, summary: str, version: str, date: str = "",
            see_also: tuple[str, ...] = ()) -> str:
    """The manual page (section 1) of the program whose parser is ``parser``."""
    name = parser.prog
    out = [f'.TH "{name.upper()}" "1" "{date}" "ISR {version}" "ISR manual"',
           ".SH NAME", f"{escape(name)} \\- {escape(summary)}",
           ".SH SYNOPSIS", synopsis(parser),
           ".SH DESCRIPTION", *(".PP\n" + p for p in paragraphs(parser.description))]
    own = list(options(parser))
    if own:
        out += [".SH OPTIONS", *own]
    subs = list(subcommands(parser))
    if subs:
        out.append(".SH COMMANDS")
        for sub, help_text in subs:
            out += [f'.SS "{escape(sub.prog)}"', synopsis(sub)]
            described = sub.description or help_text
            out += [".PP\n" + p for p in paragraphs(described)]
            out += list(options(sub))
    if parser.epilog:
        out += [".SH NOTES", *(".PP\n" + p for p in paragraphs(parser.epilog))]
    if see_also:
        out += [".SH SEE ALSO", ",\n".join(f"\\fB{escape(other)}\\fR(1)" for other in see_also)]
    return "\n".join(out) + "\n"
