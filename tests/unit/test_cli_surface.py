"""The command line is an interface users script against: its commands, options, defaults and choices are frozen
here (tests/unit/golden/cli_surface.txt). Change them on purpose: SHARDPLAN_REGOLD=1 rewrites the file."""

from __future__ import annotations

import argparse
import os
import pathlib

from shardplan.cli import build_parser

GOLDEN = pathlib.Path(__file__).with_name("golden") / "cli_surface.txt"


def _surface(parser: argparse.ArgumentParser, prefix: str = "shardplan") -> list[str]:
    lines = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in sorted(action.choices.items()):
                lines.append(f"{prefix} {name}")
                lines += _surface(sub, f"{prefix} {name}")
        elif not isinstance(action, argparse._HelpAction):
            flags = ",".join(action.option_strings) or f"<{action.dest}>"
            lines.append(
                f"{prefix} {flags} dest={action.dest} default={action.default!r} "
                f"required={action.required} choices={action.choices!r} nargs={action.nargs!r}"
            )
    return lines


def test_cli_surface_is_frozen():
    text = "\n".join(_surface(build_parser())) + "\n"
    if os.environ.get("SHARDPLAN_REGOLD"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), f"the CLI changed:\n{text}"
