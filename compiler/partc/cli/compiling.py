"""The compiling commands of the command line: compile, check, demo, shard and verify, with
their text and JSON reports (the seeing and authoring commands are `partc.cli.commands`)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partc.cli.diagnostics import report_errors
from partc.cli.parser import EXIT_ERRORS, EXIT_OK
from partc.errors import LoadError, PartcError

if TYPE_CHECKING:
    from partc.plan.plan_records import PlanFile
    from partc.shard import ShardResult
    from partc.verify.results import Check


def _progress_enabled(args: argparse.Namespace) -> bool | None:
    """None (draw when stderr is a terminal) for text output, False under --format json or
    --quiet: the steps of a long command are drawn on stderr and cleared when it ends."""
    return None if args.format == "text" and not getattr(args, "quiet", False) else False


def _policy(value: str | None):  # type: ignore[no-untyped-def]
    from partc.parallel.specs import ShardingPolicy

    return None if value is None else ShardingPolicy(value.replace("-", "_"))


def _plan_facts(plan: Any) -> dict[str, Any]:
    """Per-stage summary, fallbacks and KV replication of a Plan, as `partc inspect` gives them."""
    from partc.inspect.plan_summary import kv_replicated, pipeline_facts, plan_summary, tp_reduced
    from partc.parallel.placements import tensor_bytes
    from partc.plan.plan_decode import plan_view

    view = plan_view(plan.document[0], Path("plan.json"))  # the plan's body, no tensor table
    sizes: dict[str, int] = {}
    fell = {g.name for g in view.groups if g.fell_back_to_replication}
    kv, reduced = [], []
    for group in plan.groups:
        per_rank = plan.kinds[group.kind].layouts
        layouts = per_rank[0]
        for i, (layout, target) in enumerate(zip(layouts, group.targets, strict=True)):
            if any(rank[i].needs_tp_reduction for rank in per_rank):
                reduced.append({"group": group.name, "target": target,
                                "needs_tp_reduction": True})
            if group.name in fell:
                sizes[group.name] = sizes.get(group.name, 0) + tensor_bytes(
                    layout.dtype, layout.global_shape)
            if layout.kv_replicas > 1:
                kv.append({"group": group.name, "target": target,
                           "kv_replicas": layout.kv_replicas})
    facts = plan_summary(view, lambda name: sizes.get(name, 0), tensor_table=False)
    facts["kv_replication"] = kv_replicated(kv)
    facts["tp_reduction"] = tp_reduced(reduced)
    if plan.pipeline is not None:  # a multi-group graph: how its stages were chosen
        chosen = pipeline_facts(view)  # in the order compile's own JSON spells it
        facts["pipeline"] = {key: chosen[key] for key in plan.pipeline.to_json()}
    return facts | _expert_facts(plan)


def _print_facts(facts: dict[str, Any]) -> None:
    from partc.inspect.text import fallback_lines, pipeline_lines, stage_lines

    print()
    for line in stage_lines(facts["stages"], imbalance=facts["stage_imbalance"]):
        print(line)
    for line in pipeline_lines(facts.get("pipeline")):
        print(line)
    for line in fallback_lines(facts["fallbacks"], facts["kv_replication"],
                               facts["tp_reduction"]) or [
            "fallbacks: none; KV replication: none"]:
        print(line)
    for line in _expert_lines(facts):
        print(line)


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


def run_compile(args: argparse.Namespace) -> int:
    """`partc compile`: write the build; report its ranks and per-stage facts."""
    from partc.api import CompileOptions, compile_family
    from partc.plan.topology import Topology
    from partc.runtime.progress import terminal_progress

    with terminal_progress(_progress_enabled(args)) as report:
        result = compile_family(
            args.family, args.config,
            Topology(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                     expert_parallel_size=args.ep, expert_tensor_parallel_size=args.etp or 1),
            CompileOptions(stage_units=args.pp_layers, group_modes=args.group_mode,
                           policy=_policy(args.policy), activation_dtype=args.activation_dtype,
                           checkpoint=args.checkpoint, out=args.out, force=args.force,
                           digests=args.digests, split=args.split, progress=report,
                           expert_placement=args.expert_placement))
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
         "experts": list(slots[r.info.expert_parallel_rank]) if r.info.local_experts else [],
         "expert_bytes": r.info.expert_parameter_bytes} for r in plan.ranks]}}


def _expert_lines(facts: dict[str, Any]) -> list[str]:
    """Text lines of `_expert_facts`: the layout, then the experts of each EP rank and the
    ranks holding them (a rank of a stage without MoE layers holds none)."""
    from partc.errors import plural
    from partc.inspect.text import id_ranges

    experts = facts.get("expert_parallel")
    if experts is None:
        return []
    lines = [f"expert parallelism: E={experts['expert_parallel_size']} x "
             f"X={experts['expert_tensor_parallel_size']} = {experts['ranks_per_stage']} "
             f"ranks per stage, dense parts x{experts['dense_replicas']}; "
             f"{plural(experts['experts'], 'expert')}, "
             + ("explicit placement" if experts["explicit_placement"] else "balanced placement")
             + f", {plural(experts['redundant_slots'], 'redundant slot')}; {experts['layout']}"]
    for ep, ids in enumerate(experts["slots"]):
        ranks = [r for r in experts["ranks"] if r["expert_parallel_rank"] == ep]
        holding = [r for r in ranks if r["experts"]]
        none = [r["rank"] for r in ranks if not r["experts"]]
        mib = max((r["expert_bytes"] for r in holding), default=0) / 2**20
        lines.append(f"  EP rank {ep:>3}: {len(ids):>3} {'expert ' if len(ids) == 1 else 'experts'}"
                     f" {id_ranges(ids)} on {'rank' if len(holding) == 1 else 'ranks'} "
                     f"{id_ranges([r['rank'] for r in holding]) or '-'}"
                     f", {mib:.3f} MiB of experts per rank"
                     + (f"; {'rank' if len(none) == 1 else 'ranks'} {id_ranges(none)} "
                        f"{'holds' if len(none) == 1 else 'hold'} none (no MoE layer on "
                        f"{'its' if len(none) == 1 else 'their'} stage)" if none else ""))
    return lines


def _print_ranks(plan, loaded=None) -> None:  # type: ignore[no-untyped-def]
    """One row per rank, its columns as wide as their widest cell (a vision-language stage's
    units, `vision[0:2], projector[0:1]`, are wider than a decoder's)."""
    from partc.inspect.text import id_ranges, table

    experts = getattr(plan, "expert_parallel", None)
    etp = experts is not None and experts.expert_tensor_parallel_size > 1
    rows = []
    for rank in plan.ranks:
        part, info = rank.partition, rank.info
        units = ", ".join(f"{g.group}[{g.unit_range[0]}:{g.unit_range[1]}]" for g in part.groups)
        row = [rank.rank, rank.tensor_parallel_rank, rank.pipeline_stage]
        if experts is not None:
            row += [info.expert_parallel_rank] + ([info.expert_tensor_parallel_rank] if etp
                                                  else [])
        row += [units, info.owned_tensors, f"{info.local_parameter_bytes / 2**20:.3f}",
                ", ".join(part.ownership.static_roles) or "-"]
        if experts is not None:
            held = experts.placement.slots[info.expert_parallel_rank] if info.local_experts \
                else ()
            row += [f"{len(held)}: {id_ranges(held)}" if held else "-",
                    f"{info.expert_parameter_bytes / 2**20:.3f}"]
        if loaded is not None:
            row.append(f"loaded {loaded[rank.rank]}")
        rows.append(row)
    header = ["rank", "tp", "stage"] + (["ep"] if experts is not None else []) + (
        ["etp"] if etp else []) + ["units", "tensors", "local MiB", "static roles"]
    right = [True] * (len(header) - 4) + [False, True, True, False]
    if experts is not None:
        header += ["experts", "expert MiB"]
        right += [False, True]
    if loaded is not None:
        header.append("")
        right.append(False)
    for line in table(header, rows, right=right):
        print(line)


def run_check(args: argparse.Namespace) -> int:
    """`partc check`: validate without writing; with a topology, report the plan's facts."""
    from partc.api import check_family, plan_family
    from partc.plan.topology import Topology
    from partc.runtime.progress import terminal_progress

    topology = None
    if (args.tp is not None or args.pp is not None or args.pp_layers or args.policy
            or args.group_mode or args.ep is not None or args.etp is not None
            or args.expert_placement or args.split != "balanced"
            or args.activation_dtype is not None):
        from partc.parallel.specs import TensorSplit
        from partc.partition.boundary import PipelineActivationDtype

        named = bool(args.pp_layers) and isinstance(args.pp_layers[0], tuple)
        topology = Topology(tensor_parallel_size=args.tp or 1, pipeline_parallel_size=args.pp or 1,
                            stage_units=None if named else args.pp_layers,
                            stage_layout=args.pp_layers if named else None,
                            group_modes=tuple(args.group_mode or ()), policy=_policy(args.policy),
                            activation_dtype=None if args.activation_dtype is None
                            else PipelineActivationDtype(args.activation_dtype),
                            split=TensorSplit(args.split), expert_parallel_size=args.ep,
                            expert_tensor_parallel_size=args.etp or 1)
    with terminal_progress(_progress_enabled(args)) as report:
        errors = check_family(args.family, args.config, args.checkpoint, progress=report)
        facts = None
        if not errors and topology is not None:
            facts = _plan_facts(plan_family(args.family, args.config, topology,
                                            progress=report,
                                            expert_placement=args.expert_placement))
    if errors:
        return report_errors(errors, args.format, _builtin_hint(args, errors))
    if args.format == "json":
        print(json.dumps({"ok": True, "errors": []} | (facts or {}), indent=1))
    else:
        what = ["family"] + (["config binding"] if args.config else []) + (
            ["checkpoint"] if args.checkpoint else []) + (["topology"] if topology else [])
        print(f"ok: {', '.join(what)} checked")
        if facts is not None:
            _print_facts(facts)
    return EXIT_OK


def run_demo(args: argparse.Namespace) -> int:
    """`partc demo`: compile the embedded tiny Llama and load every rank of it."""
    import importlib
    import sys as _sys

    from partc.api import CompileOptions, compile_family
    from partc.plan.topology import Topology

    example = resources.files("partc.examples").joinpath("tiny-llama")
    with resources.as_file(example) as folder, tempfile.TemporaryDirectory() as scratch:
        out = Path(args.out) if args.out else Path(scratch) / "build"
        result = compile_family("llama", folder / "config.json",
                                Topology(tensor_parallel_size=args.tp,
                                         pipeline_parallel_size=args.pp),
                                CompileOptions(out=out, force=bool(args.out) and args.force))
        plan = result.plan
        layers = dict(plan.config_values)["num_hidden_layers"]
        where = (f"build in {out}" if args.out else
                 "build in a temporary folder, removed on exit (--out DIR keeps it)")
        if args.format == "text":
            print(f"partc demo: embedded tiny Llama ({layers} layers) "
                  f"at TP={args.tp} x PP={args.pp}, {where}")
        from partc.emit.render import package_name

        _sys.path.insert(0, str(out))
        try:
            package = importlib.import_module(package_name(plan))
            loaded: dict[int, tuple[int, int]] = {}
            for rank in plan.ranks:
                state = package.load(folder, rank=rank.rank)
                loaded[rank.rank] = (len(state.tensors),
                                     sum(a.nbytes for a in state.tensors.values()))
        finally:
            _sys.path.remove(str(out))
            for name in list(_sys.modules):
                if name.startswith(package_name(plan)):
                    del _sys.modules[name]
        if args.format == "json":
            print(json.dumps(_demo_json(plan, layers, str(out) if args.out else None, loaded),
                             indent=1))
            return EXIT_OK
        _print_ranks(plan, {rank: f"{arrays} arrays, {nbytes} bytes"
                            for rank, (arrays, nbytes) in loaded.items()})
    return EXIT_OK


def _demo_json(plan: Any, layers: int, out: str | None,
               loaded: dict[int, tuple[int, int]]) -> dict[str, Any]:
    """`partc demo --format json`: the topology, where the build is (None: a temporary folder,
    removed) and per rank its units, what the plan gives it and what loading it returned."""
    return {"ok": True, "model": "tiny-llama", "layers": layers, "family": plan.family,
            "tensor_parallel_size": plan.topology.tensor_parallel_size,
            "pipeline_parallel_size": plan.topology.pipeline_parallel_size,
            "out": out, "plan_hash": plan.plan_hash,
            "ranks": [{"rank": rank.rank, "tensor_parallel_rank": rank.tensor_parallel_rank,
                       "pipeline_stage": rank.pipeline_stage,
                       "units": [{"group": g.group, "start": g.unit_range[0],
                                  "stop": g.unit_range[1]} for g in rank.partition.groups],
                       "tensors": rank.info.owned_tensors,
                       "local_bytes": rank.info.local_parameter_bytes,
                       "loaded_arrays": loaded[rank.rank][0],
                       "loaded_bytes": loaded[rank.rank][1]} for rank in plan.ranks]}


def run_shard(args: argparse.Namespace) -> int:
    """`partc shard`: write one safetensors file per rank of a build."""
    from partc.runtime.progress import terminal_progress
    from partc.shard import shard_checkpoint

    with terminal_progress(_progress_enabled(args)) as report:
        result = shard_checkpoint(args.build, args.checkpoint, args.out,
                                  verify_fingerprint=not args.no_verify_fingerprint,
                                  force=args.force, progress=False, report=report)
    return shard_set_report(args.format, f"sharded {args.checkpoint}", result)


def shard_set_report(form: str, done: str, result: ShardResult) -> int:
    """Print what a shard or reshard wrote (`done`: what was done, e.g. `sharded CKPT`)."""
    if form == "json":
        print(json.dumps({"ok": True, "out": str(result.out), "plan_hash": result.plan_hash,
                          "files": list(result.files), "bytes": result.nbytes}, indent=1))
        return EXIT_OK
    print(f"{done} for plan {result.plan_hash[:16]} into {result.out}: "
          f"{len(result.files)} rank files, {result.nbytes / 2**20:.1f} MiB")
    return EXIT_OK


def _declared(checks: tuple[Check, ...], family: str | Path | None,
              plans: tuple[PlanFile, ...]) -> tuple[Check, ...]:
    """`checks`, each failed one narrowed to groups with the `file:line` of the family entry
    declaring its first group (found by re-binding the family to a build's plan, as inspect
    finds them); the others as they are."""
    failed = [c for c in checks if not c.ok and c.group]
    if not failed or not plans:
        return checks
    from partc.inspect.origins import group_origins
    from partc.library import family_spec_is_file

    given = Path(family) if family is not None and family_spec_is_file(family) else None
    lines = group_origins(plans[0], given).lines
    out: list[Check] = []
    for check in checks:
        first = next((lines[g] for g in check.group.split(", ") if g in lines), "")
        out.append(replace(check, declared=first) if not check.ok and first else check)
    return tuple(out)


def _skipped_lines(skipped: Sequence[dict[str, object]]) -> list[tuple[str, str]]:
    """The topologies verify skipped, as (what, reason) lines: tensor-parallel sizes of one S
    whose reasons are the same but for the size itself (every T above a group's unit count,
    or every odd T under KV replication) are one line, at the first one's place, with the
    first one's reason shown."""
    import re

    runs: list[tuple[list[int], int, str, str]] = []  # ([T...], S, reason, reason less its T)
    for entry in skipped:
        tp, pp, reason = int(str(entry["tp"])), int(str(entry["pp"])), str(entry["reason"])
        if entry.get("check") == "pipeline":
            runs.append(([], pp, reason, ""))
            continue
        shape = re.sub(rf"(?<=T=){tp}\b|(?<=size ){tp}\b|(?<=is ){tp}\b|(?<=than ){tp}\b",
                       "#", reason)
        same = [run for run in runs if run[0] and run[1] == pp and run[3] == shape]
        if same:
            same[0][0].append(tp)
        else:
            runs.append(([tp], pp, reason, shape))
    lines: list[tuple[str, str]] = []
    for sizes, pp, reason, _ in runs:
        if not sizes:
            lines.append(("the pipeline check", reason))
        elif len(sizes) == 1:
            lines.append((f"T={sizes[0]} x S={pp}", reason))
        else:
            lines.append((f"T={', '.join(map(str, sizes))} x S={pp}",
                          f"{reason} (the same error at each of these T, at its own size)"))
    return lines


def run_verify(args: argparse.Namespace) -> int:
    """`partc verify`: check the split against transformers' modeling code."""
    from partc.verify.budget import DEFAULT_MEMORY_BUDGET
    from partc.verify.results import topology_name
    from partc.verify.run import verify_family
    from partc.verify.session import ExpertTopology

    if args.ep is None and (args.etp is not None or args.expert_placement is not None):
        flag = "--etp" if args.etp is not None else "--expert-placement"
        raise LoadError(f"{flag} needs --ep (the expert-parallel size)")
    experts = None if args.ep is None else ExpertTopology(
        expert_parallel_size=args.ep, expert_tensor_parallel_size=args.etp or 1,
        placement=Path(args.expert_placement) if args.expert_placement else None)
    if args.checkpoint is not None:
        from partc.verify.checkpoint_check import checkpoint_errors

        refused = checkpoint_errors(args.family, args.config, args.checkpoint)
        if refused:
            return report_errors(refused, args.format, _builtin_hint(args, refused))
    # --pp (or --pp-layers) given with --tp or --ep: the topology they make, checked as one
    combined = (args.pp is not None or bool(args.pp_layers)) and (
        args.tp is not None or args.ep is not None)
    report = verify_family(args.family, args.config, tensor_parallel_sizes=args.tp,
                           pipeline_parallel_size=args.pp, stage_units=args.pp_layers,
                           policy=_policy(args.policy), seed=args.seed, experts=experts,
                           combined=combined,
                           memory_budget=args.memory_budget or DEFAULT_MEMORY_BUDGET)
    report = replace(report, checks=_declared(report.checks, args.family, report.plans))
    if args.checkpoint is not None:
        report = replace(report, notes=(f"checkpoint {args.checkpoint}: every tensor's name, "
                                        "dtype and shape is the family's (header only, as "
                                        "`check --checkpoint` checks it)",) + report.notes)
    if args.format == "json":
        print(json.dumps(report.to_json(), indent=1))
        return EXIT_OK if report.ok else EXIT_ERRORS
    for note in report.notes:
        print(f"note: {note}")
    for what, reason in _skipped_lines(report.skipped):
        print(f"skipped {what}: {reason}")
    topologies = sorted({(c.tp, c.pp, c.ep or 0, c.etp or 0) for c in report.checks})

    def spelled(tp: int, pp: int, ep: int = 0, etp: int = 0) -> str:
        cut = f" (--pp-layers {report.stage_units})" if pp > 1 and report.stage_units else ""
        return topology_name(tp, pp, ep or None, etp or None) + cut

    for topology in topologies:
        mine = [c for c in report.checks if (c.tp, c.pp, c.ep or 0, c.etp or 0) == topology]
        failed = sum(not c.ok for c in mine)
        print(f"{spelled(*topology)}: {len(mine) - failed}/{len(mine)} checks hold")
        if topology[2]:  # a line per expert group
            for check in (c for c in mine if c.kind == "experts"):
                print(f"  `{check.module}` ({check.group}): "
                      + ("holds" if check.ok else "FAILS")
                      + (f", max abs error {check.max_error:.3g}" if check.ok else ""))
    failure = report.first_failure
    if failure is not None:
        print(f"error: {failure.message}", file=sys.stderr)
        if failure.declared:
            print(f"    group `{failure.group.split(', ')[0]}` is declared at "
                  f"{failure.declared}", file=sys.stderr)
        return EXIT_ERRORS
    if not report.checks:
        print("error: no topology compiled, nothing was verified", file=sys.stderr)
        return EXIT_ERRORS
    left = [f"T={s['tp']} x S={s['pp']}" for s in report.skipped if s["pp"] != 1 or s["tp"] != 1
            or s["reason"] != "no pipeline split asked for (S=1)"]
    print(f"verified {report.family} ({report.model_type}) at "
          f"{', '.join(spelled(*topology) for topology in topologies)}: every check holds"
          + (f"; not checked: {', '.join(left)} (skipped, see above)" if left else ""))
    return EXIT_OK
