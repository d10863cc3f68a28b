"""The `partc` entry point: parse the command line, run one command, report its errors; a bug
in partc is one line and exit 70, never a traceback."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from partc.cli import commands
from partc.cli.compiling import run_check, run_compile, run_demo, run_shard, run_verify
from partc.cli.completion import run_completion
from partc.cli.diagnostics import flatten_errors, report_errors
from partc.cli.parser import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_MACHINE,
    EXIT_OK,
    MAX_WORLD_SIZE,
    Parser,
    build_parser,
    yaml_file_problem,
)
from partc.cli.resharding import run_merge, run_reshard
from partc.cli.storage import run_calibrate
from partc.errors import (
    MACHINE_ERRNOS,
    LoadError,
    MachineError,
    PartcError,
    SourceLocation,
)

_COMMANDS: dict[str, Any] = {
    "compile": run_compile, "check": run_check, "demo": run_demo, "families": commands.run_families,
    "shard": run_shard, "inspect": commands.run_inspect, "explain": commands.run_explain,
    "report": commands.run_report, "init": commands.run_init, "schema": commands.run_schema,
    "docs": commands.run_docs, "verify": run_verify, "completion": run_completion,
    "reshard": run_reshard, "merge": run_merge, "calibrate": run_calibrate}
"""Each command's function: it takes the parsed arguments and returns the exit status."""


def _quiet_pipe() -> None:
    """The reader of stdout went away (`partc inspect ... | head`): stop without a word.

    stdout is pointed at /dev/null so that the interpreter's final flush cannot fail again.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _internal(exc: BaseException, fmt: str) -> int:
    """Report an exception that is not a PartcError: a bug in partc, never the user's fault."""
    what = f"{type(exc).__name__}: {exc}"
    if fmt == "json":
        print(json.dumps({"ok": False, "errors": [{
            "stage": "internal", "kind": type(exc).__name__, "file": None, "line": None,
            "column": None, "pointer": "", "tensor": None,
            "message": f"internal error (a bug in partc): {what}", "doc": None,
            "see": None}]}, indent=1))
    else:
        print(f"partc: internal error (a bug in partc, please report it): {what}",
              file=sys.stderr)
    if os.environ.get("PARTC_TRACEBACK"):
        traceback.print_exception(exc, file=sys.stderr)
    else:
        print("partc: set PARTC_TRACEBACK=1 to print the traceback", file=sys.stderr)
    return EXIT_INTERNAL


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    Errors in the input (PartcError) are reported, all of them, sorted, and exit 1; a read or
    write the operating system refused (a full disk, no permission) is reported as such with
    exit 74; anything else is a bug in partc, reported in one line (no traceback unless
    PARTC_TRACEBACK is set) with exit 70.
    """
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    Parser.json_errors = any(w == "--format=json" or (w == "--format" and i + 1 < len(words)
                                                       and words[i + 1] == "json")
                              for i, w in enumerate(words))
    args, unknown = parser.parse_known_args(words)
    usage = command_parser(parser, args.command)  # later usage errors end with its section
    if unknown:
        usage.error(f"unrecognized arguments: {' '.join(unknown)}")
    _expand_home(args)
    fmt = getattr(args, "format", "text")
    try:
        _resolve_repo_ids(args)
    except PartcError as error:
        return report_errors([error], fmt)
    layers = getattr(args, "pp_layers", None)
    if layers and args.pp is None:
        args.pp = len(layers)
    elif layers and args.pp != len(layers):
        from partc.api import spelled_stage_units

        usage.error(f"--pp-layers gives {len(layers)} stage sizes "
                     f"({spelled_stage_units(layers)}) but --pp is {args.pp}; expected one unit "
                     "count per pipeline stage")
    if args.command == "compile" and args.pp is None:
        args.pp = 1
    if args.command != "verify" and (
            (getattr(args, "tp", None) or 1) * (getattr(args, "pp", None) or 1) > MAX_WORLD_SIZE):
        usage.error(f"--tp x --pp is {args.tp * args.pp}; partc builds at most "
                     f"{MAX_WORLD_SIZE} ranks")
    if getattr(args, "ep", None) is not None and (
            args.ep * (args.etp or 1) * (args.pp or 1) > MAX_WORLD_SIZE):
        usage.error(f"--ep x --etp x --pp is {args.ep * (args.etp or 1) * (args.pp or 1)}; "
                     f"partc builds at most {MAX_WORLD_SIZE} ranks")
    if args.command == "compile" and args.digests and args.checkpoint is None:
        usage.error("--digests needs --checkpoint: the digests are of the checkpoint's slices "
                    "each rank reads")
    if args.command == "families" and args.copy:
        problem = yaml_file_problem(args.copy[1])
        if problem is not None:
            usage.error(f"argument --copy: {problem}")
    if args.command in ("compile", "check", "init", "verify") and \
            args.checkpoint is not None and not os.path.lexists(args.checkpoint):
        return _missing_checkpoint(args.checkpoint, fmt)
    if args.command in ("compile", "check"):
        _config_beside(args, usage)
    return _run(args, fmt)


def _missing_checkpoint(checkpoint: str, fmt: str) -> int:
    """A --checkpoint that does not exist, reported as what loading it says, not as the
    config.json its folder would have held (a mistyped folder was reported as a missing
    config.json)."""
    from partc.errors import CheckpointError

    return report_errors([CheckpointError("no such checkpoint file or directory",
                                          location=SourceLocation(checkpoint))], fmt)


PATH_ARGUMENTS = ("family", "config", "checkpoint", "out", "expert_placement", "build", "path")
"""The arguments that name files or folders (`family` and `--family` only when a file)."""


def _expand_home(args: argparse.Namespace) -> None:
    """Expand a leading `~` of every path argument to the home folder, as a shell would.

    The shell leaves it alone after `=` (`--out=~/build`) and inside quotes, where it would
    otherwise make a folder named `~` in the working directory. A name no user has
    (`~nobody-here/x`) stays as written.
    """
    for name in PATH_ARGUMENTS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value.startswith("~"):
            setattr(args, name, os.path.expanduser(value))
    copy = getattr(args, "copy", None)
    if copy and copy[1].startswith("~"):
        args.copy = [copy[0], os.path.expanduser(copy[1])]


def _resolve_repo_ids(args: argparse.Namespace) -> None:
    """Replace a --checkpoint, --config or inspect PATH that names nothing on disk but is
    spelled as a Hugging Face repo id with the folder (config.json) of its snapshot in the
    local cache (cli.hub); a path that exists always wins."""
    from partc.cli import hub

    if isinstance(getattr(args, "checkpoint", None), str):
        args.checkpoint = hub.resolve_checkpoint(args.checkpoint)
    if isinstance(getattr(args, "config", None), str):
        args.config = hub.resolve_config(args.config)
    if args.command == "inspect":
        args.path = hub.resolve_checkpoint(args.path, "PATH")


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of one command: its usage errors end with that command's `see:` section."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = action.choices[command]
    return found


_COMPILER_DEPENDENCIES = {"yaml": "pyyaml", "jsonschema": "jsonschema", "jinja2": "jinja2",
                          "shtab": "shtab"}
"""Import name -> distribution of what the compiler needs beyond a runtime-only install."""


def _run(args: argparse.Namespace, fmt: str) -> int:
    """Run one parsed command: errors reported, a closed pipe quiet, bugs in one line."""
    try:
        status: int = _COMMANDS[args.command](args)
        return status
    except PartcError as error:
        errors = flatten_errors(error)
        status = report_errors(errors, fmt)
        machine = errors and all(isinstance(e, MachineError) for e in errors)
        return EXIT_MACHINE if machine and status != EXIT_OK else status
    except BrokenPipeError:
        _quiet_pipe()
        return EXIT_OK
    except KeyboardInterrupt:
        print("partc: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ModuleNotFoundError as exc:
        if exc.name not in _COMPILER_DEPENDENCIES:
            return _internal(exc, fmt)
        return report_errors([LoadError(
            f"partc {args.command} needs the compiler's dependencies, and this install lacks "
            f"{_COMPILER_DEPENDENCIES[exc.name]} (a runtime-only install, README \"Serving "
            "images\", loads builds only): pip install partc with its dependencies")], fmt)
    except Exception as exc:  # the last line of defence against tracebacks
        if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG:
            from partc.front.load import long_path_error

            return report_errors([long_path_error(
                os.fsdecode(exc.filename) if exc.filename is not None else "",
                f"a path of partc {args.command}")], fmt)
        refused = _machine_refusal(args.command, exc)
        if refused is None:
            return _internal(exc, fmt)
        report_errors([refused], fmt)
        return EXIT_MACHINE


def _machine_refusal(command: str, exc: BaseException) -> MachineError | None:
    """The MachineError of an exception no step turned into a PartcError, when the operating
    system refused a read or write (an OSError, or the safetensors library's error wrapping
    one: "I/O error: No space left on device (os error 28)"); None for anything else (a bug)."""
    import re
    import tempfile

    if isinstance(exc, OSError):
        number, text = exc.errno, exc.strerror or str(exc)
        if exc.filename is not None:
            text += f": {os.fsdecode(exc.filename)}"
    elif type(exc).__name__ == "SafetensorError" and (
            found := re.search(r"\(os error (\d+)\)", str(exc))):
        number, text = int(found.group(1)), str(exc)
    else:
        return None
    if number not in MACHINE_ERRNOS:
        return None
    advice = ""
    if number in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        advice = "; free space on that file system"
        if command in ("verify", "demo"):  # they write scratch checkpoints and builds
            advice += (f", or point TMPDIR at a folder with room (scratch folders go under "
                       f"{tempfile.gettempdir()})")
    return MachineError(f"partc {command}: the machine refused a read or write: {text}"
                        f"{advice}")


def _config_beside(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Take --config from beside the --checkpoint (its folder, or the folder of its file) when
    config.json is there, as `partc init` does."""
    if args.config is not None:
        return
    beside = commands.config_beside(Path(args.checkpoint or "."))
    if args.checkpoint and beside.is_file():
        args.config = str(beside)  # an HF checkpoint carries its config
    elif args.command == "compile":
        where = (f"; there is no {beside}" if args.checkpoint else "")
        parser.error("compile needs --config (or a --checkpoint folder holding config.json, or "
                     f"a --checkpoint file with config.json beside it){where}")
    elif args.checkpoint or args.tp or args.pp or args.pp_layers or args.policy or args.ep:
        parser.error("--checkpoint, --tp, --pp, --pp-layers and --policy check a binding: "
                     "pass --config (or a checkpoint folder holding config.json, or a checkpoint "
                     "file with config.json beside it)")
