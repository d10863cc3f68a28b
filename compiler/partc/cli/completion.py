"""`partc completion bash|zsh`: a shell completion script generated from the command line's
own parser by shtab, with file and folder completion for the arguments that name them and the
built-in family names and guide topics as words."""

from __future__ import annotations

import argparse
import sys

from partc.cli.parser import build_parser

_FOLDERS = {("compile", "out"), ("shard", "out"), ("demo", "out"), ("shard", "build"),
            ("explain", "build"), ("report", "build")}
"""(command, argument) pairs that name a folder; the other path arguments name a file or a
folder (a checkpoint is either)."""
_PATHS = {"config", "checkpoint", "out", "expert_placement", "build", "path", "family"}
"""Arguments completed with file names (cli.main.PATH_ARGUMENTS, less --copy's pair)."""
FAMILY_FUNCTION = "_shtab_partc_family"
"""The completion function of the family argument: a built-in name or a file."""


def _preamble(shell: str, names: list[str]) -> str:
    """The completion function of the family argument, in the shell's language."""
    words = " ".join(names)
    if shell == "bash":
        return (f"{FAMILY_FUNCTION}() {{\n"
                f"  compgen -W \"{words}\" -- \"$1\"\n"
                "  compgen -f -- \"$1\"\n"
                "}\n")
    return (f"{FAMILY_FUNCTION}() {{\n"
            f"  _alternative 'builtin:built-in family:({words})' 'file:family file:_files'\n"
            "}\n")


def _command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command's parser, by name."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def completion_script(shell: str) -> str:
    """The completion script of `partc` for `shell` (bash or zsh)."""
    import shtab

    from partc.cli.commands import doc_topics
    from partc.library import builtin_families

    parser = build_parser()
    for command, sub in _command_parsers(parser).items():
        for action in sub._actions:
            if action.dest == "family" and not action.option_strings:
                action.complete = {"bash": FAMILY_FUNCTION,  # type: ignore[attr-defined]
                                   "zsh": FAMILY_FUNCTION}
            elif (command, action.dest) in _FOLDERS:
                action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
            elif action.dest in _PATHS:
                action.complete = shtab.FILE  # type: ignore[attr-defined]
            elif command == "docs" and action.dest == "topic":
                action.choices = doc_topics()
    script: str = shtab.complete(parser, shell,
                                 preamble=_preamble(shell, sorted(builtin_families())))
    return script


def run_completion(args: argparse.Namespace) -> int:
    """`partc completion SHELL`: print the script on stdout."""
    sys.stdout.write(completion_script(args.shell))
    return 0
