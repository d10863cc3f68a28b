"""The `partc` command line: compile, check, inspect, explain, report, init, shard, verify."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

from partc import __version__, commands
from partc.errors import PartcError, PartcErrors

EXIT_OK = 0
"""Success."""
EXIT_ERRORS = 1
"""The input had errors; they were reported."""
EXIT_USAGE = 2
"""The command line itself was wrong."""
EXIT_INTERNAL = 70
"""A bug in partc."""
EXIT_INTERRUPTED = 130
"""Interrupted (Ctrl-C)."""
EXIT_CODES = ((EXIT_OK, "success (also when output stops early because a pipe was closed)"),
              (EXIT_ERRORS, "the input had errors; every one was reported"),
              (EXIT_USAGE, "the command line itself was wrong"),
              (EXIT_INTERNAL, "a bug in partc (PARTC_TRACEBACK=1 prints the traceback)"),
              (EXIT_INTERRUPTED, "interrupted"))
"""Every exit status and what it means (documented in --help and docs/cli.md)."""
FORMAT_HELP = "text: human tables on stdout, errors on stderr; json: one JSON document on stdout"
"""Help of every --format option."""


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors come out as JSON under `--format json`."""

    json_errors = False
    """Set by main when the command line asks for --format json."""

    def error(self, message: str) -> NoReturn:
        """Report a usage error (as JSON when asked for) and exit 2."""
        if _Parser.json_errors:
            print(json.dumps({"ok": False, "errors": [{
                "stage": "usage", "kind": "usage", "file": None, "line": None, "column": None,
                "pointer": "", "tensor": None, "message": f"{self.prog}: error: {message}",
                "doc": "cli", "see": commands.error_reference("cli")}]},
                indent=1))
            sys.exit(EXIT_USAGE)
        super().error(message)


def _stage_units(text: str) -> Any:
    """Unit counts per stage (`3,5,4`), or a stage layout naming groups (`vision*3|decoder*2`)."""
    from partc.partition.stages import is_named_layout, parse_stage_layout

    if is_named_layout(text):
        try:
            return parse_stage_layout(text)
        except PartcError as exc:
            raise argparse.ArgumentTypeError(exc.message) from None
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


def _group_mode(text: str) -> tuple[str, Any]:
    """`vision=replicated`: an execution group and its parallel mode."""
    from partc.partition.ownership import GroupParallelMode

    group, _, mode = text.partition("=")
    modes = ", ".join(m.value for m in GroupParallelMode)
    if not group or mode not in {m.value for m in GroupParallelMode}:
        raise argparse.ArgumentTypeError(f"expected GROUP=MODE with MODE one of {modes}, found "
                                         f"{text!r}")
    return group, GroupParallelMode(mode)


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
                             "stage, summing to the model's units), or per stage and "
                             "execution group in the layout notation partc prints, e.g. "
                             "'vision*3,projector|decoder*2' (stages split by `|`)")
    parser.add_argument("--group-mode", type=_group_mode, action="append", default=None,
                        metavar="GROUP=MODE",
                        help="parallel mode of an execution group, overriding the family's "
                             "`parallel:`: split, replicated, one_stage or "
                             "replicated_one_stage (repeatable)")
    parser.add_argument("--policy", choices=["require", "replicate-unsupported"], default=None,
                        help="what to do with shards illegal for the topology (default: the "
                             "family's, else require)")
    parser.add_argument("--ep", type=_positive, default=None,
                        help="expert-parallel size E: each stage gets E x --etp ranks, the "
                             "routed experts placed on the E EP ranks and the dense parts "
                             "split over --tp ranks, repeated (docs/expert_parallel.md)")
    parser.add_argument("--etp", type=_positive, default=None,
                        help="expert-tensor-parallel size X: ranks splitting each expert on "
                             "its intermediate dimension (default 1; needs --ep)")
    parser.add_argument("--expert-placement", default=None, metavar="FILE",
                        help="JSON placement {\"ranks\": [[expert ids of EP rank 0], ...]} "
                             "(default: balanced contiguous ranges; an expert on several ranks "
                             "is a redundant copy; needs --ep)")


def _epilog() -> str:
    codes = "\n".join(f"  {code:>3}  {meaning}" for code, meaning in EXIT_CODES)
    return (f"exit status:\n{codes}\n\nDocumentation: `partc docs` prints where the installed "
            "guides are (authoring, cli, faults).")


def _add_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=["text", "json"], default="text", help=FORMAT_HELP)


def _add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="draw no progress on stderr (progress is drawn only when stderr is "
                             "a terminal and --format is text; errors are always reported)")


def _progress_enabled(args: argparse.Namespace) -> bool | None:
    """None (draw when stderr is a terminal) for text output, False under --format json or
    --quiet: the steps of a long command are drawn on stderr and cleared when it ends."""
    return None if args.format == "text" and not getattr(args, "quiet", False) else False


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="partc", description="Compile LLM family descriptions into rank-local loaders.",
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"partc {__version__}",
                        help="print the partc version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=_Parser)

    compile_ = commands.add_parser("compile", help="write plan.json and the rank loader package",
                                   description="Bind a family to a config, realize it for "
                                   "TP x PP and write plan.json and one loader module per rank.")
    compile_.add_argument("family", nargs="?", default=None, help=FAMILY_HELP)
    compile_.add_argument("--config", default=None,
                          help="the model's config.json (default: config.json in the "
                               "--checkpoint folder)")
    _add_topology(compile_, required=True)
    compile_.add_argument("--activation-dtype", default=None,
                          choices=["float16", "bfloat16", "float32"],
                          help="dtype of activations crossing pipeline cuts (default: the "
                               "model's own, the most common float dtype of its tensors)")
    compile_.add_argument("--split", choices=["balanced", "chunk"], default="balanced",
                          help="how uneven splits give out the remainder: balanced (the first "
                               "n mod T ranks get one more) or chunk (torch.chunk's rule, which "
                               "DTensor's Shard and transformers follow; docs/torch.md)")
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
    _add_format(compile_)
    _add_quiet(compile_)

    check = commands.add_parser("check", help="validate without writing anything",
                                description="Validate a family; with --config its binding, "
                                "with --checkpoint the checkpoint's tensors, with a topology "
                                "the plan (and print its per-stage summary).")
    check.add_argument("family", nargs="?", default=None, help=FAMILY_HELP)
    check.add_argument("--config", default=None,
                       help="a config.json to bind to (default with --checkpoint: the "
                            "config.json in its folder)")
    check.add_argument("--checkpoint", default=None, help="a checkpoint to check ownership of")
    _add_topology(check, required=False)
    _add_format(check)
    _add_quiet(check)

    inspect = commands.add_parser(
        "inspect", help="show a build's totals, fallbacks and tensors, or a checkpoint's "
                        "inventory",
        description="For a build (a folder holding plan.json): per-stage and per-rank totals and "
                    "every fallback; with --rank/--group/--target a table of tensors. For a "
                    "checkpoint: its inventory with layer and expert numbers collapsed.")
    inspect.add_argument("path", help="a build folder, a plan.json, or a checkpoint (folder or "
                                      ".safetensors file)")
    inspect.add_argument("--rank", type=int, default=None,
                         help="list the tensors of this global rank")
    inspect.add_argument("--group", default=None,
                         help="list the tensors of the groups matching this glob "
                              "(e.g. 'model.layers.3.*')")
    inspect.add_argument("--target", default=None,
                         help="list the tensors whose checkpoint name matches this glob")
    inspect.add_argument("--family", default=None,
                         help="the family file the build was compiled from, to show the line "
                              "of each split (built-in families are found by themselves)")
    _add_format(inspect)

    explain = commands.add_parser(
        "explain", help="why one tensor or group is split the way it is",
        description="Group, role, units, every rank's range and placement of a tensor or a "
                    "group, and the reasons: policy fallback, KV replication, alignment, the "
                    "family line.")
    explain.add_argument("build", help="a build folder (or its plan.json)")
    explain.add_argument("target", help="a checkpoint tensor name or a group name")
    explain.add_argument("--family", default=None,
                         help="the family file the build was compiled from (for its line)")
    _add_format(explain)

    report = commands.add_parser(
        "report", help="write one self-contained HTML report of a build",
        description="An HTML page with no network access: ownership map (ranks x units), bytes "
                    "per rank by role, the boundary wire schema and the fallbacks.")
    report.add_argument("build", help="a build folder (or its plan.json)")
    report.add_argument("--out", required=True,
                        help="the HTML file to write (replaced atomically; never a folder)")
    report.add_argument("--family", default=None,
                        help="the family file the build was compiled from (for its lines)")
    _add_format(report)

    init = commands.add_parser(
        "init", help="write a family scaffold from a checkpoint header and config",
        description="Guess a family from a checkpoint: layer repetition, projections, norms, "
                    "embeddings, a tied head, experts. Lines it could not decide are marked "
                    "`# partc init: CHECK`.")
    init.add_argument("--checkpoint", required=True, help="the checkpoint folder or file")
    init.add_argument("--config", default=None,
                      help="the model's config.json (default: config.json in the checkpoint "
                           "folder)")
    init.add_argument("--out", default=None,
                      help="the family file to write (default: print it on stdout); never "
                           "replaces an existing file")
    init.add_argument("--name", default=None, help="the family name (default: the model type)")
    _add_format(init)

    demo = commands.add_parser("demo", help="compile and load the embedded tiny Llama")
    demo.add_argument("--tp", type=_positive, default=2, help="tensor-parallel size (default 2)")
    demo.add_argument("--pp", type=_positive, default=2, help="pipeline stages (default 2)")
    demo.add_argument("--out", default=None, help="where to write the build (default: temp)")

    families = commands.add_parser("families",
                                   help="list the built-in families and their model types")
    families.add_argument("--copy", nargs=2, metavar=("NAME", "FILE"), default=None,
                          help="copy built-in family NAME to FILE to edit it (never replaces "
                               "an existing file)")
    _add_format(families)

    schema = commands.add_parser("schema", help="print the family JSON Schema (for editors)",
                                 description="Print schemas/architecture.schema.json, or with "
                                 "--path where it is installed, for a `# yaml-language-server: "
                                 "$schema=...` line.")
    schema.add_argument("--path", action="store_true",
                        help="print the installed schema's path instead of its text")

    docs = commands.add_parser("docs", help="print where the installed documentation is",
                               description="Print the path of an installed guide (or of the "
                               "docs folder) so that it can be opened without the repository; "
                               "TOPIC#section prints PATH:LINE of that section, as the `see:` "
                               "line under an error does.")
    docs.add_argument("topic", nargs="?", default=None,
                      help="a guide, optionally with a section: authoring, policy, "
                           "kv_replication#the-rule-vllms, ... (default: the folder; --list "
                           "prints every topic)")
    docs.add_argument("--list", action="store_true",
                      help="list every installed guide and the anchors of its sections")

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
    _add_format(shard)
    _add_quiet(shard)

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
    _add_format(verify)
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


COLLAPSE_AFTER = 3
"""Errors of one shape beyond this many are reported as one line with a count and an example."""
_VARYING = re.compile(r"`[^`]*`|\d+")


def _shape(error: PartcError) -> tuple[str, str]:
    """What makes errors "the same" for collapsing: their class and message (the rule), with
    the names in backticks and the numbers taken out."""
    return type(error).__name__, _VARYING.sub("_", error.message)


def _collapsed(errors: Sequence[PartcError]) -> list[tuple[PartcError, int]]:
    """Each error with how many errors of its shape it stands for (1: shown as it is)."""
    shapes: dict[tuple[str, str], list[PartcError]] = {}
    for error in errors:
        shapes.setdefault(_shape(error), []).append(error)
    out = []
    for error in errors:
        same = shapes[_shape(error)]
        if len(same) <= COLLAPSE_AFTER:
            out.append((error, 1))
        elif same[0] is error:
            out.append((error, len(same)))
    return out


def _error_json(error: PartcError) -> dict[str, object]:
    """An error's JSON with `see`: where its guide (`doc`) is installed, None without one."""
    return error.to_json() | {"see": commands.error_reference(error.doc)}


def _report(errors: Sequence[PartcError], fmt: str, hints: Sequence[str] = ()) -> int:
    ordered = sorted(errors, key=PartcError.sort_key)
    if fmt == "json":
        groups = [{"count": n, "example": _error_json(e)} for e, n in _collapsed(ordered)
                  if n > 1]
        print(json.dumps({"ok": False, "errors": [_error_json(e) for e in ordered],
                          "collapsed": groups, "hints": list(hints)}, indent=1))
    else:
        for error, count in _collapsed(ordered):
            if count > 1:
                print(f"error: {count} errors like this one (first shown): {error}",
                      file=sys.stderr)
            else:
                print(f"error: {error}", file=sys.stderr)
            for line in _caret_context(error):
                print(line, file=sys.stderr)
            see = commands.error_reference(error.doc)
            if see is not None:
                print(f"    see: {see}", file=sys.stderr)
        for hint in hints:
            print(f"hint: {hint}", file=sys.stderr)
        print(f"partc: {len(ordered)} error(s)", file=sys.stderr)
    return EXIT_ERRORS


def _flatten(error: PartcError) -> list[PartcError]:
    return list(error.errors) if isinstance(error, PartcErrors) else [error]


def _plan_facts(plan: Any) -> dict[str, Any]:
    """Per-stage summary, fallbacks and KV replication of a Plan, as `partc inspect` gives them."""
    from partc.inspect.build import kv_replicated, plan_summary
    from partc.parallel.layout import tensor_bytes

    body = plan.document[0]
    sizes: dict[str, int] = {}
    fell = {g["name"] for g in body["groups"] if g["fell_back_to_replication"]}
    kv = []
    for group in plan.groups:
        layouts = plan.kinds[group.kind].layouts[0]
        for layout, target in zip(layouts, group.targets, strict=True):
            if group.name in fell:
                sizes[group.name] = sizes.get(group.name, 0) + tensor_bytes(
                    layout.dtype, layout.global_shape)
            if layout.kv_replicas > 1:
                kv.append({"group": group.name, "target": target,
                           "kv_replicas": layout.kv_replicas})
    facts = plan_summary(body, lambda name: sizes.get(name, 0))
    facts["kv_replication"] = kv_replicated(kv)
    if "pipeline" in body:  # a multi-group graph: how its stages were chosen
        facts["pipeline"] = body["pipeline"]
    return facts | _expert_facts(plan)


def _spell_layers(layers: Any) -> str:
    """`--pp-layers` as given: counts `3,5,4`, or a named layout `vision*3|decoder*2`."""
    if layers and isinstance(layers[0], tuple):
        return "|".join(",".join(f"{g}*{n}" for g, n in runs) for runs in layers)
    return ",".join(map(str, layers))


def _print_facts(facts: dict[str, Any]) -> None:
    from partc.inspect.text import fallback_lines, pipeline_lines, stage_lines

    print()
    for line in stage_lines(facts["stages"], imbalance=facts["stage_imbalance"]):
        print(line)
    for line in pipeline_lines(facts.get("pipeline")):
        print(line)
    for line in fallback_lines(facts["fallbacks"], facts["kv_replication"]) or [
            "fallbacks: none; KV replication: none"]:
        print(line)
    for line in _expert_lines(facts):
        print(line)


def _config_beside(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Take --config from the --checkpoint folder when it holds config.json."""
    if args.config is not None:
        return
    beside = Path(args.checkpoint or "") / "config.json"
    if args.checkpoint and beside.is_file():
        args.config = str(beside)  # an HF checkpoint folder carries its config
    elif args.command == "compile":
        parser.error("compile needs --config (or a --checkpoint folder holding config.json)")
    elif args.checkpoint or args.tp or args.pp or args.pp_layers or args.policy or args.ep:
        parser.error("--checkpoint, --tp, --pp, --pp-layers and --policy check a binding: "
                     "pass --config (or a checkpoint folder holding config.json)")


def _builtin_hint(args: argparse.Namespace, errors: Sequence[PartcError]) -> list[str]:
    """When a family file does not fit a checkpoint, the built-in family that does (if any)."""
    from partc.api import check_family
    from partc.errors import CheckpointError
    from partc.library import family_spec_is_file

    if (args.family is None or not family_spec_is_file(args.family) or not args.checkpoint
            or args.config is None
            or not any(isinstance(e, CheckpointError) or e.tensor for e in errors)):
        return []
    try:
        if check_family(None, args.config, args.checkpoint):
            return []
    except Exception:  # a hint is never worth a failure of its own
        return []
    return [f"the built-in family for this config's model_type fits {args.checkpoint}: run "
            f"without the family argument, or `partc families --copy NAME FILE` to edit it"]


def _compile(args: argparse.Namespace) -> int:
    from partc.api import compile_family
    from partc.runtime.progress import terminal_progress

    with terminal_progress(_progress_enabled(args)) as report:
        result = compile_family(
            args.family, args.config, tensor_parallel_size=args.tp,
            pipeline_parallel_size=args.pp, stage_units=args.pp_layers,
            group_modes=args.group_mode,
            policy=_policy(args.policy), activation_dtype=args.activation_dtype,
            checkpoint=args.checkpoint, out=args.out, force=args.force, digests=args.digests,
            split=args.split, progress=report,
            expert_parallel_size=args.ep, expert_tensor_parallel_size=args.etp or 1,
            expert_placement=args.expert_placement)
    plan = result.plan
    facts = _plan_facts(plan)
    if args.format == "json":
        print(json.dumps({"ok": True, "errors": [], "out": str(result.out), "plan_hash":
                          plan.plan_hash, "files": sorted(result.files)} | facts, indent=1))
        return EXIT_OK
    print(f"compiled {plan.family} ({plan.model_type}) for TP={plan.topology.tensor_parallel_size}"
          f" x PP={plan.topology.pipeline_parallel_size}{_expert_text(args)} into {result.out}")
    _print_ranks(plan)
    _print_facts(facts)
    return EXIT_OK


def _expert_text(args: argparse.Namespace) -> str:
    """` x EP=E (ETP=X)` under expert parallelism, else ''."""
    if getattr(args, "ep", None) is None:
        return ""
    return f" x EP={args.ep} (ETP={args.etp or 1})"


def _expert_facts(plan: Any) -> dict[str, Any]:
    """The expert-parallel layout of a plan and the experts of each rank (empty without it)."""
    experts = plan.expert_parallel
    if experts is None:
        return {}
    slots = experts.placement.slots
    return {"expert_parallel": experts.to_json() | {"ranks": [
        {"rank": r.rank, "expert_parallel_rank": r.info.expert_parallel_rank,
         "expert_tensor_parallel_rank": r.info.expert_tensor_parallel_rank,
         "dense_replica": r.info.dense_replica,
         "experts": list(slots[r.info.expert_parallel_rank]),
         "expert_bytes": r.info.expert_parameter_bytes} for r in plan.ranks]}}


def _expert_lines(facts: dict[str, Any]) -> list[str]:
    """Text lines of `_expert_facts`: the layout, then the experts of each EP rank."""
    experts = facts.get("expert_parallel")
    if experts is None:
        return []
    lines = [f"expert parallelism: E={experts['expert_parallel_size']} x "
             f"X={experts['expert_tensor_parallel_size']} = {experts['ranks_per_stage']} "
             f"ranks per stage, dense parts x{experts['dense_replicas']}; "
             f"{experts['experts']} experts, "
             + ("explicit placement" if experts["explicit_placement"] else "balanced placement")
             + f", {experts['redundant_slots']} redundant slot(s); {experts['layout']}"]
    for ep, ids in enumerate(experts["slots"]):
        ranks = [r for r in experts["ranks"] if r["expert_parallel_rank"] == ep]
        mib = max((r["expert_bytes"] for r in ranks), default=0) / 2**20
        lines.append(f"  EP rank {ep:>3}: {len(ids):>3} experts {_id_ranges(ids)}"
                     f" on ranks {_id_ranges([r['rank'] for r in ranks])}, "
                     f"{mib:.3f} MiB of experts per rank")
    return lines


def _id_ranges(ids: Sequence[int]) -> str:
    """Ascending ids as ranges: `0-3,7,9-10`."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] + 1 == i:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "-"


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
    from partc.api import check_family, plan_family
    from partc.plan.topology import Topology
    from partc.runtime.progress import terminal_progress

    topology = None
    if (args.tp is not None or args.pp is not None or args.pp_layers or args.policy
            or args.group_mode or args.ep is not None or args.etp is not None
            or args.expert_placement):
        named = bool(args.pp_layers) and isinstance(args.pp_layers[0], tuple)
        topology = Topology(tensor_parallel_size=args.tp or 1, pipeline_parallel_size=args.pp or 1,
                            stage_units=None if named else args.pp_layers,
                            stage_layout=args.pp_layers if named else None,
                            group_modes=tuple(args.group_mode or ()), policy=_policy(args.policy),
                            expert_parallel_size=args.ep,
                            expert_tensor_parallel_size=args.etp or 1)
    with terminal_progress(_progress_enabled(args)) as report:
        errors = check_family(args.family, args.config, args.checkpoint, progress=report)
        facts = None
        if not errors and topology is not None:
            facts = _plan_facts(plan_family(args.family, args.config, topology,
                                            progress=report,
                                            expert_placement=args.expert_placement))
    if errors:
        return _report(errors, args.format, _builtin_hint(args, errors))
    if args.format == "json":
        print(json.dumps({"ok": True, "errors": []} | (facts or {}), indent=1))
    else:
        what = ["family"] + (["config binding"] if args.config else []) + (
            ["checkpoint"] if args.checkpoint else []) + (["topology"] if topology else [])
        print(f"ok: {', '.join(what)} checked")
        if facts is not None:
            _print_facts(facts)
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


def _shard(args: argparse.Namespace) -> int:
    from partc.runtime.progress import terminal_progress
    from partc.shard import shard_checkpoint

    with terminal_progress(_progress_enabled(args)) as report:
        result = shard_checkpoint(args.build, args.checkpoint, args.out,
                                  verify_fingerprint=not args.no_verify_fingerprint,
                                  force=args.force, progress=False, report=report)
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


_COMMANDS: dict[str, Any] = {
    "compile": _compile, "check": _check, "demo": _demo, "families": commands.run_families,
    "shard": _shard, "inspect": commands.run_inspect, "explain": commands.run_explain,
    "report": commands.run_report, "init": commands.run_init, "schema": commands.run_schema,
    "docs": commands.run_docs, "verify": _verify}


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

    Errors in the input (PartcError) are reported, all of them, sorted, and exit 1; anything
    else is a bug in partc, reported in one line (no traceback unless PARTC_TRACEBACK is set)
    with exit 70.
    """
    parser = _parser()
    words = list(sys.argv[1:] if argv is None else argv)
    _Parser.json_errors = any(w == "--format=json" or (w == "--format" and i + 1 < len(words)
                                                       and words[i + 1] == "json")
                              for i, w in enumerate(words))
    args = parser.parse_args(words)
    fmt = getattr(args, "format", "text")
    layers = getattr(args, "pp_layers", None)
    if layers and args.pp is None:
        args.pp = len(layers)
    elif layers and args.pp != len(layers):
        parser.error(f"--pp-layers gives {len(layers)} stage sizes "
                     f"({_spell_layers(layers)}) but --pp is {args.pp}; expected one unit "
                     "count per pipeline stage")
    if args.command == "compile" and args.pp is None:
        args.pp = 1
    if args.command != "verify" and (
            (getattr(args, "tp", None) or 1) * (getattr(args, "pp", None) or 1) > MAX_WORLD_SIZE):
        parser.error(f"--tp x --pp is {args.tp * args.pp}; partc builds at most "
                     f"{MAX_WORLD_SIZE} ranks")
    if getattr(args, "ep", None) is not None and (
            args.ep * (args.etp or 1) * (args.pp or 1) > MAX_WORLD_SIZE):
        parser.error(f"--ep x --etp x --pp is {args.ep * (args.etp or 1) * (args.pp or 1)}; "
                     f"partc builds at most {MAX_WORLD_SIZE} ranks")
    if args.command in ("compile", "check"):
        _config_beside(args, parser)
    return _run(args, fmt)


def _run(args: argparse.Namespace, fmt: str) -> int:
    """Run one parsed command: errors reported, a closed pipe quiet, bugs in one line."""
    try:
        status: int = _COMMANDS[args.command](args)
        return status
    except PartcError as error:
        return _report(_flatten(error), fmt)
    except BrokenPipeError:
        _quiet_pipe()
        return EXIT_OK
    except KeyboardInterrupt:
        print("partc: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # the last line of defence against tracebacks
        return _internal(exc, fmt)


if __name__ == "__main__":
    sys.exit(main())
