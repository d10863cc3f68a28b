"""The `partc` command line: compile, check, demo, families, shard and verify."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from partc import __version__
from partc.errors import PartcError, PartcErrors

EXIT_OK = 0
"""Success."""
EXIT_ERRORS = 1
"""The input had errors; they were reported."""
EXIT_USAGE = 2
"""The command line itself was wrong."""
EXIT_INTERNAL = 70
"""A bug in partc."""


def _stage_units(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated unit counts such as 3,5,4, found {text!r}") from None
    if any(v < 1 for v in values):
        bad = next(v for v in values if v < 1)
        raise argparse.ArgumentTypeError(
            f"every pipeline stage needs at least one unit: expected positive counts such as "
            f"3,5,4, found {bad} in {text!r}")
    return values


MAX_PARALLEL_SIZE = 1024
"""Largest --tp or --pp the command line accepts."""
MAX_WORLD_SIZE = 4096
"""Largest TP x PP the command line accepts."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {value}")
    if value > MAX_PARALLEL_SIZE:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_PARALLEL_SIZE}, found {value}")
    return value


FAMILY_HELP = ("family file or built-in family name (default: the built-in family of the "
               "config's model_type). A name ending in .yaml, .yml or .toml, holding a `/`, or "
               "naming an existing file is a file; anything else is a built-in name, even when a "
               "folder of that name exists here")
"""How the family argument is read (api.family_spec_is_file)."""


def _add_topology(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument("--tp", type=_positive, default=None if not required else 1,
                        help="tensor-parallel size T (default 1)")
    parser.add_argument("--pp", type=_positive, default=None,
                        help="pipeline-parallel size S (default 1, or the number of "
                             "--pp-layers counts)")
    parser.add_argument("--pp-layers", type=_stage_units, default=None,
                        help="explicit units per pipeline stage, e.g. 3,5,4 (one count per "
                             "stage, summing to the model's units)")
    parser.add_argument("--policy", choices=["require", "replicate-unsupported"], default=None,
                        help="what to do with shards illegal for the topology (default: the "
                             "family's, else require)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="partc", description="Compile LLM family descriptions into rank-local loaders.")
    parser.add_argument("--version", action="version", version=f"partc {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    compile_ = commands.add_parser("compile", help="write plan.json and the rank loader package")
    compile_.add_argument("family", nargs="?", default=None, help=FAMILY_HELP)
    compile_.add_argument("--config", required=True, help="the model's config.json")
    _add_topology(compile_, required=True)
    compile_.add_argument("--activation-dtype", default="bfloat16",
                          choices=["float16", "bfloat16", "float32"],
                          help="dtype of activations crossing pipeline cuts")
    compile_.add_argument("--checkpoint", default=None,
                          help="checkpoint to validate and fingerprint the plan against")
    compile_.add_argument("--out", required=True,
                          help="output folder: new, empty, or a build partc wrote (marked by "
                               ".partc-build.json); replaced atomically, never the checkpoint, "
                               "the config or the working directory")
    compile_.add_argument("--force", action="store_true",
                          help="write through a symbolic link --out into its target folder "
                               "(kept as the link), or replace a partc shard set; never deletes "
                               "files partc did not write")
    compile_.add_argument("--digests", action="store_true",
                          help="with --checkpoint: read every rank's slices once and record their "
                               "sha256 in the plan, for load(..., verify='digest')")
    compile_.add_argument("--format", choices=["text", "json"], default="text")

    check = commands.add_parser("check", help="validate without writing anything")
    check.add_argument("family", nargs="?", default=None, help=FAMILY_HELP)
    check.add_argument("--config", default=None, help="a config.json to bind to")
    check.add_argument("--checkpoint", default=None, help="a checkpoint to check ownership of")
    _add_topology(check, required=False)
    check.add_argument("--format", choices=["text", "json"], default="text")

    demo = commands.add_parser("demo", help="compile and load the embedded tiny Llama")
    demo.add_argument("--tp", type=_positive, default=2)
    demo.add_argument("--pp", type=_positive, default=2)
    demo.add_argument("--out", default=None, help="where to write the build (default: temp)")

    commands.add_parser("families", help="list the built-in families and their model types")

    shard = commands.add_parser("shard", help="cut a checkpoint into one file per rank of a "
                                              "build, for sequential loading")
    shard.add_argument("build", help="a folder written by `partc compile`")
    shard.add_argument("--checkpoint", required=True, help="the checkpoint folder or file")
    shard.add_argument("--out", required=True,
                       help="output folder: new, empty, or a shard set partc wrote (marked by "
                            ".partc-build.json); replaced atomically, never the checkpoint or "
                            "the build; the manifest records every tensor's sha256")
    shard.add_argument("--force", action="store_true",
                       help="write through a symbolic link --out into its target folder (kept "
                            "as the link), or replace a partc build; never deletes files partc "
                            "did not write")
    shard.add_argument("--no-verify-fingerprint", action="store_true",
                       help="accept a checkpoint whose header differs from the plan's fingerprint"
                            " (names, dtypes and shapes are still checked)")
    shard.add_argument("--format", choices=["text", "json"], default="text")

    verify = commands.add_parser("verify", help="check the split against Hugging Face "
                                 "transformers' modeling code (needs partc[verify])")
    verify.add_argument("family", nargs="?", default=None, help=FAMILY_HELP)
    verify.add_argument("--config", required=True, help="the model's config.json (shrunk to "
                        "a tiny random model of the same structure when large)")
    verify.add_argument("--tp", type=_size_list, default=None,
                        help="tensor-parallel sizes, e.g. 1,2,4 (default: every T up to 8 "
                             "that compiles)")
    verify.add_argument("--pp", type=_positive, default=None,
                        help="pipeline stages of the pipeline check (default 2; 1 skips it)")
    verify.add_argument("--policy", choices=["require", "replicate-unsupported"], default=None,
                        help="sharding policy for groups that cannot be sharded")
    verify.add_argument("--seed", type=int, default=0, help="seed of the random model")
    verify.add_argument("--format", choices=["text", "json"], default="text")
    return parser


def _size_list(text: str) -> tuple[int, ...]:
    values = tuple(_positive(v) for v in text.split(","))
    if any(v > MAX_WORLD_SIZE for v in values):
        raise argparse.ArgumentTypeError(f"tensor-parallel sizes must be at most "
                                         f"{MAX_WORLD_SIZE}, found {text!r}")
    return values


def _policy(value: str | None):  # type: ignore[no-untyped-def]
    from partc.parallel.specs import ShardingPolicy

    return None if value is None else ShardingPolicy(value.replace("-", "_"))


BUILTIN_FILES = "architectures/"
"""How messages name a built-in family file (read from the package's resources)."""
CONTEXT_WIDTH = 100
"""Longest source line shown under an error; a longer one is cut around the column."""
_MAX_SOURCE_BYTES = 64 << 20


def _source_text(file: str) -> str | None:
    """The text of a located file: on disk, else a built-in family; None when unreadable."""
    try:
        path = Path(file)
        if path.is_file() and path.stat().st_size <= _MAX_SOURCE_BYTES:
            return path.read_bytes().decode("utf-8", "replace")
        if file.startswith(BUILTIN_FILES):
            resource = resources.files("partc.architectures").joinpath(file[len(BUILTIN_FILES):])
            return resource.read_bytes().decode("utf-8", "replace") if resource.is_file() else None
    except (OSError, ValueError):
        pass
    return None


def _caret_context(error: PartcError) -> list[str]:
    """The offending source line and a caret under its column, as lark shows them.

    Nothing when the error has no line, or its file cannot be read. Tabs before the column are
    kept so that the caret lines up; unprintable characters are shown as `?`.
    """
    where = error.location
    if where is None or where.line <= 0 or not where.file:
        return []
    text = _source_text(where.file)
    if text is None:
        return []
    lines = text.split("\n")  # the loaders count lines at "\n" (and "\r\n")
    if where.line > len(lines):
        return []
    line = "".join(c if c.isprintable() or c == "\t" else "?" for c in lines[where.line - 1]
                   .removesuffix("\r"))
    column = min(max(where.column, 0), len(line) + 1)
    start = 0
    if len(line) > CONTEXT_WIDTH:  # a window around the column, cut marks on both sides
        start = max(0, min(column - 1 - CONTEXT_WIDTH // 2, len(line) - CONTEXT_WIDTH))
        cut = line[start:start + CONTEXT_WIDTH]
        shown = ("..." if start else "") + cut + ("..." if start + CONTEXT_WIDTH < len(line)
                                                   else "")
    else:
        shown = line
    if column <= 0:
        return [f"    {shown}"]
    pad = "".join("\t" if c == "\t" else " " for c in line[start:column - 1])
    return [f"    {shown}", f"    {'   ' if start else ''}{pad}^"]


def _report(errors: Sequence[PartcError], fmt: str) -> int:
    ordered = sorted(errors, key=PartcError.sort_key)
    if fmt == "json":
        print(json.dumps({"ok": False, "errors": [e.to_json() for e in ordered]}, indent=1))
    else:
        for error in ordered:
            print(f"error: {error}", file=sys.stderr)
            for line in _caret_context(error):
                print(line, file=sys.stderr)
        print(f"partc: {len(ordered)} error(s)", file=sys.stderr)
    return EXIT_ERRORS


def _flatten(error: PartcError) -> list[PartcError]:
    return list(error.errors) if isinstance(error, PartcErrors) else [error]


def _compile(args: argparse.Namespace) -> int:
    from partc.api import compile_family

    result = compile_family(
        args.family, args.config, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
        stage_units=args.pp_layers, policy=_policy(args.policy),
        activation_dtype=args.activation_dtype, checkpoint=args.checkpoint, out=args.out,
        force=args.force, digests=args.digests)
    plan = result.plan
    if args.format == "json":
        print(json.dumps({"ok": True, "errors": [], "out": str(result.out), "plan_hash":
                          plan.plan_hash, "files": sorted(result.files)}, indent=1))
        return EXIT_OK
    print(f"compiled {plan.family} ({plan.model_type}) for TP={plan.topology.tensor_parallel_size}"
          f" x PP={plan.topology.pipeline_parallel_size} into {result.out}")
    _print_ranks(plan)
    return EXIT_OK


def _print_ranks(plan, loaded=None) -> None:  # type: ignore[no-untyped-def]
    print(f"{'rank':>4} {'tp':>3} {'stage':>5} {'units':>13} {'tensors':>7} {'local MiB':>10} "
          f"{'static roles'}")
    for rank in plan.ranks:
        part = rank.partition
        units = ", ".join(f"{g.group}[{g.unit_range[0]}:{g.unit_range[1]}]" for g in part.groups)
        line = (f"{rank.rank:>4} {rank.tensor_parallel_rank:>3} {rank.pipeline_stage:>5} "
                f"{units:>13} {rank.info.owned_tensors:>7} "
                f"{rank.info.local_parameter_bytes / 2**20:>10.3f} "
                f"{', '.join(part.ownership.static_roles) or '-'}")
        if loaded is not None:
            line += f"  loaded {loaded[rank.rank]}"
        print(line)


def _check(args: argparse.Namespace) -> int:
    from partc.api import check_family
    from partc.plan import Topology

    topology = None
    if args.tp is not None or args.pp is not None or args.pp_layers or args.policy:
        topology = Topology(tensor_parallel_size=args.tp or 1, pipeline_parallel_size=args.pp or 1,
                            stage_units=args.pp_layers, policy=_policy(args.policy))
    errors = check_family(args.family, args.config, args.checkpoint, topology=topology)
    if errors:
        return _report(errors, args.format)
    if args.format == "json":
        print(json.dumps({"ok": True, "errors": []}))
    else:
        what = ["family"] + (["config binding"] if args.config else []) + (
            ["checkpoint"] if args.checkpoint else []) + (["topology"] if topology else [])
        print(f"ok: {', '.join(what)} checked")
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    import importlib
    import sys as _sys

    from partc.api import compile_family

    example = resources.files("partc.examples").joinpath("tiny-llama")
    with resources.as_file(example) as folder, tempfile.TemporaryDirectory() as scratch:
        out = Path(args.out) if args.out else Path(scratch) / "build"
        result = compile_family("llama", folder / "config.json", tensor_parallel_size=args.tp,
                                pipeline_parallel_size=args.pp, out=out)
        plan = result.plan
        layers = dict(plan.config_values)["num_hidden_layers"]
        print(f"partc demo: embedded tiny Llama ({layers} layers) "
              f"at TP={args.tp} x PP={args.pp}, build in {out}")
        from partc.emit.render import package_name

        _sys.path.insert(0, str(out))
        try:
            package = importlib.import_module(package_name(plan))
            loaded = {}
            for rank in plan.ranks:
                state = package.load(folder, rank=rank.rank)
                total = sum(a.nbytes for a in state.tensors.values())
                loaded[rank.rank] = f"{len(state.tensors)} arrays, {total} bytes"
        finally:
            _sys.path.remove(str(out))
            for name in list(_sys.modules):
                if name.startswith(package_name(plan)):
                    del _sys.modules[name]
        _print_ranks(plan, loaded)
    return EXIT_OK


def _families(_: argparse.Namespace) -> int:
    from partc.library import builtin_families

    for model_type, file in sorted(builtin_families().items()):
        print(f"{model_type:<20} architectures/{file}")
    return EXIT_OK


def _shard(args: argparse.Namespace) -> int:
    from partc.shard import shard_checkpoint

    result = shard_checkpoint(args.build, args.checkpoint, args.out,
                              verify_fingerprint=not args.no_verify_fingerprint,
                              force=args.force)
    if args.format == "json":
        print(json.dumps({"ok": True, "out": str(result.out), "plan_hash": result.plan_hash,
                          "files": list(result.files), "bytes": result.nbytes}, indent=1))
        return EXIT_OK
    print(f"sharded {args.checkpoint} for plan {result.plan_hash[:16]} into {result.out}: "
          f"{len(result.files)} rank files, {result.nbytes / 2**20:.1f} MiB")
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from partc.verify.run import verify_family

    report = verify_family(args.family, args.config, tensor_parallel_sizes=args.tp,
                           pipeline_parallel_size=args.pp, policy=_policy(args.policy),
                           seed=args.seed)
    if args.format == "json":
        print(json.dumps(report.to_json(), indent=1))
        return EXIT_OK if report.ok else EXIT_ERRORS
    for note in report.notes:
        print(f"note: {note}")
    for skipped in report.skipped:
        print(f"skipped T={skipped['tp']} x S={skipped['pp']}: {skipped['reason']}")
    topologies = sorted({(c.tp, c.pp) for c in report.checks})
    for tp, pp in topologies:
        mine = [c for c in report.checks if (c.tp, c.pp) == (tp, pp)]
        failed = sum(not c.ok for c in mine)
        print(f"T={tp} x S={pp}: {len(mine) - failed}/{len(mine)} checks hold")
    failure = report.first_failure
    if failure is not None:
        print(f"error: {failure.message}", file=sys.stderr)
        return EXIT_ERRORS
    if not report.checks:
        print("error: no topology compiled, nothing was verified", file=sys.stderr)
        return EXIT_ERRORS
    print(f"verified {report.family} ({report.model_type}): every check holds")
    return EXIT_OK


_COMMANDS = {"compile": _compile, "check": _check, "demo": _demo, "families": _families,
             "shard": _shard, "verify": _verify}


def _internal(exc: BaseException, fmt: str) -> int:
    """Report an exception that is not a PartcError: a bug in partc, never the user's fault."""
    what = f"{type(exc).__name__}: {exc}"
    if fmt == "json":
        print(json.dumps({"ok": False, "errors": [{
            "stage": "internal", "kind": type(exc).__name__, "file": None, "line": None,
            "column": None, "pointer": "", "tensor": None,
            "message": f"internal error (a bug in partc): {what}"}]}, indent=1))
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

    Errors in the input (PartcError) are reported, all of them, sorted, and exit 1; anything
    else is a bug in partc, reported in one line (no traceback unless PARTC_TRACEBACK is set)
    with exit 70.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    fmt = getattr(args, "format", "text")
    layers = getattr(args, "pp_layers", None)
    if layers and args.pp is None:
        args.pp = len(layers)
    elif layers and args.pp != len(layers):
        parser.error(f"--pp-layers gives {len(layers)} stage sizes "
                     f"({','.join(map(str, layers))}) but --pp is {args.pp}; expected one unit "
                     "count per pipeline stage")
    if args.command == "compile" and args.pp is None:
        args.pp = 1
    if args.command != "verify" and (
            (getattr(args, "tp", None) or 1) * (getattr(args, "pp", None) or 1) > MAX_WORLD_SIZE):
        parser.error(f"--tp x --pp is {args.tp * args.pp}; partc builds at most "
                     f"{MAX_WORLD_SIZE} ranks")
    if args.command == "check" and args.config is None and (
            args.checkpoint or args.tp or args.pp or args.pp_layers or args.policy):
        beside = Path(args.checkpoint or "") / "config.json"
        if args.checkpoint and beside.is_file():
            args.config = str(beside)  # an HF checkpoint folder carries its config
        else:
            parser.error("--checkpoint, --tp, --pp, --pp-layers and --policy check a binding: "
                         "pass --config (or a checkpoint folder holding config.json)")
    try:
        return _COMMANDS[args.command](args)
    except PartcError as error:
        return _report(_flatten(error), fmt)
    except KeyboardInterrupt:
        print("partc: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the last line of defence against tracebacks
        return _internal(exc, fmt)


if __name__ == "__main__":
    sys.exit(main())
