"""Write docs/cli.md, the command-line reference, from the argparse parser (`--check`: compare)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from partc.cli.parser import EXIT_CODES, build_parser

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "docs" / "cli.md"


def _options(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | meaning |", "| --- | --- |"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
        if action.choices and not isinstance(action, argparse._SubParsersAction):
            name += " (" + " \\| ".join(str(c) for c in action.choices) + ")"
        meaning = (action.help or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {name} | {meaning} |")
    return rows


def reference() -> str:
    """The Markdown text of docs/cli.md."""
    os.environ["COLUMNS"] = "100"  # argparse wraps usage to the terminal: fix it
    parser = build_parser()
    lines = ["# partc command line", "",
             "Generated from the argparse parser by `python scripts/cli_reference.py`; do not "
             "edit (tests/test_tools.py checks it is up to date).", "",
             "```", parser.format_usage().strip(), "```", "", "## Exit status", "",
             "| status | meaning |", "| --: | --- |"]
    lines += [f"| {code} | {meaning} |" for code, meaning in EXIT_CODES]
    lines += ["", "Under `--format json` every outcome is one JSON document on stdout with an "
              "`ok` field, usage errors included (`\"stage\": \"usage\"`).", "",
              "A file or folder argument that starts with `~` names the home folder, as in a "
              "shell, also where the shell leaves it alone (`--out=~/build`, quotes).", ""]
    lines += ["## Global options", ""] + _options(parser) + [""]
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in commands._choices_actions}
    for name, sub in commands.choices.items():
        lines += [f"## partc {name}", "", helps.get(name) or "", ""]
        if sub.description:
            lines += [sub.description, ""]
        lines += ["```", sub.format_usage().strip(), "```", ""] + _options(sub) + [""]
    return "\n".join(lines)


def main() -> int:
    """Write (or with --check, compare) docs/cli.md."""
    text = reference()
    if "--check" in sys.argv[1:]:
        if TARGET.read_text(encoding="utf-8") != text:
            print(f"{TARGET} is out of date: run python scripts/cli_reference.py")
            return 1
        return 0
    TARGET.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
