"""The `partc` command line's arguments: exit statuses, the parser of every command and the
converters of their values."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, NoReturn

from partc import __version__
from partc.cli import commands
from partc.errors import PartcError

EXIT_OK = 0
"""Success."""
EXIT_ERRORS = 1
"""The input had errors; they were reported."""
EXIT_USAGE = 2
"""The command line itself was wrong."""
EXIT_INTERNAL = 70
"""A bug in partc."""
EXIT_MACHINE = 74
"""The machine refused a read or write (sysexits' EX_IOERR)."""
EXIT_INTERRUPTED = 130
"""Interrupted (Ctrl-C)."""
EXIT_CODES = ((EXIT_OK, "success (also when output stops early because a pipe was closed)"),
              (EXIT_ERRORS, "the input had errors; every one was reported"),
              (EXIT_USAGE, "the command line itself was wrong"),
              (EXIT_INTERNAL, "a bug in partc (PARTC_TRACEBACK=1 prints the traceback)"),
              (EXIT_MACHINE, "the machine refused a read or write partc needed (a full disk, no "
                             "permission, an I/O error); the message names it"),
              (EXIT_INTERRUPTED, "interrupted"))
"""Every exit status and what it means (documented in --help and docs/cli.md)."""
FORMAT_HELP = "text: human tables on stdout, errors on stderr; json: one JSON document on stdout"
"""Help of every --format option."""


class Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors come out as JSON under `--format json`."""

    json_errors = False
    """Set by main when the command line asks for --format json."""

    def error(self, message: str) -> NoReturn:
        """Report a usage error (as JSON when asked for) with a `see:` line pointing at the
        command's section of the command-line guide, and exit 2."""
        words = self.prog.split()
        topic = f"cli#{'-'.join(words[:2])}" if len(words) > 1 else "cli"
        see = commands.error_reference(topic)
        if see is None:  # a command without a section of its own: the guide itself
            topic, see = "cli", commands.error_reference("cli")
        if Parser.json_errors:
            try:
                print(json.dumps({"ok": False, "errors": [{
                    "stage": "usage", "kind": "usage", "file": None, "line": None,
                    "column": None, "pointer": "", "tensor": None,
                    "message": f"{self.prog}: error: {message}", "doc": topic, "see": see}]},
                    indent=1), flush=True)
            except BrokenPipeError:  # `partc ... --format json | head`: the reader went away
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(EXIT_USAGE)
        self.print_usage(sys.stderr)
        hint = f"    see: {see}\n" if see is not None else ""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n{hint}")


def _stage_units(text: str) -> Any:
    """Unit counts per stage (`3,5,4`), or a stage layout naming groups (`vision*3|decoder*2`)."""
    from partc.plan.stage_balance import is_named_layout, parse_stage_layout

    if is_named_layout(text):
        try:
            return parse_stage_layout(text)
        except PartcError as exc:
            raise argparse.ArgumentTypeError(exc.message) from None
    try:
        values = tuple(_digits(v) for v in text.split(","))
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


REPO_ID_HELP = ("; or a Hugging Face repo id (NAMESPACE/NAME, e.g. meta-llama/Llama-3.1-8B) "
                "naming nothing here, read from the local Hugging Face cache and never "
                "downloaded (needs partc[hub])")
"""What --checkpoint, --config and inspect's PATH add about repo ids (cli.hub)."""


MAX_PARALLEL_SIZE = 1024
"""Largest --tp or --pp the command line accepts."""
MAX_WORLD_SIZE = 4096
"""Largest TP x PP the command line accepts."""


FAMILY_FILE_SUFFIXES = (".yaml", ".yml")
"""Suffixes of the family files `init` and `families --copy` write (they write YAML)."""


def yaml_file_problem(text: str) -> str | None:
    """Why `text` is no name for a YAML family file partc writes; None when it is one."""
    suffix = text[text.rfind("."):].lower() if "." in text.rsplit("/", 1)[-1] else ""
    if suffix in FAMILY_FILE_SUFFIXES:
        return None
    return (f"expected a family file name ending in .yaml or .yml (the family is written as "
            f"YAML, and partc reads a file by its suffix), found {text!r}")


def _yaml_file(text: str) -> str:
    problem = yaml_file_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def _family_name(text: str) -> str:
    """A family name: an identifier, as the schema's `family` requires."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text) or len(text) > 128:
        raise argparse.ArgumentTypeError(
            "expected a family name: letters, digits and `_`, not starting with a digit, at "
            f"most 128 characters, found {text!r}")
    return text


def _digits(text: str) -> int:
    """An integer written in ASCII digits only, as the environment's counts are: `int()`
    alone also takes `２`, `1_0`, ` 3` and `+3`."""
    if not (text.isascii() and text.isdigit()):
        raise ValueError(text)
    return int(text)


def _positive(text: str) -> int:
    try:
        value = _digits(text)
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


def _add_plan_options(parser: argparse.ArgumentParser) -> None:
    """The plan's options beyond the topology: the activation dtype and the split rule."""
    parser.add_argument("--activation-dtype", default=None,
                        choices=["float16", "bfloat16", "float32"],
                        help="dtype of activations crossing pipeline cuts (default: the "
                             "model's own, the most common float dtype of its tensors)")
    parser.add_argument("--split", choices=["balanced", "chunk"], default="balanced",
                        help="how uneven splits give out the remainder: balanced (the first "
                             "n mod T ranks get one more) or chunk (torch.chunk's rule, which "
                             "DTensor's Shard and transformers follow; docs/torch.md)")


def _add_stages(parser: argparse.ArgumentParser, stages: str, layers: str) -> None:
    """`--pp` and `--pp-layers`, with their help texts."""
    parser.add_argument("--pp", type=_positive, default=None, help=stages)
    parser.add_argument("--pp-layers", type=_stage_units, default=None, help=layers)


def _add_topology(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument("--tp", type=_positive, default=None if not required else 1,
                        help="tensor-parallel size T (default 1)")
    _add_stages(parser, "pipeline-parallel size S (default 1, or the number of --pp-layers "
                        "counts)",
                "explicit units per pipeline stage, e.g. 3,5,4 (one count per stage, summing "
                "to the model's units), or per stage and execution group in the layout "
                "notation partc prints, e.g. 'vision*3,projector|decoder*2' (stages split by "
                "`|`)")
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
    return (f"exit status:\n{codes}\n\nDocumentation: `partc docs TOPIC` prints an installed "
            "guide (authoring, cli, faults, ...; `partc docs` lists them). Shell completion: "
            "`partc completion bash` or `partc completion zsh`. `python -m partc` is the same "
            "command line.")


def _add_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=["text", "json"], default="text", help=FORMAT_HELP)


def _add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="draw no progress on stderr (progress is drawn only when stderr is "
                             "a terminal and --format is text; errors are always reported)")


def _add_resharding(commands: Any) -> None:
    """`partc reshard` and `partc merge`."""
    reshard = commands.add_parser(
        "reshard", help="rewrite a shard set of one build as the shard set of another build of "
                        "the same model (any TP, PP, EP), equal to `partc shard` of it")
    reshard.add_argument("--from", dest="source", required=True,
                         help="the build the shard set was cut for (a `partc compile` folder)")
    reshard.add_argument("--shards", required=True,
                         help="its shard set (a `partc shard` folder); an original checkpoint "
                              "is sharded for --to directly")
    reshard.add_argument("--to", dest="destination", required=True,
                         help="the build to write the shard set of")
    reshard.add_argument("--out", required=True, help=_OUT_HELP)
    reshard.add_argument("--force", action="store_true", help=_FORCE_HELP)
    _add_format(reshard)
    _add_quiet(reshard)
    merge = commands.add_parser(
        "merge", help="write the Hugging Face safetensors checkpoint back from a shard set")
    merge.add_argument("shards", help="a shard set (a `partc shard` or `partc reshard` folder)")
    merge.add_argument("--build", required=True, help="the build the shard set was cut for")
    merge.add_argument("--out", required=True,
                       help="output folder: new, empty, or a checkpoint partc merged; replaced "
                            "atomically")
    merge.add_argument("--force", action="store_true", help=_FORCE_HELP)
    _add_format(merge)
    _add_quiet(merge)


def _add_calibrate(commands: Any) -> None:
    """`partc calibrate`."""
    calibrate = commands.add_parser(
        "calibrate", help="measure the storage holding a checkpoint and this machine's page "
                          "cache for the read planner (about a second), or show what was "
                          "measured",
        description="Time 4 KiB and 1 MiB O_DIRECT reads of a checkpoint file and cache the "
                    "storage model (request latency, bandwidth) for its device; cold loads of "
                    "files on that device then plan their reads with it. Then time a warm "
                    "column gather both ways on the same file (rows read whole, pieces copied "
                    "by themselves) and cache the two models for this machine; warm loads "
                    "choose between the ways with them.")
    calibrate.add_argument("path", nargs="?", default=None,
                           help="a checkpoint folder (its largest .safetensors file is read) or "
                                "a file on the storage to measure")
    calibrate.add_argument("--show", action="store_true",
                           help="print the cached models and the default instead of measuring")
    _add_format(calibrate)


_OUT_HELP = ("output folder: new (missing parents are created), empty, or a shard set partc "
             "wrote (marked by .partc-build.json); replaced atomically")
_FORCE_HELP = ("write through a symbolic link --out into its target folder (kept as the link), "
               "or replace another partc output; never deletes files partc did not write")


def build_parser() -> argparse.ArgumentParser:
    """The parser of the `partc` command line and every command."""
    parser = Parser(
        prog="partc", description="Compile LLM family descriptions into rank-local loaders.",
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"partc {__version__}",
                        help="print the partc version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=Parser)

    compile_ = commands.add_parser("compile", help="write plan.json and the rank loader package",
                                   description="Bind a family to a config, realize it for "
                                   "TP x PP and write plan.json and one loader module per rank.")
    compile_.add_argument("family", nargs="?", default=None, help=FAMILY_HELP)
    compile_.add_argument("--config", default=None,
                          help="the model's config.json (default: config.json in the "
                               "--checkpoint folder, or beside the --checkpoint file)"
                               + REPO_ID_HELP)
    _add_topology(compile_, required=True)
    _add_plan_options(compile_)
    compile_.add_argument("--checkpoint", default=None,
                          help="checkpoint to validate and fingerprint the plan against"
                               + REPO_ID_HELP)
    compile_.add_argument("--out", required=True,
                          help="output folder: new (missing parents are created), empty, or "
                               "a build partc wrote (marked by .partc-build.json); replaced "
                               "atomically, never the checkpoint, the config or the working "
                               "directory")
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
                            "config.json in its folder, or beside the checkpoint file)"
                            + REPO_ID_HELP)
    check.add_argument("--checkpoint", default=None,
                       help="a checkpoint to check ownership of" + REPO_ID_HELP)
    _add_topology(check, required=False)
    _add_plan_options(check)
    _add_format(check)
    _add_quiet(check)

    inspect = commands.add_parser(
        "inspect", help="show a build's totals, fallbacks and tensors, or a checkpoint's "
                        "inventory",
        description="For a build (a folder holding plan.json): per-stage and per-rank totals and "
                    "every fallback; with --rank/--group/--target a table of tensors. For a "
                    "checkpoint: its inventory with layer and expert numbers collapsed.")
    inspect.add_argument("path", help="a build folder, a plan.json, or a checkpoint (folder or "
                                      ".safetensors file)" + REPO_ID_HELP)
    inspect.add_argument("--to", default=None, metavar="BUILD",
                         help="another build of the same model: show the transfer plan from "
                              "this build to it (bytes per source -> destination rank pair, the "
                              "busiest ranks, the total against gathering whole tensors)")
    inspect.add_argument("--rank", type=int, default=None,
                         help="list the tensors of this global rank")
    inspect.add_argument("--group", default=None,
                         help="list the tensors of the groups matching this glob "
                              "(e.g. 'layers.3.*')")
    inspect.add_argument("--target", default=None,
                         help="list the tensors whose checkpoint name matches this glob")
    inspect.add_argument("--family", default=None,
                         help="the family file the build was compiled from, to show the line "
                              "of each split (built-in families, and a file of the name and "
                              "sha256 plan.json records here or beside the build, are found "
                              "by themselves)")
    _add_format(inspect)

    explain = commands.add_parser(
        "explain", help="why one tensor or group is split the way it is",
        description="Group, role, units, every rank's range and placement of a tensor or a "
                    "group, and the reasons: policy fallback, KV replication, alignment, the "
                    "family line.")
    explain.add_argument("build", help="a build folder (or its plan.json)")
    explain.add_argument("target", help="a checkpoint tensor name, a group name, or a glob of "
                         "tensor names (fnmatch, as inspect's --target), each match explained")
    explain.add_argument("--family", default=None,
                         help="the family file the build was compiled from (for its line; found "
                              "by itself as for inspect)")
    _add_format(explain)

    report = commands.add_parser(
        "report", help="write one self-contained HTML report of a build",
        description="An HTML page with no network access: ownership map (ranks x units), bytes "
                    "per rank by role, the boundary wire schema and the fallbacks.")
    report.add_argument("build", help="a build folder (or its plan.json)")
    report.add_argument("--out", required=True,
                        help="the HTML file to write (replaced atomically; never a folder)")
    report.add_argument("--family", default=None,
                        help="the family file the build was compiled from (for its lines; found "
                              "by itself as for inspect)")
    report.add_argument("--to", default=None, metavar="BUILD",
                        help="another build of the same model: a page of the transfer plan from "
                             "this build to it instead (totals and bytes per rank pair)")
    _add_format(report)

    init = commands.add_parser(
        "init", help="write a family scaffold from a checkpoint header and config",
        description="Guess a family from a checkpoint: layer repetition, projections, norms, "
                    "embeddings, a tied head, experts. Lines it could not decide are marked "
                    "`# partc init: CHECK`.")
    init.add_argument("--checkpoint", required=True,
                      help="the checkpoint folder or file" + REPO_ID_HELP)
    init.add_argument("--config", default=None,
                      help="the model's config.json (default: config.json in the checkpoint "
                           "folder, or beside the checkpoint file)" + REPO_ID_HELP)
    init.add_argument("--out", default=None, type=_yaml_file,
                      help="the family file to write, ending in .yaml or .yml (default: print "
                           "it on stdout); never replaces an existing file")
    init.add_argument("--name", default=None, type=_family_name,
                      help="the family name: letters, digits and `_`, not starting with a "
                           "digit (default: the model type)")
    init.add_argument("--prove", action="store_true",
                      help="decide each layout the header leaves open (a fused projection's "
                           "row order, a square weight's orientation) by trying the "
                           "candidates with `partc verify` at T=2, 3 and 4 against transformers "
                           "(needs partc[verify]), and each placeholder vision-language "
                           "boundary by verify's cut checks at T=1 with a stage per unit; what "
                           "none explains is marked CHECK with verify's finding")
    _add_format(init)

    demo = commands.add_parser(
        "demo", help="compile and load the embedded tiny Llama",
        description="A smoke test of the install, on the CPU: compile the tiny Llama that ships "
                    "inside the package (3 layers, hidden size 64, 4 query and 2 KV heads, "
                    "float32, half a MiB) for TP x PP (default 2 x 2; --tp 1, 2 or 4, dividing "
                    "its query heads; --pp up to 3, its layers), then load every rank's slices "
                    "from its checkpoint with numpy, in this one process, one rank after "
                    "another, and print what each rank holds. It runs no model, starts no "
                    "processes and needs no GPU, torch or network; it takes no family, config "
                    "or checkpoint of your own (for those: partc compile and partc check).")
    demo.add_argument("--tp", type=_positive, default=2, help="tensor-parallel size (default 2)")
    demo.add_argument("--pp", type=_positive, default=2, help="pipeline stages (default 2)")
    demo.add_argument("--out", default=None, help="where to write the build (default: temp)")
    demo.add_argument("--force", action="store_true",
                      help="write through a symbolic link --out into its target folder (kept as "
                           "the link), as compile --force does; never deletes files partc did "
                           "not write")
    _add_format(demo)

    families = commands.add_parser("families",
                                   help="list the built-in families and their model types")
    families.add_argument("--copy", nargs=2, metavar=("NAME", "FILE"), default=None,
                          help="copy built-in family NAME to FILE (ending in .yaml or .yml) "
                               "to edit it (never replaces an existing file)")
    _add_format(families)

    schema = commands.add_parser("schema", help="print the family JSON Schema (for editors)",
                                 description="Print schemas/architecture.schema.json, or with "
                                 "--path where it is installed, for a `# yaml-language-server: "
                                 "$schema=...` line.")
    schema.add_argument("--path", action="store_true",
                        help="print the installed schema's path instead of its text")
    _add_format(schema)

    docs = commands.add_parser("docs", help="print an installed guide",
                               description="Print an installed guide (Markdown, through $PAGER "
                               "on a terminal), so that it can be read without the repository; "
                               "TOPIC#section prints that section only. Without a TOPIC, list "
                               "the guides. --path prints where a guide is instead (PATH:LINE "
                               "for a section, as the `see:` line under an error does).")
    docs.add_argument("topic", nargs="?", default=None,
                      help="a guide, optionally with a section: authoring, policy, "
                           "kv_replication#the-rule-vllms, ... (default: list the guides)")
    docs.add_argument("--path", action="store_true",
                      help="print the guide's path (PATH:LINE for a section; the docs folder "
                           "without a TOPIC) instead of its text")
    docs.add_argument("--list", action="store_true",
                      help="list every installed guide (or TOPIC) and the anchors of its "
                           "sections")
    _add_format(docs)

    shard = commands.add_parser("shard", help="cut a checkpoint into one file per rank of a "
                                              "build, for sequential loading")
    shard.add_argument("build", help="a folder written by `partc compile`")
    shard.add_argument("--checkpoint", required=True,
                       help="the checkpoint folder or file" + REPO_ID_HELP)
    shard.add_argument("--out", required=True,
                       help="output folder: new (missing parents are created), empty, or a "
                            "shard set partc wrote (marked by .partc-build.json); replaced "
                            "atomically, never the checkpoint or the build; the manifest "
                            "records every tensor's sha256")
    shard.add_argument("--force", action="store_true",
                       help="write through a symbolic link --out into its target folder (kept "
                            "as the link), or replace a partc build; never deletes files partc "
                            "did not write")
    shard.add_argument("--no-verify-fingerprint", action="store_true",
                       help="accept a checkpoint whose header differs from the plan's fingerprint"
                            " (names, dtypes and shapes are still checked)")
    _add_format(shard)
    _add_quiet(shard)

    _add_resharding(commands)
    _add_calibrate(commands)

    verify = commands.add_parser("verify", help="check the split against Hugging Face "
                                 "transformers' modeling code (needs partc[verify])")
    verify.add_argument("family", nargs="?", default=None, help=FAMILY_HELP)
    verify.add_argument("--config", required=True, help="the model's config.json (shrunk to "
                        "a tiny random model of the same structure when large)" + REPO_ID_HELP)
    verify.add_argument("--tp", type=_size_list, default=None,
                        help="tensor-parallel sizes, e.g. 1,2,4 (default: every T up to 8 "
                             "that compiles)")
    _add_stages(verify, "pipeline stages of the pipeline check (default 2, or the number of "
                        "--pp-layers counts; 1 skips it); given (or --pp-layers) with --tp or "
                        "--ep: each T x S (x E) build is checked as one, every check on it",
                "where the pipeline check cuts: units per stage, e.g. 3,5,4, or per stage and "
                "execution group, e.g. 'vision*3,projector|decoder*2', as compile takes them "
                "(a large config then keeps its layers when shrunk)")
    verify.add_argument("--policy", choices=["require", "replicate-unsupported"], default=None,
                        help="sharding policy for groups that cannot be sharded")
    verify.add_argument("--ep", type=_positive, default=None,
                        help="also check expert parallelism at E EP ranks: each rank's experts "
                             "from its own slots, placed through the build's expert map, at "
                             "every T checked that divides E x --etp (docs/verify.md)")
    verify.add_argument("--etp", type=_positive, default=None,
                        help="expert-tensor-parallel size X of the expert check (default 1; "
                             "needs --ep)")
    verify.add_argument("--expert-placement", default=None, metavar="FILE",
                        help="JSON placement {\"ranks\": [[expert ids of EP rank 0], ...]} of "
                             "the expert check, for the reference model's experts (needs --ep)")
    verify.add_argument("--seed", type=int, default=0, help="seed of the random model")
    verify.add_argument("--memory-budget", type=_byte_size, default=None, metavar="SIZE",
                        help="memory the run may need, e.g. 8GiB (default 4GiB): a reference "
                             "model whose estimate exceeds it is refused before it is built "
                             "(docs/verify.md)")
    verify.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="the user's checkpoint (folder, index.json or .safetensors): "
                             "first check the family's names, dtypes and shapes against its "
                             "header, as `check --checkpoint` does (no weight is read)"
                             + REPO_ID_HELP)
    _add_format(verify)

    completion = commands.add_parser(
        "completion", help="print a shell completion script (bash or zsh)",
        description="Print a completion script for the shell, generated from this command "
                    "line's parser (shtab): commands, options, their choices and file names. "
                    "bash: `source <(partc completion bash)` in ~/.bashrc, or save it as "
                    "~/.local/share/bash-completion/completions/partc. zsh: save it as `_partc` "
                    "in a folder of $fpath, before `compinit` runs.")
    completion.add_argument("shell", choices=["bash", "zsh"], help="the shell to complete for")
    return parser


_BYTE_UNITS = {"": 1, "B": 1, "K": 2**10, "KiB": 2**10, "M": 2**20, "MiB": 2**20, "G": 2**30,
               "GiB": 2**30, "T": 2**40, "TiB": 2**40}
"""The units of a --memory-budget (binary multiples)."""
MAX_MEMORY_BUDGET = 2**50
"""The largest --memory-budget taken (1 PiB)."""


def _byte_size(text: str) -> int:
    """A --memory-budget: ASCII digits, optionally a decimal part, then a unit of _BYTE_UNITS
    (`4GiB`, `512M`, `1.5G`, `1000000`)."""
    found = re.fullmatch(r"([0-9]{1,16})(?:\.([0-9]{1,6}))?\s?([A-Za-z]*)", text)
    unit = found and next((u for u in _BYTE_UNITS if u.lower() == found[3].lower()), None)
    if not found or unit is None:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 4GiB, 512MiB or a byte count, found {text!r} (units: "
            f"{', '.join(u for u in _BYTE_UNITS if u)})")
    value = (int(found[1]) * 10**6 + int((found[2] or "").ljust(6, "0"))) \
        * _BYTE_UNITS[unit] // 10**6
    if not 1 <= value <= MAX_MEMORY_BUDGET:
        raise argparse.ArgumentTypeError(f"expected from 1 byte to 1 PiB, found {text!r}")
    return value


def _size_list(text: str) -> tuple[int, ...]:
    values = tuple(_positive(v) for v in text.split(","))
    if any(v > MAX_WORLD_SIZE for v in values):
        raise argparse.ArgumentTypeError(f"tensor-parallel sizes must be at most "
                                         f"{MAX_WORLD_SIZE}, found {text!r}")
    return values
